#pragma once
// Runs a schedule's action list on this pipeline rank, for any pipeline::Stage (GPT's
// PipelineStage, a ModuleStage of the user's chunks): non-blocking p2p (buffers sized from
// the stage's activation specs), on Gloo over the PP group with tags, posted as
// p2p_batches.h places them; where NCCL's rules apply (NCCL, or the NCCL check) each op
// alone on its channel's communicator (p2p_channels.h), so NCCL's in-order pairing neither
// mixes messages nor deadlocks, for every schedule. Micro-batch losses averaged,
// gradients accumulated, each stage output freed once sent (Megatron's deallocation:
// only its autograd graph is kept). A zero-bubble schedule's split backward runs through
// split_backward.h: B sends the input gradient on, W fills a bubble later. Records a
// timestamp per compute action for the timeline and the measured bubble, and the peak
// activations stashed for backward (held from a forward to its backward's end: W). Forward
// only (evaluation) runs the schedule's forwards through the same p2p, without autograd.
#include <ATen/Tensor.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <type_traits>
#include <vector>

#include "megatorch/pipeline/pipeline_stage.h"
#include "megatorch/pipeline/schedule.h"
#include "megatorch/pipeline/stage.h"
#include "megatorch/pipeline/timeline_svg.h"

namespace megatorch::pipeline {

struct PipelineStepResult {
  // Mean over micro-batches of each micro-batch's loss (Stage::micro_batch_loss; GPT: the
  // mean over its non-ignored tokens); defined on the last pipeline rank only.
  at::Tensor loss;
  std::vector<TimelineRecord> timeline;  // this rank's compute actions, monotonic-clock seconds
  double busy_s = 0;                     // time in compute actions
  double makespan_s = 0;                 // start to the last action's end
  int64_t peak_stashed = 0;              // activations held for backward, at most at once (0 forward only)
  int64_t peak_stashed_bytes = 0;        // their bytes: the activation each one's chunk exchanges
};

struct ExecutorOptions {
  TORCH_ARG(ScheduleKind, schedule) = ScheduleKind::kOneFOneB;
  // Free each stage output once its send completed (keeps only its graph).
  TORCH_ARG(bool, deallocate_outputs) = true;
  // The last stage's loss is multiplied by this before backward (fp16 loss scaling);
  // the returned loss is not.
  TORCH_ARG(double, loss_scale) = 1.0;
  // Called before each backward (a split backward's B and W alike), with true for this
  // rank's last one of the step (a data-parallel optimizer starts its gradient reduction
  // during that one; with a split backward it is a W).
  TORCH_ARG(std::function<void(bool)>, before_backward) = nullptr;
  // Megatron's forward_only: the schedule's forwards only (build_forward_only_schedule),
  // under no_grad, for the loss; no backward, no gradients, nothing stashed, outputs
  // dropped once sent. loss_scale and before_backward are unused.
  TORCH_ARG(bool, forward_only) = false;
  // Time each compute action (timeline, busy_s, makespan_s). On a GPU the marks are device
  // events and reading them waits for the device once at the end of the step, so a training
  // loop asks for timings only on the steps it reports them (TrainingLoop: the one whose
  // timeline it draws); untimed steps leave timeline empty and busy_s, makespan_s zero.
  TORCH_ARG(bool, time_compute) = true;
  // Where NCCL's rules apply (p2p_channels.h): how many receives each channel keeps posted
  // ahead of the compute that consumes them (each holds one received buffer). >= 1.
  TORCH_ARG(int64_t, recv_lookahead) = 1;
};

// One training step's forward and backward over all micro-batches (no optimizer step),
// or with forward_only the forwards alone (evaluation).
PipelineStepResult run_pipeline_step(Stage& stage, const std::vector<MicroBatch>& micro_batches,
                                     const ExecutorOptions& options = {});
// The same for a module holder of a stage (PipelineStage, ModuleStage).
template <typename Impl, typename = std::enable_if_t<std::is_base_of_v<Stage, Impl>>>
PipelineStepResult run_pipeline_step(torch::nn::ModuleHolder<Impl>& stage, const std::vector<MicroBatch>& micro_batches,
                                     const ExecutorOptions& options = {}) {
  return run_pipeline_step(static_cast<Stage&>(*stage), micro_batches, options);
}

// Every pipeline rank's timeline on every rank (a collective over the PP group), with
// the time shifted to start at 0 and `rank` set to the pipeline rank.
std::vector<TimelineRecord> gather_timeline(const PipelineStepResult& result, const std::string& pp_group);
// Measured bubble of a gathered timeline: the stages' idle time over their busy time,
// summed over stages (docs/reference.md's definition; (p-1)/m for 1F1B in theory).
double measured_bubble(const std::vector<TimelineRecord>& timeline);

}  // namespace megatorch::pipeline
