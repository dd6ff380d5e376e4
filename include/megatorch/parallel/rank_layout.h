#pragma once
// Pure arithmetic of Megatron's rank order: tensor-parallel fastest, then context, then
// data, then pipeline (tp-cp-dp-pp):
//   rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)).
// Expert layers (MoE) fold their own layout into each pipeline stage's tp x cp x dp ranks
// (Megatron-core's "parallel folding"), expert-tensor fastest, then expert, then
// expert-data (etp-ep-edp):
//   rank mod (tp * cp * dp) = etp_rank + etp * (ep_rank + ep * edp_rank).
// No processes, no I/O, so it can be checked for every (world, tp, cp, pp) in a unit test.
#include <cstdint>
#include <string>
#include <vector>

namespace megatorch::parallel {

// kContext splits the sequence (context parallelism); kDataContext is DP x CP, the ranks
// that hold the same parameters (they are replicated over CP), over which gradients are
// reduced and ZeRO shards. The expert kinds split a pipeline stage for the expert layers:
// kExpert distributes the experts (token all-to-all), kExpertTensor splits each expert's
// weights, kExpertData holds replicas of the same experts (their gradients reduce over it).
enum class GroupKind {
  kWorld,
  kTensor,
  kData,
  kPipeline,
  kContext,
  kDataContext,
  kExpert,
  kExpertTensor,
  kExpertData
};

// Short name used in group names and messages: "world", "tp", "dp", "pp", "cp", "dp_cp",
// "ep", "etp", "edp".
const char* group_kind_name(GroupKind kind);

struct RankCoord {
  int64_t tp = 0;
  int64_t dp = 0;
  int64_t pp = 0;
  int64_t cp = 0;
  bool operator==(const RankCoord& o) const { return tp == o.tp && dp == o.dp && pp == o.pp && cp == o.cp; }
};

// A rank's place in the expert layers' layout; pp is the pipeline stage, as in RankCoord.
struct ExpertCoord {
  int64_t etp = 0;
  int64_t ep = 0;
  int64_t edp = 0;
  int64_t pp = 0;
  bool operator==(const ExpertCoord& o) const { return etp == o.etp && ep == o.ep && edp == o.edp && pp == o.pp; }
};

class RankLayout {
 public:
  // Validates: every size >= 1, world divisible by tp * cp * pp, and tp * cp * dp (the
  // ranks of one pipeline stage) divisible by ep * etp.
  RankLayout(int64_t world_size, int64_t tensor_parallel_size, int64_t pipeline_parallel_size,
             int64_t context_parallel_size = 1, int64_t expert_parallel_size = 1,
             int64_t expert_tensor_parallel_size = 1);

  int64_t world_size() const { return world_; }
  int64_t tp_size() const { return tp_; }
  int64_t pp_size() const { return pp_; }
  int64_t dp_size() const { return dp_; }
  int64_t cp_size() const { return cp_; }
  int64_t ep_size() const { return ep_; }
  int64_t etp_size() const { return etp_; }
  int64_t edp_size() const { return edp_; }  // tp * cp * dp / (ep * etp)
  int64_t size(GroupKind kind) const;

  RankCoord coord(int64_t rank) const;
  int64_t rank_of(const RankCoord& c) const;
  ExpertCoord expert_coord(int64_t rank) const;
  int64_t expert_rank_of(const ExpertCoord& c) const;

  // Every group of a kind, each as ascending global ranks, in a fixed order that is
  // the same on every rank (the group's index in this list is its id).
  std::vector<std::vector<int64_t>> groups(GroupKind kind) const;
  // The index (into groups(kind)) and the members of the group `rank` belongs to.
  int64_t group_index(GroupKind kind, int64_t rank) const;
  std::vector<int64_t> group_ranks(GroupKind kind, int64_t rank) const;

  // "world 16 = tp 2 x dp 2 x pp 4" (with "x cp c" when c > 1), and
  // " (experts: etp E x ep P x edp D)" when ep * etp > 1.
  std::string describe() const;

 private:
  int64_t world_, tp_, pp_, cp_, dp_, ep_, etp_, edp_;
};

}  // namespace megatorch::parallel
