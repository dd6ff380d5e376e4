#pragma once
// The sequence-parallel column-parallel linear as one autograd function: Megatron's
// LinearWithGradAccumulationAndAsyncCommunication. It keeps the [s/t, b, in] input shard
// for backward instead of the all-gathered [s, b, in] input (Korthikanti's SP memory):
//
//   forward   x_full = all-gather(x) along dim 0 (sequence); y = at::linear(x_full, W, b).
//             Saves x (the shard) and W.
//   backward  launch all-gather(x) again; grad_x_full = grad_y·W while it is in flight;
//             wait; launch reduce-scatter(grad_x_full) along dim 0; grad_W = grad_yᵀ·x_full
//             and grad_b = Σ grad_y while that is in flight; wait.
//
// Communication per call over `group`: forward one all-gather of the shard; backward one
// all-gather of the shard (when W needs a gradient) and one reduce-scatter of the
// [s, b, in] input gradient (when x needs one). The GEMMs are the ones autograd runs for
// at::linear's backward, on the same operands, so the results equal the composition
// gather_from_sp_region + at::linear.
//
// Not differentiable twice: the backward's collectives are not recorded by autograd.
#include <ATen/Tensor.h>
#include <torch/autograd.h>

#include <string>

namespace megatorch::tp {

class SequenceParallelColumnLinear : public torch::autograd::Function<SequenceParallelColumnLinear> {
 public:
  // input [s/t, ..., in] (at least 2-D), weight [out/t, in], bias broadcastable to
  // [..., out/t] or none -> [s, ..., out/t].
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const std::string& group);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

// y = all_gather_s(input)·weightᵀ (+ bias) over the TP group `group` (a registered name).
at::Tensor sequence_parallel_column_linear(const at::Tensor& input, const at::Tensor& weight,
                                           const c10::optional<at::Tensor>& bias, const std::string& group);

}  // namespace megatorch::tp
