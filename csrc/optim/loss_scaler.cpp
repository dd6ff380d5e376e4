#include "megatorch/optim/loss_scaler.h"

#include <algorithm>

#include "megatorch/check.h"

namespace megatorch::optim {

DynamicLossScaler::DynamicLossScaler(LossScalerOptions options)
    : options_(options), scale_(options.initial_scale()), hysteresis_tracker_(options.hysteresis()) {
  MEGATORCH_CHECK(options.initial_scale() > 0 && options.min_scale() > 0 && options.growth_factor() > 1 &&
                      options.backoff_factor() > 0 && options.backoff_factor() < 1 && options.growth_interval() > 0 &&
                      options.hysteresis() > 0,
                  "DynamicLossScaler: expected initial_scale > 0, min_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                  "growth_interval > 0 and hysteresis > 0; got ",
                  options.initial_scale(), ", ", options.min_scale(), ", ", options.growth_factor(), ", ",
                  options.backoff_factor(), ", ", options.growth_interval(), ", ", options.hysteresis());
}

bool DynamicLossScaler::update(bool found_inf) {
  if (found_inf) {
    growth_tracker_ = 0;
    // Once the budget is spent every further overflow backs off, until a growth refills it.
    if (--hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * options_.backoff_factor(), options_.min_scale());
    return true;
  }
  if (++growth_tracker_ >= options_.growth_interval()) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = options_.hysteresis();
    scale_ *= options_.growth_factor();
  }
  return false;
}

std::map<std::string, double> DynamicLossScaler::state_dict() const {
  return {{"scale", scale_},
          {"growth_tracker", static_cast<double>(growth_tracker_)},
          {"hysteresis_tracker", static_cast<double>(hysteresis_tracker_)}};
}

void DynamicLossScaler::load_state_dict(const std::map<std::string, double>& state) {
  for (const char* key : {"scale", "growth_tracker", "hysteresis_tracker"}) {
    MEGATORCH_CHECK(state.count(key), "DynamicLossScaler::load_state_dict: expected key '", key,
                    "' in the state; got a state without it (was it saved by DynamicLossScaler::state_dict?)");
  }
  scale_ = state.at("scale");
  growth_tracker_ = static_cast<int64_t>(state.at("growth_tracker"));
  hysteresis_tracker_ = static_cast<int64_t>(state.at("hysteresis_tracker"));
}

}  // namespace megatorch::optim
