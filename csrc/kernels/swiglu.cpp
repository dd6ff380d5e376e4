#include "megatorch/kernels/swiglu.h"

#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <cmath>
#include <vector>

#include "cpu_vec.h"
#include "dispatch.h"

namespace megatorch::kernels {
namespace {

void check(const at::Tensor& input) {
  MEGATORCH_CHECK(input.dim() >= 1 && input.size(-1) % 2 == 0,
                  "swiglu: expected input [..., 2f] with an even last dim, got ", input.sizes());
}

// float, bf16, fp16: the vectorised row loops in fp32.
template <typename T>
void cpu_vec(const T* g, const T* x, T* out, int64_t rows, int64_t f, bool backward) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(f, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> ba(f), bb(f), bg(f), b1(f), b2(f);
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = detail::load_f32(x + r * 2 * f, f, ba.data());
      const float* b = detail::load_f32(x + r * 2 * f + f, f, bb.data());
      if (!backward) {
        float* y = detail::out_f32(out + r * f, b1.data());
        vec::swiglu(a, b, y, f);
        detail::store_f32(y, out + r * f, f);
      } else {
        float* da = detail::out_f32(out + r * 2 * f, b1.data());
        float* db = detail::out_f32(out + r * 2 * f + f, b2.data());
        vec::swiglu_backward(a, b, detail::load_f32(g + r * f, f, bg.data()), da, db, f);
        detail::store_f32(da, out + r * 2 * f, f);
        detail::store_f32(db, out + r * 2 * f + f, f);
      }
    }
  });
}

template <typename T>
void cpu_forward(const T* x, T* y, int64_t rows, int64_t f) {
  if constexpr (!std::is_same_v<T, double>) return cpu_vec<T>(nullptr, x, y, rows, f, false);
  using A = detail::acc_t<T>;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(f, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* a = x + r * 2 * f;
      const T* b = a + f;
      for (int64_t c = 0; c < f; ++c) {
        const A u = static_cast<A>(a[c]);
        y[r * f + c] = static_cast<T>(u / (A(1) + std::exp(-u)) * static_cast<A>(b[c]));
      }
    }
  });
}

template <typename T>
void cpu_backward(const T* g, const T* x, T* dx, int64_t rows, int64_t f) {
  if constexpr (!std::is_same_v<T, double>) return cpu_vec<T>(g, x, dx, rows, f, true);
  using A = detail::acc_t<T>;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(f, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* a = x + r * 2 * f;
      const T* b = a + f;
      T* da = dx + r * 2 * f;
      T* db = da + f;
      for (int64_t c = 0; c < f; ++c) {
        const A u = static_cast<A>(a[c]), v = static_cast<A>(b[c]), gr = static_cast<A>(g[r * f + c]);
        const A sig = A(1) / (A(1) + std::exp(-u));
        da[c] = static_cast<T>(gr * v * sig * (A(1) + u * (A(1) - sig)));
        db[c] = static_cast<T>(gr * u * sig);
      }
    }
  });
}

at::Tensor run(const at::Tensor* grad_, const at::Tensor& input_) {
  check(input_);
  const at::Tensor input = input_.contiguous();
  const int64_t f = input.size(-1) / 2, rows = detail::rows_of(input);
  std::vector<int64_t> half_shape = input.sizes().vec();
  half_shape.back() = f;
  const at::Tensor grad = grad_ ? grad_->contiguous() : at::Tensor();
  at::Tensor out = grad_ ? at::empty_like(input, at::MemoryFormat::Contiguous) : at::empty(half_shape, input.options());
  if (out.numel() == 0) return out;
  if (input.is_cuda()) {
    detail::check_cuda_build("swiglu");
#ifdef MEGATORCH_WITH_CUDA
    const c10::cuda::CUDAGuard guard(input.device());
    cuda::SwigluParams p{input.const_data_ptr(), grad_ ? grad.const_data_ptr() : nullptr, out.data_ptr(), rows, f,
                         detail::cuda_dtype(input.scalar_type(), "swiglu")};
    grad_ ? cuda::swiglu_backward(p, detail::stream_of(input)) : cuda::swiglu_forward(p, detail::stream_of(input));
    return out;
#endif
  }
  MEGATORCH_DISPATCH_FLOATS(input.scalar_type(), "swiglu", [&] {
    if (grad_) {
      cpu_backward<scalar_t>(grad.const_data_ptr<scalar_t>(), input.const_data_ptr<scalar_t>(),
                             out.data_ptr<scalar_t>(), rows, f);
    } else {
      cpu_forward<scalar_t>(input.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, f);
    }
  });
  return out;
}

using FwdSig = at::Tensor(const at::Tensor&);
using BwdSig = at::Tensor(const at::Tensor&, const at::Tensor&);

class SwigluFunction : public torch::autograd::Function<SwigluFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({input});
    return MEGATORCH_OP_HANDLE("megatorch::_swiglu_fwd", FwdSig).call(input);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {MEGATORCH_OP_HANDLE("megatorch::_swiglu_bwd", BwdSig).call(grads[0], ctx->get_saved_variables()[0])};
  }
};

}  // namespace

at::Tensor swiglu_forward(const at::Tensor& input) { return run(nullptr, input); }

at::Tensor swiglu_backward(const at::Tensor& grad, const at::Tensor& input) {
  check(input);
  std::vector<int64_t> expected = input.sizes().vec();
  expected.back() /= 2;
  MEGATORCH_CHECK(grad.sizes() == c10::IntArrayRef(expected) && grad.scalar_type() == input.scalar_type(),
                  "swiglu backward: expected grad of shape ", c10::IntArrayRef(expected), " and dtype ",
                  input.scalar_type(), " for input ", input.sizes(), ", got ", grad.sizes(), " ", grad.scalar_type());
  return run(&grad, input);
}

at::Tensor swiglu(const at::Tensor& input) {
  check(input);
  return SwigluFunction::apply(input);
}

}  // namespace megatorch::kernels
