#pragma once
// Checkpoint entries for any module tree: one per parameter, with the TP layout its
// parallel layer describes (tp::parameter_layouts), so a user's model saved at one
// TP x PP x DP layout loads at another exactly like GPT. Names are the parameters' dotted
// names (renamed to be layout-independent by the caller: a pipeline stage renumbers its
// layer lists, see pipeline::ModuleStageImpl::global_name).
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <vector>

#include "megatorch/ckpt/sharded_entry.h"
#include "megatorch/pipeline/stage.h"

namespace megatorch::ckpt {

struct ModuleEntriesOptions {
  TORCH_ARG(std::string, prefix) = "model/";
  // false on data-parallel replicas (dp rank > 0): they load but another rank writes.
  TORCH_ARG(bool, writer) = true;
  // TP rank of this module's replica: TP-replicated parameters are written by rank 0 only.
  TORCH_ARG(int64_t, tp_rank) = 0;
  // The checkpoint name of a parameter's dotted name; null keeps the name.
  TORCH_ARG(std::function<std::string(const std::string&)>, rename) = nullptr;
  // Whether this rank writes a parameter (false: another rank writes it, e.g. a tied
  // copy); null: every parameter.
  TORCH_ARG(std::function<bool(const std::string&)>, writes) = nullptr;
  TORCH_ARG(bool, sequence_parallel) = false;  // passed to tp::parameter_layouts
};

// One entry per parameter (tensor = the parameter itself, so load fills it in place).
std::vector<ShardedEntry> module_entries(torch::nn::Module& module, const ModuleEntriesOptions& options = {});

// A pipeline stage's entries: GPT's PipelineStage as pipeline_stage_entries, any other
// stage's chunks by their global names (ModuleStageImpl::global_name), a tie written by
// its first copy only. `writer`: false on DP replicas.
std::vector<ShardedEntry> stage_entries(pipeline::Stage& stage, bool writer = true, const std::string& prefix = "model/");

}  // namespace megatorch::ckpt
