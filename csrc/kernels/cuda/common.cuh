#pragma once
// Device helpers shared by the kernels: dtype dispatch over the plain DType tag,
// fp32 conversion of 16-bit values, warp/block reductions, 16-byte vector loads and
// stores, launch-error checks, the device's SM count.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

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

inline bool aligned_to(const void* p, uintptr_t bytes) {
  return p == nullptr || (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// The N values of a pack as fp32. bf16 pairs are unpacked with integer shifts and masks
// of the 32-bit words (cvt.f32.bf16 wants each value in a 16-bit register of its own,
// which costs registers in kernels that keep raw packs live).
template <typename T, int N>
__device__ __forceinline__ void unpack_float(const Pack<T, N>& p, float (&f)[N]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    uint32_t w[N / 2];
    memcpy(w, &p, sizeof(w));
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) f[e] = to_float(p.v[e]);
  }
}

// N elements of T at p as fp32, in loads of at most 16 bytes (Pack<T, min(N, 16 / sizeof(T))>):
// p must be aligned to min(16, N·sizeof(T)) bytes. E.g. 8 fp32 weights of a bf16 pack: two
// 16-byte loads.
template <typename T, int N>
__device__ __forceinline__ void load_float(const T* p, float (&f)[N]) {
  constexpr int C = N < kVec<T> ? N : kVec<T>;
  static_assert(N % C == 0, "load_float: N must be a multiple of the chunk");
#pragma unroll
  for (int k = 0; k < N; k += C) {
    float c[C];
    // One vector load into a local first: unpacking through a reference to global memory
    // lets the compiler split the pack into scalar loads.
    const Pack<T, C> pack = *reinterpret_cast<const Pack<T, C>*>(p + k);
    unpack_float(pack, c);
#pragma unroll
    for (int e = 0; e < C; ++e) f[k + e] = c[e];
  }
}

// Stores N fp32 values as T at p (rounded to nearest even), same chunks and alignment.
template <typename T, int N>
__device__ __forceinline__ void store_float(T* p, const float (&f)[N]) {
  constexpr int C = N < kVec<T> ? N : kVec<T>;
  static_assert(N % C == 0, "store_float: N must be a multiple of the chunk");
#pragma unroll
  for (int k = 0; k < N; k += C) {
    Pack<T, C> v;
#pragma unroll
    for (int e = 0; e < C; ++e) v.v[e] = from_float<T>(f[k + e]);
    *reinterpret_cast<Pack<T, C>*>(p + k) = v;
  }
}

// x rounded to T and back (the rounding of an intermediate the unfused chain keeps in T).
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// Number of SMs of the current device, looked up once per device.
inline int device_sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // static storage: zero-initialised
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev >= 0 && dev < kMaxDevices) {
    const int cached = cache[dev].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 1;
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Resident blocks per SM of `kernel` at this block size and dynamic shared memory (at least 1).
template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel, int threads, size_t smem) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) {
    (void)cudaGetLastError();  // clear a sticky launch-configuration error; 1 is a safe answer
    n = 1;
  }
  return n;
}

// Grid size for a grid-stride loop over `groups` work groups with at most `max_blocks`
// blocks: as many blocks as allowed, then evened out so that every block runs the same
// number of iterations (but the last few).
inline int64_t balanced_blocks(int64_t groups, int64_t max_blocks) {
  max_blocks = std::max<int64_t>(1, max_blocks);
  const int64_t iters = ceil_div(groups, max_blocks);
  return ceil_div(groups, iters);
}

// Grid size for a grid-stride `Kernel` at `threads` per block over `groups` work groups:
// one wave of the blocks every SM holds at once, evened out (balanced_blocks). The
// occupancy is looked up once per kernel (`threads` must be the same at every call).
template <auto Kernel>
int64_t one_wave_blocks(int64_t groups, int threads) {
  static const int per_sm = resident_blocks_per_sm(Kernel, threads, 0);
  return balanced_blocks(groups, static_cast<int64_t>(device_sm_count()) * per_sm);
}

}  // namespace megatorch::kernels::cuda
