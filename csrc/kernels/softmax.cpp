#include "megatorch/kernels/softmax.h"

#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_vec.h"
#include "dispatch.h"

namespace megatorch::kernels {
namespace {

struct Layout {
  int64_t batch, heads, sq, sk;
  const bool* mask = nullptr;
  int64_t ms[4] = {0, 0, 0, 0};  // mask strides over (b, h, q, k); 0 where broadcast
  bool causal = false;
};

// float, bf16, fp16: the vectorised row loops in fp32 (a float row is computed in place
// in the output).
template <typename T>
void cpu_forward_vec(const T* x, T* y, const Layout& l, float scale) {
  const int64_t rows = l.batch * l.heads * l.sq, sk = l.sk;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / sk), [&](int64_t r0, int64_t r1) {
    std::vector<float> bx(sk), by(sk);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t q = r % l.sq, h = (r / l.sq) % l.heads, b = r / (l.sq * l.heads);
      const bool* mrow = l.mask ? l.mask + b * l.ms[0] + h * l.ms[1] + q * l.ms[2] : nullptr;
      const int64_t limit = l.causal ? std::min(sk, q + 1) : sk;
      float* yr = detail::out_f32(y + r * sk, by.data());
      const float mx =
          vec::scale_mask_max(detail::load_f32(x + r * sk, sk, bx.data()), scale, mrow, l.ms[3], limit, yr, sk);
      if (mx == -std::numeric_limits<float>::infinity()) {  // every entry masked
        std::fill(yr, yr + sk, 0.0f);
      } else {
        vec::scale(yr, 1.0f / vec::exp_shift_sum(yr, mx, sk), sk);
      }
      detail::store_f32(yr, y + r * sk, sk);
    }
  });
}

template <typename T>
void cpu_forward(const T* x, T* y, const Layout& l, double scale_) {
  if constexpr (!std::is_same_v<T, double>) return cpu_forward_vec<T>(x, y, l, static_cast<float>(scale_));
  using A = detail::acc_t<T>;
  const A scale = static_cast<A>(scale_);
  const int64_t rows = l.batch * l.heads * l.sq, sk = l.sk;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / sk), [&](int64_t r0, int64_t r1) {
    std::vector<A> buf(sk);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t q = r % l.sq, h = (r / l.sq) % l.heads, b = r / (l.sq * l.heads);
      const bool* mrow = l.mask ? l.mask + b * l.ms[0] + h * l.ms[1] + q * l.ms[2] : nullptr;
      const int64_t limit = l.causal ? std::min(sk, q + 1) : sk;  // entries past it are masked
      const T* xr = x + r * sk;
      T* yr = y + r * sk;
      A mx = -std::numeric_limits<A>::infinity();
      for (int64_t k = 0; k < sk; ++k) {
        const bool masked = k >= limit || (mrow && mrow[k * l.ms[3]]);
        buf[k] = masked ? -std::numeric_limits<A>::infinity() : static_cast<A>(xr[k]) * scale;
        mx = std::max(mx, buf[k]);
      }
      if (mx == -std::numeric_limits<A>::infinity()) {  // every entry masked
        for (int64_t k = 0; k < sk; ++k) yr[k] = static_cast<T>(0);
        continue;
      }
      A sum = 0;
      for (int64_t k = 0; k < sk; ++k) {
        buf[k] = std::exp(buf[k] - mx);
        sum += buf[k];
      }
      const A inv = A(1) / sum;
      for (int64_t k = 0; k < sk; ++k) yr[k] = static_cast<T>(buf[k] * inv);
    }
  });
}

template <typename T>
void cpu_backward(const T* g, const T* y, T* dx, int64_t rows, int64_t sk, double scale_) {
  if constexpr (!std::is_same_v<T, double>) {
    return at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / sk), [&](int64_t r0, int64_t r1) {
      std::vector<float> bg(sk), by(sk), bd(sk);
      for (int64_t r = r0; r < r1; ++r) {
        float* d = detail::out_f32(dx + r * sk, bd.data());
        vec::softmax_backward(detail::load_f32(g + r * sk, sk, bg.data()), detail::load_f32(y + r * sk, sk, by.data()),
                              static_cast<float>(scale_), d, sk);
        detail::store_f32(d, dx + r * sk, sk);
      }
    });
  }
  using A = detail::acc_t<T>;
  const A scale = static_cast<A>(scale_);
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / sk), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = g + r * sk;
      const T* yr = y + r * sk;
      A dot = 0;
      for (int64_t k = 0; k < sk; ++k) dot += static_cast<A>(gr[k]) * static_cast<A>(yr[k]);
      for (int64_t k = 0; k < sk; ++k) {
        dx[r * sk + k] = static_cast<T>(scale * static_cast<A>(yr[k]) * (static_cast<A>(gr[k]) - dot));
      }
    }
  });
}

at::Tensor forward(const char* op, const at::Tensor& input_, const at::Tensor& mask_, Layout l, double scale) {
  const at::Tensor input = input_.contiguous();
  at::Tensor mask;
  if (mask_.defined()) {
    MEGATORCH_CHECK(mask_.scalar_type() == at::kBool && mask_.device() == input.device(), op,
                    ": expected a bool mask on ", input.device(), ", got ", mask_.scalar_type(), " on ",
                    mask_.device());
    MEGATORCH_CHECK(mask_.dim() <= 4, op, ": expected a mask broadcastable to ", input.sizes(), ", got ",
                    mask_.sizes());
    mask = mask_.expand({l.batch, l.heads, l.sq, l.sk});  // strides 0 where broadcast, no copy
    l.mask = mask.const_data_ptr<bool>();
    for (int i = 0; i < 4; ++i) l.ms[i] = mask.stride(i);
  }
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  if (input.is_cuda()) {
    detail::check_cuda_build(op);
#ifdef MEGATORCH_WITH_CUDA
    const c10::cuda::CUDAGuard guard(input.device());
    cuda::SoftmaxParams p{};
    p.input = input.const_data_ptr();
    p.mask = l.mask;
    p.mask_stride_b = l.ms[0], p.mask_stride_h = l.ms[1], p.mask_stride_q = l.ms[2], p.mask_stride_k = l.ms[3];
    p.out = out.data_ptr();
    p.batch = l.batch, p.heads = l.heads, p.sq = l.sq, p.sk = l.sk;
    p.scale = static_cast<float>(scale);
    p.causal = l.causal;
    p.dtype = detail::cuda_dtype(input.scalar_type(), op);
    cuda::softmax_forward(p, detail::stream_of(input));
    return out;
#endif
  }
  MEGATORCH_DISPATCH_FLOATS(input.scalar_type(), "softmax", [&] {
    cpu_forward<scalar_t>(input.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), l, scale);
  });
  return out;
}

using MaskedSig = at::Tensor(const at::Tensor&, const c10::optional<at::Tensor>&, double);
using CausalSig = at::Tensor(const at::Tensor&, double);
using BwdSig = at::Tensor(const at::Tensor&, const at::Tensor&, double);

template <bool kCausal>
class SoftmaxFunction : public torch::autograd::Function<SoftmaxFunction<kCausal>> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const c10::optional<at::Tensor>& mask, double scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor out =
        kCausal ? MEGATORCH_OP_HANDLE("megatorch::_scaled_upper_triang_masked_softmax_fwd", CausalSig).call(input, scale)
                : MEGATORCH_OP_HANDLE("megatorch::_scaled_masked_softmax_fwd", MaskedSig).call(input, mask, scale);
    ctx->save_for_backward({out});
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor out = ctx->get_saved_variables()[0];
    at::Tensor dx = MEGATORCH_OP_HANDLE("megatorch::_scaled_softmax_bwd", BwdSig)
                        .call(grads[0], out, ctx->saved_data["scale"].toDouble());
    return {dx, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor scaled_masked_softmax_forward(const at::Tensor& input, const c10::optional<at::Tensor>& mask,
                                         double scale) {
  MEGATORCH_CHECK(input.dim() == 4, "scaled_masked_softmax: expected input [b, heads, sq, sk], got ", input.sizes());
  Layout l{input.size(0), input.size(1), input.size(2), input.size(3)};
  return forward("scaled_masked_softmax", input, mask ? *mask : at::Tensor(), l, scale);
}

at::Tensor scaled_upper_triang_masked_softmax_forward(const at::Tensor& input, double scale) {
  MEGATORCH_CHECK(input.dim() == 3, "scaled_upper_triang_masked_softmax: expected input [b·heads, sq, sk], got ",
                  input.sizes());
  Layout l{input.size(0), 1, input.size(1), input.size(2)};
  l.causal = true;
  return forward("scaled_upper_triang_masked_softmax", input, at::Tensor(), l, scale);
}

at::Tensor scaled_softmax_backward(const at::Tensor& grad_, const at::Tensor& output_, double scale) {
  MEGATORCH_CHECK(grad_.sizes() == output_.sizes() && output_.dim() >= 1,
                  "scaled softmax backward: expected grad of the output's shape ", output_.sizes(), ", got ",
                  grad_.sizes());
  const at::Tensor out = output_.contiguous(), grad = grad_.to(out.scalar_type()).contiguous();
  at::Tensor dx = at::empty_like(out, at::MemoryFormat::Contiguous);
  if (dx.numel() == 0) return dx;
  const int64_t sk = out.size(-1), rows = detail::rows_of(out);
  if (out.is_cuda()) {
    detail::check_cuda_build("scaled softmax backward");
#ifdef MEGATORCH_WITH_CUDA
    const c10::cuda::CUDAGuard guard(out.device());
    cuda::SoftmaxParams p{};
    p.input = out.const_data_ptr();
    p.grad = grad.const_data_ptr();
    p.out = dx.data_ptr();
    p.batch = rows, p.heads = 1, p.sq = 1, p.sk = sk;
    p.scale = static_cast<float>(scale);
    p.dtype = detail::cuda_dtype(out.scalar_type(), "scaled softmax backward");
    cuda::softmax_backward(p, detail::stream_of(out));
    return dx;
#endif
  }
  MEGATORCH_DISPATCH_FLOATS(out.scalar_type(), "scaled_softmax_backward", [&] {
    cpu_backward<scalar_t>(grad.const_data_ptr<scalar_t>(), out.const_data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(),
                           rows, sk, scale);
  });
  return dx;
}

at::Tensor scaled_masked_softmax(const at::Tensor& input, const c10::optional<at::Tensor>& mask, double scale) {
  MEGATORCH_CHECK(input.dim() == 4, "scaled_masked_softmax: expected input [b, heads, sq, sk], got ", input.sizes());
  return SoftmaxFunction<false>::apply(input, mask, scale);
}

at::Tensor scaled_upper_triang_masked_softmax(const at::Tensor& input, double scale) {
  MEGATORCH_CHECK(input.dim() == 3, "scaled_upper_triang_masked_softmax: expected input [b·heads, sq, sk], got ",
                  input.sizes());
  return SoftmaxFunction<true>::apply(input, c10::nullopt, scale);
}

}  // namespace megatorch::kernels
