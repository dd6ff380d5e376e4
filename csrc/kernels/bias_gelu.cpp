#include "megatorch/kernels/bias_gelu.h"

#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cmath>
#include <vector>

#include "cpu_vec.h"
#include "dispatch.h"

namespace megatorch::kernels {
namespace {

constexpr double kAlpha = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kBeta = 0.044715;

void check(const at::Tensor& input, const at::Tensor& bias) {
  MEGATORCH_CHECK(input.dim() >= 1 && bias.dim() == 1 && bias.size(0) == input.size(-1),
                  "bias_gelu: expected bias of shape [input.shape[-1]] = [", input.dim() ? input.size(-1) : 0,
                  "], got ", bias.sizes());
  MEGATORCH_CHECK(bias.scalar_type() == input.scalar_type() && bias.device() == input.device(),
                  "bias_gelu: expected bias with the input's dtype and device (", input.scalar_type(), ", ",
                  input.device(), "), got ", bias.scalar_type(), ", ", bias.device());
}

// float, bf16, fp16: the vectorised row loops in fp32.
template <typename T, bool kBackward>
void cpu_kernel_vec(const T* x, const T* b, const T* g, T* out, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> bx(cols), bb(cols), bg(kBackward ? cols : 0), by(cols);
    const float* bf = detail::load_f32(b, cols, bb.data());
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * cols;
      const float* xr = detail::load_f32(x + o, cols, bx.data());
      float* yr = detail::out_f32(out + o, by.data());
      if constexpr (kBackward) {
        vec::bias_gelu_backward(xr, bf, detail::load_f32(g + o, cols, bg.data()), yr, cols);
      } else {
        vec::bias_gelu(xr, bf, yr, cols);
      }
      detail::store_f32(yr, out + o, cols);
    }
  });
}

// double (gradcheck): plain loops.
template <typename T, bool kBackward>
void cpu_kernel(const T* x, const T* b, const T* g, T* out, int64_t rows, int64_t cols) {
  if constexpr (!std::is_same_v<T, double>) return cpu_kernel_vec<T, kBackward>(x, b, g, out, rows, cols);
  using A = detail::acc_t<T>;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        const A u = static_cast<A>(x[o + c]) + static_cast<A>(b[c]);
        const A t = std::tanh(A(kAlpha) * (u + A(kBeta) * u * u * u));
        if constexpr (!kBackward) {
          out[o + c] = static_cast<T>(A(0.5) * u * (A(1) + t));
        } else {
          const A d = A(0.5) * (A(1) + t) + A(0.5) * u * (A(1) - t * t) * A(kAlpha) * (A(1) + A(3 * kBeta) * u * u);
          out[o + c] = static_cast<T>(static_cast<A>(g[o + c]) * d);
        }
      }
    }
  });
}

at::Tensor run(const at::Tensor* grad, const at::Tensor& input_, const at::Tensor& bias_) {
  check(input_, bias_);
  const at::Tensor input = input_.contiguous(), bias = bias_.contiguous();
  const at::Tensor g = grad ? grad->contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  const int64_t rows = detail::rows_of(input), cols = input.size(-1);
  if (out.numel() == 0) return out;
  if (input.is_cuda()) {
    detail::check_cuda_build("bias_gelu");
#ifdef MEGATORCH_WITH_CUDA
    const c10::cuda::CUDAGuard guard(input.device());
    cuda::BiasGeluParams p{input.const_data_ptr(), bias.const_data_ptr(), grad ? g.const_data_ptr() : nullptr,
                           out.data_ptr(), rows, cols, detail::cuda_dtype(input.scalar_type(), "bias_gelu")};
    grad ? cuda::bias_gelu_backward(p, detail::stream_of(input)) : cuda::bias_gelu_forward(p, detail::stream_of(input));
    return out;
#endif
  }
  MEGATORCH_DISPATCH_FLOATS(input.scalar_type(), "bias_gelu", [&] {
    if (grad) {
      cpu_kernel<scalar_t, true>(input.const_data_ptr<scalar_t>(), bias.const_data_ptr<scalar_t>(),
                                 g.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, cols);
    } else {
      cpu_kernel<scalar_t, false>(input.const_data_ptr<scalar_t>(), bias.const_data_ptr<scalar_t>(), nullptr,
                                  out.data_ptr<scalar_t>(), rows, cols);
    }
  });
  return out;
}

using FwdSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using BwdSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

class BiasGeluFunction : public torch::autograd::Function<BiasGeluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({input, bias});
    return MEGATORCH_OP_HANDLE("megatorch::_bias_gelu_fwd", FwdSig).call(input, bias);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor gi = MEGATORCH_OP_HANDLE("megatorch::_bias_gelu_bwd", BwdSig).call(grads[0], saved[0], saved[1]);
    std::vector<int64_t> lead(gi.dim() - 1);
    for (size_t i = 0; i < lead.size(); ++i) lead[i] = static_cast<int64_t>(i);
    at::Tensor gb = lead.empty() ? gi : gi.sum(lead);
    return {gi, gb};
  }
};

}  // namespace

at::Tensor bias_gelu_forward(const at::Tensor& input, const at::Tensor& bias) { return run(nullptr, input, bias); }

at::Tensor bias_gelu_backward(const at::Tensor& grad, const at::Tensor& input, const at::Tensor& bias) {
  MEGATORCH_CHECK(grad.sizes() == input.sizes(), "bias_gelu backward: expected grad of shape ", input.sizes(), ", got ",
                  grad.sizes());
  return run(&grad, input, bias);
}

at::Tensor bias_gelu(const at::Tensor& input, const at::Tensor& bias) {
  check(input, bias);
  return BiasGeluFunction::apply(input, bias);
}

}  // namespace megatorch::kernels
