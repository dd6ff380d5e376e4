#include "megatorch/kernels/rotary.h"

#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include "dispatch.h"

namespace megatorch::kernels {
namespace {

void check(const at::Tensor& input, const at::Tensor& freqs) {
  MEGATORCH_CHECK(input.dim() == 4, "rotary_embedding: expected input [s, b, heads, d], got ", input.sizes());
  MEGATORCH_CHECK(freqs.dim() == 4 && freqs.size(0) == input.size(0) && freqs.size(1) == 1 && freqs.size(2) == 1,
                  "rotary_embedding: expected freqs [s, 1, 1, r] with s = ", input.size(0), ", got ", freqs.sizes());
  const int64_t r = freqs.size(3), d = input.size(3);
  MEGATORCH_CHECK(r % 2 == 0 && r <= d, "rotary_embedding: expected an even rotary dim r <= head dim ", d, ", got ",
                  r);
  MEGATORCH_CHECK(freqs.device() == input.device(), "rotary_embedding: expected freqs on ", input.device(), ", got ",
                  freqs.device());
}

// out_i = x_i·cos_i + R(x)_i·sin_i, R(x) = [-x2, x1]; backward: the transpose,
// dx_j = g_j·cos_j + (j < h ? g_{j+h}·sin_{j+h} : -g_{j-h}·sin_{j-h}).
template <typename T, bool kBackward>
void cpu_kernel(const T* x, const float* cos, const float* sin, T* out, int64_t s, int64_t bh, int64_t d, int64_t r) {
  using A = detail::acc_t<T>;
  const int64_t h = r / 2;
  at::parallel_for(0, s * bh, std::max<int64_t>(1, 8192 / d), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t pos = i / bh;
      const T* xi = x + i * d;
      T* oi = out + i * d;
      const float* c = cos + pos * r;
      const float* sn = sin + pos * r;
      for (int64_t j = 0; j < r; ++j) {
        const A xj = static_cast<A>(xi[j]);
        A rot;
        if constexpr (!kBackward) {
          rot = j < h ? -static_cast<A>(xi[j + h]) * A(sn[j]) : static_cast<A>(xi[j - h]) * A(sn[j]);
        } else {
          rot = j < h ? static_cast<A>(xi[j + h]) * A(sn[j + h]) : -static_cast<A>(xi[j - h]) * A(sn[j - h]);
        }
        oi[j] = static_cast<T>(xj * A(c[j]) + rot);
      }
      for (int64_t j = r; j < d; ++j) oi[j] = xi[j];
    }
  });
}

at::Tensor run(const at::Tensor& input_, const at::Tensor& freqs, bool backward) {
  check(input_, freqs);
  const at::Tensor input = input_.contiguous();
  const int64_t s = input.size(0), bh = input.size(1) * input.size(2), d = input.size(3), r = freqs.size(3);
  // cos/sin once per (position, channel) with ATen, as the unfused RoPE takes them.
  const at::Tensor angles = freqs.reshape({s, r}).to(at::kFloat);
  const at::Tensor cos = angles.cos().contiguous(), sin = angles.sin().contiguous();
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (out.numel() == 0) return out;
  if (input.is_cuda()) {
    detail::check_cuda_build("rotary_embedding");
#ifdef MEGATORCH_WITH_CUDA
    const c10::cuda::CUDAGuard guard(input.device());
    cuda::RotaryParams p{input.const_data_ptr(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
                         out.data_ptr(), s, bh, d, r, backward,
                         detail::cuda_dtype(input.scalar_type(), "rotary_embedding")};
    cuda::rotary(p, detail::stream_of(input));
    return out;
#endif
  }
  MEGATORCH_DISPATCH_FLOATS(input.scalar_type(), "rotary_embedding", [&] {
    auto fn = backward ? cpu_kernel<scalar_t, true> : cpu_kernel<scalar_t, false>;
    fn(input.const_data_ptr<scalar_t>(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
       out.data_ptr<scalar_t>(), s, bh, d, r);
  });
  return out;
}

using Sig = at::Tensor(const at::Tensor&, const at::Tensor&);

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& freqs) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({freqs});
    return MEGATORCH_OP_HANDLE("megatorch::_rotary_embedding_fwd", Sig).call(input, freqs);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor freqs = ctx->get_saved_variables()[0];
    return {MEGATORCH_OP_HANDLE("megatorch::_rotary_embedding_bwd", Sig).call(grads[0], freqs), at::Tensor()};
  }
};

}  // namespace

at::Tensor rotary_embedding_forward(const at::Tensor& input, const at::Tensor& freqs) {
  return run(input, freqs, false);
}

at::Tensor rotary_embedding_backward(const at::Tensor& grad, const at::Tensor& freqs) { return run(grad, freqs, true); }

at::Tensor rotary_embedding(const at::Tensor& input, const at::Tensor& freqs) {
  check(input, freqs);
  return RotaryFunction::apply(input, freqs);
}

}  // namespace megatorch::kernels
