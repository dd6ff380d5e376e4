#include "megatorch/kernels/grouped_gemm.h"

#include <ATen/ATen.h>

#include <limits>
#include <numeric>

#include "megatorch/check.h"

namespace megatorch::kernels {

at::Tensor grouped_gemm(const at::Tensor& input, const at::Tensor& weight, const std::vector<int64_t>& counts,
                        bool grouped) {
  MEGATORCH_CHECK(input.dim() == 2 && weight.dim() == 3 && input.size(1) == weight.size(1),
                  "grouped_gemm: expected input [N, K] and weight [G, K, M], got ", input.sizes(), " and ",
                  weight.sizes());
  MEGATORCH_CHECK(static_cast<int64_t>(counts.size()) == weight.size(0), "grouped_gemm: expected one row count per ",
                  "group (", weight.size(0), "), got ", counts.size());
  const int64_t rows = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  MEGATORCH_CHECK(rows == input.size(0), "grouped_gemm: the group row counts add up to ", rows, " but the input has ",
                  input.size(0), " rows");
  MEGATORCH_CHECK(input.scalar_type() == weight.scalar_type(), "grouped_gemm: expected input and weight of one dtype, ",
                  "got ", input.scalar_type(), " and ", weight.scalar_type());
  // ATen's grouped kernel needs 16-byte aligned rows in every operand (CUTLASS's rule,
  // kept on CPU); other widths take the per-group GEMMs.
  const int64_t esize = input.element_size();
  const bool aligned = (weight.size(1) * esize) % 16 == 0 && (weight.size(2) * esize) % 16 == 0;
  if (!grouped || !aligned) {
    // split/unbind, not narrow/select: their backward gathers the pieces once, where a
    // select's would write a zero-filled gradient of the whole weight per expert.
    const auto rows = input.split_with_sizes(counts, 0);
    const auto weights = weight.unbind(0);
    std::vector<at::Tensor> out;
    out.reserve(counts.size());
    for (size_t g = 0; g < counts.size(); ++g) out.push_back(at::mm(rows[g], weights[g]));
    return out.empty() ? at::empty({0, weight.size(2)}, input.options()) : at::cat(out, 0);
  }
  // _grouped_mm takes each group's end row (int32, on the operands' device).
  std::vector<int32_t> ends(counts.size());
  int64_t end = 0;
  for (size_t g = 0; g < counts.size(); ++g) {
    end += counts[g];
    MEGATORCH_CHECK(end <= std::numeric_limits<int32_t>::max(), "grouped_gemm: more than 2^31 rows");
    ends[g] = static_cast<int32_t>(end);
  }
  const at::Tensor offs =
      at::tensor(ends, at::TensorOptions().dtype(at::kInt)).to(input.device(), /*non_blocking=*/true);
  return at::_grouped_mm(input.contiguous(), weight, offs);
}

}  // namespace megatorch::kernels
