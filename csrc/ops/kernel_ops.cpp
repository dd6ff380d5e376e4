// Registers the fused kernels as torch.ops.megatorch.*. Registration only: the
// kernels and their autograd functions live in csrc/kernels/.
//
// Each differentiable operator X has an Autograd kernel (a torch::autograd::Function
// whose forward and backward call the internal operators _X_fwd / _X_bwd) and a
// CompositeExplicitAutograd kernel (forward only, through _X_fwd). The internal
// operators carry the CPU, CUDA and Meta kernels, so fake tensors and torch.compile
// see every step. The Meta kernels compute shapes from the arguments alone.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "megatorch/kernels/bias_dropout_add.h"
#include "megatorch/kernels/bias_gelu.h"
#include "megatorch/kernels/cross_entropy_local.h"
#include "megatorch/kernels/fused_adamw.h"
#include "megatorch/kernels/norms.h"
#include "megatorch/kernels/rotary.h"
#include "megatorch/kernels/softmax.h"
#include "megatorch/kernels/swiglu.h"

namespace megatorch::ops {
namespace {

using OptTensor = std::optional<at::Tensor>;
using at::Tensor;

at::ScalarType stats_dtype(const Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }
Tensor stats_like(const Tensor& t) {
  return at::empty_symint(t.sym_sizes().slice(0, t.dim() - 1), t.options().dtype(stats_dtype(t)));
}
Tensor same_like(const Tensor& t) { return at::empty_like(t, at::MemoryFormat::Contiguous); }

// ---- forward-only kernels of the public operators (below autograd) ----
Tensor bias_gelu_fwd_only(const Tensor& input, const Tensor& bias) { return kernels::bias_gelu_forward(input, bias); }
Tensor bias_dropout_add_fwd_only(const Tensor& input, const OptTensor& bias, const Tensor& residual, double p,
                                 bool train) {
  return std::get<0>(kernels::bias_dropout_add_forward(input, bias, residual, p, train));
}
Tensor layer_norm_fwd_only(const Tensor& input, const Tensor& weight, const OptTensor& bias, double eps) {
  return std::get<0>(kernels::layer_norm_forward(input, weight, bias, eps));
}
Tensor rms_norm_fwd_only(const Tensor& input, const Tensor& weight, double eps) {
  return std::get<0>(kernels::rms_norm_forward(input, weight, eps));
}

// ---- Meta kernels ----
Tensor unary_meta(const Tensor& input, const Tensor&) { return same_like(input); }
Tensor bias_gelu_bwd_meta(const Tensor&, const Tensor& input, const Tensor&) { return same_like(input); }
std::tuple<Tensor, Tensor> bias_dropout_add_fwd_meta(const Tensor& input, const OptTensor&, const Tensor&, double p,
                                                     bool train) {
  const bool drop = train && p > 0;
  Tensor mask = drop ? at::empty_symint(input.sym_sizes(), input.options().dtype(at::kBool))
                     : at::empty({0}, input.options().dtype(at::kBool));
  return {same_like(input), mask};
}
Tensor swiglu_fwd_meta(const Tensor& input) {
  std::vector<c10::SymInt> shape(input.sym_sizes().begin(), input.sym_sizes().end());
  shape.back() = shape.back() / 2;
  return at::empty_symint(shape, input.options());
}
Tensor swiglu_bwd_meta(const Tensor&, const Tensor& input) { return same_like(input); }
Tensor rotary_meta(const Tensor& input, const Tensor&) { return same_like(input); }
Tensor masked_softmax_meta(const Tensor& input, const OptTensor&, double) { return same_like(input); }
Tensor causal_softmax_meta(const Tensor& input, double) { return same_like(input); }
Tensor softmax_bwd_meta(const Tensor&, const Tensor& output, double) { return same_like(output); }
std::tuple<Tensor, Tensor, Tensor> layer_norm_fwd_meta(const Tensor& input, const Tensor&, const OptTensor&, double) {
  return {same_like(input), stats_like(input), stats_like(input)};
}
std::tuple<Tensor, Tensor, Tensor> layer_norm_bwd_meta(const Tensor&, const Tensor& input, const Tensor&,
                                                       const Tensor&, const Tensor& weight) {
  return {same_like(input), at::empty_like(weight), at::empty_like(weight)};
}
std::tuple<Tensor, Tensor> rms_norm_fwd_meta(const Tensor& input, const Tensor&, double) {
  return {same_like(input), stats_like(input)};
}
std::tuple<Tensor, Tensor> rms_norm_bwd_meta(const Tensor&, const Tensor& input, const Tensor&, const Tensor& weight) {
  return {same_like(input), at::empty_like(weight)};
}
std::tuple<Tensor, Tensor, Tensor, Tensor> ce_local_meta(const Tensor& logits, const Tensor& target, int64_t,
                                                         int64_t) {
  const auto opts = logits.options().dtype(stats_dtype(logits));
  return {at::empty_symint(target.sym_sizes(), opts), at::empty_symint(target.sym_sizes(), opts),
          at::empty_symint(target.sym_sizes(), opts), at::empty_symint(target.sym_sizes(), opts)};
}

// ---- the optimizer ----
void fused_adamw_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                    double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    std::optional<at::TensorList> model_params) {
  kernels::fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, model_params);
}
void fused_adamw_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, double, double, double, double, double, int64_t step,
                      std::optional<at::TensorList> model_params) {
  kernels::check_fused_adamw_args(params, grads, exp_avgs, exp_avg_sqs, step, model_params);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatorch, m) {
  m.def("bias_gelu(Tensor input, Tensor bias) -> Tensor");
  m.def("bias_dropout_add(Tensor input, Tensor? bias, Tensor residual, float p, bool train) -> Tensor");
  m.def("scaled_masked_softmax(Tensor input, Tensor? mask, float scale) -> Tensor");
  m.def("scaled_upper_triang_masked_softmax(Tensor input, float scale) -> Tensor");
  m.def("layer_norm(Tensor input, Tensor weight, Tensor? bias, float eps) -> Tensor");
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def("swiglu(Tensor input) -> Tensor");
  m.def("rotary_embedding(Tensor input, Tensor freqs) -> Tensor");
  // Not differentiable by itself: the loss that uses it has its own backward.
  m.def("vocab_parallel_cross_entropy_local(Tensor logits, Tensor target, int vocab_start, int real_cols) -> "
        "(Tensor max, Tensor sum_exp, Tensor target_logit, Tensor sum_logits)");
  // The mutated lists carry alias annotations (a!) so functionalization and
  // torch.compile know what the optimizer step writes.
  m.def("fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
        "Tensor(d!)[]? model_params=None) -> ()");

  // Internal halves.
  m.def("_bias_gelu_fwd(Tensor input, Tensor bias) -> Tensor");
  m.def("_bias_gelu_bwd(Tensor grad, Tensor input, Tensor bias) -> Tensor");
  m.def("_bias_dropout_add_fwd(Tensor input, Tensor? bias, Tensor residual, float p, bool train) -> (Tensor, Tensor)");
  m.def("_scaled_masked_softmax_fwd(Tensor input, Tensor? mask, float scale) -> Tensor");
  m.def("_scaled_upper_triang_masked_softmax_fwd(Tensor input, float scale) -> Tensor");
  m.def("_scaled_softmax_bwd(Tensor grad, Tensor output, float scale) -> Tensor");
  m.def("_layer_norm_fwd(Tensor input, Tensor weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("_layer_norm_bwd(Tensor grad, Tensor input, Tensor mean, Tensor rstd, Tensor weight) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("_rms_norm_fwd(Tensor input, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("_rms_norm_bwd(Tensor grad, Tensor input, Tensor rstd, Tensor weight) -> (Tensor, Tensor)");
  m.def("_swiglu_fwd(Tensor input) -> Tensor");
  m.def("_swiglu_bwd(Tensor grad, Tensor input) -> Tensor");
  m.def("_rotary_embedding_fwd(Tensor input, Tensor freqs) -> Tensor");
  m.def("_rotary_embedding_bwd(Tensor grad, Tensor freqs) -> Tensor");

  using c10::DispatchKey;
  m.impl("bias_gelu", DispatchKey::Autograd, TORCH_FN(kernels::bias_gelu));
  m.impl("bias_gelu", DispatchKey::CompositeExplicitAutograd, TORCH_FN(bias_gelu_fwd_only));
  m.impl("bias_dropout_add", DispatchKey::Autograd, TORCH_FN(kernels::bias_dropout_add));
  m.impl("bias_dropout_add", DispatchKey::CompositeExplicitAutograd, TORCH_FN(bias_dropout_add_fwd_only));
  m.impl("scaled_masked_softmax", DispatchKey::Autograd, TORCH_FN(kernels::scaled_masked_softmax));
  m.impl("scaled_masked_softmax", DispatchKey::CompositeExplicitAutograd,
         TORCH_FN(kernels::scaled_masked_softmax_forward));
  m.impl("scaled_upper_triang_masked_softmax", DispatchKey::Autograd,
         TORCH_FN(kernels::scaled_upper_triang_masked_softmax));
  m.impl("scaled_upper_triang_masked_softmax", DispatchKey::CompositeExplicitAutograd,
         TORCH_FN(kernels::scaled_upper_triang_masked_softmax_forward));
  m.impl("layer_norm", DispatchKey::Autograd, TORCH_FN(kernels::layer_norm));
  m.impl("layer_norm", DispatchKey::CompositeExplicitAutograd, TORCH_FN(layer_norm_fwd_only));
  m.impl("rms_norm", DispatchKey::Autograd, TORCH_FN(kernels::rms_norm));
  m.impl("rms_norm", DispatchKey::CompositeExplicitAutograd, TORCH_FN(rms_norm_fwd_only));
  m.impl("swiglu", DispatchKey::Autograd, TORCH_FN(kernels::swiglu));
  m.impl("swiglu", DispatchKey::CompositeExplicitAutograd, TORCH_FN(kernels::swiglu_forward));
  m.impl("rotary_embedding", DispatchKey::Autograd, TORCH_FN(kernels::rotary_embedding));
  m.impl("rotary_embedding", DispatchKey::CompositeExplicitAutograd, TORCH_FN(kernels::rotary_embedding_forward));
}

// The same functions serve CPU and CUDA: they branch on the device inside, after
// their checks (csrc/kernels/*.cpp).
#define MEGATORCH_KERNEL_IMPLS(m)                                                                  \
  m.impl("_bias_gelu_fwd", TORCH_FN(kernels::bias_gelu_forward));                                  \
  m.impl("_bias_gelu_bwd", TORCH_FN(kernels::bias_gelu_backward));                                 \
  m.impl("_bias_dropout_add_fwd", TORCH_FN(kernels::bias_dropout_add_forward));                    \
  m.impl("_scaled_masked_softmax_fwd", TORCH_FN(kernels::scaled_masked_softmax_forward));          \
  m.impl("_scaled_upper_triang_masked_softmax_fwd",                                                \
         TORCH_FN(kernels::scaled_upper_triang_masked_softmax_forward));                           \
  m.impl("_scaled_softmax_bwd", TORCH_FN(kernels::scaled_softmax_backward));                       \
  m.impl("_layer_norm_fwd", TORCH_FN(kernels::layer_norm_forward));                                \
  m.impl("_layer_norm_bwd", TORCH_FN(kernels::layer_norm_backward));                               \
  m.impl("_rms_norm_fwd", TORCH_FN(kernels::rms_norm_forward));                                    \
  m.impl("_rms_norm_bwd", TORCH_FN(kernels::rms_norm_backward));                                   \
  m.impl("_swiglu_fwd", TORCH_FN(kernels::swiglu_forward));                                        \
  m.impl("_swiglu_bwd", TORCH_FN(kernels::swiglu_backward));                                       \
  m.impl("_rotary_embedding_fwd", TORCH_FN(kernels::rotary_embedding_forward));                    \
  m.impl("_rotary_embedding_bwd", TORCH_FN(kernels::rotary_embedding_backward));                   \
  m.impl("vocab_parallel_cross_entropy_local", TORCH_FN(kernels::cross_entropy_local));            \
  m.impl("fused_adamw_", TORCH_FN(fused_adamw_op))

TORCH_LIBRARY_IMPL(megatorch, CPU, m) { MEGATORCH_KERNEL_IMPLS(m); }
TORCH_LIBRARY_IMPL(megatorch, CUDA, m) { MEGATORCH_KERNEL_IMPLS(m); }

TORCH_LIBRARY_IMPL(megatorch, Meta, m) {
  m.impl("_bias_gelu_fwd", TORCH_FN(unary_meta));
  m.impl("_bias_gelu_bwd", TORCH_FN(bias_gelu_bwd_meta));
  m.impl("_bias_dropout_add_fwd", TORCH_FN(bias_dropout_add_fwd_meta));
  m.impl("_scaled_masked_softmax_fwd", TORCH_FN(masked_softmax_meta));
  m.impl("_scaled_upper_triang_masked_softmax_fwd", TORCH_FN(causal_softmax_meta));
  m.impl("_scaled_softmax_bwd", TORCH_FN(softmax_bwd_meta));
  m.impl("_layer_norm_fwd", TORCH_FN(layer_norm_fwd_meta));
  m.impl("_layer_norm_bwd", TORCH_FN(layer_norm_bwd_meta));
  m.impl("_rms_norm_fwd", TORCH_FN(rms_norm_fwd_meta));
  m.impl("_rms_norm_bwd", TORCH_FN(rms_norm_bwd_meta));
  m.impl("_swiglu_fwd", TORCH_FN(swiglu_fwd_meta));
  m.impl("_swiglu_bwd", TORCH_FN(swiglu_bwd_meta));
  m.impl("_rotary_embedding_fwd", TORCH_FN(rotary_meta));
  m.impl("_rotary_embedding_bwd", TORCH_FN(rotary_meta));
  m.impl("vocab_parallel_cross_entropy_local", TORCH_FN(ce_local_meta));
  m.impl("fused_adamw_", TORCH_FN(fused_adamw_meta));
}

}  // namespace megatorch::ops
