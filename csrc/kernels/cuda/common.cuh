#pragma once
// Device helpers shared by the kernels: dtype dispatch over the plain DType tag,
// fp32 conversion of 16-bit values, warp/block reductions, launch-error checks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "params.h"

namespace megatorch::kernels::cuda {

inline void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("megatorch: CUDA kernel ") + what + " failed to launch: " +
                             cudaGetErrorString(err));
  }
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Runs the statements with T the C++ type of the DType `d`.
#define MEGATORCH_CUDA_DISPATCH(d, T, ...)                     \
  switch (d) {                                                 \
    case ::megatorch::kernels::cuda::DType::kFloat: {          \
      using T = float;                                         \
      __VA_ARGS__;                                             \
    } break;                                                   \
    case ::megatorch::kernels::cuda::DType::kHalf: {           \
      using T = __half;                                        \
      __VA_ARGS__;                                             \
    } break;                                                   \
    case ::megatorch::kernels::cuda::DType::kBFloat16: {       \
      using T = __nv_bfloat16;                                 \
      __VA_ARGS__;                                             \
    } break;                                                   \
  }

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Block-wide reduction; every thread gets the result. `shared` holds 32 floats.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float x, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  x = kMax ? warp_max(x) : warp_sum(x);
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < warps ? shared[lane] : (kMax ? -INFINITY : 0.0f);
  return kMax ? warp_max(x) : warp_sum(x);
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Element-wise kernels run grid-stride loops over `n` work items: blocks of
// kElementwiseThreads, no more blocks than a grid's x dimension allows everywhere.
constexpr int kElementwiseThreads = 256;
inline int elementwise_blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>(ceil_div(n, kElementwiseThreads), 65535));
}

// Row-wise kernels (norms, softmax, cross entropy) run one block of kRowThreads per row.
constexpr int kRowThreads = 256;
inline unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(rows); }

// Vector width in elements for 16-byte loads of T, when pointers and sizes allow it.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

inline bool aligned16(const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

}  // namespace megatorch::kernels::cuda
