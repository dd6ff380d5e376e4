#pragma once
// The step's mixture-of-experts statistics over every rank, for the log and for the
// expert bias: each MoE layer's auxiliary and z losses (the values whose gradients the
// step took: the DP x CP mean of each micro-batch's whole-sequence losses, averaged over
// micro-batches) and its tokens per expert over the global batch.
#include <torch/nn/module.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace megatorch::moe {

struct MoELayerReport {
  int64_t layer = 0;  // global layer number
  double aux_loss = 0, z_loss = 0;
  std::vector<int64_t> tokens_per_expert;  // top-k assignments, before capacity
  int64_t dropped = 0;                     // assignments dropped by capacity
  int64_t min_load() const;
  int64_t max_load() const;
  double mean_load() const;
};

struct MoEStepReport {
  std::vector<MoELayerReport> layers;  // every MoE layer of the model, ascending
  bool empty() const { return layers.empty(); }
  double aux_loss() const;  // mean over the layers
  double z_loss() const;
  int64_t dropped() const;  // summed over the layers
  // The Megatron-style log line's part: " | load balancing loss: ... | z loss: ... | ...".
  std::string line() const;
  nlohmann::json to_json() const;
};

// The shape every rank allocates for the reduction: (layers, experts) of the model, the
// maximum over `world_group` of what this rank's MoE layers say ((0, 0): no MoE layer
// anywhere). Called once, on every rank.
std::pair<int64_t, int64_t> moe_shape(torch::nn::Module& root, const std::string& world_group);
// Sums every rank's layer statistics (one all-reduce over `world_group`, every rank
// calls it), dividing the losses by `data_replicas` (DP x CP) and by each layer's
// forwards per rank (the micro-batches). Resets the layers' statistics.
MoEStepReport reduce_step_stats(torch::nn::Module& root, const std::string& world_group, std::pair<int64_t, int64_t> shape,
                                int64_t data_replicas);
// DeepSeek-V3's bias update on every expert-biased router under `root` from the report's
// global loads (the same on every replica, so replicas stay equal).
void update_expert_biases(torch::nn::Module& root, const MoEStepReport& report);

}  // namespace megatorch::moe
