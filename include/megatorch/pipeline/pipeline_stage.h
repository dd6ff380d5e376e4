#pragma once
// PipelineStage: this pipeline rank's chunks of a GPT, the GPT's pipeline::Stage. With p
// stages and v virtual chunks per stage, virtual stage s = chunk·p + rank (or, in the V
// layout, r and 2p-1-r) owns a contiguous range of GPT layers; virtual stage 0 also owns the embedding, the last one
// the final norm, the head and the loss. Layers split evenly, or by an explicit list of
// per-virtual-stage counts. Micro-batches carry `ids` and `labels` [b, seq_length]; the
// activation is [s, b, h] ([s/tp, b, h] under SP) in the parameters' dtype; the tied
// embedding's two copies are one TiedParameters tie. With context parallelism (the
// config's context_parallel_group, c ranks) micro-batches still carry whole sequences:
// each CP rank takes its chunks of ids and labels, so s is seq_length / c.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <vector>

#include "megatorch/models/gpt_model.h"
#include "megatorch/pipeline/stage.h"
#include "megatorch/pipeline/tied_parameters.h"

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
  // kV (with virtual_chunks 2) for the zb-v and dualpipev schedules: rank 0 then holds the
  // embedding and the head.
  TORCH_ARG(ChunkLayout, chunk_layout) = ChunkLayout::kLooped;
  TORCH_ARG(std::vector<int64_t>, layer_split) = {};  // empty: even split
};

class PipelineStageImpl : public torch::nn::Cloneable<PipelineStageImpl>, public Stage {
 public:
  explicit PipelineStageImpl(PipelineStageOptions options);
  void reset() override;

  int64_t pp_rank() const override { return pp_rank_; }
  int64_t pp_size() const override { return pp_size_; }
  int64_t num_chunks() const override { return options.virtual_chunks(); }
  ChunkLayout chunk_layout() const override { return options.chunk_layout(); }
  const std::string& pipeline_group() const override { return options.pp_group(); }
  c10::Device device() const override { return options.config().device(); }
  models::GPTModel chunk(int64_t c) const { return chunks->ptr<models::GPTModelImpl>(c); }
  // The [s, b, h] (or [s/tp, b, h] under SP) shape passed between stages.
  std::vector<int64_t> activation_shape(int64_t micro_batch_size) const;

  // Checks ids and labels ([b, seq_length], one b) before any p2p.
  void prepare(const std::vector<MicroBatch>& micro_batches) override;
  ActivationSpec activation_spec(int64_t virtual_stage) const override;
  at::Tensor forward_chunk(int64_t chunk, const at::Tensor& input, const MicroBatch& micro_batch) override;
  // tp::masked_mean_loss of the vocab-parallel cross entropy: the mean over non-ignored tokens.
  at::Tensor micro_batch_loss(const at::Tensor& output, const MicroBatch& micro_batch) override;

  // Tied embeddings across stages: the first stage's embedding and the last stage's copy
  // of it get the sum of both gradients (a p2p exchange between pp ranks 0 and p-1).
  void allreduce_tied_embedding_grads() { allreduce_tied_grads(); }
  void allreduce_tied_grads() override { ties_.allreduce_grads(); }
  const TiedParameters& ties() const override { return ties_; }
  // Under SP, each chunk's partial gradients summed over the TP group.
  void allreduce_sequence_parallel_grads() override;
  void set_unit_hooks(int64_t chunk, std::shared_ptr<models::UnitHooks> hooks, int64_t first_unit,
                      int64_t last_unit) override;
  torch::nn::Module& stage_module() override { return *this; }
  std::shared_ptr<torch::nn::Module> chunk_module(int64_t c) const override { return chunks->ptr(c); }
  std::shared_ptr<tp::RngTracker> rng_tracker() const override { return chunk(0)->options.rng(); }
  int64_t context_parallel_size() const override { return chunk(0)->cp.size; }

  PipelineStageOptions options;
  torch::nn::ModuleList chunks{nullptr};

 private:
  int64_t pp_rank_ = 0, pp_size_ = 1;
  int64_t micro_batch_size_ = 0;  // of the step prepare() saw
  TiedParameters ties_;
};
TORCH_MODULE(PipelineStage);

}  // namespace megatorch::pipeline
