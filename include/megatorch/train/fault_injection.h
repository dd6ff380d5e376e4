#pragma once
// Faults a test injects into a training run, so the fault-tolerance paths (the NaN check,
// --skip-nan-steps, the straggler report, a kill during an asynchronous write) run on
// demand. Read once by TrainingLoop from MEGATORCH_FAULT_INJECTION, a comma-separated list:
//
//   nan_grad@ITER:RANK   at iteration ITER, rank RANK's gradient of its first 1-D
//                        parameter (a norm's weight or a bias) becomes NaN
//   slow_rank@RANK:MS    rank RANK sleeps MS ms in each backward of that parameter (a straggler)
//   slow_save@MS         every asynchronous checkpoint writer sleeps MS ms before writing
//   loss_spike@ITER:RANK             at iteration ITER rank RANK adds 1000 to its share of the
//                                    loss, on the first run of the step only (a transient fault)
//   loss_spike_persistent@ITER:RANK  the same on every run of that step (a reproducible one)
//
// Unset or empty: nothing is injected. A malformed value is an error naming the entry.
#include <cstdint>
#include <string>

namespace megatorch::train {

struct FaultInjection {
  int64_t nan_grad_iteration = 0;  // 0: none
  int64_t nan_grad_rank = -1;
  int64_t slow_rank = -1;  // -1: none
  int64_t slow_rank_ms = 0;
  int64_t slow_save_ms = 0;
  int64_t loss_spike_iteration = 0;  // 0: none
  int64_t loss_spike_rank = -1;
  bool loss_spike_persistent = false;

  bool any_gradient_fault() const { return nan_grad_iteration > 0 || slow_rank >= 0; }
  // `spec` as MEGATORCH_FAULT_INJECTION holds it.
  static FaultInjection parse(const std::string& spec);
  static FaultInjection from_environment();
};

}  // namespace megatorch::train
