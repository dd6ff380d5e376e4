#include "megatorch/tp/init.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "megatorch/check.h"
#include "megatorch/util/fnv1a.h"

namespace megatorch::tp {

uint64_t name_seed(int64_t seed, const std::string& name, int64_t salt) {
  // Byte by byte (integers little-endian), so the seeds never depend on the platform.
  util::Fnv1a h;
  auto mix_int = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) h.mix((static_cast<uint64_t>(v) >> (8 * i)) & 0xff);
  };
  mix_int(seed);
  h.mix_bytes(name);
  mix_int(salt);
  return h.value();
}

std::vector<int64_t> shard_shape(const ShardSpec& spec) {
  std::vector<int64_t> shape = spec.full_shape;
  if (spec.outer_world > 1) {
    MEGATORCH_CHECK(!shape.empty() && spec.partition_dim != 0, "expected an outer split of dim 0 with the partition ",
                    "dim elsewhere, got a shape ", c10::IntArrayRef(shape), " and partition dim ", spec.partition_dim);
    MEGATORCH_CHECK(shape[0] % spec.outer_world == 0, "expected dim 0 of size ", shape[0],
                    " to be divisible by the outer split ", spec.outer_world,
                    "; choose sizes that the expert-parallel size divides");
    shape[0] /= spec.outer_world;
  }
  if (spec.partition_dim < 0) return shape;
  MEGATORCH_CHECK(spec.partition_dim < static_cast<int64_t>(shape.size()), "expected partition dim < ",
                  shape.size(), ", got ", spec.partition_dim);
  const int64_t size = shape[spec.partition_dim];
  MEGATORCH_CHECK(size % (spec.world * spec.parts) == 0, "expected dim ", spec.partition_dim, " of size ", size,
                  " to be divisible by tensor-parallel size x parts = ", spec.world, " x ", spec.parts,
                  "; choose sizes that the tensor-parallel size divides");
  shape[spec.partition_dim] = size / spec.world;
  return shape;
}

at::Tensor slice_for_rank(const at::Tensor& full, const ShardSpec& spec) {
  if (!spec.is_split()) return full;
  shard_shape(spec);  // validates
  at::Tensor t = spec.outer_world > 1 ? full.chunk(spec.outer_world, 0)[spec.outer_rank] : full;
  if (spec.partition_dim < 0 || spec.world == 1) return t.contiguous();
  std::vector<at::Tensor> pieces;
  for (const auto& block : t.chunk(spec.parts, spec.partition_dim)) {
    pieces.push_back(block.chunk(spec.world, spec.partition_dim)[spec.rank]);
  }
  return at::cat(pieces, spec.partition_dim).contiguous();
}

at::Tensor init_shard(const ShardSpec& spec, const std::string& name, int64_t seed, InitMethod method, double std,
                      bool shard_local) {
  const auto local = shard_shape(spec);
  if (method == InitMethod::kZeros) return at::zeros(local, at::kFloat);
  if (method == InitMethod::kOnes) return at::ones(local, at::kFloat);
  const bool sharded = spec.is_split();
  // Each shard of a (outer x inner)-split weight draws from its own stream.
  const int64_t shard = spec.rank + spec.world * spec.outer_rank;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(name_seed(seed, name, shard_local && sharded ? shard + 1 : 0));
  if (shard_local && sharded) return at::normal(0.0, std, local, gen, at::TensorOptions().dtype(at::kFloat));
  at::Tensor full = at::normal(0.0, std, spec.full_shape, gen, at::TensorOptions().dtype(at::kFloat));
  return slice_for_rank(full, spec);
}

}  // namespace megatorch::tp
