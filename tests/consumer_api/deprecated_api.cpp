// Code written against megatorch 0.2's API, unchanged: the GPT parameter grouping was in
// megatorch/optim/model_parameters.h, namespace optim (README's ZeRO example of then,
// below). It must still compile, with deprecation warnings naming the replacements
// (check_deprecation.cmake builds this file with -Werror=deprecated-declarations and
// reads them), and still work (run by megatorch_api_check).
#include <megatorch/optim/model_parameters.h>
#include <megatorch/parallel/parallel_state.h>
#include <megatorch/pipeline/p2p_batches.h>
#include <megatorch/plan/model_spec.h>

#include "api_checks.h"

namespace api_checks {

using namespace megatorch::optim;
using megatorch::parallel::GroupKind;

// The README's snippet as it was (before the move to train::).
void old_readme_zero_snippet(megatorch::models::GPTModel& model, const megatorch::parallel::ParallelState& state,
                             const at::Tensor& ids, const at::Tensor& labels) {
  auto params = megatorch::optim::gpt_model_parameters({model});
  megatorch::optim::DistributedOptimizer opt(params.units, state.group_name(GroupKind::kData),
      DistributedOptimizerOptions().zero_stage(2).lr(3e-4).weight_decay(0.1).clip_grad(1.0)
          .model_parallel_groups({state.group_name(GroupKind::kTensor)}), params.info);
  megatorch::optim::attach_unit_hooks({model}, opt);  // ZeRO-3 only
  opt.zero_grad(); model->loss(ids, labels).backward(); opt.step();
}

// Every other moved name, as old code spelled it; returns what the aliases forward to.
bool old_names_forward(megatorch::models::GPTModel& model, const megatorch::pipeline::PipelineStage& stage) {
  const megatorch::optim::ModelParameters old_params = megatorch::optim::gpt_model_parameters({model});
  const megatorch::train::ModelParameters new_params = megatorch::train::gpt_model_parameters({model});
  const megatorch::optim::ModelParameters old_stage = megatorch::optim::pipeline_stage_parameters(stage);
  const bool old_sums = megatorch::optim::optimizer_sums_tied_embedding(stage);
  return old_params.units.size() == new_params.units.size() && old_params.info.size() == new_params.info.size() &&
         old_stage.info.size() == megatorch::train::pipeline_stage_parameters(stage).info.size() &&
         old_sums == megatorch::train::optimizer_sums_tied_embedding(stage);
}

// 0.2's schedule checks: nothing is refused on NCCL or for ZeRO-3 any more.
bool old_schedule_checks_accept_everything() {
  using megatorch::pipeline::ScheduleKind;
  const std::string zb_v_zero3 =
      megatorch::plan::schedule_error(ScheduleKind::kZeroBubbleV, 2, 1, 3, megatorch::plan::DistributedBackend::kNccl);
  return megatorch::pipeline::nccl_refusal(ScheduleKind::kDualPipeV).empty() && zb_v_zero3.empty() &&
         megatorch::plan::schedule_error(ScheduleKind::kInterleaved, 2, 1, 0) ==
             megatorch::plan::schedule_error(ScheduleKind::kInterleaved, 2, 1);
}

}  // namespace api_checks
