#pragma once
// Megatron-LM's learning-rate schedule: linear warm-up from 0 to `max_lr` over
// `warmup_iters`, then constant, linear or cosine decay to `min_lr` at `decay_iters`,
// `min_lr` after that.
#include <cstdint>
#include <string>

namespace megatorch::train {

struct LRSchedule {
  double max_lr = 3e-4;
  double min_lr = 0.0;
  int64_t warmup_iters = 0;
  int64_t decay_iters = 0;
  std::string style = "cosine";  // constant | linear | cosine

  // The learning rate of the step that follows `iteration` completed steps.
  double at(int64_t iteration) const;
};

}  // namespace megatorch::train
