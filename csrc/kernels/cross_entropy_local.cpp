#include "megatorch/kernels/cross_entropy_local.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu_vec.h"
#include "dispatch.h"

namespace megatorch::kernels {
namespace {

// float, bf16, fp16: vectorised passes over the row in fp32 (max, then Σ exp and Σ x;
// the row stays in cache between them).
template <typename T>
void cpu_kernel_vec(const T* x, const int64_t* target, float* mx, float* se, float* tl, float* sl, int64_t rows,
                    int64_t cols, int64_t start, int64_t real) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(real);
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = detail::load_f32(x + r * cols, real, buf.data());
      const float m = vec::max(xr, real);
      mx[r] = m;
      se[r] = real > 0 ? vec::exp_sum(xr, m, real) : 0.0f;
      sl[r] = vec::sum(xr, real);
      const int64_t t = target[r] - start;
      tl[r] = t >= 0 && t < cols ? static_cast<float>(x[r * cols + t]) : 0.0f;
    }
  });
}

template <typename T, typename A = detail::acc_t<T>>
void cpu_kernel(const T* x, const int64_t* target, A* mx, A* se, A* tl, A* sl, int64_t rows, int64_t cols,
                int64_t start, int64_t real) {
  if constexpr (!std::is_same_v<T, double>) {
    return cpu_kernel_vec<T>(x, target, mx, se, tl, sl, rows, cols, start, real);
  }
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(cols, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * cols;
      // Online max and sum of exps: one read of the row.
      A m = -std::numeric_limits<A>::infinity(), s = 0, sum = 0;
      for (int64_t c = 0; c < real; ++c) {
        const A v = static_cast<A>(xr[c]);
        if (v > m) {
          s = s * std::exp(m - v) + A(1);
          m = v;
        } else {
          s += std::exp(v - m);
        }
        sum += v;
      }
      const int64_t t = target[r] - start;
      mx[r] = m;
      se[r] = s;
      sl[r] = sum;
      tl[r] = t >= 0 && t < cols ? static_cast<A>(xr[t]) : A(0);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_local(const at::Tensor& logits_,
                                                                               const at::Tensor& target_,
                                                                               int64_t vocab_start, int64_t real_cols) {
  MEGATORCH_CHECK(logits_.dim() >= 1 && target_.sizes() == logits_.sizes().slice(0, logits_.dim() - 1),
                  "cross_entropy_local: expected target of shape logits.shape[:-1] = ",
                  logits_.sizes().slice(0, logits_.dim() ? logits_.dim() - 1 : 0), ", got ", target_.sizes());
  MEGATORCH_CHECK(target_.scalar_type() == at::kLong && target_.device() == logits_.device(),
                  "cross_entropy_local: expected int64 targets on ", logits_.device(), ", got ",
                  target_.scalar_type(), " on ", target_.device());
  const int64_t cols = logits_.size(-1);
  MEGATORCH_CHECK(real_cols >= 0 && real_cols <= cols, "cross_entropy_local: expected 0 <= real_cols <= ", cols,
                  ", got ", real_cols);
  const at::Tensor logits = logits_.contiguous(), target = target_.contiguous();
  const auto opts = logits.options().dtype(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  const auto shape = target.sizes();
  at::Tensor mx = at::empty(shape, opts), se = at::empty(shape, opts), tl = at::empty(shape, opts),
             sl = at::empty(shape, opts);
  const int64_t rows = target.numel();
  if (rows == 0) return {mx, se, tl, sl};
  if (logits.is_cuda()) {
    detail::check_cuda_build("cross_entropy_local");
#ifdef MEGATORCH_WITH_CUDA
    const c10::cuda::CUDAGuard guard(logits.device());
    cuda::CrossEntropyLocalParams p{logits.const_data_ptr(), target.const_data_ptr<int64_t>(), mx.data_ptr<float>(),
                                    se.data_ptr<float>(), tl.data_ptr<float>(), sl.data_ptr<float>(), rows, cols,
                                    vocab_start, real_cols,
                                    detail::cuda_dtype(logits.scalar_type(), "cross_entropy_local")};
    cuda::cross_entropy_local(p, detail::stream_of(logits));
    return {mx, se, tl, sl};
#endif
  }
  MEGATORCH_DISPATCH_FLOATS(logits.scalar_type(), "cross_entropy_local", [&] {
    using A = detail::acc_t<scalar_t>;
    cpu_kernel<scalar_t>(logits.const_data_ptr<scalar_t>(), target.const_data_ptr<int64_t>(), mx.data_ptr<A>(),
                         se.data_ptr<A>(), tl.data_ptr<A>(), sl.data_ptr<A>(), rows, cols, vocab_start, real_cols);
  });
  return {mx, se, tl, sl};
}

at::Tensor cross_entropy_backward_cuda(const at::Tensor& grad_loss_, const at::Tensor& logits_,
                                       const at::Tensor& target_, const at::Tensor& log_sum_exp_,
                                       int64_t vocab_start, int64_t real_cols, int64_t vocab_real,
                                       double label_smoothing, int64_t ignore_index) {
  const auto row_shape = logits_.sizes().slice(0, logits_.dim() ? logits_.dim() - 1 : 0);
  MEGATORCH_CHECK(logits_.dim() >= 1 && target_.sizes() == row_shape,
                  "cross_entropy_backward: expected target of shape logits.shape[:-1] = ", row_shape, ", got ",
                  target_.sizes());
  MEGATORCH_CHECK(grad_loss_.sizes() == target_.sizes() && log_sum_exp_.sizes() == target_.sizes(),
                  "cross_entropy_backward: expected grad_loss and log_sum_exp of the target's shape ",
                  target_.sizes(), ", got ", grad_loss_.sizes(), " and ", log_sum_exp_.sizes());
  MEGATORCH_CHECK(logits_.is_cuda(), "cross_entropy_backward: expected logits on a CUDA device, got ",
                  logits_.device(), " (the CPU backward is tp::vocab_parallel_cross_entropy_backward's ATen chain)");
  MEGATORCH_CHECK(target_.device() == logits_.device() && grad_loss_.device() == logits_.device() &&
                      log_sum_exp_.device() == logits_.device(),
                  "cross_entropy_backward: expected every tensor on ", logits_.device(), ", got target on ",
                  target_.device(), ", grad_loss on ", grad_loss_.device(), ", log_sum_exp on ",
                  log_sum_exp_.device());
  MEGATORCH_CHECK(target_.scalar_type() == at::kLong, "cross_entropy_backward: expected int64 targets, got ",
                  target_.scalar_type());
  const int64_t cols = logits_.size(-1);
  MEGATORCH_CHECK(real_cols >= 0 && real_cols <= cols, "cross_entropy_backward: expected 0 <= real_cols <= ", cols,
                  ", got ", real_cols);
  MEGATORCH_CHECK(vocab_real >= 1, "cross_entropy_backward: expected a real vocabulary size >= 1, got ", vocab_real);
  MEGATORCH_CHECK(label_smoothing >= 0 && label_smoothing < 1,
                  "cross_entropy_backward: expected label_smoothing in [0, 1), got ", label_smoothing);
  detail::check_cuda_build("cross_entropy_backward");
#ifdef MEGATORCH_WITH_CUDA
  const c10::cuda::CUDAGuard guard(logits_.device());
  const cuda::DType dtype = detail::cuda_dtype(logits_.scalar_type(), "cross_entropy_backward");
  const at::Tensor logits = logits_.contiguous(), target = target_.contiguous();
  // fp32 like the ATen chain's grad_loss.to(float) and its fp32 arithmetic; [rows] each.
  const at::Tensor grad_loss = grad_loss_.to(at::kFloat).contiguous();
  const at::Tensor lse = log_sum_exp_.to(at::kFloat).contiguous();
  at::Tensor grad = at::empty(logits.sizes(), logits.options());  // fresh: the saved logits stay as they are
  const int64_t rows = target.numel();
  if (rows == 0 || cols == 0) return grad;
  // The weights rounded to fp32 as the chain rounds them: (1 - ε) as a float scalar of a
  // float multiply, ε / K (in double) as the value of a float tensor.
  cuda::CrossEntropyBackwardParams p{logits.const_data_ptr(),
                                     target.const_data_ptr<int64_t>(),
                                     lse.const_data_ptr<float>(),
                                     grad_loss.const_data_ptr<float>(),
                                     grad.data_ptr(),
                                     rows,
                                     cols,
                                     vocab_start,
                                     real_cols,
                                     ignore_index,
                                     static_cast<float>(1 - label_smoothing),
                                     label_smoothing > 0 ? static_cast<float>(label_smoothing / vocab_real) : 0.0f,
                                     dtype};
  cuda::cross_entropy_backward(p, detail::stream_of(logits));
  return grad;
#else
  return at::Tensor();  // not reached: check_cuda_build threw
#endif
}

}  // namespace megatorch::kernels
