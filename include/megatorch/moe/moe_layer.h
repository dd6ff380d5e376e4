#pragma once
// MoELayer: the MLP of a mixture-of-experts transformer layer (Megatron-core's MoELayer):
// route each token to k experts (router.h), move it to the expert-parallel ranks that
// hold them and back (token_dispatcher.h), run every local expert in one grouped GEMM
// per projection (grouped_experts.h), and add the shared expert's output if any.
//
// The auxiliary and z losses do not pass through the model's output: they join backward
// at the layer (Megatron's MoEAuxLossAutoScaler), with the gradient the main loss's
// backward would give them (loss scale / micro-batches, set by the pipeline executor).
// Each layer keeps its step's statistics (losses, tokens per expert, drops) for the log.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <vector>

#include "megatorch/moe/grouped_experts.h"
#include "megatorch/moe/router.h"
#include "megatorch/transformer/mlp.h"

namespace megatorch::moe {

struct MoELayerOptions {
  explicit MoELayerOptions(transformer::TransformerConfig config) : config_(std::move(config)) {}
  TORCH_ARG(transformer::TransformerConfig, config);
  TORCH_ARG(std::string, group) = "";  // TP
  TORCH_ARG(std::string, name) = "mlp";
  TORCH_ARG(int64_t, layer_number) = 0;  // global: names the statistics
};

// One layer's statistics since the last reset (detached, on the layer's device).
struct MoELayerStats {
  at::Tensor aux_loss, z_loss;  // sums of this rank's contributions over forwards (scalars)
  at::Tensor routed;            // [E] top-k assignments per expert on this rank, summed
  at::Tensor dropped;           // assignments dropped by capacity on this rank, summed
  int64_t forwards = 0;
};

class MoELayerImpl : public torch::nn::Cloneable<MoELayerImpl> {
 public:
  explicit MoELayerImpl(MoELayerOptions options);
  void reset() override;
  // x [s, b, h] (a sequence shard under SP) -> [s, b, h].
  at::Tensor forward(const at::Tensor& x);

  // The gradient the auxiliary losses receive in backward (the main loss's scale).
  void set_aux_loss_backward_scale(double scale) { aux_loss_backward_scale_ = scale; }
  const MoELayerStats& stats() const { return stats_; }
  void reset_stats();
  // Parameters replicated over TP whose gradients are partial sums under SP.
  std::vector<at::Tensor> sequence_parallel_parameters() const;

  MoELayerOptions options;
  TopKRouter router{nullptr};
  GroupedExperts experts{nullptr};
  transformer::ParallelMLP shared_expert{nullptr};

 private:
  void record(const Routing& routing);
  double aux_loss_backward_scale_ = 1.0;
  MoELayerStats stats_;
};
TORCH_MODULE(MoELayer);

// Every MoELayer under `root` (any module tree), in module order.
std::vector<MoELayerImpl*> moe_layers(torch::nn::Module& root);
// Sets the auxiliary losses' backward scale on every MoE layer under `root`.
void set_aux_loss_backward_scale(torch::nn::Module& root, double scale);
// Whether `param` belongs to a GroupedExperts (reduced over the expert-DP group).
bool is_expert_parameter(torch::nn::Module& root, const at::Tensor& param);

}  // namespace megatorch::moe
