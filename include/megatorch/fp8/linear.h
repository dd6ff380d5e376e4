#pragma once
// y = x·Wᵀ + b with the three GEMMs of a linear layer in FP8 (at::_scaled_mm): forward
// x·Wᵀ, data gradient dY·W, weight gradient dYᵀ·x, each operand quantised by its own
// TensorScaling, accumulation and output in the input's dtype (fp32 for the weight
// gradient, which goes into the main grad where there is one). The bias, and the bias
// gradient, stay in high precision.
#include <ATen/Tensor.h>
#include <c10/util/Optional.h>
#include <ATen/core/ivalue.h>

#include <array>
#include <map>
#include <string>
#include <vector>

#include "megatorch/fp8/scaling.h"

namespace megatorch::fp8 {

// The scaling state of one FP8 linear layer: its input, weight and output gradient.
struct LinearScaling : torch::CustomClassHolder {
  // groups[role]: what that operand is split over (see TensorScaling).
  LinearScaling(const Fp8Options& options, c10::Device device, const std::array<std::vector<std::string>, kNumRoles>& groups);
  TensorScaling& of(Role r) { return roles[static_cast<int>(r)]; }
  // The checkpointed tensors by name: "input.amax_history", "input.scale", "weight.…", "grad_output.…".
  std::map<std::string, at::Tensor> state();

  Fp8Options options;
  std::vector<TensorScaling> roles;  // indexed by Role
};

// Fails unless `_scaled_mm` can take this layer's GEMMs: every weight dimension
// (out_local, in_local) divisible by 16 (cuBLASLt's FP8 rule; kept on CPU too, so a
// layout that trains here trains on the GPU), params in fp32 or bf16, and on CUDA a
// device of compute capability 8.9 or newer. The message names the layer and its shape.
void check_linear_shape(const std::string& layer, int64_t out_local, int64_t in_local, c10::ScalarType dtype,
                        c10::Device device);

// a [M, K] · bᵀ with b [N, K], both quantised: [M, N] in out_dtype, dequantised by both
// scale_invs. The operands are laid out as cuBLASLt wants them (a row-major, b as a
// column-major K × N); K not divisible by 16 is padded with zeros (the weight gradient's
// token count).
at::Tensor scaled_gemm(const Quantized& a, const Quantized& b, c10::ScalarType out_dtype, bool fast_accum = false);

// y = x·Wᵀ + b through FP8 GEMMs, with `scaling` updated as the recipe says.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const c10::intrusive_ptr<LinearScaling>& scaling);

}  // namespace megatorch::fp8
