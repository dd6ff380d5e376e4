#include "megatorch/tp/fused_linear.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "megatorch/optim/main_grad.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// at::linear with the weight gradient accumulated into the main grad. Its name contains
// "Linear": the zero-bubble split backward defers its weight gradient like any GEMM's.
class LinearWithGradAccumulation : public torch::autograd::Function<LinearWithGradAccumulation> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias) {
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->saved_data["has_bias"] = has_bias;
    if (has_bias) ctx->saved_data["bias_sizes"] = bias->sizes();
    ctx->save_for_backward({weight.requires_grad() ? input : at::Tensor(), weight});
    return at::linear(input, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& grad = grads[0];
    const at::Tensor grad2d = grad.reshape({-1, grad.size(-1)});
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      std::vector<int64_t> sizes = grad.sizes().vec();
      sizes.back() = weight.size(1);
      grad_input = grad2d.mm(weight).view(sizes);
    }
    if (ctx->needs_input_grad(1)) grad_weight = linear_weight_grad(weight, grad2d, input.reshape({-1, input.size(-1)}));
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      grad_bias = at::sum_to(grad2d, at::IntArrayRef(ctx->saved_data["bias_sizes"].toIntVector()));
    }
    return {grad_input, grad_weight, grad_bias};
  }
};

}  // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  // Tracers (torch.compile's fake tensors) see at::linear itself.
  if (at::GradMode::is_enabled() && weight.requires_grad() && !is_traced(input, weight, bias) &&
      optim::find_main_grad(weight)) {
    return LinearWithGradAccumulation::apply(input, weight, bias);
  }
  return at::linear(input, weight, bias);
}

namespace {

// The main grad a weight gradient goes into, where this backward accumulates into the
// weight's gradient and one is registered; else nullopt (autograd keeps the gradient).
std::optional<optim::MainGrad> accumulating_main_grad(const at::Tensor& weight) {
  const bool row_major = weight.stride(1) == 1 && weight.stride(0) == weight.size(1);
  // Under create_graph the gradient must stay a differentiable value: no fusion.
  if (!row_major || at::GradMode::is_enabled()) return std::nullopt;
  // The registry first: without fusion it is empty and answers without a lookup.
  auto mg = optim::find_main_grad(weight);
  if (!mg || !optim::backward_accumulates_into(weight)) return std::nullopt;
  return mg;
}

// What AccumulateGrad is handed once the gradient is in the main grad: an uninitialised
// tensor of W's shape that it stores as .grad (the optimizer reads the main grad, never
// it), so nothing is added into the buffer twice.
at::Tensor delivered(const at::Tensor& weight, const optim::MainGrad& mg) {
  mg.sink->mark_added(mg.index);
  weight.mutable_grad() = at::Tensor();
  return at::empty_like(weight, at::MemoryFormat::Contiguous);
}

}  // namespace

at::Tensor linear_weight_grad(const at::Tensor& weight, const at::Tensor& grad2d, const at::Tensor& x2d) {
  if (const auto mg = accumulating_main_grad(weight)) {
    at::Tensor buffer = mg->sink->main_grad(mg->index);
    if (buffer.scalar_type() == grad2d.scalar_type()) {
      buffer.addmm_(grad2d.t(), x2d);
    } else if (buffer.is_cuda()) {
      // 16-bit operands into the fp32 buffer: cuBLAS accumulates in fp32 and adds in place.
      at::addmm_out(buffer, buffer, grad2d.t(), x2d, buffer.scalar_type());
    } else {
      // No mixed-dtype GEMM on this device: the add stays a separate pass.
      buffer.add_(grad2d.t().mm(x2d));
    }
    return delivered(weight, *mg);
  }
  const bool row_major = weight.stride(1) == 1 && weight.stride(0) == weight.size(1);
  return row_major ? grad2d.t().mm(x2d) : x2d.t().mm(grad2d).t();
}

at::Tensor add_weight_grad(const at::Tensor& weight, const at::Tensor& grad_weight) {
  if (const auto mg = accumulating_main_grad(weight)) {
    mg->sink->main_grad(mg->index).add_(grad_weight);
    return delivered(weight, *mg);
  }
  return grad_weight.to(weight.scalar_type());
}

}  // namespace megatorch::tp
