#pragma once
// Multi-tensor AdamW on fp32 master weights (Loshchilov & Hutter's decoupled weight
// decay, as torch.optim.AdamW): for every i,
//   p -= lr·wd·p;  m = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²
//   p -= lr/(1-β1^step) · m / (sqrt(v)/sqrt(1-β2^step) + eps)
// params, exp_avgs, exp_avg_sqs are fp32; grads fp32, bf16 or fp16 (upcast inside);
// when model_params is given each gets the updated value cast to its own dtype (the
// 16-bit model copy). `step` is 1-based. CPU: at::parallel_for over each tensor;
// CUDA: one launch per chunk of up to 24 tensors (apex's multi_tensor_apply pattern).
// Operator: torch.ops.megatorch.fused_adamw_.
#include <ATen/Tensor.h>
#include <ATen/core/ATen_fwd.h>

#include <optional>

namespace megatorch::kernels {

void fused_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                  std::optional<at::TensorList> model_params = std::nullopt);

// The same checks without touching data (the operator's Meta kernel).
void check_fused_adamw_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, int64_t step, std::optional<at::TensorList> model_params);

}  // namespace megatorch::kernels
