#pragma once
// What documented_api.cpp calls in deprecated_api.cpp (kept apart: only that file uses
// the deprecated names, so only its build is expected to warn).
#include <ATen/ATen.h>

#include <megatorch/models/gpt_model.h>
#include <megatorch/parallel/parallel_state.h>
#include <megatorch/pipeline/pipeline_stage.h>

namespace api_checks {

void old_readme_zero_snippet(megatorch::models::GPTModel& model, const megatorch::parallel::ParallelState& state,
                             const at::Tensor& ids, const at::Tensor& labels);
bool old_names_forward(megatorch::models::GPTModel& model, const megatorch::pipeline::PipelineStage& stage);
bool old_schedule_checks_accept_everything();

}  // namespace api_checks
