// Element-wise kernels: bias-GeLU, SwiGLU, RoPE. Grid-stride loops with fp32 math;
// bias-GeLU moves 16-byte packs when the pointers and the row length allow it.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

constexpr float kAlpha = 0.7978845608028654f;
constexpr float kBeta = 0.044715f;

__device__ __forceinline__ float gelu(float u) { return 0.5f * u * (1.0f + tanhf(kAlpha * (u + kBeta * u * u * u))); }
__device__ __forceinline__ float gelu_grad(float u) {
  const float t = tanhf(kAlpha * (u + kBeta * u * u * u));
  return 0.5f * (1.0f + t) + 0.5f * u * (1.0f - t * t) * kAlpha * (1.0f + 3.0f * kBeta * u * u);
}

template <typename T, int N, bool kBackward>
__global__ void bias_gelu_kernel(BiasGeluParams p) {
  using P = Pack<T, N>;
  const int64_t packs = p.rows * p.cols / N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < packs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c0 = (i * N) % p.cols;
    const P x = reinterpret_cast<const P*>(p.input)[i];
    const P b = *reinterpret_cast<const P*>(static_cast<const T*>(p.bias) + c0);
    P y;
    if constexpr (kBackward) {
      const P g = reinterpret_cast<const P*>(p.grad)[i];
#pragma unroll
      for (int k = 0; k < N; ++k) y.v[k] = from_float<T>(to_float(g.v[k]) * gelu_grad(to_float(x.v[k]) + to_float(b.v[k])));
    } else {
#pragma unroll
      for (int k = 0; k < N; ++k) y.v[k] = from_float<T>(gelu(to_float(x.v[k]) + to_float(b.v[k])));
    }
    reinterpret_cast<P*>(p.out)[i] = y;
  }
}

template <bool kBackward>
void launch_bias_gelu(const BiasGeluParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, {
    constexpr int V = kVec<T>;
    const bool vec = p.cols % V == 0 && aligned16(p.input) && aligned16(p.bias) && aligned16(p.grad) && aligned16(p.out);
    const int64_t work = vec ? p.rows * p.cols / V : p.rows * p.cols;
    const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(work, 256), 65535));
    if (vec) {
      bias_gelu_kernel<T, V, kBackward><<<blocks, 256, 0, as_stream(stream)>>>(p);
    } else {
      bias_gelu_kernel<T, 1, kBackward><<<blocks, 256, 0, as_stream(stream)>>>(p);
    }
  });
  check_launch("bias_gelu");
}

template <typename T>
__global__ void swiglu_forward_kernel(SwigluParams p) {
  const T* x = static_cast<const T*>(p.input);
  T* y = static_cast<T*>(p.out);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.rows * p.f;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.f, c = i % p.f;
    const float u = to_float(x[r * 2 * p.f + c]), v = to_float(x[r * 2 * p.f + p.f + c]);
    y[i] = from_float<T>(u / (1.0f + __expf(-u)) * v);
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(SwigluParams p) {
  const T* x = static_cast<const T*>(p.input);
  const T* g = static_cast<const T*>(p.grad);
  T* dx = static_cast<T*>(p.out);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.rows * p.f;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.f, c = i % p.f, a = r * 2 * p.f + c;
    const float u = to_float(x[a]), v = to_float(x[a + p.f]), gr = to_float(g[i]);
    const float sig = 1.0f / (1.0f + __expf(-u));
    dx[a] = from_float<T>(gr * v * sig * (1.0f + u * (1.0f - sig)));
    dx[a + p.f] = from_float<T>(gr * u * sig);
  }
}

template <typename T>
__global__ void rotary_kernel(RotaryParams p) {
  const T* x = static_cast<const T*>(p.input);
  T* out = static_cast<T*>(p.out);
  const int64_t h = p.r / 2, n = p.s * p.bh * p.d;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % p.d, row = i / p.d, pos = row / p.bh;
    if (j >= p.r) {
      out[i] = x[i];
      continue;
    }
    const float* c = p.cos + pos * p.r;
    const float* sn = p.sin + pos * p.r;
    float rot;
    if (!p.backward) {
      rot = j < h ? -to_float(x[i + h]) * sn[j] : to_float(x[i - h]) * sn[j];
    } else {
      rot = j < h ? to_float(x[i + h]) * sn[j + h] : -to_float(x[i - h]) * sn[j - h];
    }
    out[i] = from_float<T>(to_float(x[i]) * c[j] + rot);
  }
}

int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>(ceil_div(n, 256), 65535)); }

}  // namespace

void bias_gelu_forward(const BiasGeluParams& p, void* stream) { launch_bias_gelu<false>(p, stream); }
void bias_gelu_backward(const BiasGeluParams& p, void* stream) { launch_bias_gelu<true>(p, stream); }

void swiglu_forward(const SwigluParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, swiglu_forward_kernel<T><<<grid_for(p.rows * p.f), 256, 0, as_stream(stream)>>>(p));
  check_launch("swiglu_forward");
}
void swiglu_backward(const SwigluParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, swiglu_backward_kernel<T><<<grid_for(p.rows * p.f), 256, 0, as_stream(stream)>>>(p));
  check_launch("swiglu_backward");
}
void rotary(const RotaryParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, rotary_kernel<T><<<grid_for(p.s * p.bh * p.d), 256, 0, as_stream(stream)>>>(p));
  check_launch("rotary");
}

}  // namespace megatorch::kernels::cuda
