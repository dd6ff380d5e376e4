#pragma once
// swiglu: input [..., 2f] split in halves (x1, x2) -> silu(x1)·x2, [..., f], in one
// pass with fp32 math. Operator: torch.ops.megatorch.swiglu; backward _swiglu_bwd.
#include <ATen/Tensor.h>

namespace megatorch::kernels {

at::Tensor swiglu(const at::Tensor& input);  // differentiable

at::Tensor swiglu_forward(const at::Tensor& input);
at::Tensor swiglu_backward(const at::Tensor& grad, const at::Tensor& input);  // -> grad of input [..., 2f]

}  // namespace megatorch::kernels
