#pragma once
// Initialisation that gives the same numbers at every TP size: the full weight is
// generated from a generator seeded by (seed, parameter name) and each rank keeps its
// slice, so a TP=4 shard equals the matching slice of the TP=1 weight exactly.
// `shard_local` instead draws only the shard (seeded by seed, name and rank): no full
// tensor is ever allocated, for models too large for that, at the price of numbers
// that depend on the TP size.
#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <string>
#include <vector>

namespace megatorch::tp {

// How a layer's parameters are created: `name` prefixes the parameter
// names that seed the generator, so two layers never draw the same numbers.
struct ParamInitOptions {
  TORCH_ARG(std::string, name) = "param";
  TORCH_ARG(int64_t, seed) = 1234;
  TORCH_ARG(double, std) = 0.02;
  TORCH_ARG(bool, shard_local) = false;
  TORCH_ARG(c10::ScalarType, dtype) = c10::kFloat;
  TORCH_ARG(c10::Device, device) = c10::kCPU;
};

enum class InitMethod { kNormal, kZeros, kOnes };

struct ShardSpec {
  std::vector<int64_t> full_shape;  // the unsharded parameter
  int64_t partition_dim = -1;       // -1: replicated, the full tensor on every rank
  int64_t rank = 0;
  int64_t world = 1;
  // A fused weight made of `parts` equal blocks along partition_dim (e.g. SwiGLU's
  // [gate; up]) is sharded block by block: rank r keeps the r-th slice of each block.
  int64_t parts = 1;
  // A second, outer split of dim 0 into `outer_world` contiguous blocks, of which this
  // rank holds block `outer_rank`, taken before the split above (expert weights [E, ...]:
  // each expert-parallel rank's experts, split again over expert-TP). partition_dim is
  // then another dim.
  int64_t outer_rank = 0;
  int64_t outer_world = 1;

  bool is_split() const { return (partition_dim >= 0 && world > 1) || outer_world > 1; }
};

std::vector<int64_t> shard_shape(const ShardSpec& spec);

// The shard of the full parameter `name` (fp32 on CPU; the caller casts and moves).
at::Tensor init_shard(const ShardSpec& spec, const std::string& name, int64_t seed, InitMethod method,
                      double std = 0.02, bool shard_local = false);

// The rank's slice of a full tensor under `spec` (also used to check parity in tests).
at::Tensor slice_for_rank(const at::Tensor& full, const ShardSpec& spec);

// Stable 64-bit seed from (seed, name): FNV-1a, identical on every platform and rank.
uint64_t name_seed(int64_t seed, const std::string& name, int64_t salt = 0);

}  // namespace megatorch::tp
