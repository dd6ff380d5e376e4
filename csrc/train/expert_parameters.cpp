#include "megatorch/train/expert_parameters.h"

#include "megatorch/moe/moe_layer.h"

namespace megatorch::train {

SplitParameters split_expert_parameters(const ModelParameters& all, pipeline::Stage& stage) {
  // Each expert parameter, and whether this rank counts it in the norm: the ETP ranks
  // hold different columns, except of a replicated one (fc2's bias), counted on etp rank 0.
  std::vector<std::pair<at::Tensor, bool>> experts;
  for (auto* layer : moe::moe_layers(stage.stage_module())) {
    const auto& e = *layer->experts;
    for (const auto& [name, layout] : e.parameter_layouts()) {
      const bool etp_replicated = layout.spec.partition_dim < 0 || layout.spec.world == 1;
      experts.emplace_back(e.named_parameters(/*recurse=*/false)[name], !etp_replicated || e.etp.rank == 0);
    }
  }
  // -1: dense; else 1 when counted in the norm, 0 when not.
  const auto is_expert = [&experts](const at::Tensor& p) {
    for (const auto& [e, counted] : experts) {
      if (e.is_same(p)) return counted ? 1 : 0;
    }
    return -1;
  };
  SplitParameters out;
  out.dense.chunk_units = all.chunk_units;
  size_t i = 0;
  for (const auto& unit : all.units) {
    std::vector<at::Tensor> dense_unit, expert_unit;
    for (const auto& p : unit) {
      const int counted = is_expert(p);
      const bool expert = counted >= 0;
      ModelParameters& to = expert ? out.experts : out.dense;
      (expert ? expert_unit : dense_unit).push_back(p);
      optim::ParamInfo info = all.info[i];
      if (expert) {
        // Each expert lives on one EP rank: counted there (its columns on each ETP
        // rank), and its gradient already holds every token routed to it.
        info.counted_in_norm = counted == 1;
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
