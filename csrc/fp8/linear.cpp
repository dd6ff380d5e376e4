#include "megatorch/fp8/linear.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/autograd.h>

#include "megatorch/check.h"
#include "megatorch/tp/fused_linear.h"

namespace megatorch::fp8 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kAlign = 16;  // cuBLASLt's FP8 rule for K and N

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Zero-padded along the last dim to `k` columns (an FP8 tensor has no pad kernel).
at::Tensor pad_columns(const at::Tensor& t, int64_t k) {
  if (t.size(1) == k) return t;
  at::Tensor out = at::zeros({t.size(0), k}, t.options());
  out.narrow(1, 0, t.size(1)).copy_(t);
  return out;
}

Quantized transposed(const Quantized& q) { return {q.data.t().contiguous(), q.scale_inv}; }

// Its name says "Linear": the zero-bubble split backward defers its weight gradient to W.
// B and W then run this backward twice, for the data and the weight gradient; the output
// gradient is quantised (and its amax recorded) once, in whichever comes first.
class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const c10::intrusive_ptr<LinearScaling>& scaling,
                            bool training) {
    const at::Tensor x2d = input.reshape({-1, input.size(-1)});
    const Quantized qx = scaling->of(Role::kInput).quantize(x2d, training);
    const Quantized qw = scaling->of(Role::kWeight).quantize(weight, training);
    ctx->saved_data["scaling"] = c10::IValue::make_capsule(scaling);
    // The FP8 copies, not the high-precision tensors: a quarter (fp32) or half (bf16) the memory.
    if (weight.requires_grad()) ctx->saved_data["qx"] = std::vector<at::Tensor>{qx.data, qx.scale_inv};
    ctx->saved_data["qw"] = std::vector<at::Tensor>{qw.data, qw.scale_inv};
    ctx->saved_data["dtype"] = static_cast<int64_t>(input.scalar_type());
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->saved_data["has_bias"] = has_bias;
    if (has_bias) ctx->saved_data["bias_sizes"] = bias->sizes();
    ctx->save_for_backward({weight});
    at::Tensor y = scaled_gemm(qx, qw, input.scalar_type(), /*fast_accum=*/true);
    if (has_bias) y = y + *bias;
    std::vector<int64_t> sizes = input.sizes().vec();
    sizes.back() = weight.size(0);
    // Not a view, as at::matmul's output is not: callers reduce it in place (g's all-reduce).
    return at::_unsafe_view(y, sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor weight = ctx->get_saved_variables()[0];
    auto scaling = c10::static_intrusive_pointer_cast<LinearScaling>(ctx->saved_data["scaling"].toCapsule());
    const auto dtype = static_cast<c10::ScalarType>(ctx->saved_data["dtype"].toInt());
    const at::Tensor& grad = grads[0];
    const at::Tensor g2d = grad.reshape({-1, grad.size(-1)});
    const bool need_input = ctx->needs_input_grad(0), need_weight = ctx->needs_input_grad(1);
    Quantized qg;
    if (ctx->saved_data.count("qg")) {  // W after B: the quantisation B made
      const auto kept = ctx->saved_data["qg"].toTensorVector();
      qg = {kept[0], kept[1]};
      ctx->saved_data.erase("qg");
    } else if (need_input || need_weight) {
      qg = scaling->of(Role::kGradOutput).quantize(g2d);
      if (need_input != need_weight) ctx->saved_data["qg"] = std::vector<at::Tensor>{qg.data, qg.scale_inv};
    }
    at::Tensor grad_input, grad_weight, grad_bias;
    if (need_input) {
      const auto w = ctx->saved_data["qw"].toTensorVector();
      // dX [M, in] = dY [M, out] · W [out, in]: W's transpose is the GEMM's [N, K] operand.
      std::vector<int64_t> sizes = grad.sizes().vec();
      sizes.back() = weight.size(1);
      grad_input = scaled_gemm(qg, transposed({w[0], w[1]}), dtype).view(sizes);
    }
    if (need_weight) {
      const auto x = ctx->saved_data["qx"].toTensorVector();
      // dW [out, in] = dYᵀ [out, M] · X [M, in], accumulated in fp32 for the main grad.
      const at::Tensor dw = scaled_gemm(transposed(qg), transposed({x[0], x[1]}), at::kFloat);
      grad_weight = tp::add_weight_grad(weight, dw);
    }
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) {
      grad_bias = at::sum_to(g2d, at::IntArrayRef(ctx->saved_data["bias_sizes"].toIntVector()));
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

LinearScaling::LinearScaling(const Fp8Options& options_, c10::Device device,
                             const std::array<std::vector<std::string>, kNumRoles>& groups)
    : options(options_) {
  MEGATORCH_CHECK(options.enabled(), "fp8::LinearScaling: expected an FP8 format (e4m3 or hybrid), got none");
  for (int r = 0; r < kNumRoles; ++r) roles.emplace_back(options, static_cast<Role>(r), device, groups[r]);
}

std::map<std::string, at::Tensor> LinearScaling::state() {
  std::map<std::string, at::Tensor> out;
  for (auto& s : roles) {
    out[std::string(to_string(s.role())) + ".amax_history"] = s.amax_history;
    out[std::string(to_string(s.role())) + ".scale"] = s.scale;
  }
  return out;
}

void check_linear_shape(const std::string& layer, int64_t out_local, int64_t in_local, c10::ScalarType dtype,
                        c10::Device device) {
  MEGATORCH_CHECK(out_local % kAlign == 0 && in_local % kAlign == 0, "fp8: layer '", layer, "' has a weight shard [",
                  out_local, ", ", in_local, "]; FP8 GEMMs (_scaled_mm) need both dimensions divisible by ", kAlign,
                  ". Change the hidden/FFN sizes or the tensor-parallel size, or keep this layer in bf16 "
                  "(--num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16, or no fp8 on it)");
  MEGATORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "fp8: layer '", layer, "' has ", dtype,
                  " parameters; FP8 GEMMs here take fp32 or bf16 (fp16 would need a loss scaler on top of the "
                  "FP8 scales). Use --bf16");
  if (device.is_cuda()) {
    const auto* p = at::cuda::getDeviceProperties(device.index() < 0 ? at::cuda::current_device() : device.index());
    MEGATORCH_CHECK(p->major * 10 + p->minor >= 89, "fp8: layer '", layer, "' is on ", p->name, " (compute capability ",
                    p->major, ".", p->minor, "); FP8 GEMMs need 8.9 or newer (Ada, Hopper, Blackwell). Train it "
                    "in bf16 (drop --fp8-format)");
  }
}

at::Tensor scaled_gemm(const Quantized& a, const Quantized& b, c10::ScalarType out_dtype, bool fast_accum) {
  MEGATORCH_CHECK(a.data.dim() == 2 && b.data.dim() == 2 && a.data.size(1) == b.data.size(1),
                  "fp8::scaled_gemm: expected a [M, K] and b [N, K], got ", a.data.sizes(), " and ", b.data.sizes());
  const int64_t k = round_up(a.data.size(1), kAlign);
  const at::Tensor lhs = pad_columns(a.data.contiguous(), k);
  const at::Tensor rhs = pad_columns(b.data.contiguous(), k);
  return at::_scaled_mm(lhs, rhs.t(), a.scale_inv, b.scale_inv, c10::nullopt, c10::nullopt, out_dtype,
                        fast_accum && lhs.is_cuda());
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  const c10::intrusive_ptr<LinearScaling>& scaling) {
  MEGATORCH_CHECK(scaling, "fp8::linear: expected the layer's FP8 scaling state, got none");
  MEGATORCH_CHECK(input.size(-1) == weight.size(1), "fp8::linear: expected input features ", weight.size(1),
                  " (weight [out, in] = ", weight.sizes(), "), got input ", input.sizes());
  // Delayed scaling records amaxes in training forwards only (grad mode on): evaluation
  // leaves the scales alone, and a fully recomputed layer's no-grad first pass and its
  // replay quantise alike, recording once.
  return Fp8LinearFunction::apply(input, weight, bias, scaling, at::GradMode::is_enabled());
}

}  // namespace megatorch::fp8
