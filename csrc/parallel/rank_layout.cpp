#include "megatorch/parallel/rank_layout.h"

#include <sstream>

#include "megatorch/check.h"

namespace megatorch::parallel {

const char* group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::kWorld: return "world";
    case GroupKind::kTensor: return "tp";
    case GroupKind::kData: return "dp";
    case GroupKind::kPipeline: return "pp";
  }
  return "?";
}

RankLayout::RankLayout(int64_t world_size, int64_t tp, int64_t pp)
    : world_(world_size), tp_(tp), pp_(pp), dp_(0) {
  MEGATORCH_CHECK(world_size >= 1, "expected a world size >= 1, got ", world_size,
                  "; launch with torchrun --nproc-per-node=N (N >= 1)");
  MEGATORCH_CHECK(tp >= 1, "expected --tensor-model-parallel-size >= 1, got ", tp);
  MEGATORCH_CHECK(pp >= 1, "expected --pipeline-model-parallel-size >= 1, got ", pp);
  MEGATORCH_CHECK(world_size % (tp * pp) == 0, "expected the world size to be divisible by ",
                  "tensor-model-parallel-size x pipeline-model-parallel-size = ", tp, " x ", pp,
                  " = ", tp * pp, ", got world size ", world_size,
                  "; choose tp and pp whose product divides the number of ranks");
  dp_ = world_size / (tp * pp);
}

int64_t RankLayout::size(GroupKind kind) const {
  switch (kind) {
    case GroupKind::kWorld: return world_;
    case GroupKind::kTensor: return tp_;
    case GroupKind::kData: return dp_;
    case GroupKind::kPipeline: return pp_;
  }
  return 0;
}

RankCoord RankLayout::coord(int64_t rank) const {
  MEGATORCH_CHECK(rank >= 0 && rank < world_, "expected a rank in [0, ", world_, "), got ", rank);
  return RankCoord{rank % tp_, (rank / tp_) % dp_, rank / (tp_ * dp_)};
}

int64_t RankLayout::rank_of(const RankCoord& c) const {
  MEGATORCH_CHECK(c.tp >= 0 && c.tp < tp_ && c.dp >= 0 && c.dp < dp_ && c.pp >= 0 && c.pp < pp_,
                  "expected a coordinate inside tp ", tp_, " x dp ", dp_, " x pp ", pp_, ", got (tp ",
                  c.tp, ", dp ", c.dp, ", pp ", c.pp, ")");
  return c.tp + tp_ * (c.dp + dp_ * c.pp);
}

// A group is the set of ranks that differ only in the coordinate of its kind. Its index
// enumerates the remaining coordinates with the faster-varying one first, which gives
// Megatron's order: tp groups by (dp, pp), dp groups by (tp, pp), pp groups by (tp, dp).
int64_t RankLayout::group_index(GroupKind kind, int64_t rank) const {
  const RankCoord c = coord(rank);
  switch (kind) {
    case GroupKind::kWorld: return 0;
    case GroupKind::kTensor: return c.dp + dp_ * c.pp;
    case GroupKind::kData: return c.tp + tp_ * c.pp;
    case GroupKind::kPipeline: return c.tp + tp_ * c.dp;
  }
  return 0;
}

std::vector<int64_t> RankLayout::group_ranks(GroupKind kind, int64_t rank) const {
  const RankCoord c = coord(rank);
  std::vector<int64_t> ranks;
  ranks.reserve(size(kind));
  for (int64_t i = 0; i < size(kind); ++i) {
    RankCoord m = c;
    switch (kind) {
      case GroupKind::kWorld: ranks.push_back(i); continue;
      case GroupKind::kTensor: m.tp = i; break;
      case GroupKind::kData: m.dp = i; break;
      case GroupKind::kPipeline: m.pp = i; break;
    }
    ranks.push_back(rank_of(m));
  }
  return ranks;
}

std::vector<std::vector<int64_t>> RankLayout::groups(GroupKind kind) const {
  const int64_t count = world_ / size(kind);
  std::vector<std::vector<int64_t>> out(count);
  for (int64_t r = 0; r < world_; ++r) {
    auto& g = out[group_index(kind, r)];
    if (g.empty()) g = group_ranks(kind, r);
  }
  return out;
}

std::string RankLayout::describe() const {
  std::ostringstream os;
  os << "world " << world_ << " = tp " << tp_ << " x dp " << dp_ << " x pp " << pp_;
  return os.str();
}

}  // namespace megatorch::parallel
