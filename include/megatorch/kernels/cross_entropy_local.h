#pragma once
// The local part of the vocab-parallel cross entropy in one pass over a logits shard:
// per row, over the real columns [0, real_cols) of the shard (the rest is Megatron's
// vocabulary padding), the max, Σ exp(x - that max), Σ x, and the raw logit of the
// target when it falls in [vocab_start, vocab_start + cols) (else 0). The loss
// (tp::vocab_parallel_cross_entropy) combines these across ranks with its three
// all-reduces; its backward is the loss's own operator, on CUDA through
// cross_entropy_backward_cuda below.
// Operator: torch.ops.megatorch.vocab_parallel_cross_entropy_local.
#include <ATen/Tensor.h>

#include <tuple>

namespace megatorch::kernels {

// logits [..., cols] (any float dtype), target [...] int64 global ids.
// -> (max, sum_exp, target_logit, sum_logits), each [...] fp32 (double for double).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_local(const at::Tensor& logits,
                                                                               const at::Tensor& target,
                                                                               int64_t vocab_start, int64_t real_cols);

// The loss's backward on CUDA in one pass over the shard (the CPU backward is the ATen
// chain of tp::vocab_parallel_cross_entropy_backward, with the same fp32 arithmetic):
//   grad = g' · (exp(x - log_sum_exp) - (1-ε)·[column = target - vocab_start] - ε/K)
// over the real columns [0, real_cols), g' · (-(1-ε)·[column = target - vocab_start]) on
// the padded ones (0 unless a target names one), g' = grad_loss, 0 where target ==
// ignore_index. fp32 arithmetic, one rounding to the logits' dtype; a new tensor (the
// logits are left as they are).
// grad_loss, log_sum_exp [...] (converted to fp32), target [...] int64 global ids,
// logits [..., cols] fp32, fp16 or bf16 on a CUDA device; vocab_real = K >= 1, the real
// vocabulary size of the whole (unsharded) vocabulary, the mean of the smoothing term.
// -> [..., cols] in the logits' dtype.
at::Tensor cross_entropy_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& log_sum_exp,
                                       int64_t vocab_start, int64_t real_cols, int64_t vocab_real,
                                       double label_smoothing, int64_t ignore_index);

}  // namespace megatorch::kernels
