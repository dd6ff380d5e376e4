#pragma once
// One GEMM operand's FP8 scaling: quantise with a scale, keep the amax history the delayed
// recipe chooses the next scale from. Quantised values are x·scale saturated to the
// format's max and rounded to nearest-even by the cast; x ≈ data·scale_inv.
#include <ATen/Tensor.h>

#include <string>
#include <vector>

#include "megatorch/fp8/recipe.h"

namespace megatorch::fp8 {

// An operand in FP8 with the factor that turns it back: x ≈ data · scale_inv.
struct Quantized {
  at::Tensor data;       // Float8_e4m3fn or Float8_e5m2, x's shape
  at::Tensor scale_inv;  // fp32 scalar: 1 / the scale data was made with
};

// x·scale clamped to ±max_of(dtype) (saturation, NaN stays NaN), cast to dtype. `scale` is
// an fp32 scalar tensor on x's device.
at::Tensor quantize(const at::Tensor& x, const at::Tensor& scale, c10::ScalarType dtype);
// The scale that maps `amax` onto the format's max: (fp8_max / amax) / 2^margin. Where
// amax is 0 or not finite, `fallback` (TE keeps the previous scale; current scaling
// uses 1); an overflow to inf becomes FLT_MAX. All on the device, no synchronisation.
at::Tensor scale_from_amax(const at::Tensor& amax, double fp8_max, int64_t margin, const at::Tensor& fallback);

class TensorScaling {
 public:
  // `amax_groups`: the registered groups `role`'s tensor is split over (TP and/or CP): its
  // amax is the max over them, so every rank (and every layout) picks the scale the
  // whole tensor would give.
  TensorScaling(const Fp8Options& options, Role role, c10::Device device, std::vector<std::string> amax_groups);

  // Quantises x by the recipe and, for delayed scaling with `record`, records x's amax and
  // moves the scale to the next step's (TE's order: use the scale, then update it).
  // Without `record` (a forward outside training: evaluation, or the first pass of a
  // recomputed layer, whose replay records) the state stays as it was.
  Quantized quantize(const at::Tensor& x, bool record = true);

  Role role() const { return role_; }
  c10::ScalarType dtype() const { return dtype_; }
  // State kept across steps (checkpointed): the last amaxes, newest written at [0] before
  // each update and rolled one place after it, and the scale the next call uses.
  at::Tensor amax_history;  // [amax_history_len] fp32
  at::Tensor scale;         // [] fp32

 private:
  at::Tensor reduced_amax(const at::Tensor& x) const;

  Fp8Options options_;
  Role role_;
  c10::ScalarType dtype_;
  double max_;
  std::vector<std::string> groups_;
};

}  // namespace megatorch::fp8
