// Registers the communication mappings and the accounting as torch.ops.megatorch.*.
// Registration only: the functions live in csrc/comm/.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <utility>

#include "megatorch/comm/comm_stats.h"
#include "megatorch/comm/group.h"
#include "megatorch/comm/mappings.h"

namespace megatorch::ops {
namespace {

using comm::Mapping;

template <Mapping M>
at::Tensor forward_kernel(const at::Tensor& input, c10::string_view group) {
  return comm::mapping_forward(M, input, std::string(group));
}

template <Mapping M>
at::Tensor meta_kernel(const at::Tensor& input, c10::string_view group) {
  const int64_t size = comm::Group(std::string(group)).size();
  return at::empty_symint(comm::mapping_output_shape(M, input.sym_sizes(), size), input.options());
}

template <Mapping M>
at::Tensor autograd_kernel(const at::Tensor& input, c10::string_view group) {
  return comm::detail::apply_mapping_op(M, input, std::string(group));
}

c10::Dict<std::string, int64_t> comm_stats_op(c10::string_view group) {
  c10::Dict<std::string, int64_t> out;
  for (const auto& [k, v] : comm::comm_stats(std::string(group)).to_map()) out.insert(k, v);
  return out;
}

void reset_comm_stats_op(std::optional<c10::string_view> group) {
  comm::reset_comm_stats(group ? std::string(*group) : std::string());
}

template <Mapping M>
void def_mapping(torch::Library& m) {
  m.def((std::string(comm::mapping_name(M)) + "(Tensor input, str group) -> Tensor").c_str());
}

template <Mapping M>
void impl_mapping(torch::Library& m, c10::DispatchKey key) {
  const char* name = comm::mapping_name(M);
  switch (key) {
    case c10::DispatchKey::Meta: m.impl(name, TORCH_FN(meta_kernel<M>)); break;
    case c10::DispatchKey::Autograd: m.impl(name, TORCH_FN(autograd_kernel<M>)); break;
    default: m.impl(name, TORCH_FN(forward_kernel<M>));
  }
}

// Every enumerator before Mapping::kCount.
template <int... Is>
struct AllMappings {
  static void def(torch::Library& m) { (def_mapping<static_cast<Mapping>(Is)>(m), ...); }
  static void impl(torch::Library& m, c10::DispatchKey key) { (impl_mapping<static_cast<Mapping>(Is)>(m, key), ...); }
};
template <int... Is>
AllMappings<Is...> all_mappings(std::integer_sequence<int, Is...>);
using Mappings = decltype(all_mappings(std::make_integer_sequence<int, comm::kNumMappings>()));

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatorch, m) {
  Mappings::def(m);
  m.def("comm_stats(str group) -> Dict(str, int)", TORCH_FN(comm_stats_op));
  m.def("reset_comm_stats(str? group=None) -> ()", TORCH_FN(reset_comm_stats_op));
}

// The collectives serve CPU (Gloo) and CUDA (NCCL) tensors with the same kernel.
TORCH_LIBRARY_IMPL(megatorch, CPU, m) { Mappings::impl(m, c10::DispatchKey::CPU); }
TORCH_LIBRARY_IMPL(megatorch, CUDA, m) { Mappings::impl(m, c10::DispatchKey::CUDA); }
TORCH_LIBRARY_IMPL(megatorch, Meta, m) { Mappings::impl(m, c10::DispatchKey::Meta); }
TORCH_LIBRARY_IMPL(megatorch, Autograd, m) { Mappings::impl(m, c10::DispatchKey::Autograd); }

}  // namespace megatorch::ops
