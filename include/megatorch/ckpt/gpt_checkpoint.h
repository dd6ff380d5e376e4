#pragma once
// A GPT model's parameters as checkpoint entries, named as in the whole single-stage
// model ("model/layers.5.mlp.fc1.weight": the GLOBAL layer index), so a checkpoint
// saved by any TP x PP (x virtual stages) layout loads into any other. Also the model
// configuration as JSON: saved with the checkpoint, compared on load, read by tools.
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "megatorch/ckpt/sharded_entry.h"
#include "megatorch/models/gpt_model.h"
#include "megatorch/pipeline/pipeline_stage.h"

namespace megatorch::ckpt {

struct GPTEntriesOptions {
  TORCH_ARG(std::string, prefix) = "model/";
  // false on data-parallel replicas (dp rank > 0): they load but another rank writes.
  TORCH_ARG(bool, writer) = true;
};

// The whole-model name of a chunk's parameter: layers renumbered from layer_begin; an
// output layer tied to the embedding (the last stage's copy) is "embedding.weight".
std::string gpt_global_name(const std::string& local_name, int64_t layer_begin, bool tied_copy);

// One entry per parameter of the chunk (tensor = the parameter itself, so load fills
// the model in place). TP-replicated parameters are written by tp rank 0 only, the last
// stage's copy of a tied embedding never (the first stage writes it); the vocabulary
// tables are stored without their padding.
std::vector<ShardedEntry> gpt_model_entries(models::GPTModelImpl& model, const GPTEntriesOptions& options = {});
// Every chunk of a pipeline stage.
std::vector<ShardedEntry> pipeline_stage_entries(pipeline::PipelineStageImpl& stage,
                                                 const GPTEntriesOptions& options = {});

// Every architecture field of the configuration (the defaults resolved: ffn, query groups,
// max positions), enums as Megatron's strings.
nlohmann::json gpt_config_json(const transformer::TransformerConfig& config);
// The fields that fix the parameters' shapes: what a checkpoint must match to load.
nlohmann::json gpt_shape_json(const transformer::TransformerConfig& config);
// gpt_config_json's fields applied to `base` (training-only fields kept from base).
transformer::TransformerConfig gpt_config_from_json(const nlohmann::json& j,
                                                    transformer::TransformerConfig base = {});

}  // namespace megatorch::ckpt
