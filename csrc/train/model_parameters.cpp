#include "megatorch/train/model_parameters.h"

#include <algorithm>

namespace megatorch::train {

ModelParameters gpt_model_parameters(const std::vector<models::GPTModel>& chunks) {
  ModelParameters out;
  for (const auto& chunk : chunks) {
    const auto replicated = chunk->sequence_parallel_parameters();
    const auto& c = chunk->options.config();
    const bool tied_copy = c.tie_embeddings() && !chunk->options.pre_process() && chunk->output_layer.defined();
    for (auto& unit : chunk->parameter_units()) {
      for (const auto& p : unit) {
        optim::ParamInfo info;
        const bool is_replicated = std::any_of(replicated.begin(), replicated.end(),
                                               [&](const at::Tensor& r) { return r.is_same(p); });
        if ((is_replicated && chunk->tp.rank != 0) || (tied_copy && p.is_same(chunk->output_layer))) {
          info.counted_in_norm = false;
        }
        info.weight_decay = p.dim() > 1;
        // Under SP each TP rank's gradient of a replicated parameter covers its sequence shard.
        if (is_replicated && c.sequence_parallel() && chunk->tp.size > 1) info.grad_sum_group = chunk->options.group();
        out.info.push_back(info);
      }
      out.units.push_back(std::move(unit));
    }
  }
  return out;
}

bool optimizer_sums_tied_embedding(const pipeline::PipelineStage& stage) {
  return stage->options.config().tie_embeddings() && stage->pp_size() > 1;
}

ModelParameters pipeline_stage_parameters(const pipeline::PipelineStage& stage) {
  std::vector<models::GPTModel> chunks;
  for (int64_t c = 0; c < stage->num_chunks(); ++c) chunks.push_back(stage->chunk(c));
  ModelParameters out = gpt_model_parameters(chunks);
  if (!optimizer_sums_tied_embedding(stage)) return out;
  const int64_t first = 0, last = stage->pp_size() - 1;
  at::Tensor tied;
  if (stage->pp_rank() == first) tied = stage->chunk(0)->embedding->weight;
  if (stage->pp_rank() == last) tied = stage->chunk(stage->num_chunks() - 1)->output_layer;
  if (!tied.defined()) return out;  // a middle stage
  size_t i = 0;
  for (const auto& unit : out.units) {
    for (const auto& p : unit) {
      if (p.is_same(tied)) {
        out.info[i].grad_sum_group = stage->options.pp_group();
        out.info[i].grad_sum_ranks = {first, last};
        out.info[i].own_bucket = true;
      }
      ++i;
    }
  }
  return out;
}

void attach_unit_hooks(const std::vector<models::GPTModel>& chunks, optim::DistributedOptimizer& optimizer) {
  int64_t first = 0;
  for (models::GPTModel chunk : chunks) {  // a copy of the handle: the module is not const
    const int64_t last = first + static_cast<int64_t>(chunk->layers->size());
    chunk->set_unit_hooks(optimizer.unit_hooks(first, last), first);
    first = last + 1;
  }
}

}  // namespace megatorch::train
