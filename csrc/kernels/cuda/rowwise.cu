// Row-wise kernels: LayerNorm/RMSNorm, the scaled masked softmaxes, the local part of
// the vocab-parallel cross entropy. One block per row, block reductions in fp32; each
// row is read from global memory (L2-resident at these row lengths) once per pass.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

constexpr int kThreads = 256;

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

template <typename T>
__global__ void cross_entropy_local_kernel(CrossEntropyLocalParams p) {
  __shared__ float shared[32];
  const int64_t r = blockIdx.x;
  const T* x = static_cast<const T*>(p.logits) + r * p.cols;
  // Per-thread online max / sum of exps, then combined across the block.
  float m = -INFINITY, s = 0, sum = 0;
  for (int64_t c = threadIdx.x; c < p.real_cols; c += blockDim.x) {
    const float v = to_float(x[c]);
    if (v > m) {
      s = s * __expf(m - v) + 1.0f;
      m = v;
    } else {
      s += __expf(v - m);
    }
    sum += v;
  }
  const float bm = block_reduce<true>(m, shared);
  s = m == -INFINITY ? 0.0f : s * __expf(m - bm);
  s = block_reduce<false>(s, shared);
  sum = block_reduce<false>(sum, shared);
  if (threadIdx.x == 0) {
    const int64_t t = p.target[r] - p.vocab_start;
    p.max[r] = bm;
    p.sum_exp[r] = s;
    p.sum_logits[r] = sum;
    p.target_logit[r] = t >= 0 && t < p.cols ? to_float(x[t]) : 0.0f;
  }
}

unsigned rows_grid(int64_t rows) { return static_cast<unsigned>(rows); }

}  // namespace

void norm_forward(const NormParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, norm_forward_kernel<T><<<rows_grid(p.rows), kThreads, 0, as_stream(stream)>>>(p));
  check_launch("norm_forward");
}
void norm_backward(const NormParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          norm_backward_kernel<T><<<static_cast<unsigned>(p.partial_blocks), kThreads, 0,
                                                    as_stream(stream)>>>(p));
  check_launch("norm_backward");
}
void softmax_forward(const SoftmaxParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          softmax_forward_kernel<T><<<rows_grid(p.batch * p.heads * p.sq), kThreads, 0,
                                                      as_stream(stream)>>>(p));
  check_launch("softmax_forward");
}
void softmax_backward(const SoftmaxParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          softmax_backward_kernel<T><<<rows_grid(p.batch * p.heads * p.sq), kThreads, 0,
                                                       as_stream(stream)>>>(p));
  check_launch("softmax_backward");
}
void cross_entropy_local(const CrossEntropyLocalParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          cross_entropy_local_kernel<T><<<rows_grid(p.rows), kThreads, 0, as_stream(stream)>>>(p));
  check_launch("cross_entropy_local");
}

}  // namespace megatorch::kernels::cuda
