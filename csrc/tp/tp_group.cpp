#include "megatorch/tp/tp_group.h"

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

}  // namespace megatorch::tp
