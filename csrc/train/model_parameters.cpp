#include "megatorch/train/model_parameters.h"

#include <string>

namespace megatorch::train {

ModelParameters gpt_model_parameters(const std::vector<models::GPTModel>& chunks) {
  ModelParameters out;
  for (const auto& chunk : chunks) {
    const auto& c = chunk->options.config();
    // With tied embeddings an output_layer exists only as the last stage's copy of the
    // embedding, which the first stage counts in the norm.
    const bool tied = c.tie_embeddings();
    const auto options = ParameterGroupingOptions()
                             .tp_group(chunk->options.group())
                             .sequence_parallel(c.sequence_parallel())
                             .adjust([tied](const std::string& name, const at::Tensor&, optim::ParamInfo& info) {
                               if (tied && name == "output_layer") info.counted_in_norm = false;
                             });
    // One chunk at a time: each with its own group and configuration, as before.
    ModelParameters one = module_parameters({chunk.ptr()}, options);
    const int64_t offset = static_cast<int64_t>(out.units.size());
    for (auto& u : one.units) out.units.push_back(std::move(u));
    for (auto& i : one.info) out.info.push_back(std::move(i));
    for (auto& n : one.names) out.names.push_back(std::move(n));
    for (const auto& [first, last] : one.chunk_units) out.chunk_units.emplace_back(offset + first, offset + last);
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
