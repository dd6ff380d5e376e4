#pragma once
// GroupedExperts: this expert-parallel rank's experts, E / ep of them, as stacked weights
// run by one grouped GEMM per projection (kernels/grouped_gemm.h): fc1 [E/ep, h, F]
// ([gate | up], 2F, for SwiGLU), the activation, fc2 [E/ep, F, h]. Rank r holds experts
// [r E/ep, (r+1) E/ep).
//
// Expert tensor parallelism (etp > 1) splits each expert again like a TP MLP: fc1 keeps
// F/etp columns (of gate and of up), fc2 the matching F/etp rows. The ETP ranks first
// all-gather the rows they received for their experts, each computes its columns' partial
// output for all of them, and a reduce-scatter sums the partials back to each rank's own
// rows (Megatron-core's expert-TP dispatch); fc2's bias, whole on every ETP rank, is added
// after it. FLOPs per rank stay those of etp = 1; the weights are etp times smaller.
//
// The checkpoint sees each weight as its slice of the full [E, ...] tensor: experts over
// dim 0 by EP, columns by ETP (tp::ShardSpec's outer and partition splits), so
// checkpoints reshard across EP and ETP sizes as across TP. Weights are drawn whole and
// sliced (or drawn per shard with shard_local_init), as the TP layers do, so every EP x
// ETP layout starts from the same experts.
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
  TORCH_ARG(std::string, etp_group) = "";  // expert-TP; "" : each expert whole
  TORCH_ARG(std::string, name) = "experts";
};

class GroupedExpertsImpl : public torch::nn::Cloneable<GroupedExpertsImpl>, public tp::ShardedModule {
 public:
  explicit GroupedExpertsImpl(GroupedExpertsOptions options);
  void reset() override;
  // rows [N, h] grouped by local expert, counts[j] rows for local expert j -> [N, h]. With
  // etp > 1 every ETP rank of the group calls it together.
  at::Tensor forward(const at::Tensor& rows, const std::vector<int64_t>& counts);
  std::map<std::string, tp::ParameterLayout> parameter_layouts() const override;
  int64_t num_local_experts() const { return fc1_weight.size(0); }

  GroupedExpertsOptions options;
  tp::TPInfo ep;   // rank and size of the expert-parallel group
  tp::TPInfo etp;  // rank and size of the expert-tensor-parallel group
  at::Tensor fc1_weight, fc2_weight;
  at::Tensor fc1_bias, fc2_bias;  // [E/ep, (2F or F)/etp] and [E/ep, h] with add_bias_linear

 private:
  // fc1, the activation and fc2 (without its bias) on rows grouped by local expert;
  // `row_experts` is each row's expert, for fc1's bias (undefined without one).
  at::Tensor compute(const at::Tensor& rows, const std::vector<int64_t>& counts, const at::Tensor& row_experts);
  tp::ShardSpec spec(const std::string& name) const;
};
TORCH_MODULE(GroupedExperts);

}  // namespace megatorch::moe
