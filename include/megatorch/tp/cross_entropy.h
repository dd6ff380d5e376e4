#pragma once
// Cross entropy over vocab-parallel logits without gathering them: exactly three
// all-reduces over the TP group, each of one value per token — the max logit, the
// target's logit, the sum of exps (with label smoothing the second also carries the
// sum of logits, so it moves two values per token). The backward communicates nothing:
// it rebuilds the softmax from the logits shard and the global log-sum-exp.
#include <ATen/Tensor.h>
#include <c10/util/Optional.h>

#include <string>
#include <tuple>

namespace megatorch::tp {

// The target id whose tokens carry no loss (PyTorch's and Megatron's default ignore_index).
constexpr int64_t kIgnoreIndex = -100;

// logits [..., V/tp] (this rank's vocabulary shard, rank r holding columns
// [r·V/tp, (r+1)·V/tp)), target [...] of global ids -> per-token loss [...], fp32.
// Tokens whose target is ignore_index get loss 0 and no gradient. Label smoothing as
// torch.nn.functional.cross_entropy: (1-ε)·nll + ε·mean over the vocabulary of -log p.
// `vocab_size`, when given, is the real vocabulary: columns at or past it (Megatron's
// padding) are left out of the softmax, so every TP size gives the same loss.
// Differentiable; runs through the dispatcher (torch.compile and TorchScript see ops).
// `fused`: the local part (row max, Σ exp, target logit, Σ logits) in one pass over the
// shard (kernels::cross_entropy_local); off: ATen ops. Three all-reduces either way.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const std::string& group,
                                        double label_smoothing = 0.0, int64_t ignore_index = kIgnoreIndex,
                                        c10::optional<int64_t> vocab_size = c10::nullopt, bool fused = true);

// The two halves, outside autograd (the kernels of the internal operators).
// vocab_size <= 0 means every column is real. Returns (loss, log_sum_exp), both fp32.
std::tuple<at::Tensor, at::Tensor> vocab_parallel_cross_entropy_forward(const at::Tensor& logits,
                                                                        const at::Tensor& target,
                                                                        const std::string& group, double label_smoothing,
                                                                        int64_t ignore_index, int64_t vocab_size,
                                                                        bool fused = true);
at::Tensor vocab_parallel_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                                 const at::Tensor& target, const at::Tensor& log_sum_exp,
                                                 const std::string& group, double label_smoothing,
                                                 int64_t ignore_index, int64_t vocab_size);

// The mean loss over the tokens that carry one: per_token (any layout, e.g. [s, b] from
// GPTModel::per_token_loss) summed over the labels (the same tokens, e.g. [b, s]) that are
// not ignore_index. The one loss average of the model, the pipeline and evaluation: a
// plain mean would count ignored tokens' zeros. A batch with every token ignored gives 0.
at::Tensor masked_mean_loss(const at::Tensor& per_token, const at::Tensor& labels,
                            int64_t ignore_index = kIgnoreIndex);

}  // namespace megatorch::tp
