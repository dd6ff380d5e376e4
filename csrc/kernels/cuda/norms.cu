// LayerNorm and RMSNorm, forward and backward (weight and bias gradients as per-block
// partial sums the caller reduces). One block per row, block reductions in fp32; each
// row is read from global memory (L2-resident at these row lengths) once per pass.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

template <typename T>
__global__ void norm_forward_kernel(NormParams p) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x;
  const T* x = static_cast<const T*>(p.input) + r * p.cols;
  T* y = static_cast<T*>(p.out) + r * p.cols;
  float s1 = 0, s2 = 0;
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    const float v = to_float(x[c]);
    s1 += v;
    s2 += v * v;
  }
  s1 = block_reduce<false>(s1, shared);
  s2 = block_reduce<false>(s2, shared);
  const float mean = p.rms ? 0.0f : s1 / p.cols;
  const float var = p.rms ? s2 / p.cols : fmaxf(s2 / p.cols - mean * mean, 0.0f);
  const float rstd = rsqrtf(var + p.eps);
  if (threadIdx.x == 0) {
    if (p.mean) p.mean[r] = mean;
    p.rstd[r] = rstd;
  }
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    const float v = (to_float(x[c]) - mean) * rstd * p.weight[c];
    y[c] = from_float<T>(p.bias ? v + p.bias[c] : v);
  }
}

// Block k handles rows k, k + blocks, ...: the input gradient row by row, and its own
// partial sums of the weight and bias gradients (reduced by the caller).
template <typename T>
__global__ void norm_backward_kernel(NormParams p) {
  __shared__ float shared[32];
  float* dwp = p.grad_weight_partial + blockIdx.x * p.cols;
  float* dbp = p.grad_bias_partial + blockIdx.x * p.cols;
  for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) dwp[c] = dbp[c] = 0.0f;
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const T* x = static_cast<const T*>(p.input) + r * p.cols;
    const T* g = static_cast<const T*>(p.grad) + r * p.cols;
    T* dx = static_cast<T*>(p.out) + r * p.cols;
    const float mean = p.rms ? 0.0f : p.mean[r], rstd = p.rstd[r];
    float sgw = 0, sgwx = 0;
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
      const float xh = (to_float(x[c]) - mean) * rstd, gv = to_float(g[c]);
      sgw += gv * p.weight[c];
      sgwx += gv * p.weight[c] * xh;
      dwp[c] += gv * xh;
      dbp[c] += gv;
    }
    sgw = block_reduce<false>(sgw, shared);
    sgwx = block_reduce<false>(sgwx, shared);
    const float a = p.rms ? 0.0f : sgw / p.cols, b = sgwx / p.cols;
    for (int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
      const float xh = (to_float(x[c]) - mean) * rstd;
      dx[c] = from_float<T>(rstd * (to_float(g[c]) * p.weight[c] - a - xh * b));
    }
  }
}

}  // namespace

void norm_forward(const NormParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          norm_forward_kernel<T><<<row_blocks(p.rows), kRowThreads, 0, as_stream(stream)>>>(p));
  check_launch("norm_forward");
}
void norm_backward(const NormParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          norm_backward_kernel<T><<<static_cast<unsigned>(p.partial_blocks), kRowThreads, 0,
                                                    as_stream(stream)>>>(p));
  check_launch("norm_backward");
}

}  // namespace megatorch::kernels::cuda
