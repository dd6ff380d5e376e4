// The backward of the vocab-parallel cross entropy in one pass over this rank's logits
// shard: each logit is read once and its gradient written once, in the logits' dtype,
//
//   grad[r, c] = g'_r · (p - (1-ε)·[c = t_r - vocab_start] - ε/K·[c < real_cols]),
//   p = exp(x[r, c] - lse_r) for a real column c < real_cols, 0 for a padded one,
//   g'_r = grad_loss[r], 0 when t_r = ignore_index.
//
// The arithmetic is the ATen chain's of tp::vocab_parallel_cross_entropy_backward, op by
// op in fp32 with explicit round-to-nearest intrinsics (no FMA contraction): x - lse,
// exp, + (-(1-ε)) at the target's column, - ε/K, · g', then one rounding to T. The
// target term applies to any column of the shard that the target names, padded or not,
// as the chain's scatter_add does (and as the forward picks that column's logit).
//
// Grid: blockIdx.x = row (the per-row scalars are loaded once per block), blockIdx.y = a
// chunk of the row's packs; the chunks of a row are evened out so that every block runs
// the same number of steps (but the last). A thread moves kUnroll packs of N elements
// per step (all loads first, then the arithmetic and the stores). N = 16 bytes / sizeof(T)
// when the row length and the pointers allow it, else the widest power of two that does.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) cross_entropy_backward_kernel(CrossEntropyBackwardParams p,
                                                                          int64_t span) {
  using P = Pack<T, N>;
  const int64_t r = blockIdx.x;
  const int64_t packs = p.cols / N;
  const int64_t p0 = static_cast<int64_t>(blockIdx.y) * span;
  const int64_t p1 = p0 + span < packs ? p0 + span : packs;

  // Per-row scalars, once per block.
  const float lse = p.log_sum_exp[r];
  const int64_t t = p.target[r];
  const float g = t == p.ignore_index ? 0.0f : p.grad_loss[r];
  const int64_t hit = t - p.vocab_start;  // the target's column when 0 <= hit < cols; never matches otherwise
  const float neg_target_weight = -p.target_weight;
  const float uniform = p.uniform_weight;

  const P* __restrict__ x = reinterpret_cast<const P*>(static_cast<const T*>(p.logits) + r * p.cols);
  P* __restrict__ out = reinterpret_cast<P*>(static_cast<T*>(p.grad) + r * p.cols);

  for (int64_t base = p0 + threadIdx.x; base < p1; base += kUnroll * kThreads) {
    P v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + k * kThreads;
      if (i < p1) v[k] = x[i];
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + k * kThreads;
      if (i < p1) {
        float f[N];
        unpack_float(v[k], f);
        // Columns relative to this pack, 64-bit once per pack, then clamped to 32-bit
        // compares per element: the target's element (-1: none) and the real ones (< rel_real).
        const int64_t c0 = i * N;
        const int rel_hit = hit >= c0 && hit < c0 + N ? static_cast<int>(hit - c0) : -1;
        const int rel_real = static_cast<int>(max(int64_t{0}, min(p.real_cols - c0, int64_t{N})));
        P y;
#pragma unroll
        for (int e = 0; e < N; ++e) {
          const bool real = e < rel_real;
          float d = real ? expf(__fsub_rn(f[e], lse)) : 0.0f;  // masked_fill of the padded columns
          if (e == rel_hit) d = __fadd_rn(d, neg_target_weight);  // scatter_add of -(1-ε)
          d = __fsub_rn(d, real ? uniform : 0.0f);                 // - ε/K over the real columns
          y.v[e] = from_float<T>(__fmul_rn(d, g));
        }
        out[i] = y;
      }
    }
  }
}

template <typename T, int N>
void launch(const CrossEntropyBackwardParams& p, cudaStream_t stream) {
  const int64_t packs = p.cols / N;
  // Chunks of at most kUnroll · kThreads packs (one step per thread), evened out.
  const int64_t chunks = std::min<int64_t>(ceil_div(packs, static_cast<int64_t>(kUnroll) * kThreads), 65535);
  const int64_t span = ceil_div(packs, chunks);
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(chunks));
  cross_entropy_backward_kernel<T, N><<<grid, kThreads, 0, stream>>>(p, span);
}

// The widest N (a power of two, at most 16 bytes of T) that divides the row and to which
// both rows' base pointers are aligned.
template <typename T>
int vector_width(const CrossEntropyBackwardParams& p) {
  for (int n = kVec<T>; n > 1; n /= 2) {
    const uintptr_t bytes = static_cast<uintptr_t>(n) * sizeof(T);
    if (p.cols % n == 0 && aligned_to(p.logits, bytes) && aligned_to(p.grad, bytes)) return n;
  }
  return 1;
}

template <typename T>
void dispatch_width(const CrossEntropyBackwardParams& p, cudaStream_t stream) {
  switch (vector_width<T>(p)) {
    case 8:
      if constexpr (kVec<T> >= 8) launch<T, 8>(p, stream);
      break;
    case 4: launch<T, 4>(p, stream); break;
    case 2: launch<T, 2>(p, stream); break;
    default: launch<T, 1>(p, stream); break;
  }
}

}  // namespace

void cross_entropy_backward(const CrossEntropyBackwardParams& p, void* stream) {
  if (p.rows == 0 || p.cols == 0) return;
  if (p.rows > 0x7fffffff) {
    throw std::runtime_error("megatorch: cross_entropy_backward: more than 2^31 - 1 rows (" + std::to_string(p.rows) +
                             ") for the grid's x dimension");
  }
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, dispatch_width<T>(p, as_stream(stream)));
  check_launch("cross_entropy_backward");
}

}  // namespace megatorch::kernels::cuda
