// SwiGLU of [gate; up] rows, silu(gate) * up, and its backward: grid-stride loops with
// fp32 math.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

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

}  // namespace

void swiglu_forward(const SwigluParams& p, void* stream) {
  const int blocks = elementwise_blocks(p.rows * p.f);
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          swiglu_forward_kernel<T><<<blocks, kElementwiseThreads, 0, as_stream(stream)>>>(p));
  check_launch("swiglu_forward");
}
void swiglu_backward(const SwigluParams& p, void* stream) {
  const int blocks = elementwise_blocks(p.rows * p.f);
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          swiglu_backward_kernel<T><<<blocks, kElementwiseThreads, 0, as_stream(stream)>>>(p));
  check_launch("swiglu_backward");
}

}  // namespace megatorch::kernels::cuda
