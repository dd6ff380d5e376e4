#include "megatorch/train/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "megatorch/check.h"

namespace megatorch::train {

double LRSchedule::at(int64_t it) const {
  if (warmup_iters > 0 && it <= warmup_iters) return max_lr * static_cast<double>(it) / static_cast<double>(warmup_iters);
  if (style == "constant") return max_lr;
  if (it > decay_iters) return min_lr;
  const double span = static_cast<double>(std::max<int64_t>(1, decay_iters - warmup_iters));
  const double ratio = std::clamp(static_cast<double>(it - warmup_iters) / span, 0.0, 1.0);
  double coeff = 0;
  if (style == "linear") {
    coeff = 1.0 - ratio;
  } else if (style == "cosine") {
    coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0);
  } else {
    MEGATORCH_FAIL("LRSchedule: expected style constant, linear or cosine, got '", style, "'");
  }
  return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace megatorch::train
