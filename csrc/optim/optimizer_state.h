#pragma once
// DistributedOptimizer's buffers and in-flight work, shared by its source files
// (distributed_optimizer.cpp: buffers, update, state; grad_reduction.cpp: the bucket
// reductions during backward; param_gather_overlap.cpp: ZeRO-1/2's deferred parameter
// gathers; zero3_unit_hooks.cpp: ZeRO-3's just-in-time units). Private to csrc/optim.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "megatorch/comm/group.h"
#include "megatorch/optim/distributed_optimizer.h"

namespace megatorch::optim {

struct BucketState {
  at::Tensor grad_full;    // [n] gradients; stages 2-3: staging, undefined between steps
  at::Tensor grad_shard;   // the owned range [n/d] (stage 0: all n)
  at::Tensor param_full;   // [n] parameters; stage 3: its storage is freed between uses
  at::Tensor param_shard;  // the owned range (stage 3: the only persistent copy)
  at::Tensor master;       // fp32 owned range (aliases param_shard for fp32 parameters)
  at::Tensor exp_avg, exp_avg_sq;  // AdamW; SGD keeps its momentum in exp_avg
  int64_t ready = 0;
  bool launched = false;
  comm::Work work;
  bool gathered = true;
  std::optional<comm::Work> prefetch;
  std::optional<comm::Work> param_gather;  // stages 1-2, overlap_param_gather
};

struct DistributedOptimizer::State {
  std::vector<BucketState> buckets;
  std::vector<at::Tensor> param_buffers, grad_buffers;  // stages 0-2 / 0-1, per dtype
  std::vector<std::vector<int64_t>> unit_buckets;  // buckets whose first parameter is in the unit
  std::vector<std::vector<int64_t>> unit_param_buckets;  // buckets holding any parameter of the unit
  std::vector<int64_t> unit_ready;
};

// Stages 1-2 with overlap_param_gather: hooks that wait for a unit's parameter
// all-gathers before its forward (param_gather_overlap.cpp); nullptr otherwise.
std::shared_ptr<models::UnitHooks> param_gather_hooks(DistributedOptimizer& optimizer);

}  // namespace megatorch::optim
