// stage_parameters and friends: the optimizer's view of any pipeline::Stage. GPT's
// PipelineStage keeps its own rules (model_parameters.cpp); a ModuleStage is grouped by
// module_parameters over its chunks, with its ties applied.
#include <algorithm>

#include "megatorch/check.h"
#include "megatorch/pipeline/module_stage.h"
#include "megatorch/train/model_parameters.h"

namespace megatorch::train {
namespace {

pipeline::ModuleStageImpl* as_module_stage(pipeline::Stage& stage) {
  return dynamic_cast<pipeline::ModuleStageImpl*>(&stage);
}
pipeline::PipelineStageImpl* as_gpt_stage(pipeline::Stage& stage) {
  return dynamic_cast<pipeline::PipelineStageImpl*>(&stage);
}

// The stage's chunk units as module_parameters numbers them: per chunk, the root then one
// per element of its top-level ModuleLists.
std::vector<std::pair<int64_t, int64_t>> gpt_chunk_units(const pipeline::PipelineStageImpl& stage) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t first = 0;
  for (int64_t c = 0; c < stage.num_chunks(); ++c) {
    const int64_t last = first + static_cast<int64_t>(stage.chunk(c)->layers->size());
    out.emplace_back(first, last);
    first = last + 1;
  }
  return out;
}

}  // namespace

ModelParameters stage_parameters(pipeline::Stage& stage, const ParameterGroupingOptions& options) {
  if (auto* gpt = as_gpt_stage(stage)) {
    const pipeline::PipelineStage holder(std::static_pointer_cast<pipeline::PipelineStageImpl>(gpt->shared_from_this()));
    ModelParameters out = pipeline_stage_parameters(holder);
    if (options.adjust()) {
      size_t i = 0;
      for (const auto& unit : out.units) {
        for (const auto& p : unit) {
          options.adjust()(i < out.names.size() ? out.names[i] : std::string(), p, out.info[i]);
          ++i;
        }
      }
    }
    return out;
  }
  auto* ms = as_module_stage(stage);
  MEGATORCH_CHECK(ms != nullptr, "stage_parameters: expected a pipeline::ModuleStage or a GPT PipelineStage; for "
                  "another Stage implementation group its chunks with train::module_parameters");
  ParameterGroupingOptions o = options;
  if (o.tp_group().empty()) o.tp_group(ms->options.tp_group());
  o.sequence_parallel(o.sequence_parallel() || ms->options.sequence_parallel());
  std::vector<std::shared_ptr<torch::nn::Module>> chunks;
  for (int64_t c = 0; c < ms->num_chunks(); ++c) chunks.push_back(ms->chunk_module(c));
  ModelParameters out = module_parameters(chunks, o);
  apply_ties(out, stage);
  return out;
}

void apply_ties(ModelParameters& params, const pipeline::Stage& stage) {
  const auto& ties = stage.ties();
  // When every tie is two copies on two ranks the optimizer sums them after its DP
  // reduction (each alone in its bucket, sharded alike); otherwise all of them are summed
  // on .grad (Stage::allreduce_tied_grads), never some twice.
  const bool optimizer_sums = ties.optimizer_can_sum();
  size_t i = 0;
  for (const auto& unit : params.units) {
    for (const auto& p : unit) {
      for (const auto& copy : ties.local_copies()) {
        if (!copy.tensor.is_same(p)) continue;
        if (!ties.is_primary(copy)) params.info[i].counted_in_norm = false;
        if (optimizer_sums) {
          params.info[i].grad_sum_group = stage.pipeline_group();
          params.info[i].grad_sum_ranks = ties.holders(copy.name);
          params.info[i].own_bucket = true;
        }
      }
      ++i;
    }
  }
}

bool optimizer_sums_ties(pipeline::Stage& stage) { return stage.ties().optimizer_can_sum(); }

void attach_stage_unit_hooks(pipeline::Stage& stage, const ModelParameters& params,
                             optim::DistributedOptimizer& optimizer) {
  std::vector<std::pair<int64_t, int64_t>> units = params.chunk_units;
  if (auto* gpt = as_gpt_stage(stage); gpt && units.empty()) units = gpt_chunk_units(*gpt);
  MEGATORCH_CHECK(static_cast<int64_t>(units.size()) == stage.num_chunks(), "attach_stage_unit_hooks: expected the ",
                  "units of ", stage.num_chunks(), " chunks (ModelParameters::chunk_units), got ", units.size(),
                  "; group the parameters with train::stage_parameters");
  for (int64_t c = 0; c < stage.num_chunks(); ++c) {
    stage.set_unit_hooks(c, optimizer.unit_hooks(units[c].first, units[c].second), units[c].first, units[c].second);
  }
}

}  // namespace megatorch::train
