// The local part of the vocab-parallel cross entropy: per row of this rank's logits
// shard, the max, the sum of exps, the sum of logits and the target's logit. One block
// per row, block reductions in fp32.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

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

}  // namespace

void cross_entropy_local(const CrossEntropyLocalParams& p, void* stream) {
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          cross_entropy_local_kernel<T><<<row_blocks(p.rows), kRowThreads, 0, as_stream(stream)>>>(p));
  check_launch("cross_entropy_local");
}

}  // namespace megatorch::kernels::cuda
