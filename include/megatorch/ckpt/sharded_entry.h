#pragma once
// ShardedEntry: one rank's piece of one global tensor, described independently of the
// layout that produced it. A global tensor has a key ("model/layers.3.mlp.fc1.weight",
// "optim/exp_avg/..."), a logical shape, and pieces: a TP shard (tp::ShardSpec: full
// shape, partition dim, rank, world, fused parts) of which the entry holds a range of
// the flattened elements (a ZeRO shard). Any piece maps onto the global tensor as runs
// of consecutive elements, which is all that saving and resharding need.
#include <ATen/Tensor.h>

#include <string>
#include <vector>

#include "megatorch/tp/init.h"

namespace megatorch::ckpt {

struct ShardedEntry {
  std::string key;  // global and layout-independent (global layer index, not the stage's)
  tp::ShardSpec spec;
  // Element range [begin, end) of the flattened TP shard held by this entry; end = -1:
  // the whole shard. `tensor` holds exactly end - begin elements (any shape).
  int64_t begin = 0, end = -1;
  // Rows of dim 0 that are real when spec.full_shape[0] is padded (a vocabulary padded to
  // a multiple of tp): the checkpoint holds [valid_rows, ...] and load zeroes the
  // padding, so TP sizes with different paddings exchange checkpoints. -1: no padding.
  int64_t valid_rows = -1;
  at::Tensor tensor;  // save: the data (any dtype, device); load: filled in place (cast)
  bool write = true;  // false for copies another rank writes (DP replicas, TP-replicated)
};

// A run of `length` consecutive elements: `local` indexes the entry's flat tensor,
// `global` the flat logical tensor.
struct Run {
  int64_t local = 0, global = 0, length = 0;
};

// The logical shape of the entry's global tensor (full_shape with dim 0 = valid_rows).
std::vector<int64_t> logical_shape(const ShardedEntry& e);
// Elements in the TP shard, and in the entry (end - begin).
int64_t shard_numel(const ShardedEntry& e);
int64_t entry_numel(const ShardedEntry& e);
// Checks the spec (rank < world, parts >= 1, partition dim -1 or inside the shape, sizes
// >= 0 without int64 overflow, divisibility), the range and valid_rows, naming the key:
// what shard_numel and entry_runs need to be safe. Load runs it on every saved piece
// described by metadata.json before using it.
void validate_layout(const ShardedEntry& e);
// validate_layout, and the tensor's element count.
void validate_entry(const ShardedEntry& e);
// The entry's elements as runs over the logical tensor, ascending in both indices;
// padding rows are left out.
std::vector<Run> entry_runs(const ShardedEntry& e);

// Copies between two entries' runs: (destination local, source local, length) for every
// element both hold. Both run lists ascending by global index.
struct Copy {
  int64_t dst = 0, src = 0, length = 0;
};
std::vector<Copy> overlap(const std::vector<Run>& dst, const std::vector<Run>& src);

}  // namespace megatorch::ckpt
