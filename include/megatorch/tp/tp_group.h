#pragma once
// How layers see their tensor-parallel group: by name, or "" for no tensor parallelism
// (a plain single-rank layer that runs no mappings at all).
#include <ATen/Tensor.h>
#include <torch/arg.h>
#include <c10/core/Device.h>

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

// How a layer's parameters are created (see init.h): `name` prefixes the parameter
// names that seed the generator, so two layers never draw the same numbers.
struct ParamInitOptions {
  TORCH_ARG(std::string, name) = "param";
  TORCH_ARG(int64_t, seed) = 1234;
  TORCH_ARG(double, std) = 0.02;
  TORCH_ARG(bool, shard_local) = false;
  TORCH_ARG(c10::ScalarType, dtype) = c10::kFloat;
  TORCH_ARG(c10::Device, device) = c10::kCPU;
};

}  // namespace megatorch::tp
