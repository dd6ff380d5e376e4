#include "megatorch/kernels/fused_adamw.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "dispatch.h"

namespace megatorch::kernels {
namespace {

bool is_16_or_32(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// 1 - beta in double, then rounded once, as torch.optim.AdamW passes it (a Python float) to
// its kernels: float(1 - 0.999) is 1e-3 to the last bit, 1.0f - float(0.999) is 1.3e-5 short.
struct Scalars {
  float decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt;
};

// The arithmetic of torch.optim.AdamW's single-tensor path, in fp32 (vec::adamw), over
// chunks of 2048 elements: 16-bit grads are converted chunk by chunk, the model copy is
// written from the chunk just updated (still in cache).
template <typename G, typename M>
void adamw_cpu(float* p, const G* g, float* m, float* v, M* model, int64_t n, const Scalars& s) {
  constexpr int64_t kChunk = 2048;
  at::parallel_for(0, (n + kChunk - 1) / kChunk, 2, [&](int64_t c0, int64_t c1) {
    float gbuf[kChunk];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i = c * kChunk, len = std::min(kChunk, n - i);
      vec::adamw(p + i, detail::load_f32(g + i, len, gbuf), m + i, v + i, len, s.decay, s.one_minus_beta1, s.beta2,
                 s.one_minus_beta2, s.eps, s.step_size, s.bias_correction2_sqrt);
      if (model) {
        if constexpr (std::is_same_v<M, float>) {
          std::copy(p + i, p + i + len, model + i);
        } else {
          detail::store_f32(p + i, model + i, len);
        }
      }
    }
  });
}

template <typename G>
void adamw_cpu_tensor(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                      const at::Tensor* model, const Scalars& s) {
  float* pp = p.data_ptr<float>();
  const G* gp = g.const_data_ptr<G>();
  float *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t n = p.numel();
  if (!model) return adamw_cpu<G, float>(pp, gp, mp, vp, nullptr, n, s);
  switch (model->scalar_type()) {
    case at::kFloat: return adamw_cpu<G, float>(pp, gp, mp, vp, model->data_ptr<float>(), n, s);
    case at::kBFloat16: return adamw_cpu<G, at::BFloat16>(pp, gp, mp, vp, model->data_ptr<at::BFloat16>(), n, s);
    case at::kHalf: return adamw_cpu<G, at::Half>(pp, gp, mp, vp, model->data_ptr<at::Half>(), n, s);
    default: MEGATORCH_FAIL("fused_adamw_: unexpected model dtype ", model->scalar_type());
  }
}

#ifdef MEGATORCH_WITH_CUDA
// Consecutive tensors with the same (grad, model) dtypes share a launch, up to
// kAdamWMaxTensors of them.
void adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                std::optional<at::TensorList> model, const Scalars& s) {
  const c10::cuda::CUDAGuard guard(params[0].device());
  cuda::AdamWParams p{};
  auto flush = [&] {
    if (p.count > 0) cuda::fused_adamw(p, detail::stream_of(params[0]));
    p.count = 0;
    p.max_numel = 0;
  };
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    const cuda::DType gd = detail::cuda_dtype(grads[i].scalar_type(), "fused_adamw_");
    const cuda::DType md = model ? detail::cuda_dtype((*model)[i].scalar_type(), "fused_adamw_") : cuda::DType::kFloat;
    if (p.count == cuda::kAdamWMaxTensors || (p.count > 0 && (gd != p.grad_dtype || md != p.model_dtype))) flush();
    if (p.count == 0) {
      p.grad_dtype = gd;
      p.model_dtype = md;
      p.has_model = model.has_value();
      p.decay = s.decay, p.one_minus_beta1 = s.one_minus_beta1, p.beta2 = s.beta2;
      p.one_minus_beta2 = s.one_minus_beta2, p.eps = s.eps;
      p.step_size = s.step_size, p.bias_correction2_sqrt = s.bias_correction2_sqrt;
    }
    const int k = p.count++;
    p.param[k] = params[i].data_ptr<float>();
    p.grad[k] = grads[i].const_data_ptr();
    p.exp_avg[k] = exp_avgs[i].data_ptr<float>();
    p.exp_avg_sq[k] = exp_avg_sqs[i].data_ptr<float>();
    p.model[k] = model ? (*model)[i].data_ptr() : nullptr;
    p.numel[k] = params[i].numel();
    p.max_numel = std::max(p.max_numel, p.numel[k]);
  }
  flush();
}
#endif

}  // namespace

void check_fused_adamw_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, int64_t step, std::optional<at::TensorList> model) {
  const size_t n = params.size();
  MEGATORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && (!model || model->size() == n),
                  "fused_adamw_: expected as many grads, exp_avgs, exp_avg_sqs (and model_params) as params (", n,
                  "), got ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(),
                  model ? ", " + std::to_string(model->size()) : std::string());
  MEGATORCH_CHECK(step >= 1, "fused_adamw_: expected a 1-based step, got ", step);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    MEGATORCH_CHECK(p.scalar_type() == at::kFloat && exp_avgs[i].scalar_type() == at::kFloat &&
                        exp_avg_sqs[i].scalar_type() == at::kFloat,
                    "fused_adamw_: expected fp32 params and states (master weights), got ", p.scalar_type(), ", ",
                    exp_avgs[i].scalar_type(), ", ", exp_avg_sqs[i].scalar_type(), " at index ", i);
    MEGATORCH_CHECK(is_16_or_32(grads[i].scalar_type()), "fused_adamw_: expected fp32, bf16 or fp16 grads, got ",
                    grads[i].scalar_type(), " at index ", i);
    for (const at::Tensor* t : {&grads[i], &exp_avgs[i], &exp_avg_sqs[i]}) {
      MEGATORCH_CHECK(t->sym_numel() == p.sym_numel() && t->device() == p.device(),
                      "fused_adamw_: expected grads and states with the param's numel (", p.sym_numel(), ") on ",
                      p.device(), ", got ", t->sym_numel(), " on ", t->device(), " at index ", i);
    }
    if (model) {
      const at::Tensor& mp = (*model)[i];
      MEGATORCH_CHECK(mp.sym_numel() == p.sym_numel() && mp.device() == p.device() && is_16_or_32(mp.scalar_type()),
                      "fused_adamw_: expected a model param of numel ", p.sym_numel(), " on ", p.device(),
                      " in fp32/bf16/fp16, got ", mp.sym_numel(), " on ", mp.device(), " in ", mp.scalar_type(),
                      " at index ", i);
    }
    MEGATORCH_CHECK(p.device() == params[0].device(), "fused_adamw_: expected every tensor on ", params[0].device(),
                    ", got ", p.device(), " at index ", i);
  }
}

void fused_adamw_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                  std::optional<at::TensorList> model_params) {
  check_fused_adamw_args(params, grads, exp_avgs, exp_avg_sqs, step, model_params);
  for (size_t i = 0; i < params.size(); ++i) {
    const bool contiguous = params[i].is_contiguous() && grads[i].is_contiguous() && exp_avgs[i].is_contiguous() &&
                            exp_avg_sqs[i].is_contiguous() && (!model_params || (*model_params)[i].is_contiguous());
    MEGATORCH_CHECK(contiguous, "fused_adamw_: expected contiguous tensors (index ", i,
                    "); flat buffers are, call .contiguous() otherwise");
  }
  if (params.empty()) return;
  // Bias corrections in double, as torch.optim.AdamW computes them in Python floats.
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const Scalars s{static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(1.0 - beta1),
                  static_cast<float>(beta2),                        static_cast<float>(1.0 - beta2),
                  static_cast<float>(eps),                          static_cast<float>(lr / bc1),
                  static_cast<float>(std::sqrt(bc2))};
  if (params[0].is_cuda()) {
    detail::check_cuda_build("fused_adamw_");
#ifdef MEGATORCH_WITH_CUDA
    return adamw_cuda(params, grads, exp_avgs, exp_avg_sqs, model_params, s);
#endif
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor* model = model_params ? &(*model_params)[i] : nullptr;
    switch (grads[i].scalar_type()) {
      case at::kFloat: adamw_cpu_tensor<float>(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], model, s); break;
      case at::kBFloat16:
        adamw_cpu_tensor<at::BFloat16>(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], model, s);
        break;
      default: adamw_cpu_tensor<at::Half>(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], model, s); break;
    }
  }
}

}  // namespace megatorch::kernels
