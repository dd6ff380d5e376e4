#include "megatorch/transformer/norm.h"

#include <ATen/ATen.h>

#include "megatorch/kernels/norms.h"

namespace megatorch::transformer {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor y = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (y * weight.to(at::kFloat)).to(x.scalar_type());
}

NormImpl::NormImpl(NormOptions options_) : options(std::move(options_)) { reset(); }

void NormImpl::reset() {
  const auto t = at::TensorOptions().dtype(options.dtype()).device(options.device());
  weight = register_parameter("weight", at::empty({options.hidden()}, t));
  if (options.kind() == Normalization::kLayerNorm && options.bias()) {
    bias = register_parameter("bias", at::empty({options.hidden()}, t));
  }
  reset_parameters();
}

void NormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  weight.fill_(1);
  if (bias.defined()) bias.zero_();
}

void NormImpl::pretty_print(std::ostream& stream) const {
  stream << "megatorch::transformer::" << to_string(options.kind()) << "(" << options.hidden()
         << ", eps=" << options.eps() << (options.fused() ? ", fused" : "") << ")";
}

at::Tensor NormImpl::forward(const at::Tensor& x) { return forward(x, weight, bias); }

at::Tensor NormImpl::forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const bool rms = options.kind() == Normalization::kRMSNorm;
  if (options.fused()) {
    return rms ? kernels::rms_norm(x, w, options.eps())
               : kernels::layer_norm(x, w, b.defined() ? c10::optional<at::Tensor>(b) : c10::nullopt,
                                     options.eps());
  }
  if (rms) return rms_norm(x, w, options.eps());
  // at::layer_norm accumulates in fp32 for reduced-precision inputs on CPU and CUDA.
  return at::layer_norm(x, {options.hidden()}, w, b, options.eps());
}

std::map<std::string, tp::ParameterLayout> NormImpl::parameter_layouts() const {
  std::map<std::string, tp::ParameterLayout> out;
  if (options.partial_grad_under_sp()) return out;
  out["weight"] = tp::replicated_layout(weight, /*partial_grad=*/false);
  if (bias.defined()) out["bias"] = tp::replicated_layout(bias, /*partial_grad=*/false);
  return out;
}

Norm make_norm(const TransformerConfig& c) { return make_norm(c, c.hidden_size()); }

Norm make_norm(const TransformerConfig& c, int64_t size) {
  return Norm(NormOptions(size)
                  .fused(c.fused_kernels())
                  .kind(c.normalization())
                  .eps(c.norm_epsilon())
                  .bias(c.add_bias_linear())
                  .dtype(c.params_dtype())
                  .device(c.device()));
}

}  // namespace megatorch::transformer
