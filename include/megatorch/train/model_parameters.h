#pragma once
// What the DistributedOptimizer needs to know about a model's parameters: their units
// (for ZeRO-3) and, per parameter, whether it counts in the global gradient norm and
// takes weight decay. For any module tree (module_parameters), derived from the parallel
// layers' own layouts (tp/parameter_layout.h); for GPT as before (gpt_model_parameters).
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/models/gpt_model.h"
#include "megatorch/optim/distributed_optimizer.h"
#include "megatorch/pipeline/pipeline_stage.h"
#include "megatorch/pipeline/stage.h"

namespace megatorch::train {

struct ModelParameters {
  std::vector<std::vector<at::Tensor>> units;
  std::vector<optim::ParamInfo> info;  // flattened in unit order
  std::vector<std::string> names;      // the same order: each parameter's dotted name in its chunk
  // Per chunk: its first unit (the root) and its last.
  std::vector<std::pair<int64_t, int64_t>> chunk_units;
};

struct ParameterGroupingOptions {
  // The TP group of the model's parallel layers ("" none): a parameter no parallel layer
  // splits is replicated over it, so it counts in the gradient norm on TP rank 0 only.
  TORCH_ARG(std::string, tp_group) = "";
  // Sequence parallelism: replicated parameters see only this rank's sequence shard, so
  // their gradients are partial sums over TP (norms, row-parallel biases), added by the
  // optimizer (ParamInfo::grad_sum_group). Layers that know better say so themselves.
  TORCH_ARG(bool, sequence_parallel) = false;
  // Called for every parameter (its dotted name in its chunk) after the defaults were
  // derived: the user's overrides of counted_in_norm, weight_decay, grad_sum_group.
  TORCH_ARG(std::function<void(const std::string& name, const at::Tensor& param, optim::ParamInfo& info)>,
            adjust) = nullptr;
};

// Units and flags for any module tree, one entry of `chunks` per model chunk of this rank.
// Each chunk's units: its root (every parameter not inside an element of a top-level
// ModuleList; possibly empty), then one per element of each top-level ModuleList, in
// registration order (as Python's FullyShard wraps each block). Per parameter: split by
// a parallel layer (tp::parameter_layouts) -> counted on every TP rank; replicated ->
// counted on TP rank 0 only; 1-D -> no weight decay (Megatron's rule).
ModelParameters module_parameters(const std::vector<std::shared_ptr<torch::nn::Module>>& chunks,
                                  const ParameterGroupingOptions& options = {});

// A pipeline stage's parameters: GPT's PipelineStage as pipeline_stage_parameters; any
// other stage as module_parameters over its chunks, with tied copies other than a tie's
// first not counted in the norm, and, when every tie of the pipeline is two copies on two
// ranks, the ties marked for the optimizer to sum after its DP reduction (as GPT's tied
// embedding).
ModelParameters stage_parameters(pipeline::Stage& stage, const ParameterGroupingOptions& options = {});
// A stage's ties applied to its chunks' grouping: copies other than a tie's first not
// counted in the norm; when every tie of the pipeline is two copies on two ranks, each
// copy marked for the optimizer to sum over the pipeline group (its own bucket).
void apply_ties(ModelParameters& params, const pipeline::Stage& stage);
// Whether stage_parameters left every tie's sum to the optimizer (else call
// Stage::allreduce_tied_grads after backward, with overlap_grad_reduce off).
bool optimizer_sums_ties(pipeline::Stage& stage);
// ZeRO-3 and overlapped ZeRO-1/2 gathers for any stage: unit numbers as stage_parameters.
void attach_stage_unit_hooks(pipeline::Stage& stage, const ModelParameters& params, optim::DistributedOptimizer& optimizer);

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
