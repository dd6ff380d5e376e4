#include "megatorch/train/expert_parameters.h"

#include "megatorch/moe/moe_layer.h"

namespace megatorch::train {

SplitParameters split_expert_parameters(const ModelParameters& all, pipeline::Stage& stage) {
  std::vector<at::Tensor> experts;
  for (auto* layer : moe::moe_layers(stage.stage_module())) {
    for (const auto& p : layer->experts->parameters()) experts.push_back(p);
  }
  const auto is_expert = [&experts](const at::Tensor& p) {
    for (const auto& e : experts) {
      if (e.is_same(p)) return true;
    }
    return false;
  };
  SplitParameters out;
  out.dense.chunk_units = all.chunk_units;
  size_t i = 0;
  for (const auto& unit : all.units) {
    std::vector<at::Tensor> dense_unit, expert_unit;
    for (const auto& p : unit) {
      const bool expert = is_expert(p);
      ModelParameters& to = expert ? out.experts : out.dense;
      (expert ? expert_unit : dense_unit).push_back(p);
      optim::ParamInfo info = all.info[i];
      if (expert) {
        // Each expert lives on one EP rank (whole, ETP 1): counted there, and its
        // gradient already holds every token routed to it.
        info.counted_in_norm = true;
        info.grad_sum_group.clear();
        info.grad_sum_ranks.clear();
        info.own_bucket = false;
      }
      to.info.push_back(std::move(info));
      if (i < all.names.size()) to.names.push_back(all.names[i]);
      ++i;
    }
    // Dense units keep their numbering (ZeRO-3's unit hooks); expert units need none.
    out.dense.units.push_back(std::move(dense_unit));
    if (!expert_unit.empty()) out.experts.units.push_back(std::move(expert_unit));
  }
  return out;
}

}  // namespace megatorch::train
