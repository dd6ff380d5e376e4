#include "megatorch/tp/tp_group.h"

#include <ATen/core/Tensor.h>
#include <ATen/TensorSubclassLikeUtils.h>

#include "megatorch/comm/group.h"

namespace megatorch::tp {

TPInfo tp_info(const std::string& group) {
  if (group.empty()) return {};
  comm::Group g(group);
  return {g.rank(), g.size()};
}

at::Tensor map_region(comm::Mapping m, const at::Tensor& x, const std::string& group) {
  return group.empty() ? x : comm::apply_mapping(m, x, group);
}

bool is_traced(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return at::areAnyTensorSubclassLike({input, weight}) ||
         (bias.has_value() && bias->defined() && at::isTensorSubclassLike(*bias));
}

}  // namespace megatorch::tp
