#pragma once
// How layers see their tensor-parallel group: by name, or "" for no tensor parallelism
// (a plain single-rank layer that runs no mappings at all).
#include <ATen/Tensor.h>

#include <c10/util/Optional.h>

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

// Whether a tracer sees these tensors (fake, functional or meta tensors, a dispatch mode:
// torch.compile, opcheck, shape-only passes). Layers then take the mapping operators, which
// every tracer follows, instead of the paths that call the process group directly (the
// sequence-parallel linear, the in-place g); both compute the same.
bool is_traced(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

}  // namespace megatorch::tp
