#pragma once
// GPTModel: vocab-parallel embedding (+ learned positions), transformer layers, final
// norm, output head (tied to the embedding or not) and the vocab-parallel loss, with
// activations in Megatron's [s, b, h] layout. Built for a layer range, with or
// without the embedding (pre_process) and the head (post_process), so a pipeline
// stage owns a slice of the model with the same numbers as the whole.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <string>

#include "megatorch/models/unit_hooks.h"
#include "megatorch/tp/cross_entropy.h"
#include "megatorch/tp/parameter_layout.h"
#include "megatorch/tp/vocab_parallel_embedding.h"
#include "megatorch/transformer/cuda_graph.h"
#include "megatorch/transformer/transformer_layer.h"

namespace megatorch::models {

struct GPTModelOptions {
  explicit GPTModelOptions(transformer::TransformerConfig config) : config_(std::move(config)) {}
  TORCH_ARG(transformer::TransformerConfig, config);
  TORCH_ARG(std::string, group) = "";  // TP group name; "" for none
  TORCH_ARG(int64_t, layer_begin) = 0;
  TORCH_ARG(int64_t, layer_end) = -1;  // -1: config.num_layers
  TORCH_ARG(bool, pre_process) = true;
  TORCH_ARG(bool, post_process) = true;
  // Dropout RNG streams; made and seeded from config.seed + tp rank when null.
  TORCH_ARG(std::shared_ptr<tp::RngTracker>, rng) = nullptr;
};

class GPTModelImpl : public torch::nn::Cloneable<GPTModelImpl>, public tp::ShardedModule {
 public:
  explicit GPTModelImpl(GPTModelOptions options);
  void reset() override;

  // pre_process: token ids [b, s]; otherwise the previous stage's hidden states
  // [s, b, h] ([s/tp, b, h] under SP). Returns hidden states, or with post_process
  // this rank's logits shard [s, b, Vp/tp]. With context parallelism (config's
  // context_parallel_group) s is this CP rank's share of the sequence, in the order
  // transformer::context_parallel_slice gives it (ids sliced so); positions follow.
  // packed: documents packed into each row (transformer/packed_sequence.h; every stage of
  // a pipeline gets the micro-batch's): their positions and attention inside each document.
  at::Tensor forward(const at::Tensor& input, const transformer::PackedSequence& packed = {});
  // Inference with one KV cache per layer of this chunk (inference::make_kv_caches): the
  // input (ids [b, s], or the previous stage's hidden states [s, b, h]) holds the s tokens
  // at positions [position_offset, position_offset + s), the caches every earlier one.
  // Returns what forward returns for those tokens. Eval mode, no sequence parallelism,
  // causal attention.
  at::Tensor forward_cached(const at::Tensor& input, int64_t position_offset, std::vector<inference::KVCache>& caches);
  // Per-token loss [s, b] (fp32) from a logits shard and labels [b, s]; padded
  // vocabulary columns are left out of the softmax, ignore_index tokens give 0.
  at::Tensor per_token_loss(const at::Tensor& logits, const at::Tensor& labels,
                            int64_t ignore_index = tp::kIgnoreIndex) const;
  // Mean loss over the non-ignored tokens of a batch (tp::masked_mean_loss).
  at::Tensor loss(const at::Tensor& ids, const at::Tensor& labels, int64_t ignore_index = tp::kIgnoreIndex);

  // Sums, over the TP group, the gradients that sequence parallelism leaves partial
  // (norms, row-parallel biases, position embeddings) in one flat all-reduce. Call
  // after backward, before clipping and the optimizer step. A no-op without SP.
  void allreduce_sequence_parallel_grads();
  std::vector<at::Tensor> sequence_parallel_parameters() const;

  // The parameters unit by unit: unit 0 is everything outside the layers (embeddings,
  // final norm, output layer; empty on a middle pipeline stage), unit 1 + i is layer i of
  // this chunk. ZeRO-3 gathers and frees a unit at once.
  std::vector<std::vector<at::Tensor>> parameter_units() const;
  // Runs hooks->before_forward / after_forward around each unit, numbered from
  // `first_unit` (several chunks can share one optimizer). nullptr removes them.
  void set_unit_hooks(std::shared_ptr<UnitHooks> hooks, int64_t first_unit = 0);

  // With config.cuda_graph: forward/backward graph pairs captured so far (0 where the
  // layers cannot be captured), and why not ("" until a training forward found a reason).
  int64_t cuda_graph_captures() const;
  const std::string& cuda_graph_fallback_reason() const { return cuda_graph_fallback_; }

  // The output layer's weight shard [Vp/tp, h] (the embedding's when tied).
  at::Tensor output_weight() const;
  // Its own raw parameters: output_layer split over the padded vocabulary like the
  // embedding; position_embedding replicated, partial under sequence parallelism.
  std::map<std::string, tp::ParameterLayout> parameter_layouts() const override;

  GPTModelOptions options;
  tp::VocabParallelEmbedding embedding{nullptr};
  at::Tensor position_embedding;  // [max_positions, h], learned positions only
  torch::nn::ModuleList layers{nullptr};
  transformer::Norm final_norm{nullptr};
  at::Tensor output_layer;  // [Vp/tp, h] when untied (or tied on a stage without the embedding)
  tp::TPInfo tp;
  tp::TPInfo cp;  // the context-parallel group's rank and size (size 1 without CP)

 private:
  at::Tensor embed(const at::Tensor& ids, const at::Tensor& position_ids);
  // The layers through captured CUDA graphs, or eagerly (saying why once) where they cannot be.
  at::Tensor run_layers_graphed(const at::Tensor& h, const at::Tensor& freqs,
                                const std::function<at::Tensor(at::Tensor)>& run_layers);
  // Global positions of this CP rank's `tokens` tokens (arange without CP).
  at::Tensor positions(int64_t tokens);
  at::Tensor positions_;  // positions()'s last table
  at::Tensor cp_rope_freqs_;  // RoPE angles at positions_
  at::Tensor rope_freqs_;
  at::Tensor inference_rope_freqs_;  // forward_cached's table, grown to the longest sequence seen
  std::shared_ptr<UnitHooks> unit_hooks_;
  std::shared_ptr<transformer::LayerStackGraphs> cuda_graphs_;
  std::string cuda_graph_fallback_;
  int64_t first_unit_ = 0;
};
TORCH_MODULE(GPTModel);

}  // namespace megatorch::models
