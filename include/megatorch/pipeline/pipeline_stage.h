#pragma once
// PipelineStage: this pipeline rank's model chunks. With p stages and v virtual chunks
// per stage, virtual stage s = chunk·p + rank owns a contiguous range of GPT layers;
// virtual stage 0 also owns the embedding, the last one the final norm, the head and
// the loss. Layers split evenly, or by an explicit list of per-virtual-stage counts.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <vector>

#include "megatorch/models/gpt_model.h"

namespace megatorch::pipeline {

// Layer counts per virtual stage (p·v entries): `explicit_split` if given (checked), else
// an even split (an error when p·v does not divide the layers).
std::vector<int64_t> split_layers(int64_t num_layers, int64_t p, int64_t v, const std::vector<int64_t>& explicit_split);

struct PipelineStageOptions {
  explicit PipelineStageOptions(transformer::TransformerConfig config) : config_(std::move(config)) {}
  TORCH_ARG(transformer::TransformerConfig, config);
  TORCH_ARG(std::string, tp_group) = "";
  TORCH_ARG(std::string, pp_group) = "";  // "" for a single stage
  TORCH_ARG(int64_t, virtual_chunks) = 1;
  TORCH_ARG(std::vector<int64_t>, layer_split) = {};  // empty: even split
};

class PipelineStageImpl : public torch::nn::Cloneable<PipelineStageImpl> {
 public:
  explicit PipelineStageImpl(PipelineStageOptions options);
  void reset() override;

  int64_t pp_rank() const { return pp_rank_; }
  int64_t pp_size() const { return pp_size_; }
  int64_t num_chunks() const { return options.virtual_chunks(); }
  models::GPTModel chunk(int64_t c) const { return chunks->ptr<models::GPTModelImpl>(c); }
  bool is_first_virtual_stage(int64_t c) const { return c == 0 && pp_rank_ == 0; }
  bool is_last_virtual_stage(int64_t c) const { return c == num_chunks() - 1 && pp_rank_ == pp_size_ - 1; }
  // The [s, b, h] (or [s/tp, b, h] under SP) shape passed between stages.
  std::vector<int64_t> activation_shape(int64_t micro_batch_size) const;

  // Tied embeddings across stages: the first stage's embedding and the last stage's copy
  // of it get the sum of both gradients (a p2p exchange between pp ranks 0 and p-1).
  void allreduce_tied_embedding_grads();
  // Under SP, each chunk's partial gradients summed over the TP group.
  void allreduce_sequence_parallel_grads();

  PipelineStageOptions options;
  torch::nn::ModuleList chunks{nullptr};

 private:
  int64_t pp_rank_ = 0, pp_size_ = 1;
};
TORCH_MODULE(PipelineStage);

}  // namespace megatorch::pipeline
