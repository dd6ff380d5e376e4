#pragma once
// Dispatch helpers shared by the torch-facing kernel files: the dtype switch of the CPU
// kernels, the CUDA kernels' dtype tag and current stream, typed operator handles, the
// error for a CUDA tensor reaching a build without CUDA, and fp32 row views.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "cpu_vec.h"
#include "cuda/params.h"
#include "megatorch/check.h"

#ifdef MEGATORCH_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace megatorch::kernels::detail {

inline cuda::DType cuda_dtype(at::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return cuda::DType::kFloat;
    case at::kHalf: return cuda::DType::kHalf;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    default: MEGATORCH_FAIL(op, ": expected a float32, float16 or bfloat16 CUDA tensor, got ", t);
  }
}

inline void check_cuda_build(const char* op) {
#ifndef MEGATORCH_WITH_CUDA
  MEGATORCH_FAIL(op, ": got a CUDA tensor, but megatorch was built against a torch without CUDA; rebuild against a "
                 "CUDA build of torch or move the tensors to the CPU");
#endif
}

#ifdef MEGATORCH_WITH_CUDA
inline void* stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

// Floating dtypes of the CPU kernels: double for gradcheck, the rest for training.
#define MEGATORCH_DISPATCH_FLOATS(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

// fp32 accumulation for 16-bit inputs, double for double.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// A typed handle of the operator megatorch::NAME, looked up once.
#define MEGATORCH_OP_HANDLE(NAME, SIG)                                                          \
  ([]() -> const c10::TypedOperatorHandle<SIG>& {                                               \
    static const auto h = c10::Dispatcher::singleton().findSchemaOrThrow(NAME, "").typed<SIG>(); \
    return h;                                                                                   \
  }())

// fp32 views of 16-bit rows for the vectorised loops (cpu_vec.h): a float row is used in
// place, another dtype is converted into (or out of) the caller's buffer.
template <typename T>
const float* load_f32(const T* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    vec::bf16_to_f32(reinterpret_cast<const uint16_t*>(src), buf, n);
    return buf;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}
template <typename T>
float* out_f32(T* dst, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return dst;
  } else {
    return buf;
  }
}
template <typename T>
void store_f32(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    vec::f32_to_bf16(src, reinterpret_cast<uint16_t*>(dst), n);
  } else if constexpr (!std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

// Rows x cols view of a tensor normalised over (or applied along) its last dim.
inline int64_t rows_of(const at::Tensor& t) { return t.dim() == 0 || t.size(-1) == 0 ? 0 : t.numel() / t.size(-1); }

}  // namespace megatorch::kernels::detail
