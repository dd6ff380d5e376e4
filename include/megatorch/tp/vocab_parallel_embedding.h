#pragma once
// Embedding with the vocabulary split across the TP group: rank r holds rows
// [r·Vp/tp, (r+1)·Vp/tp) of a vocabulary padded up to Vp, a multiple of
// tp × make_vocab_size_divisible_by. Ids outside the shard look up zeros, and the
// partial results are summed across the group (g, or the SP reduce-scatter).
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/tp/init.h"
#include "megatorch/tp/parameter_layout.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::tp {

// Megatron's padding: the smallest multiple of tp * divisible_by that is >= vocab.
int64_t padded_vocab_size(int64_t vocab, int64_t tp_size, int64_t divisible_by = 128);

// This rank's [Vp/tp, h] fp32 rows of a vocabulary table named `name`: the real rows
// drawn as one [V, h] tensor whatever the padding (so every TP size starts from the same
// numbers, or per shard with init.shard_local), padded rows zero. Shared by the
// embedding and by an output layer tied to it on another pipeline stage.
at::Tensor init_vocab_shard(int64_t vocab, int64_t hidden, int64_t padded_vocab, const TPInfo& tp,
                            const std::string& name, const ParamInitOptions& init);

// ids (any shape) -> ids.shape + [h], summed over the group. With sequence_parallel the
// ids are [s, b] and the result is reduce-scattered along s: [s/tp, b, h].
at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, const std::string& group,
                                    bool sequence_parallel = false);

struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);  // the real vocabulary size V
  TORCH_ARG(int64_t, embedding_dim);
  TORCH_ARG(int64_t, make_vocab_size_divisible_by) = 128;
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(std::string, group) = "";
  TORCH_ARG(ParamInitOptions, init) = {};
};

class VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl>, public ShardedModule {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options);

  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& ids);
  // weight split along dim 0 over the padded vocabulary; num_embeddings rows are real.
  std::map<std::string, ParameterLayout> parameter_layouts() const override;

  int64_t padded_vocab() const { return padded_vocab_; }
  int64_t vocab_start() const { return tp.rank * (padded_vocab_ / tp.size); }

  VocabParallelEmbeddingOptions options;
  at::Tensor weight;  // [Vp/tp, h]; padded rows are zero
  TPInfo tp;

 private:
  int64_t padded_vocab_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

}  // namespace megatorch::tp
