#pragma once
// Deprecated in 0.3.0, to be removed in 0.4.0 at the earliest: the optimizer's view of a GPT
// model's parameters moved from here (namespace megatorch::optim) to
// megatorch/train/model_parameters.h (namespace megatorch::train), because it knows GPTModel
// and PipelineStage, which the optimizer should not. Code written against the old names
// still compiles, with a deprecation warning naming the replacement. megatorch's own code
// must not use these (its tests compile them in tests/consumer_api only).
#include <vector>

#include "megatorch/train/model_parameters.h"

namespace megatorch::optim {

using ModelParameters [[deprecated("use megatorch::train::ModelParameters (megatorch/train/model_parameters.h)")]] =
    train::ModelParameters;

[[deprecated("use megatorch::train::gpt_model_parameters (megatorch/train/model_parameters.h)")]]
inline train::ModelParameters gpt_model_parameters(const std::vector<models::GPTModel>& chunks) {
  return train::gpt_model_parameters(chunks);
}

[[deprecated("use megatorch::train::pipeline_stage_parameters (megatorch/train/model_parameters.h)")]]
inline train::ModelParameters pipeline_stage_parameters(const pipeline::PipelineStage& stage) {
  return train::pipeline_stage_parameters(stage);
}

[[deprecated("use megatorch::train::optimizer_sums_tied_embedding (megatorch/train/model_parameters.h)")]]
inline bool optimizer_sums_tied_embedding(const pipeline::PipelineStage& stage) {
  return train::optimizer_sums_tied_embedding(stage);
}

[[deprecated("use megatorch::train::attach_unit_hooks (megatorch/train/model_parameters.h)")]]
inline void attach_unit_hooks(const std::vector<models::GPTModel>& chunks, DistributedOptimizer& optimizer) {
  train::attach_unit_hooks(chunks, optimizer);
}

}  // namespace megatorch::optim
