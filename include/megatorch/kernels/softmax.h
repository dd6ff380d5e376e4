#pragma once
// Scaled, masked softmax over the last dim (Megatron's fused softmaxes), fp32 math:
//   scaled_masked_softmax: input [b, heads, sq, sk], mask bool broadcastable to it
//     (true = masked out) or none;
//   scaled_upper_triang_masked_softmax: input [b·heads, sq, sk], causal (key j > query
//     i masked out).
// A row with every entry masked gives zeros, not NaN. Backward (both):
// dx = scale·y·(g - Σ g·y), from the output alone (_scaled_softmax_bwd).
#include <ATen/Tensor.h>
#include <c10/util/Optional.h>

namespace megatorch::kernels {

// Differentiable in input.
at::Tensor scaled_masked_softmax(const at::Tensor& input, const c10::optional<at::Tensor>& mask, double scale);
at::Tensor scaled_upper_triang_masked_softmax(const at::Tensor& input, double scale);

at::Tensor scaled_masked_softmax_forward(const at::Tensor& input, const c10::optional<at::Tensor>& mask, double scale);
at::Tensor scaled_upper_triang_masked_softmax_forward(const at::Tensor& input, double scale);
at::Tensor scaled_softmax_backward(const at::Tensor& grad, const at::Tensor& output, double scale);

}  // namespace megatorch::kernels
