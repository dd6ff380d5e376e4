#include "megatorch/kernels/norms.h"

#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "dispatch.h"

namespace megatorch::kernels {
namespace {

void check(const char* op, const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  MEGATORCH_CHECK(input.dim() >= 1 && weight.dim() == 1 && weight.size(0) == input.size(-1), op,
                  ": expected weight of shape [input.shape[-1]] = [", input.dim() ? input.size(-1) : 0, "], got ",
                  weight.sizes());
  MEGATORCH_CHECK(!bias || bias->sizes() == weight.sizes(), op, ": expected bias of shape ", weight.sizes(), ", got ",
                  bias ? bias->sizes() : at::IntArrayRef{});
  MEGATORCH_CHECK(weight.device() == input.device() && (!bias || bias->device() == input.device()), op,
                  ": expected weight and bias on the input's device ", input.device());
}

at::ScalarType acc_dtype(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor empty_stats(const at::Tensor& input) {
  return at::empty(input.sizes().slice(0, input.dim() - 1), input.options().dtype(acc_dtype(input)));
}

// Weights arrive in the accumulation type A (converted once per call).
// float, bf16, fp16: vectorised row loops.
template <typename T>
void cpu_forward_vec(const T* x, const float* w, const float* b, T* y, float* mean, float* rstd, int64_t rows,
                     int64_t cols, double eps, bool rms) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / cols), [&](int64_t r0, int64_t r1) {
    std::vector<float> bx(cols), by(cols);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = detail::load_f32(x + r * cols, cols, bx.data());
      // Two passes over the cached row in fp32: the mean, then Σ (x - mean)² (no cancellation).
      const float m = rms ? 0.0f : vec::sum(xr, cols) / static_cast<float>(cols);
      const double var = static_cast<double>(vec::sq_dev_sum(xr, m, cols)) / cols;
      const float rs = static_cast<float>(1.0 / std::sqrt(var + eps));
      if (mean) mean[r] = m;
      rstd[r] = rs;
      float* yr = detail::out_f32(y + r * cols, by.data());
      vec::normalize(xr, m, rs, w, b, yr, cols);
      detail::store_f32(yr, y + r * cols, cols);
    }
  });
}

template <typename T, typename A = detail::acc_t<T>>
void cpu_forward(const T* x, const A* w, const A* b, T* y, A* mean, A* rstd, int64_t rows, int64_t cols, double eps,
                 bool rms) {
  if constexpr (!std::is_same_v<T, double>) return cpu_forward_vec<T>(x, w, b, y, mean, rstd, rows, cols, eps, rms);
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      T* yr = y + r * cols;
      // Row sums in double: one pass, no cancellation worth speaking of at these lengths.
      double s1 = 0, s2 = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double v = static_cast<A>(xr[c]);
        s1 += v;
        s2 += v * v;
      }
      const double mu = rms ? 0.0 : s1 / cols;
      const double var = rms ? s2 / cols : std::max(s2 / cols - mu * mu, 0.0);
      const A m = static_cast<A>(mu), rs = static_cast<A>(1.0 / std::sqrt(var + eps));
      if (mean) mean[r] = m;
      rstd[r] = rs;
      for (int64_t c = 0; c < cols; ++c) {
        const A v = (static_cast<A>(xr[c]) - m) * rs * w[c];
        yr[c] = static_cast<T>(b ? v + b[c] : v);
      }
    }
  });
}

// dx = rstd·(g·w - mean(g·w) - x̂·mean(g·w·x̂)) (LayerNorm; RMSNorm drops the middle
// term), dw = Σ_rows g·x̂, db = Σ_rows g. Partial sums per chunk of rows, then summed
// in chunk order: deterministic for any thread count.
template <typename T, typename A = detail::acc_t<T>>
void cpu_backward(const T* g, const T* x, const A* mean, const A* rstd, const A* w, T* dx, A* dw_part, A* db_part,
                  int64_t rows, int64_t cols, int64_t chunks, bool rms) {
  const int64_t per = (rows + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      A* dwp = dw_part + k * cols;
      A* dbp = db_part + k * cols;
      std::fill(dwp, dwp + cols, A(0));
      std::fill(dbp, dbp + cols, A(0));
      for (int64_t r = k * per; r < std::min(rows, (k + 1) * per); ++r) {
        if constexpr (std::is_same_v<T, float>) {  // the vectorised row (cpu_vec.cpp)
          vec::norm_backward_row(x + r * cols, g + r * cols, w, rms ? 0.0f : mean[r], rstd[r], dx + r * cols, dwp, dbp,
                                 cols, rms);
          continue;
        }
        const T* xr = x + r * cols;
        const T* gr = g + r * cols;
        const A m = rms ? A(0) : mean[r], rs = rstd[r];
        A sum_gw = 0, sum_gwx = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const A xh = (static_cast<A>(xr[c]) - m) * rs, gv = static_cast<A>(gr[c]);
          sum_gw += gv * w[c];
          sum_gwx += gv * w[c] * xh;
          dwp[c] += gv * xh;
          dbp[c] += gv;
        }
        const A a = rms ? A(0) : sum_gw / cols, bq = sum_gwx / cols;
        for (int64_t c = 0; c < cols; ++c) {
          const A xh = (static_cast<A>(xr[c]) - m) * rs;
          dx[r * cols + c] = static_cast<T>(rs * (static_cast<A>(gr[c]) * w[c] - a - xh * bq));
        }
      }
    }
  });
}

#ifdef MEGATORCH_WITH_CUDA
// The CUDA kernels take weight and bias as they come when they are fp32 or of the input's
// dtype (no conversion per call); any other combination is converted to fp32 once here.
std::pair<at::Tensor, at::Tensor> cuda_weight_and_bias(const at::Tensor& input, const at::Tensor& weight,
                                                       const c10::optional<at::Tensor>& bias) {
  const at::ScalarType wt = weight.scalar_type();
  const bool as_is = (wt == at::kFloat || wt == input.scalar_type()) && (!bias || bias->scalar_type() == wt);
  const at::ScalarType t = as_is ? wt : at::kFloat;
  return {weight.to(t).contiguous(), bias ? bias->to(t).contiguous() : at::Tensor()};
}

cuda::NormParams cuda_params(const char* op, const at::Tensor& input, const at::Tensor& w, const at::Tensor& b,
                             bool rms) {
  cuda::NormParams p{};
  p.input = input.const_data_ptr();
  p.weight = w.const_data_ptr();
  p.bias = b.defined() ? b.const_data_ptr() : nullptr;
  p.rows = detail::rows_of(input), p.cols = input.size(-1), p.rms = rms;
  p.dtype = detail::cuda_dtype(input.scalar_type(), op);
  p.weight_dtype = detail::cuda_dtype(w.scalar_type(), op);
  return p;
}
#endif

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const char* op, const at::Tensor& input_,
                                                       const at::Tensor& weight,
                                                       const c10::optional<at::Tensor>& bias_, double eps, bool rms) {
  check(op, input_, weight, bias_);
  const at::Tensor input = input_.contiguous();
  if (input.is_cuda()) {
    detail::check_cuda_build(op);
#ifdef MEGATORCH_WITH_CUDA
    const c10::cuda::CUDAGuard guard(input.device());
    at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
    at::Tensor mean = rms ? at::empty({0}, input.options().dtype(at::kFloat)) : empty_stats(input);
    at::Tensor rstd = empty_stats(input);
    if (detail::rows_of(input) == 0) return {out, mean, rstd};
    const auto [w, b] = cuda_weight_and_bias(input, weight, bias_);
    cuda::NormParams p = cuda_params(op, input, w, b, rms);
    p.out = out.data_ptr();
    p.mean = rms ? nullptr : mean.data_ptr<float>();
    p.rstd = rstd.data_ptr<float>();
    p.eps = static_cast<float>(eps);
    cuda::norm_forward(p, detail::stream_of(input));
    return {out, mean, rstd};
#endif
  }
  const at::Tensor w = weight.to(acc_dtype(input)).contiguous();
  const at::Tensor b = bias_ ? bias_->to(acc_dtype(input)).contiguous() : at::Tensor();
  if (!rms && input.is_cpu() && input.scalar_type() != at::kDouble) {
    const auto stats_shape = input.sizes().slice(0, input.dim() - 1);
    // ATen's CPU LayerNorm is already one fused, vectorised pass (mixed 16-bit input and
    // fp32 weight included): use it, keeping fp32 statistics of the shape ours have.
    // (Before allocating anything: a second live output buffer costs page faults.)
    const c10::optional<at::Tensor> b_opt = b.defined() ? c10::optional<at::Tensor>(b) : c10::nullopt;
    auto [y, mu, rs] = at::native_layer_norm(input, {input.size(-1)}, w, b_opt, eps);
    return {y.contiguous(), mu.reshape(stats_shape).to(at::kFloat), rs.reshape(stats_shape).to(at::kFloat)};
  }
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  at::Tensor mean = rms ? at::empty({0}, input.options().dtype(acc_dtype(input))) : empty_stats(input);
  at::Tensor rstd = empty_stats(input);
  const int64_t rows = detail::rows_of(input), cols = input.size(-1);
  if (rows == 0) return {out, mean, rstd};
  MEGATORCH_DISPATCH_FLOATS(input.scalar_type(), "norm", [&] {
    using A = detail::acc_t<scalar_t>;
    cpu_forward<scalar_t>(input.const_data_ptr<scalar_t>(), w.const_data_ptr<A>(),
                          b.defined() ? b.const_data_ptr<A>() : nullptr, out.data_ptr<scalar_t>(),
                          rms ? nullptr : mean.data_ptr<A>(), rstd.data_ptr<A>(), rows, cols, eps, rms);
  });
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const char* op, const at::Tensor& grad_,
                                                        const at::Tensor& input_, const at::Tensor& mean,
                                                        const at::Tensor& rstd, const at::Tensor& weight, bool rms) {
  check(op, input_, weight, c10::nullopt);
  MEGATORCH_CHECK(grad_.sizes() == input_.sizes(), op, " backward: expected grad of shape ", input_.sizes(), ", got ",
                  grad_.sizes());
  const at::Tensor input = input_.contiguous(), grad = grad_.to(input.scalar_type()).contiguous();
  const at::Tensor m = rms ? at::Tensor() : mean.contiguous(), rs = rstd.contiguous();
  const int64_t rows = detail::rows_of(input), cols = input.size(-1);
  if (!rms && rows > 0 && input.is_cpu() && input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat) {
    // The forward on CPU is ATen's LayerNorm, and so is the backward: one vectorised pass
    // per row, with its own reduction of the weight and bias gradients (measured faster
    // than the per-row loop below plus the partial sums' reduction at small widths). Its
    // statistics are ours with a trailing 1; its bias argument only gives the bias
    // gradient's shape and dtype, which are the weight's.
    std::vector<int64_t> stats = input.sizes().vec();
    stats.back() = 1;
    const at::Tensor w = weight.contiguous();
    return at::native_layer_norm_backward(grad, input, {cols}, m.reshape(stats), rs.reshape(stats), w, w,
                                          {true, true, true});
  }
  at::Tensor dx = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (rows == 0) return {dx, at::zeros_like(weight), at::zeros_like(weight)};
  if (input.is_cuda()) {
    detail::check_cuda_build(op);
#ifdef MEGATORCH_WITH_CUDA
    const c10::cuda::CUDAGuard guard(input.device());
    MEGATORCH_CHECK((rms || m.scalar_type() == at::kFloat) && rs.scalar_type() == at::kFloat, op,
                    " backward: expected fp32 statistics on CUDA, got ", rs.scalar_type());
    const at::Tensor w = cuda_weight_and_bias(input, weight, c10::nullopt).first;
    cuda::NormParams p = cuda_params(op, input, w, at::Tensor(), rms);
    p.grad = grad.const_data_ptr();
    p.out = dx.data_ptr();
    p.mean = rms ? nullptr : const_cast<float*>(m.const_data_ptr<float>());
    p.rstd = const_cast<float*>(rs.const_data_ptr<float>());
    // The kernel's per-block partial sums (fp32, [partial_rows, cols] for the weight and,
    // LayerNorm, the bias), reduced by its second kernel straight into dw and db.
    p.partial_rows = cuda::norm_backward_partial_rows(p);
    at::Tensor partial = at::empty({rms ? 1 : 2, p.partial_rows, cols}, input.options().dtype(at::kFloat));
    at::Tensor dw = at::empty({cols}, w.options()), db = rms ? at::Tensor() : at::empty({cols}, w.options());
    p.grad_weight_partial = partial[0].data_ptr<float>();
    p.grad_bias_partial = rms ? nullptr : partial[1].data_ptr<float>();
    p.grad_weight = dw.data_ptr();
    p.grad_bias = rms ? nullptr : db.data_ptr();
    cuda::norm_backward(p, detail::stream_of(input));
    return {dx, dw.to(weight.scalar_type()), rms ? db : db.to(weight.scalar_type())};
#endif
  }
  const at::Tensor w = weight.to(acc_dtype(input)).contiguous();
  const int64_t chunks = std::min<int64_t>(rows, 32);
  at::Tensor dw_part = at::empty({chunks, cols}, w.options()), db_part = at::empty({chunks, cols}, w.options());
  MEGATORCH_DISPATCH_FLOATS(input.scalar_type(), "norm", [&] {
    using A = detail::acc_t<scalar_t>;
    cpu_backward<scalar_t>(grad.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                           rms ? nullptr : m.const_data_ptr<A>(), rs.const_data_ptr<A>(), w.const_data_ptr<A>(),
                           dx.data_ptr<scalar_t>(), dw_part.data_ptr<A>(), db_part.data_ptr<A>(), rows, cols, chunks,
                           rms);
  });
  return {dx, dw_part.sum(0).to(weight.scalar_type()), db_part.sum(0).to(weight.scalar_type())};
}

using LnFwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                             const c10::optional<at::Tensor>&, double);
using LnBwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, const at::Tensor&);
using RmsFwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double);
using RmsBwd = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&);

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mean, rstd] = MEGATORCH_OP_HANDLE("megatorch::_layer_norm_fwd", LnFwd).call(input, weight, bias, eps);
    ctx->save_for_backward({input, weight, mean, rstd});
    ctx->saved_data["has_bias"] = bias.has_value();
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [dx, dw, db] = MEGATORCH_OP_HANDLE("megatorch::_layer_norm_bwd", LnBwd).call(grads[0], s[0], s[2], s[3], s[1]);
    return {dx, dw, ctx->saved_data["has_bias"].toBool() ? db : at::Tensor(), at::Tensor()};
  }
};

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rstd] = MEGATORCH_OP_HANDLE("megatorch::_rms_norm_fwd", RmsFwd).call(input, weight, eps);
    ctx->save_for_backward({input, weight, rstd});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [dx, dw] = MEGATORCH_OP_HANDLE("megatorch::_rms_norm_bwd", RmsBwd).call(grads[0], s[0], s[2], s[1]);
    return {dx, dw, at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(const at::Tensor& input, const at::Tensor& weight,
                                                                  const c10::optional<at::Tensor>& bias, double eps) {
  return forward("layer_norm", input, weight, bias, eps, false);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& grad, const at::Tensor& input,
                                                                   const at::Tensor& mean, const at::Tensor& rstd,
                                                                   const at::Tensor& weight) {
  return backward("layer_norm", grad, input, mean, rstd, weight, false);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& input, const at::Tensor& weight, double eps) {
  auto [out, mean, rstd] = forward("rms_norm", input, weight, c10::nullopt, eps, true);
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad, const at::Tensor& input,
                                                     const at::Tensor& rstd, const at::Tensor& weight) {
  auto [dx, dw, db] = backward("rms_norm", grad, input, at::Tensor(), rstd, weight, true);
  return {dx, dw};
}

at::Tensor layer_norm(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      double eps) {
  check("layer_norm", input, weight, bias);
  return LayerNormFunction::apply(input, weight, bias, eps);
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  check("rms_norm", input, weight, c10::nullopt);
  return RmsNormFunction::apply(input, weight, eps);
}

}  // namespace megatorch::kernels
