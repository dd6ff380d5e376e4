#include "megatorch/tp/sequence_parallel_linear.h"

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/tp/fused_linear.h"

namespace megatorch::tp {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor SequenceParallelColumnLinear::forward(AutogradContext* ctx, const at::Tensor& input,
                                                 const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                                 const std::string& group) {
  MEGATORCH_CHECK(input.dim() >= 2, "sequence-parallel column_parallel_linear: expected an input of at least 2 dims "
                  "([s/t, ..., in], the sequence first), got shape ", input.sizes(),
                  "; add the sequence dim, or call it with sequence_parallel=false");
  const bool has_bias = bias.has_value() && bias->defined();
  ctx->saved_data["group"] = group;
  ctx->saved_data["has_bias"] = has_bias;
  if (has_bias) ctx->saved_data["bias_sizes"] = bias->sizes();
  // The shard, not the gathered input: backward gathers it again. Without a weight
  // gradient to compute, backward needs no input at all.
  ctx->save_for_backward({weight.requires_grad() ? input : at::Tensor(), weight});
  const at::Tensor full = comm::Group(group).all_gather(input, 0);
  return at::linear(full, weight, bias);
}

variable_list SequenceParallelColumnLinear::backward(AutogradContext* ctx, variable_list grads) {
  // Under create_graph the engine runs backward with grad mode on; the re-gathered input
  // and the reduce-scatter would enter the graph without their adjoints.
  MEGATORCH_CHECK(!at::GradMode::is_enabled(), "sequence-parallel column_parallel_linear: expected a first-order "
                  "backward, got one with create_graph=True; its backward re-gathers the input with a collective "
                  "that autograd does not differentiate. Use sequence_parallel=false for double backward");
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& shard = saved[0];
  const at::Tensor& weight = saved[1];
  const bool has_bias = ctx->saved_data["has_bias"].toBool();
  const bool need_input = ctx->needs_input_grad(0), need_weight = ctx->needs_input_grad(1);
  const bool need_bias = has_bias && ctx->needs_input_grad(2);
  comm::Group group(ctx->saved_data["group"].toStringRef());

  // The re-gather needs only the saved shard: start it before the input-gradient GEMM,
  // which does not need x.
  comm::Work gather = need_weight ? group.all_gather_async(shard, 0) : comm::Work();
  const at::Tensor& grad = grads[0];
  // at::linear's output is a view of a 2-D GEMM result: its backward reshapes the
  // gradient to that GEMM's [rows, out] first.
  const at::Tensor grad2d = grad.reshape({-1, grad.size(-1)});
  comm::Work scatter;
  if (need_input) {
    std::vector<int64_t> full_sizes = grad.sizes().vec();
    full_sizes.back() = weight.size(1);
    const at::Tensor grad_full = grad2d.mm(weight).view(full_sizes);
    // One collective at a time on the group, as Megatron does: the gather has had the
    // GEMM's time to finish.
    gather.wait();
    scatter = group.reduce_scatter_async(grad_full, 0);
  }
  at::Tensor grad_weight, grad_bias;
  if (need_weight) {
    const at::Tensor x_full = gather.wait();  // waits only if no input gradient came first
    const at::Tensor x2d = x_full.reshape({-1, x_full.size(-1)});
    grad_weight = linear_weight_grad(weight, grad2d, x2d);  // autograd's bits, or into the main grad
  }
  if (need_bias) {
    // addmm's bias gradient as the engine reduces it: grad_y summed to the bias's shape.
    const std::vector<int64_t> bias_sizes = ctx->saved_data["bias_sizes"].toIntVector();
    grad_bias = at::sum_to(grad2d, at::IntArrayRef(bias_sizes));
  }
  const at::Tensor grad_input = need_input ? scatter.wait() : at::Tensor();
  return {grad_input, grad_weight, grad_bias, at::Tensor()};
}

at::Tensor sequence_parallel_column_linear(const at::Tensor& input, const at::Tensor& weight,
                                           const c10::optional<at::Tensor>& bias, const std::string& group) {
  return SequenceParallelColumnLinear::apply(input, weight, bias, group);
}

}  // namespace megatorch::tp
