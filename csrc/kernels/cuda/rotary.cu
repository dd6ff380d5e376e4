// Rotary position embedding over the first r of each head's d features (the rest copied),
// and its transpose for backward: a grid-stride loop with fp32 math.
#include "common.cuh"

namespace megatorch::kernels::cuda {
namespace {

template <typename T>
__global__ void rotary_kernel(RotaryParams p) {
  const T* x = static_cast<const T*>(p.input);
  T* out = static_cast<T*>(p.out);
  const int64_t h = p.r / 2, n = p.s * p.bh * p.d;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i % p.d, row = i / p.d, pos = row / p.bh;
    if (j >= p.r) {
      out[i] = x[i];
      continue;
    }
    const float* c = p.cos + pos * p.r;
    const float* sn = p.sin + pos * p.r;
    float rot;
    if (!p.backward) {
      rot = j < h ? -to_float(x[i + h]) * sn[j] : to_float(x[i - h]) * sn[j];
    } else {
      rot = j < h ? to_float(x[i + h]) * sn[j + h] : -to_float(x[i - h]) * sn[j - h];
    }
    out[i] = from_float<T>(to_float(x[i]) * c[j] + rot);
  }
}

}  // namespace

void rotary(const RotaryParams& p, void* stream) {
  const int blocks = elementwise_blocks(p.s * p.bh * p.d);
  MEGATORCH_CUDA_DISPATCH(p.dtype, T, rotary_kernel<T><<<blocks, kElementwiseThreads, 0, as_stream(stream)>>>(p));
  check_launch("rotary");
}

}  // namespace megatorch::kernels::cuda
