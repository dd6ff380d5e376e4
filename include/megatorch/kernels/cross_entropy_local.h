#pragma once
// The local part of the vocab-parallel cross entropy in one pass over a logits shard:
// per row, over the real columns [0, real_cols) of the shard (the rest is Megatron's
// vocabulary padding), the max, Σ exp(x - that max), Σ x, and the raw logit of the
// target when it falls in [vocab_start, vocab_start + cols) (else 0). The loss
// (tp::vocab_parallel_cross_entropy) combines these across ranks with its three
// all-reduces; its backward is the loss's own operator.
// Operator: torch.ops.megatorch.vocab_parallel_cross_entropy_local.
#include <ATen/Tensor.h>

#include <tuple>

namespace megatorch::kernels {

// logits [..., cols] (any float dtype), target [...] int64 global ids.
// -> (max, sum_exp, target_logit, sum_logits), each [...] fp32 (double for double).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_local(const at::Tensor& logits,
                                                                               const at::Tensor& target,
                                                                               int64_t vocab_start, int64_t real_cols);

}  // namespace megatorch::kernels
