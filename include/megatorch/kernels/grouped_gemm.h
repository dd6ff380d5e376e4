#pragma once
// grouped_gemm: the GEMMs of a mixture of experts' local experts as one call. Rows of
// `input` [N, K] are grouped by expert, `counts[g]` rows for group g in order; `weight`
// is [G, K, M] (input-major, one [K, M] per group); the result is [N, M] with group g's
// rows multiplied by weight[g]. One ATen grouped-GEMM call (at::_grouped_mm: CUTLASS's
// grouped kernel for bf16 on Hopper, ATen's own elsewhere) over variable-sized groups,
// empty groups included, differentiable in both operands. The grouped kernel needs rows
// of 16 bytes' multiples (K and M: multiples of 4 fp32 or 8 bf16 elements); other widths,
// and `grouped` false, run one at::mm per group instead (the loop it replaces; the same
// numbers, and the benchmark's comparison).
#include <ATen/Tensor.h>

#include <vector>

namespace megatorch::kernels {

at::Tensor grouped_gemm(const at::Tensor& input, const at::Tensor& weight, const std::vector<int64_t>& counts,
                        bool grouped = true);

}  // namespace megatorch::kernels
