#pragma once
// bias_gelu: GeLU (tanh approximation) of input + bias in one pass; bias [h] is
// broadcast over input [..., h]. The 16-bit sum is never rounded: the math is fp32.
// Operator: torch.ops.megatorch.bias_gelu; backward through _bias_gelu_bwd.
#include <ATen/Tensor.h>

namespace megatorch::kernels {

// Differentiable in input and bias.
at::Tensor bias_gelu(const at::Tensor& input, const at::Tensor& bias);

// The kernels (CPU or CUDA by the input's device), outside autograd.
at::Tensor bias_gelu_forward(const at::Tensor& input, const at::Tensor& bias);
// Gradient of the input; the bias gradient is its sum over the leading dims.
at::Tensor bias_gelu_backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& bias);

}  // namespace megatorch::kernels
