#pragma once
// Pre-norm transformer layer: x + dropout(attn(norm(x))), then + dropout(mlp(norm(.))).
// The MLP is a mixture of experts (moe::MoELayer, registered as "mlp" too) on the layers
// config.is_moe_layer names.
// With recompute = full the whole layer is replayed in backward from its input.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/moe/moe_layer.h"
#include "megatorch/transformer/attention.h"
#include "megatorch/transformer/mlp.h"
#include "megatorch/transformer/norm.h"

namespace megatorch::transformer {

struct TransformerLayerOptions {
  explicit TransformerLayerOptions(TransformerConfig config) : config_(std::move(config)) {}
  TORCH_ARG(TransformerConfig, config);
  TORCH_ARG(std::string, group) = "";
  TORCH_ARG(int64_t, layer_number) = 0;  // global index: seeds the weights
  TORCH_ARG(std::shared_ptr<tp::RngTracker>, rng) = nullptr;
};

class TransformerLayerImpl : public torch::nn::Cloneable<TransformerLayerImpl> {
 public:
  explicit TransformerLayerImpl(TransformerLayerOptions options);
  void reset() override;
  // documents: packed documents attention stays inside (ParallelAttention::forward).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& rope_freqs = {}, const Documents& documents = nullptr);
  // Inference: x [s, b, h] are the tokens after those in `cache` (see
  // ParallelAttention::forward_cached_without_bias). Eval mode.
  at::Tensor forward_cached(const at::Tensor& x, const at::Tensor& rope_freqs, inference::KVCache& cache);

  // Parameters replicated across TP whose gradients are partial under sequence
  // parallelism (norms, row-parallel biases): they need a sum over the TP group.
  std::vector<at::Tensor> sequence_parallel_parameters() const;

  TransformerLayerOptions options;
  Norm input_norm{nullptr};
  ParallelAttention attention{nullptr};
  Norm post_attention_norm{nullptr};
  ParallelMLP mlp{nullptr};   // dense layers
  moe::MoELayer moe{nullptr};  // MoE layers

 private:
  // The MLP block on the normalised h, and the bias dropout_add adds (dense: fc2's).
  std::pair<at::Tensor, at::Tensor> mlp_block(const at::Tensor& normed);
  at::Tensor layer(const at::Tensor& x, const at::Tensor& rope_freqs, const Documents& documents);
  // residual + dropout(x + bias) (bias may be undefined); one kernel with fused_kernels.
  at::Tensor dropout_add(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual);
};
TORCH_MODULE(TransformerLayer);

// Hidden dropout: replicated regions draw the same mask on every TP rank; under
// sequence parallelism each rank holds other tokens, so it draws from its own stream.
at::Tensor hidden_dropout(const at::Tensor& x, const TransformerConfig& config, bool training, tp::RngTracker* rng);

}  // namespace megatorch::transformer
