#pragma once
// What the DistributedOptimizer needs to know about a GPT model's parameters: their
// units (for ZeRO-3) and, per parameter, whether it counts in the global gradient norm
// and takes weight decay.
#include <vector>

#include "megatorch/models/gpt_model.h"
#include "megatorch/optim/distributed_optimizer.h"
#include "megatorch/pipeline/pipeline_stage.h"

namespace megatorch::train {

struct ModelParameters {
  std::vector<std::vector<at::Tensor>> units;
  std::vector<optim::ParamInfo> info;  // flattened in unit order
};

// `chunks`: the model chunks of this rank's pipeline stage (one, or v when interleaved).
// Parameters replicated across TP (norms, row-parallel biases, position embeddings)
// count in the norm on TP rank 0 only, and a tied output-layer copy on the last stage not
// at all (the first stage counts the embedding). As Megatron does, 1-D parameters
// (biases, norm weights) take no weight decay.
ModelParameters gpt_model_parameters(const std::vector<models::GPTModel>& chunks);

// A pipeline stage's chunks, as gpt_model_parameters, with the tied embedding's copies on
// the first and last stage (pipeline size > 1) marked for the optimizer to sum after its
// DP reduction (an exchange over the PP group, each copy alone in its bucket), so that
// reduction can overlap backward: replaces PipelineStage::allreduce_tied_embedding_grads.
ModelParameters pipeline_stage_parameters(const pipeline::PipelineStage& stage);

// Whether pipeline_stage_parameters leaves the tied embedding's sum to the optimizer
// (false: call PipelineStage::allreduce_tied_embedding_grads before the step).
bool optimizer_sums_tied_embedding(const pipeline::PipelineStage& stage);

// ZeRO-3 and overlapped ZeRO-1/2 parameter gathers: makes every chunk run the optimizer's
// unit hooks (unit numbers as in gpt_model_parameters). A no-op when there are none.
void attach_unit_hooks(const std::vector<models::GPTModel>& chunks, optim::DistributedOptimizer& optimizer);

}  // namespace megatorch::train
