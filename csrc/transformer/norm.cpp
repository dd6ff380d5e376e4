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

at::Tensor NormImpl::forward(const at::Tensor& x) {
  const bool rms = options.kind() == Normalization::kRMSNorm;
  if (options.fused()) {
    return rms ? kernels::rms_norm(x, weight, options.eps())
               : kernels::layer_norm(x, weight, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt,
                                     options.eps());
  }
  if (rms) return rms_norm(x, weight, options.eps());
  // at::layer_norm accumulates in fp32 for reduced-precision inputs on CPU and CUDA.
  return at::layer_norm(x, {options.hidden()}, weight, bias, options.eps());
}

Norm make_norm(const TransformerConfig& c) {
  return Norm(NormOptions(c.hidden_size())
                  .fused(c.fused_kernels())
                  .kind(c.normalization())
                  .eps(c.norm_epsilon())
                  .bias(c.add_bias_linear())
                  .dtype(c.params_dtype())
                  .device(c.device()));
}

}  // namespace megatorch::transformer
