#pragma once
// layer_norm and rms_norm over the last dim: per row the mean, then Σ (x - mean)² and
// the output, each a pass over the cached row (fp32 accumulation for 16-bit inputs,
// double for double; on CUDA the row is read once and kept in registers; LayerNorm's CPU
// forward is ATen's fused kernel). The forward keeps the per-row statistics (fp32; double for double
// inputs) for the backward, which computes the input gradient row by row and the weight
// (and bias) gradients as deterministic per-chunk partial sums.
// Operators: torch.ops.megatorch.layer_norm / rms_norm.
#include <ATen/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace megatorch::kernels {

// Differentiable in input, weight and bias.
at::Tensor layer_norm(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      double eps);
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps);

// Kernels. Statistics have the shape input.shape[:-1].
// -> (output, mean, rstd)
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(const at::Tensor& input, const at::Tensor& weight,
                                                                  const c10::optional<at::Tensor>& bias, double eps);
// -> (grad input, grad weight, grad bias)
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& grad, const at::Tensor& input,
                                                                   const at::Tensor& mean, const at::Tensor& rstd,
                                                                   const at::Tensor& weight);
// -> (output, rstd)
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& input, const at::Tensor& weight, double eps);
// -> (grad input, grad weight)
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& input,
                                                     const at::Tensor& rstd, const at::Tensor& weight);

}  // namespace megatorch::kernels
