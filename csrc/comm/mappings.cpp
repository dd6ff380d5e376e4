#include "megatorch/comm/mappings.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"

namespace megatorch::comm {
namespace {

// Which dim a mapping splits or gathers: the last (TP) or the first (SP, sequence).
bool is_sequence_mapping(Mapping m) {
  return m == Mapping::kScatterToSP || m == Mapping::kGatherFromSP || m == Mapping::kReduceScatterToSP;
}

int64_t split_dim(Mapping m, int64_t ndim) { return is_sequence_mapping(m) ? 0 : ndim - 1; }

void check_divisible(Mapping m, c10::SymIntArrayRef shape, int64_t dim, int64_t group_size) {
  MEGATORCH_CHECK(shape[dim] % group_size == 0, mapping_name(m), ": expected dim ", dim, " of the input (shape ",
                  shape, ") to be divisible by the group size ", group_size,
                  is_sequence_mapping(m) ? "; with sequence parallelism the sequence length must be a multiple "
                                           "of the tensor-parallel size"
                                         : "; the hidden size must be a multiple of the tensor-parallel size");
}

using MappingOp = at::Tensor(const at::Tensor&, c10::string_view);

const c10::TypedOperatorHandle<MappingOp>& mapping_op(Mapping m) {
  static const std::vector<c10::TypedOperatorHandle<MappingOp>> handles = [] {
    std::vector<c10::TypedOperatorHandle<MappingOp>> h;
    for (int i = 0; i < kNumMappings; ++i) {
      const std::string name = std::string("megatorch::") + mapping_name(static_cast<Mapping>(i));
      h.push_back(c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<MappingOp>());
    }
    return h;
  }();
  return handles[static_cast<int>(m)];
}

// Forward: the operator below autograd (CPU, CUDA or Meta/fake kernel), or, for
// copy_to_tp_region with `alias_identity`, the input itself, which autograd hands back
// as a view (input.view_as(input)) whose backward is this node's.
// Backward: the adjoint mapping, itself differentiable. It may return the incoming
// gradient itself (an identity direction), as the backward of a view op does.
class MappingFunction : public torch::autograd::Function<MappingFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, int64_t mapping,
                            const std::string& group, bool alias_identity) {
    ctx->saved_data["mapping"] = mapping;
    ctx->saved_data["group"] = group;
    const auto m = static_cast<Mapping>(mapping);
    if (alias_identity && m == Mapping::kCopyToTP) return input;
    at::AutoDispatchBelowADInplaceOrView guard;
    return mapping_op(m).call(input, group);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto m = static_cast<Mapping>(ctx->saved_data["mapping"].toInt());
    const std::string& group = ctx->saved_data["group"].toStringRef();
    return {apply_mapping(mapping_adjoint(m), grads[0], group), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// g in place: the all-reduce on the input's own memory, marked dirty so autograd rebases
// its history onto this node (whose backward, the identity, is g's).
class ReduceInPlaceFunction : public torch::autograd::Function<ReduceInPlaceFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor partial, const std::string& group) {
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      Group(group).all_reduce(partial);
    }
    ctx->mark_dirty({partial});
    return partial;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

bool splits_or_gathers(Mapping m) { return m != Mapping::kCopyToTP && m != Mapping::kReduceFromTP; }

// Whether autograd would record a node: if not (inference, or a backward without
// create_graph), the mapping runs without one, as autograd's own kernels do.
bool records_gradient(const at::Tensor& input) { return at::GradMode::is_enabled() && input.requires_grad(); }

}  // namespace

const char* mapping_name(Mapping m) {
  switch (m) {
    case Mapping::kCopyToTP: return "copy_to_tp_region";
    case Mapping::kReduceFromTP: return "reduce_from_tp_region";
    case Mapping::kScatterToTP: return "scatter_to_tp_region";
    case Mapping::kGatherFromTP: return "gather_from_tp_region";
    case Mapping::kScatterToSP: return "scatter_to_sp_region";
    case Mapping::kGatherFromSP: return "gather_from_sp_region";
    case Mapping::kReduceScatterToSP: return "reduce_scatter_to_sp_region";
    case Mapping::kCount: break;
  }
  return "?";
}

Mapping mapping_adjoint(Mapping m) {
  switch (m) {
    case Mapping::kCopyToTP: return Mapping::kReduceFromTP;
    case Mapping::kReduceFromTP: return Mapping::kCopyToTP;
    case Mapping::kScatterToTP: return Mapping::kGatherFromTP;
    case Mapping::kGatherFromTP: return Mapping::kScatterToTP;
    case Mapping::kScatterToSP: return Mapping::kGatherFromSP;
    case Mapping::kGatherFromSP: return Mapping::kReduceScatterToSP;
    case Mapping::kReduceScatterToSP: return Mapping::kGatherFromSP;
    case Mapping::kCount: break;
  }
  MEGATORCH_FAIL("mapping_adjoint: expected a mapping, got Mapping::kCount");
}

std::vector<c10::SymInt> mapping_output_shape(Mapping m, c10::SymIntArrayRef shape, int64_t group_size) {
  std::vector<c10::SymInt> out(shape.begin(), shape.end());
  if (!splits_or_gathers(m)) return out;
  MEGATORCH_CHECK(!shape.empty(), mapping_name(m), ": expected a tensor with at least one dim, got a scalar");
  const int64_t dim = split_dim(m, static_cast<int64_t>(shape.size()));
  switch (m) {
    case Mapping::kScatterToTP:
    case Mapping::kScatterToSP:
    case Mapping::kReduceScatterToSP:
      check_divisible(m, shape, dim, group_size);
      out[dim] = out[dim] / group_size;
      break;
    default:  // gathers
      out[dim] = out[dim] * group_size;
  }
  return out;
}

// The operators' kernel. Their schemas carry no alias annotation, so an output never
// shares the input's memory: the identity copies, the all-reduce reduces a contiguous
// copy in place (the only copy it makes), a scatter copies its chunk.
at::Tensor mapping_forward(Mapping m, const at::Tensor& input, const std::string& group_name) {
  Group group(group_name);
  const int64_t dim = input.dim() > 0 ? split_dim(m, input.dim()) : 0;
  mapping_output_shape(m, input.sym_sizes(), group.size());  // validates before any collective
  switch (m) {
    case Mapping::kCopyToTP:
      return input.clone();
    case Mapping::kReduceFromTP: {
      at::Tensor out = input.clone(at::MemoryFormat::Contiguous);
      return group.all_reduce(out);
    }
    case Mapping::kScatterToTP:
    case Mapping::kScatterToSP:
      // A chunk along dim 0 is a view of the input: copy, an operator must not alias.
      return input.chunk(group.size(), dim)[group.rank()].clone(at::MemoryFormat::Contiguous);
    case Mapping::kGatherFromTP:
    case Mapping::kGatherFromSP:
      return group.all_gather(input, dim);
    case Mapping::kReduceScatterToSP:
      return group.reduce_scatter(input, dim);
    case Mapping::kCount: break;
  }
  MEGATORCH_FAIL("mapping_forward: expected a mapping, got Mapping::kCount");
}

// The identity directions without a copy. Only here, for C++ callers: through the
// dispatcher (detail::apply_mapping_op) an alias would break the schemas' promise, which
// TorchScript's alias analysis and torch.compile's functionalization rely on. The
// all-reduce keeps its one copy (it must not reduce the caller's tensor in place), and so
// does the scatter: its chunk of the last dim is not contiguous and the linear after it
// would copy it anyway.
at::Tensor apply_mapping(Mapping m, const at::Tensor& input, const std::string& group) {
  const Group g(group);  // cached: validates the name, gives the size
  if (g.size() == 1) {
    MEGATORCH_CHECK(!splits_or_gathers(m) || input.dim() > 0, mapping_name(m),
                    ": expected a tensor with at least one dim, got a scalar");
    return input;  // every mapping is the identity on one rank, forward and backward
  }
  if (!records_gradient(input)) {
    if (m == Mapping::kCopyToTP) return input;
    at::AutoDispatchBelowADInplaceOrView guard;
    return mapping_op(m).call(input, group);
  }
  return MappingFunction::apply(input, static_cast<int64_t>(m), group, /*alias_identity=*/true);
}

at::Tensor reduce_from_tp_region_(at::Tensor& partial, const std::string& group) {
  MEGATORCH_CHECK(!(partial.is_leaf() && partial.requires_grad()), "reduce_from_tp_region_: expected a tensor "
                  "computed from others (a row-parallel GEMM's partial output), got a leaf that requires grad, which "
                  "autograd cannot modify in place; call reduce_from_tp_region (out of place) on it");
  Group g(group);
  if (g.size() == 1) return partial;
  // Collectives need one dense buffer: anything else goes out of place (one copy, as before).
  if (!partial.is_contiguous()) return apply_mapping(Mapping::kReduceFromTP, partial, group);
  if (!records_gradient(partial)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return g.all_reduce(partial);
  }
  return ReduceInPlaceFunction::apply(partial, group);
}

namespace detail {
at::Tensor apply_mapping_op(Mapping m, const at::Tensor& input, const std::string& group) {
  if (!records_gradient(input)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return mapping_op(m).call(input, group);
  }
  return MappingFunction::apply(input, static_cast<int64_t>(m), group, /*alias_identity=*/false);
}
}  // namespace detail

}  // namespace megatorch::comm
