#pragma once
// Dynamic loss scaling for fp16 training, with Megatron-LM's defaults and hysteresis:
// the scale starts at 2^32, is halved only after `hysteresis` overflowing steps, is
// doubled after `growth_interval` consecutive finite steps (which also restores the
// hysteresis budget), and never drops below `min_scale`. The caller reduces the overflow
// flag (max) across every rank the step depends on before calling update().
#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <string>

namespace megatorch::optim {

struct LossScalerOptions {
  TORCH_ARG(double, initial_scale) = 4294967296.0;  // 2^32
  TORCH_ARG(double, min_scale) = 1.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 1000;
  TORCH_ARG(int64_t, hysteresis) = 2;
};

class DynamicLossScaler {
 public:
  explicit DynamicLossScaler(LossScalerOptions options = {});

  double scale() const { return scale_; }
  double inverse_scale() const { return 1.0 / scale_; }
  // Records one step's (globally reduced) overflow flag; returns true when the step must
  // be skipped (i.e. when found_inf).
  bool update(bool found_inf);

  // Plain numbers, for checkpoints.
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

  const LossScalerOptions& options() const { return options_; }

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;  // consecutive finite steps
  int64_t hysteresis_tracker_;  // overflows left before the next back-off
};

}  // namespace megatorch::optim
