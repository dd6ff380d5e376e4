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
  return !stage->ties().empty() && stage->ties().optimizer_can_sum();
}

ModelParameters pipeline_stage_parameters(const pipeline::PipelineStage& stage) {
  std::vector<models::GPTModel> chunks;
  for (int64_t c = 0; c < stage->num_chunks(); ++c) chunks.push_back(stage->chunk(c));
  ModelParameters out = gpt_model_parameters(chunks);
  apply_ties(out, *stage);
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
