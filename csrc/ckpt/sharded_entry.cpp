#include "megatorch/ckpt/sharded_entry.h"

#include <algorithm>

#include "megatorch/check.h"

namespace megatorch::ckpt {

namespace {

int64_t product(const std::vector<int64_t>& v, size_t from, size_t to) {
  int64_t p = 1;
  for (size_t i = from; i < to; ++i) p *= v[i];
  return p;
}

}  // namespace

std::vector<int64_t> logical_shape(const ShardedEntry& e) {
  std::vector<int64_t> shape = e.spec.full_shape;
  if (e.valid_rows >= 0 && !shape.empty()) shape[0] = e.valid_rows;
  return shape;
}

int64_t shard_numel(const ShardedEntry& e) {
  const auto s = tp::shard_shape(e.spec);
  return product(s, 0, s.size());
}

int64_t entry_numel(const ShardedEntry& e) { return (e.end < 0 ? shard_numel(e) : e.end) - e.begin; }

void validate_layout(const ShardedEntry& e) {
  const auto& s = e.spec;
  MEGATORCH_CHECK(!e.key.empty(), "checkpoint entry: expected a key, got an empty one");
  // Each check guards the arithmetic after it: world or parts of 0 would divide by zero,
  // a partition dim beyond the rank would index past the shape.
  MEGATORCH_CHECK(s.world >= 1 && s.rank >= 0 && s.rank < s.world && s.parts >= 1, "checkpoint entry '", e.key,
                  "': expected 0 <= rank < world and parts >= 1, got rank ", s.rank, ", world ", s.world, ", parts ",
                  s.parts);
  MEGATORCH_CHECK(s.partition_dim >= -1 && s.partition_dim < static_cast<int64_t>(s.full_shape.size()),
                  "checkpoint entry '", e.key, "': expected a partition dim of -1 (replicated) or a dim of the shape ",
                  c10::IntArrayRef(s.full_shape), ", got ", s.partition_dim);
  int64_t total = 1;
  for (int64_t d : s.full_shape) {
    MEGATORCH_CHECK(d >= 0, "checkpoint entry '", e.key, "': expected sizes >= 0, got the shape ",
                    c10::IntArrayRef(s.full_shape));
    MEGATORCH_CHECK(!__builtin_mul_overflow(total, d, &total), "checkpoint entry '", e.key, "': the shape ",
                    c10::IntArrayRef(s.full_shape), " has more elements than an int64 counts");
  }
  if (s.partition_dim >= 0) {
    // world x parts must divide the partitioned size; computed without overflow so a huge
    // world cannot wrap around into a divisor.
    int64_t split = 0;
    const int64_t size = s.full_shape[s.partition_dim];
    MEGATORCH_CHECK(!__builtin_mul_overflow(s.world, s.parts, &split) && size % split == 0, "checkpoint entry '",
                    e.key, "': expected dim ", s.partition_dim, " of ", c10::IntArrayRef(s.full_shape),
                    " to be divisible by world x parts = ", s.world, " x ", s.parts);
  }
  const int64_t numel = shard_numel(e);
  MEGATORCH_CHECK(e.end >= -1, "checkpoint entry '", e.key, "': expected end >= 0 (or -1: the whole shard), got ",
                  e.end);
  const int64_t end = e.end < 0 ? numel : e.end;
  MEGATORCH_CHECK(e.begin >= 0 && e.begin <= end && end <= numel, "checkpoint entry '", e.key,
                  "': expected a range inside the shard's ", numel, " elements, got [", e.begin, ", ", end, ")");
  MEGATORCH_CHECK(e.valid_rows >= -1 && (e.valid_rows < 0 || (!s.full_shape.empty() && e.valid_rows <= s.full_shape[0])),
                  "checkpoint entry '", e.key, "': expected valid_rows -1 (no padding) or 0..", 
                  s.full_shape.empty() ? 0 : s.full_shape[0], " (the padded rows), got ", e.valid_rows);
}

void validate_entry(const ShardedEntry& e) {
  validate_layout(e);
  const int64_t end = e.end < 0 ? shard_numel(e) : e.end;
  MEGATORCH_CHECK(e.tensor.defined() && e.tensor.numel() == end - e.begin, "checkpoint entry '", e.key,
                  "': expected a tensor of ", end - e.begin, " elements (shard ", c10::IntArrayRef(tp::shard_shape(e.spec)),
                  ", range [", e.begin, ", ", end, ")), got ",
                  e.tensor.defined() ? c10::str(e.tensor.sizes()) : std::string("an undefined tensor"));
}

std::vector<Run> entry_runs(const ShardedEntry& e) {
  const auto& s = e.spec;
  const auto& full = s.full_shape;
  const int64_t total = product(full, 0, full.size());
  std::vector<Run> shard;  // the whole TP shard, before the range and the padding
  if (s.partition_dim < 0 || s.world == 1) {
    shard.push_back({0, 0, total});
  } else {
    // Rank r holds, of each of the `parts` blocks along the partition dim, its r-th slice
    // (slice_for_rank): per outer index and block, one run of rows x inner elements.
    const size_t pd = static_cast<size_t>(s.partition_dim);
    const int64_t outer = product(full, 0, pd), size = full[pd], inner = product(full, pd + 1, full.size());
    const int64_t rows = size / (s.world * s.parts), local_size = size / s.world;
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t p = 0; p < s.parts; ++p) {
        shard.push_back({(o * local_size + p * rows) * inner, (o * size + p * (size / s.parts) + s.rank * rows) * inner,
                         rows * inner});
      }
    }
  }
  // Dim 0 is outermost, so the padded and the logical flat indices agree below the
  // first padding row.
  const int64_t limit = e.valid_rows < 0 ? total : e.valid_rows * product(full, 1, full.size());
  const int64_t begin = e.begin, end = e.end < 0 ? shard_numel(e) : e.end;
  std::vector<Run> out;
  for (const Run& r : shard) {
    const int64_t lo = std::max(r.local, begin);
    int64_t hi = std::min(r.local + r.length, end);
    hi = std::min(hi, r.local + (limit - r.global));  // the padding
    if (hi <= lo) continue;
    out.push_back({lo - begin, r.global + (lo - r.local), hi - lo});
  }
  return out;
}

std::vector<Copy> overlap(const std::vector<Run>& dst, const std::vector<Run>& src) {
  std::vector<Copy> out;
  size_t i = 0, j = 0;
  while (i < dst.size() && j < src.size()) {
    const Run& a = dst[i];
    const Run& b = src[j];
    const int64_t lo = std::max(a.global, b.global);
    const int64_t hi = std::min(a.global + a.length, b.global + b.length);
    if (hi > lo) out.push_back({a.local + (lo - a.global), b.local + (lo - b.global), hi - lo});
    if (a.global + a.length <= b.global + b.length) {
      ++i;
    } else {
      ++j;
    }
  }
  return out;
}

}  // namespace megatorch::ckpt
