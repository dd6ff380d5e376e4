// The scaled masked (or causal) softmax of attention scores and its backward. One block
// per row, block reductions in fp32; each row is read from global memory (L2-resident at
// these row lengths) once per pass.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

template <typename T>
__global__ void softmax_forward_kernel(SoftmaxParams p) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x;
  const int64_t q = r % p.sq, h = (r / p.sq) % p.heads, b = r / (p.sq * p.heads);
  const T* x = static_cast<const T*>(p.input) + r * p.sk;
  T* y = static_cast<T*>(p.out) + r * p.sk;
  const bool* m = p.mask ? p.mask + b * p.mask_stride_b + h * p.mask_stride_h + q * p.mask_stride_q : nullptr;
  const int64_t limit = p.causal ? min(p.sk, q + 1) : p.sk;
  auto value = [&](int64_t k) -> float {
    return (k >= limit || (m && m[k * p.mask_stride_k])) ? -INFINITY : to_float(x[k]) * p.scale;
  };
  float mx = -INFINITY;
  for (int64_t k = threadIdx.x; k < p.sk; k += blockDim.x) mx = fmaxf(mx, value(k));
  mx = block_reduce<true>(mx, shared);
  if (mx == -INFINITY) {  // every entry masked: zeros
    for (int64_t k = threadIdx.x; k < p.sk; k += blockDim.x) y[k] = from_float<T>(0.0f);
    return;
  }
  float sum = 0;
  for (int64_t k = threadIdx.x; k < p.sk; k += blockDim.x) sum += __expf(value(k) - mx);
  sum = block_reduce<false>(sum, shared);
  const float inv = 1.0f / sum;
  for (int64_t k = threadIdx.x; k < p.sk; k += blockDim.x) y[k] = from_float<T>(__expf(value(k) - mx) * inv);
}

template <typename T>
__global__ void softmax_backward_kernel(SoftmaxParams p) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x;
  const T* y = static_cast<const T*>(p.input) + r * p.sk;
  const T* g = static_cast<const T*>(p.grad) + r * p.sk;
  T* dx = static_cast<T*>(p.out) + r * p.sk;
  float dot = 0;
  for (int64_t k = threadIdx.x; k < p.sk; k += blockDim.x) dot += to_float(g[k]) * to_float(y[k]);
  dot = block_reduce<false>(dot, shared);
  for (int64_t k = threadIdx.x; k < p.sk; k += blockDim.x) {
    dx[k] = from_float<T>(p.scale * to_float(y[k]) * (to_float(g[k]) - dot));
  }
}

}  // namespace

void softmax_forward(const SoftmaxParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          softmax_forward_kernel<T><<<row_blocks(p.batch * p.heads * p.sq), kRowThreads, 0,
                                                      as_stream(stream)>>>(p));
  check_launch("softmax_forward");
}
void softmax_backward(const SoftmaxParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          softmax_backward_kernel<T><<<row_blocks(p.batch * p.heads * p.sq), kRowThreads, 0,
                                                       as_stream(stream)>>>(p));
  check_launch("softmax_backward");
}

}  // namespace megatorch::kernels::cuda
