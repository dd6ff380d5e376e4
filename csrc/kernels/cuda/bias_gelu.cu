// GeLU (tanh approximation) of input + bias, and its backward: a grid-stride loop with
// fp32 math that moves 16-byte packs when the pointers and the row length allow it.
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
    const int blocks = elementwise_blocks(work);
    if (vec) {
      bias_gelu_kernel<T, V, kBackward><<<blocks, kElementwiseThreads, 0, as_stream(stream)>>>(p);
    } else {
      bias_gelu_kernel<T, 1, kBackward><<<blocks, kElementwiseThreads, 0, as_stream(stream)>>>(p);
    }
  });
  check_launch("bias_gelu");
}

}  // namespace

void bias_gelu_forward(const BiasGeluParams& p, void* stream) { launch_bias_gelu<false>(p, stream); }
void bias_gelu_backward(const BiasGeluParams& p, void* stream) { launch_bias_gelu<true>(p, stream); }

}  // namespace megatorch::kernels::cuda
