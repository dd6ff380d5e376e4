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
  MEGATORCH_CHECK(s.outer_world >= 1 && s.outer_rank >= 0 && s.outer_rank < s.outer_world, "checkpoint entry '",
                  e.key, "': expected 0 <= outer_rank < outer_world, got outer_rank ", s.outer_rank, ", outer_world ",
                  s.outer_world);
  if (s.outer_world > 1) {
    MEGATORCH_CHECK(!s.full_shape.empty() && s.partition_dim != 0 && s.full_shape[0] % s.outer_world == 0,
                    "checkpoint entry '", e.key, "': expected an outer split of dim 0 of ", c10::IntArrayRef(s.full_shape),
                    " into ", s.outer_world, " equal blocks, with the partition dim elsewhere (got ", s.partition_dim, ")");
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
  // The whole shard, before the range and the padding: per dim, the index intervals
  // (global start, length) the shard keeps, in its own order.
  const size_t nd = full.size();
  std::vector<std::vector<std::pair<int64_t, int64_t>>> kept(nd);
  for (size_t d = 0; d < nd; ++d) kept[d] = {{0, full[d]}};
  if (s.outer_world > 1) kept[0] = {{s.outer_rank * (full[0] / s.outer_world), full[0] / s.outer_world}};
  if (s.partition_dim >= 0 && s.world > 1) {
    // Rank r holds, of each of the `parts` blocks along the partition dim, its r-th slice
    // (slice_for_rank).
    const size_t pd = static_cast<size_t>(s.partition_dim);
    const int64_t size = full[pd], rows = size / (s.world * s.parts);
    kept[pd].clear();
    for (int64_t p = 0; p < s.parts; ++p) kept[pd].push_back({p * (size / s.parts) + s.rank * rows, rows});
  }
  // Dims after the last split one are contiguous: one run per interval of that dim and
  // index of the dims before it.
  size_t last = 0;
  bool split = false;
  for (size_t d = 0; d < nd; ++d) {
    if (kept[d].size() != 1 || kept[d][0].second != full[d]) last = d, split = true;
  }
  std::vector<Run> shard;
  if (!split) {
    shard.push_back({0, 0, total});
  } else {
    const int64_t inner = product(full, last + 1, nd);
    std::vector<int64_t> index(last, 0);  // position in each outer dim's kept indices
    std::vector<std::vector<int64_t>> outer(last);
    bool empty = false;
    for (size_t d = 0; d < last; ++d) {
      for (const auto& [start, length] : kept[d]) {
        for (int64_t i = 0; i < length; ++i) outer[d].push_back(start + i);
      }
      empty = empty || outer[d].empty();
    }
    int64_t local = 0;
    while (!empty) {
      int64_t base = 0;  // the global flat offset of the outer dims' indices
      for (size_t d = 0; d < last; ++d) base = base * full[d] + outer[d][index[d]];
      for (const auto& [start, length] : kept[last]) {
        shard.push_back({local, (base * full[last] + start) * inner, length * inner});
        local += length * inner;
      }
      size_t d = last;  // the odometer over the outer dims
      while (d > 0 && ++index[d - 1] == static_cast<int64_t>(outer[d - 1].size())) index[--d] = 0;
      if (d == 0) break;
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
