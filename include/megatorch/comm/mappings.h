#pragma once
// Megatron's autograd communication mappings, each an operator torch.ops.megatorch.<op>
// (Tensor input, str group) -> Tensor. Activations use the [s, b, h] layout: "last dim"
// is the hidden/feature dim, dim 0 the sequence dim.
//
//   mapping                     forward                      backward
//   copy_to_tp_region (f)       identity                     all-reduce
//   reduce_from_tp_region (g)   all-reduce                   identity
//   scatter_to_tp_region        split along the last dim     all-gather along the last dim
//   gather_from_tp_region       all-gather along last dim    split along the last dim
//   scatter_to_sp_region        split along dim 0            all-gather along dim 0
//   gather_from_sp_region       all-gather along dim 0       reduce-scatter along dim 0
//   reduce_scatter_to_sp_region reduce-scatter along dim 0   all-gather along dim 0
//
// Each backward is the forward of another mapping (its "adjoint" below), so the set is
// closed: the backward of one mapping applies its adjoint (its operator, or nothing for
// an identity), which keeps double backward, TorchScript and torch.compile (fake
// tensors) on the dispatcher.
#include <ATen/Tensor.h>

#include <string>
#include <vector>

namespace megatorch::comm {

enum class Mapping {
  kCopyToTP,
  kReduceFromTP,
  kScatterToTP,
  kGatherFromTP,
  kScatterToSP,
  kGatherFromSP,
  kReduceScatterToSP,
  kCount,  // no mapping: the number of them, so a new one goes before it
};
constexpr int kNumMappings = static_cast<int>(Mapping::kCount);

// Operator name without namespace, e.g. "copy_to_tp_region".
const char* mapping_name(Mapping m);
// The mapping whose forward is the backward of `m`.
Mapping mapping_adjoint(Mapping m);

// The forward collective itself, outside autograd (the CPU/CUDA kernel of the operator).
at::Tensor mapping_forward(Mapping m, const at::Tensor& input, const std::string& group);
// Output shape for an input shape, given the group size (the Meta/fake kernel; symbolic
// sizes allowed so that torch.compile(dynamic=True) traces it). Validates divisibility.
std::vector<c10::SymInt> mapping_output_shape(Mapping m, c10::SymIntArrayRef input_shape, int64_t group_size);

// Differentiable, with Megatron's backward: what the C++ layers call. The collectives run
// as the operators, through the dispatcher; the identity directions copy nothing. On a
// group of one rank every mapping is the identity both ways and `input` itself comes
// back; copy_to_tp_region's forward returns `input` (as a view carrying the all-reduce
// backward when a gradient is wanted). Like contiguous(), then, the result may share
// `input`'s memory: modify neither in place while the other is still needed.
at::Tensor apply_mapping(Mapping m, const at::Tensor& input, const std::string& group);

// reduce_from_tp_region (g) in place: sums `partial` over the group in its own memory and
// returns it, with g's backward (the identity) recorded as an in-place op's. For a partial
// result nothing else reads, as a row-parallel GEMM's output is: the out-of-place mapping
// must copy it first (it cannot know that), and at b*s*h per layer and direction that copy
// is as large as the all-reduce's own traffic. A leaf that requires grad is refused, as
// for any in-place op.
at::Tensor reduce_from_tp_region_(at::Tensor& partial, const std::string& group);

namespace detail {
// The operators' autograd kernel: apply_mapping whose result never aliases `input`, as
// the operator schemas (no alias annotation) promise TorchScript and torch.compile.
at::Tensor apply_mapping_op(Mapping m, const at::Tensor& input, const std::string& group);
}  // namespace detail

inline at::Tensor copy_to_tp_region(const at::Tensor& x, const std::string& g) { return apply_mapping(Mapping::kCopyToTP, x, g); }
inline at::Tensor reduce_from_tp_region(const at::Tensor& x, const std::string& g) { return apply_mapping(Mapping::kReduceFromTP, x, g); }
inline at::Tensor scatter_to_tp_region(const at::Tensor& x, const std::string& g) { return apply_mapping(Mapping::kScatterToTP, x, g); }
inline at::Tensor gather_from_tp_region(const at::Tensor& x, const std::string& g) { return apply_mapping(Mapping::kGatherFromTP, x, g); }
inline at::Tensor scatter_to_sp_region(const at::Tensor& x, const std::string& g) { return apply_mapping(Mapping::kScatterToSP, x, g); }
inline at::Tensor gather_from_sp_region(const at::Tensor& x, const std::string& g) { return apply_mapping(Mapping::kGatherFromSP, x, g); }
inline at::Tensor reduce_scatter_to_sp_region(const at::Tensor& x, const std::string& g) { return apply_mapping(Mapping::kReduceScatterToSP, x, g); }

}  // namespace megatorch::comm
