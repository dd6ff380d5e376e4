#pragma once
// How layers see their tensor-parallel group: by name, or "" for no tensor parallelism
// (a plain single-rank layer that runs no mappings at all).
#include <ATen/Tensor.h>

#include <string>

#include "megatorch/comm/mappings.h"

namespace megatorch::tp {

struct TPInfo {
  int64_t rank = 0;
  int64_t size = 1;
};
TPInfo tp_info(const std::string& group);

// Applies the mapping over `group`, or returns `x` itself when group is "".
at::Tensor map_region(comm::Mapping m, const at::Tensor& x, const std::string& group);

}  // namespace megatorch::tp
