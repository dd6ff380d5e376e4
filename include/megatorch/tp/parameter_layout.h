#pragma once
// How each parameter of a module tree lies over the TP group, from the parallel layers'
// own metadata: what the optimizer's grouping (train::module_parameters) and the
// checkpoint entries of any model (ckpt::module_entries) are derived from, so that a
// user's model needs no table of its own.
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "megatorch/tp/init.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::tp {

struct ParameterLayout {
  // full shape over the TP group, partition dim (-1: replicated), rank, world, fused parts.
  ShardSpec spec;
  // Rows of dim 0 that are real when the full shape is padded (a vocabulary padded to a
  // multiple of tp); -1: no padding.
  int64_t valid_rows = -1;
  // Replicated, with a gradient that is a partial sum over TP (under sequence parallelism:
  // a row-parallel bias, a norm applied to a sequence shard).
  bool partial_grad = false;
};

// A module that splits its own parameters over TP (the parallel layers; GPTModel for its
// output layer and position table; any user module holding raw shards) describes them,
// keyed by the parameter's name in that module ("weight", "bias").
class ShardedModule {
 public:
  virtual ~ShardedModule() = default;
  virtual std::map<std::string, ParameterLayout> parameter_layouts() const = 0;
};

// A replicated parameter's layout: the whole tensor on every TP rank.
ParameterLayout replicated_layout(const at::Tensor& param, bool partial_grad = false);

// Every parameter of `root`, by its dotted name (named_parameters order), with its
// layout: from the ShardedModule that owns it, else replicated (partial_grad =
// `sequence_parallel`, as a norm under SP).
std::vector<std::pair<std::string, ParameterLayout>> parameter_layouts(const torch::nn::Module& root,
                                                                       bool sequence_parallel = false);

}  // namespace megatorch::tp
