#pragma once
// GroupedExperts: this expert-parallel rank's experts, E / ep of them, as stacked weights
// run by one grouped GEMM per projection (kernels/grouped_gemm.h): fc1 [E/ep, h, F]
// ([gate | up], 2F, for SwiGLU), the activation, fc2 [E/ep, F, h]. Rank r holds experts
// [r E/ep, (r+1) E/ep): the checkpoint sees each weight as a slice of dim 0 of [E, ...],
// so checkpoints reshard across expert-parallel sizes as across TP. Weights are drawn
// whole and sliced (or drawn per shard with shard_local_init), as the TP layers do, so
// every EP size starts from the same experts.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/tp/parameter_layout.h"
#include "megatorch/tp/tp_group.h"
#include "megatorch/transformer/config.h"

namespace megatorch::moe {

struct GroupedExpertsOptions {
  explicit GroupedExpertsOptions(transformer::TransformerConfig config) : config_(std::move(config)) {}
  TORCH_ARG(transformer::TransformerConfig, config);
  TORCH_ARG(std::string, ep_group) = "";
  TORCH_ARG(std::string, name) = "experts";
};

class GroupedExpertsImpl : public torch::nn::Cloneable<GroupedExpertsImpl>, public tp::ShardedModule {
 public:
  explicit GroupedExpertsImpl(GroupedExpertsOptions options);
  void reset() override;
  // rows [N, h] grouped by local expert, counts[j] rows for local expert j -> [N, h].
  at::Tensor forward(const at::Tensor& rows, const std::vector<int64_t>& counts);
  std::map<std::string, tp::ParameterLayout> parameter_layouts() const override;
  int64_t num_local_experts() const { return fc1_weight.size(0); }

  GroupedExpertsOptions options;
  tp::TPInfo ep;  // rank and size of the expert-parallel group
  at::Tensor fc1_weight, fc2_weight;
  at::Tensor fc1_bias, fc2_bias;  // [E/ep, 2F or F] and [E/ep, h] with add_bias_linear

 private:
  std::map<std::string, std::vector<int64_t>> full_shapes() const;
};
TORCH_MODULE(GroupedExperts);

}  // namespace megatorch::moe
