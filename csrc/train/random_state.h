#pragma once
// The random generators a training step draws from (the default CPU and device
// generators, the TP tracker's streams), captured before a step and restored to run the
// same step again with the same dropout masks (TrainingLoop's rerun_mode).
#include <ATen/ATen.h>

#include <optional>

#include "megatorch/pipeline/stage.h"
#include "megatorch/tp/rng_tracker.h"

namespace megatorch::train {

struct RandomState {
  at::Tensor cpu, device;  // default generators (device: a CUDA run's)
  std::optional<tp::RngTracker::Snapshot> tracker;

  static RandomState capture(pipeline::Stage& stage, c10::Device on) {
    RandomState r;
    r.cpu = tp::default_generator_state(c10::kCPU);
    if (on.is_cuda()) r.device = tp::default_generator_state(on);
    if (const auto t = stage.rng_tracker()) r.tracker = t->snapshot();
    return r;
  }
  void restore(pipeline::Stage& stage, c10::Device on) const {
    tp::set_default_generator_state(c10::kCPU, cpu);
    if (device.defined()) tp::set_default_generator_state(on, device);
    if (const auto t = stage.rng_tracker(); t && tracker) t->restore(*tracker);
  }
};

}  // namespace megatorch::train
