// residual + dropout(input + bias): Philox draws from the seed/offset the torch-facing
// code reserved on the current CUDA generator; four uniforms per thread per call.
#include <curand_kernel.h>

#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

template <typename T>
__global__ void bias_dropout_add_kernel(BiasDropoutAddParams p) {
  const T* x = static_cast<const T*>(p.input);
  const T* b = static_cast<const T*>(p.bias);
  const T* res = static_cast<const T*>(p.residual);
  T* out = static_cast<T*>(p.out);
  const int64_t n = p.rows * p.cols;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  curandStatePhilox4_32_10_t state;
  if (p.mask) curand_init(p.seed, tid, p.offset, &state);
  const float scale = 1.0f / p.keep_prob;
  for (int64_t base = tid * 4; base < n; base += stride * 4) {
    float4 u = make_float4(0, 0, 0, 0);
    if (p.mask) u = curand_uniform4(&state);
    const float us[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t i = base + k;
      if (i >= n) break;
      float v = to_float(x[i]) + (b ? to_float(b[i % p.cols]) : 0.0f);
      if (p.mask) {
        const bool keep = us[k] < p.keep_prob;
        p.mask[i] = keep;
        v = keep ? v * scale : 0.0f;
      }
      out[i] = from_float<T>(to_float(res[i]) + v);
    }
  }
}

}  // namespace

void bias_dropout_add_forward(const BiasDropoutAddParams& p, void* stream) {
  const int blocks = elementwise_blocks(ceil_div(p.rows * p.cols, 4));  // four elements a thread
  MEGATORCH_CUDA_DISPATCH(p.dtype, T,
                          bias_dropout_add_kernel<T><<<blocks, kElementwiseThreads, 0, as_stream(stream)>>>(p));
  check_launch("bias_dropout_add");
}

}  // namespace megatorch::kernels::cuda
