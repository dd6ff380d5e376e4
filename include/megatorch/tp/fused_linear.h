#pragma once
// The tensor-parallel layers' GEMM: at::linear, whose backward adds the weight gradient
// straight into the weight's gradient buffer when one is registered (gradient-accumulation
// fusion, optim/main_grad.h).
#include <ATen/Tensor.h>
#include <c10/util/Optional.h>

namespace megatorch::tp {

// y = x·Wᵀ + b, computed as at::linear computes it. When autograd records the call and W
// has a main grad, the backward is this file's node: the input and bias gradients as
// at::linear's backward computes them, the weight gradient accumulated into the main grad.
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

// The weight gradient of y = x·Wᵀ from 2-D grad_y [rows, out] and x [rows, in], as
// autograd's mm backward computes it (grad_yᵀ·x for a row-major W, else (xᵀ·grad_y)ᵀ, the
// same bits). Where this backward accumulates into W's gradient and W has a main grad,
// it is added there by the GEMM itself and a placeholder (never read) is returned.
at::Tensor linear_weight_grad(const at::Tensor& weight, const at::Tensor& grad2d, const at::Tensor& x2d);

// A weight gradient computed elsewhere (an FP8 GEMM's, in fp32): added into W's main grad
// where linear_weight_grad would accumulate there (what it returns then is the same unread
// stand-in for .grad as linear_weight_grad's), else returned in W's dtype for autograd.
at::Tensor add_weight_grad(const at::Tensor& weight, const at::Tensor& grad_weight);

}  // namespace megatorch::tp
