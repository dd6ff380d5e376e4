#include "megatorch/fp8/scaling.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"

namespace megatorch::fp8 {

at::Tensor quantize(const at::Tensor& x, const at::Tensor& scale, c10::ScalarType dtype) {
  const double max = max_of(dtype);
  // In fp32: a bf16 product would round once more before the cast. One fp32 buffer,
  // scaled and clamped in place (a cast past the format's max would give NaN, not max).
  at::Tensor y = x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  return y.mul_(scale).clamp_(-max, max).to(dtype);
}

at::Tensor scale_from_amax(const at::Tensor& amax, double fp8_max, int64_t margin, const at::Tensor& fallback) {
  const at::Tensor scale = (fp8_max / amax) / std::ldexp(1.0, static_cast<int>(margin));
  const at::Tensor usable = amax.gt(0).logical_and_(amax.isfinite());
  const at::Tensor chosen = at::where(usable, scale, fallback);
  return chosen.clamp_max(std::numeric_limits<float>::max());
}

TensorScaling::TensorScaling(const Fp8Options& options, Role role, c10::Device device,
                             std::vector<std::string> amax_groups)
    : options_(options),
      role_(role),
      dtype_(dtype_of(options.format(), role)),
      max_(max_of(dtype_)),
      groups_(std::move(amax_groups)) {
  options_.validate("fp8 scaling");
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  amax_history = at::zeros({options_.amax_history_len()}, f32);
  scale = at::ones({}, f32);
}

at::Tensor TensorScaling::reduced_amax(const at::Tensor& x) const {
  // max |x| in one reduction (the infinity norm), exact in any dtype.
  at::Tensor amax = x.numel() == 0 ? at::zeros({}, x.options().dtype(at::kFloat))
                                   : at::linalg_vector_norm(x, INFINITY).to(at::kFloat);
  for (const auto& g : groups_) {
    if (!g.empty()) comm::Group(g).all_reduce(amax, comm::ReduceOp::kMax);
  }
  return amax;
}

Quantized TensorScaling::quantize(const at::Tensor& x, bool record) {
  MEGATORCH_CHECK(x.device() == scale.device(), "fp8 ", to_string(role_), ": expected a tensor on ", scale.device(),
                  " (where the layer's FP8 state lives), got one on ", x.device(), "; move the layer with the data");
  if (options_.recipe() == Recipe::kDelayed && !record) return {fp8::quantize(x, scale, dtype_), scale.reciprocal()};
  const at::Tensor amax = reduced_amax(x);
  if (options_.recipe() == Recipe::kTensorwise) {
    // Current scaling: this tensor's own amax, no margin; amax 0 quantises with scale 1.
    scale.copy_(scale_from_amax(amax, max_, 0, at::ones_like(scale)));
    amax_history.select(0, 0).copy_(amax);
    return {fp8::quantize(x, scale, dtype_), scale.reciprocal()};
  }
  // Delayed: quantise with the scale chosen before this call, then record and update.
  Quantized q{fp8::quantize(x, scale, dtype_), scale.reciprocal()};
  amax_history.select(0, 0).copy_(amax);
  const at::Tensor chosen = options_.amax_compute_algo() == AmaxAlgo::kMax ? amax_history.amax() : amax_history[0];
  scale.copy_(scale_from_amax(chosen, max_, options_.margin(), scale));
  // The window moves one step: the oldest amax leaves, slot 0 is the next to write.
  amax_history.copy_(amax_history.roll(-1));
  amax_history.select(0, 0).zero_();
  return q;
}

}  // namespace megatorch::fp8
