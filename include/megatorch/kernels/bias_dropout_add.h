#pragma once
// bias_dropout_add: residual + dropout(input + bias, p) in one pass (bias optional,
// broadcast over the last dim). The keep/drop draws come from the current default
// generator of the device, so the TP RNG tracker's forks govern them. On CPU the draws
// are at::dropout's (a Bernoulli(1-p) tensor of the input's dtype), so the result equals
// residual + at::dropout(input + bias, p, true) under the same generator state.
// Without training (or p = 0) it is residual + input + bias. The forward keeps a bool
// keep-mask (1 byte per element) for the backward.
// Operator: torch.ops.megatorch.bias_dropout_add.
#include <ATen/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace megatorch::kernels {

// Differentiable in input, bias and residual.
at::Tensor bias_dropout_add(const at::Tensor& input, const c10::optional<at::Tensor>& bias, const at::Tensor& residual,
                            double p, bool train);

// The kernel: (output, keep mask); the mask is empty when nothing is dropped.
std::tuple<at::Tensor, at::Tensor> bias_dropout_add_forward(const at::Tensor& input,
                                                            const c10::optional<at::Tensor>& bias,
                                                            const at::Tensor& residual, double p, bool train);

}  // namespace megatorch::kernels
