#pragma once
// Where every parameter lives in the flat buffers. Parameters are grouped into buckets
// in backward order (last unit, last parameter first), so buckets fill up, and their
// collectives can start, while backward is still running. A bucket holds one dtype and
// is padded to a multiple of the DP size: DP rank r owns the contiguous range
// [r·n/d, (r+1)·n/d) of every bucket (its ZeRO shard).
#include <ATen/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace megatorch::optim {

struct ParamPlace {
  int64_t bucket = 0;
  int64_t offset = 0;  // first element inside the bucket
  int64_t numel = 0;
};

struct BucketPlace {
  int64_t unit = 0;      // the unit its parameters belong to (stage 3 gathers a unit at once)
  at::ScalarType dtype;  // of its parameters
  int64_t begin = 0;     // first element inside the dtype's flat buffer
  int64_t numel = 0;     // padded to a multiple of the DP size
  int64_t used = 0;      // elements that belong to parameters; numel - used is padding
  std::vector<int64_t> params;  // indices into the flattened parameter list
  int64_t shard_numel(int64_t dp) const { return numel / dp; }
};

struct BucketLayout {
  std::vector<ParamPlace> params;  // one per parameter, in the order given
  std::vector<BucketPlace> buckets;
  // Total (padded) elements per dtype buffer, in the order the dtypes first appear.
  std::vector<std::pair<at::ScalarType, int64_t>> buffers;
  int64_t buffer_numel(at::ScalarType dtype) const;
};

inline bool is_16bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Overlap of [a, a + n) and [b, b + m), as (begin, length); length 0 when disjoint.
inline std::pair<int64_t, int64_t> range_overlap(int64_t a, int64_t n, int64_t b, int64_t m) {
  const int64_t lo = std::max(a, b), hi = std::min(a + n, b + m);
  return {lo, std::max<int64_t>(0, hi - lo)};
}

// Megatron-LM's default bucket size: max(40M, 1M·dp) elements.
int64_t default_bucket_size(int64_t dp);

// `units` lists the parameters unit by unit (a transformer layer, the embedding...).
// With `bucket_per_unit` (ZeRO-3) every unit is one bucket per dtype; otherwise a bucket
// closes once it holds at least `bucket_size` elements. A parameter marked in `alone`
// (flattened index) gets a bucket of its own, so that two ranks holding copies of it in
// different models (the tied embedding on the first and last pipeline stage) shard it
// alike: the same elements in the same DP rank's range.
BucketLayout build_bucket_layout(const std::vector<std::vector<at::Tensor>>& units, int64_t bucket_size, int64_t dp,
                                 bool bucket_per_unit, const std::vector<bool>& alone = {});

}  // namespace megatorch::optim
