#pragma once
// Pure arithmetic of Megatron's rank order: tensor-parallel fastest, then context, then
// data, then pipeline (tp-cp-dp-pp):
//   rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)).
// No processes, no I/O, so it can be checked for every (world, tp, cp, pp) in a unit test.
#include <cstdint>
#include <string>
#include <vector>

namespace megatorch::parallel {

// kContext splits the sequence (context parallelism); kDataContext is DP x CP, the ranks
// that hold the same parameters (they are replicated over CP), over which gradients are
// reduced and ZeRO shards.
enum class GroupKind { kWorld, kTensor, kData, kPipeline, kContext, kDataContext };

// Short name used in group names and messages: "world", "tp", "dp", "pp", "cp", "dp_cp".
const char* group_kind_name(GroupKind kind);

struct RankCoord {
  int64_t tp = 0;
  int64_t dp = 0;
  int64_t pp = 0;
  int64_t cp = 0;
  bool operator==(const RankCoord& o) const { return tp == o.tp && dp == o.dp && pp == o.pp && cp == o.cp; }
};

class RankLayout {
 public:
  // Validates: every size >= 1 and world divisible by tp * cp * pp.
  RankLayout(int64_t world_size, int64_t tensor_parallel_size, int64_t pipeline_parallel_size,
             int64_t context_parallel_size = 1);

  int64_t world_size() const { return world_; }
  int64_t tp_size() const { return tp_; }
  int64_t pp_size() const { return pp_; }
  int64_t dp_size() const { return dp_; }
  int64_t cp_size() const { return cp_; }
  int64_t size(GroupKind kind) const;

  RankCoord coord(int64_t rank) const;
  int64_t rank_of(const RankCoord& c) const;

  // Every group of a kind, each as ascending global ranks, in a fixed order that is
  // the same on every rank (the group's index in this list is its id).
  std::vector<std::vector<int64_t>> groups(GroupKind kind) const;
  // The index (into groups(kind)) and the members of the group `rank` belongs to.
  int64_t group_index(GroupKind kind, int64_t rank) const;
  std::vector<int64_t> group_ranks(GroupKind kind, int64_t rank) const;

  std::string describe() const;  // "world 16 = tp 2 x dp 2 x pp 4" (with "x cp c" when c > 1)

 private:
  int64_t world_, tp_, pp_, cp_, dp_;
};

}  // namespace megatorch::parallel
