#pragma once
// Cross entropy over vocab-parallel logits without gathering them: exactly three
// all-reduces over the TP group, each of one value per token — the max logit, the
// target's logit, the sum of exps (with label smoothing the second also carries the
// sum of logits, so it moves two values per token). The backward communicates nothing.
#include <ATen/Tensor.h>
#include <c10/util/Optional.h>

#include <string>

namespace megatorch::tp {

// logits [..., V/tp] (this rank's vocabulary shard, rank r holding columns
// [r·V/tp, (r+1)·V/tp)), target [...] of global ids -> per-token loss [...], fp32.
// Tokens whose target is ignore_index get loss 0 and no gradient. Label smoothing as
// torch.nn.functional.cross_entropy: (1-ε)·nll + ε·mean over the vocabulary of -log p.
// `vocab_size`, when given, is the real vocabulary: columns at or past it (Megatron's
// padding) are left out of the softmax, so every TP size gives the same loss.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const std::string& group,
                                        double label_smoothing = 0.0, int64_t ignore_index = -100,
                                        c10::optional<int64_t> vocab_size = c10::nullopt);

}  // namespace megatorch::tp
