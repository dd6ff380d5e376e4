// Multi-tensor AdamW: blockIdx.y picks the tensor of this launch, blocks stride over
// its elements. fp32 arithmetic throughout, as the CPU implementation.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

template <typename G, typename M>
__global__ void adamw_kernel(AdamWParams p) {
  const int t = blockIdx.y;
  const int64_t n = p.numel[t];
  float* __restrict__ param = p.param[t];
  const G* __restrict__ grad = static_cast<const G*>(p.grad[t]);
  float* __restrict__ m = p.exp_avg[t];
  float* __restrict__ v = p.exp_avg_sq[t];
  M* __restrict__ model = static_cast<M*>(p.model[t]);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = to_float(grad[i]);
    float w = param[i] * p.decay;
    const float mi = m[i] + p.one_minus_beta1 * (g - m[i]);
    const float vi = v[i] * p.beta2 + p.one_minus_beta2 * g * g;
    w -= p.step_size * (mi / (sqrtf(vi) / p.bias_correction2_sqrt + p.eps));
    param[i] = w;
    m[i] = mi;
    v[i] = vi;
    if (model) model[i] = from_float<M>(w);
  }
}

}  // namespace

void fused_adamw(const AdamWParams& p, void* stream) {
  constexpr int threads = 512;
  const int64_t blocks = ceil_div(p.max_numel, threads);
  const dim3 grid(static_cast<unsigned>(blocks < 1024 ? blocks : 1024), p.count);
  MEGATORCH_CUDA_DISPATCH(p.grad_dtype, G, {
    if (!p.has_model) {
      adamw_kernel<G, float><<<grid, threads, 0, as_stream(stream)>>>(p);
    } else {
      MEGATORCH_CUDA_DISPATCH(p.model_dtype, M, adamw_kernel<G, M><<<grid, threads, 0, as_stream(stream)>>>(p));
    }
  });
  check_launch("fused_adamw");
}

}  // namespace megatorch::kernels::cuda
