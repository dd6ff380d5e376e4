#include "megatorch/kernels/bias_dropout_add.h"

#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include "dispatch.h"

#ifdef MEGATORCH_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#endif

namespace megatorch::kernels {
namespace {

void check(const at::Tensor& input, const c10::optional<at::Tensor>& bias, const at::Tensor& residual, double p) {
  MEGATORCH_CHECK(residual.sizes() == input.sizes() && residual.scalar_type() == input.scalar_type() &&
                      residual.device() == input.device(),
                  "bias_dropout_add: expected residual with the input's shape, dtype and device (", input.sizes(), ", ",
                  input.scalar_type(), ", ", input.device(), "), got ", residual.sizes(), ", ",
                  residual.scalar_type(), ", ", residual.device());
  MEGATORCH_CHECK(!bias || (input.dim() >= 1 && bias->dim() == 1 && bias->size(0) == input.size(-1) &&
                            bias->scalar_type() == input.scalar_type() && bias->device() == input.device()),
                  "bias_dropout_add: expected bias [input.shape[-1]] with the input's dtype and device, got ",
                  bias ? bias->sizes() : at::IntArrayRef{}, " for input ", input.sizes());
  MEGATORCH_CHECK(p >= 0 && p < 1, "bias_dropout_add: expected a dropout probability in [0, 1), got ", p);
}

double keep_scale(double p) { return 1.0 / (1.0 - p); }

template <typename T>
void cpu_kernel(const T* x, const T* b, const T* res, const T* noise, T* out, bool* mask, int64_t rows, int64_t cols,
                double p) {
  using A = detail::acc_t<T>;
  // at::dropout scales the noise in the input's dtype: noise / (1 - p).
  const A scale = static_cast<A>(static_cast<T>(A(1) / static_cast<A>(1 - p)));
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t i = r * cols + c;
        A v = static_cast<A>(x[i]);
        if (b) v = static_cast<A>(static_cast<T>(v + static_cast<A>(b[c])));
        if (noise) {
          const bool keep = static_cast<A>(noise[i]) != A(0);
          mask[i] = keep;
          v = keep ? static_cast<A>(static_cast<T>(v * scale)) : A(0);
        }
        out[i] = static_cast<T>(static_cast<A>(res[i]) + v);
      }
    }
  });
}

using FwdSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const c10::optional<at::Tensor>&,
                                                  const at::Tensor&, double, bool);

class BiasDropoutAddFunction : public torch::autograd::Function<BiasDropoutAddFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const c10::optional<at::Tensor>& bias, const at::Tensor& residual, double p, bool train) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mask] =
        MEGATORCH_OP_HANDLE("megatorch::_bias_dropout_add_fwd", FwdSig).call(input, bias, residual, p, train);
    ctx->save_for_backward({mask});
    ctx->saved_data["scale"] = keep_scale(p);
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->mark_non_differentiable({mask});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor mask = ctx->get_saved_variables()[0];
    const at::Tensor& g = grads[0];
    // grad of input = g·keep/(1-p): ATen operators, no kernel of its own. The scale is the
    // forward's, rounded to the gradient's dtype (a 0-dim host tensor of it, read as a
    // scalar even for CUDA gradients), as eager dropout's mask-times-scale is both ways.
    const at::Tensor gi =
        mask.numel() == 0 ? g : g * mask * at::scalar_tensor(ctx->saved_data["scale"].toDouble(),
                                                                     g.options().device(at::kCPU));
    at::Tensor gb;
    if (ctx->saved_data["has_bias"].toBool()) {
      std::vector<int64_t> lead(gi.dim() - 1);
      for (size_t i = 0; i < lead.size(); ++i) lead[i] = static_cast<int64_t>(i);
      gb = lead.empty() ? gi : gi.sum(lead);
    }
    return {gi, gb, g, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> bias_dropout_add_forward(const at::Tensor& input_,
                                                            const c10::optional<at::Tensor>& bias_,
                                                            const at::Tensor& residual_, double p, bool train) {
  check(input_, bias_, residual_, p);
  const at::Tensor input = input_.contiguous(), residual = residual_.contiguous();
  const at::Tensor bias = bias_ ? bias_->contiguous() : at::Tensor();
  const bool drop = train && p > 0;
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  at::Tensor mask = at::empty(drop ? input.sizes() : at::IntArrayRef{0}, input.options().dtype(at::kBool));
  const int64_t cols = input.dim() ? input.size(-1) : 1, rows = input.dim() ? detail::rows_of(input) : 1;
  if (out.numel() == 0) return {out, mask};
  if (input.is_cuda()) {
    detail::check_cuda_build("bias_dropout_add");
#ifdef MEGATORCH_WITH_CUDA
    const c10::cuda::CUDAGuard guard(input.device());
    cuda::BiasDropoutAddParams prm{};
    prm.input = input.const_data_ptr();
    prm.bias = bias.defined() ? bias.const_data_ptr() : nullptr;
    prm.residual = residual.const_data_ptr();
    prm.out = out.data_ptr();
    prm.mask = drop ? mask.data_ptr<bool>() : nullptr;
    prm.rows = rows;
    prm.cols = cols;
    prm.keep_prob = static_cast<float>(1 - p);
    prm.dtype = detail::cuda_dtype(input.scalar_type(), "bias_dropout_add");
    if (drop) {
      auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(c10::nullopt,
                                                                       at::cuda::detail::getDefaultCUDAGenerator());
      std::lock_guard<std::mutex> lock(gen->mutex_);
      // Element i takes its draw from Philox subsequence i / 4 at this offset: one 128-bit
      // block (4 values) per subsequence, whatever the size (cuda/params.h).
      const at::PhiloxCudaState st = gen->philox_cuda_state(cuda::kBiasDropoutAddPhiloxIncrement);
      MEGATORCH_CHECK(!st.captured_, "bias_dropout_add: CUDA graph capture is not supported by the fused dropout; "
                                     "run it eagerly");
      prm.seed = st.seed_.val;
      prm.offset = st.offset_.val;
    }
    cuda::bias_dropout_add_forward(prm, detail::stream_of(input));
    return {out, mask};
#endif
  }
  // The draws of at::dropout on CPU: Bernoulli(1 - p) into a tensor like the input.
  const at::Tensor noise = drop ? at::empty_like(input).bernoulli_(1 - p) : at::Tensor();
  MEGATORCH_DISPATCH_FLOATS(input.scalar_type(), "bias_dropout_add", [&] {
    cpu_kernel<scalar_t>(input.const_data_ptr<scalar_t>(), bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
                         residual.const_data_ptr<scalar_t>(), drop ? noise.const_data_ptr<scalar_t>() : nullptr,
                         out.data_ptr<scalar_t>(), drop ? mask.data_ptr<bool>() : nullptr, rows, cols, p);
  });
  return {out, mask};
}

at::Tensor bias_dropout_add(const at::Tensor& input, const c10::optional<at::Tensor>& bias, const at::Tensor& residual,
                            double p, bool train) {
  check(input, bias, residual, p);
  return BiasDropoutAddFunction::apply(input, bias, residual, p, train);
}

}  // namespace megatorch::kernels
