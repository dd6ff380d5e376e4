#include "megatorch/parallel/rank_layout.h"

#include <sstream>

#include "megatorch/check.h"

namespace megatorch::parallel {
namespace {

bool is_expert(GroupKind kind) {
  return kind == GroupKind::kExpert || kind == GroupKind::kExpertTensor || kind == GroupKind::kExpertData;
}

}  // namespace

const char* group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::kWorld: return "world";
    case GroupKind::kTensor: return "tp";
    case GroupKind::kData: return "dp";
    case GroupKind::kPipeline: return "pp";
    case GroupKind::kContext: return "cp";
    case GroupKind::kDataContext: return "dp_cp";
    case GroupKind::kExpert: return "ep";
    case GroupKind::kExpertTensor: return "etp";
    case GroupKind::kExpertData: return "edp";
  }
  return "?";
}

RankLayout::RankLayout(int64_t world_size, int64_t tp, int64_t pp, int64_t cp, int64_t ep, int64_t etp)
    : world_(world_size), tp_(tp), pp_(pp), cp_(cp), dp_(0), ep_(ep), etp_(etp), edp_(0) {
  MEGATORCH_CHECK(world_size >= 1, "expected a world size >= 1, got ", world_size,
                  "; launch with torchrun --nproc-per-node=N (N >= 1)");
  MEGATORCH_CHECK(tp >= 1, "expected --tensor-model-parallel-size >= 1, got ", tp);
  MEGATORCH_CHECK(pp >= 1, "expected --pipeline-model-parallel-size >= 1, got ", pp);
  MEGATORCH_CHECK(cp >= 1, "expected --context-parallel-size >= 1, got ", cp);
  MEGATORCH_CHECK(ep >= 1, "expected --expert-model-parallel-size >= 1, got ", ep);
  MEGATORCH_CHECK(etp >= 1, "expected --expert-tensor-parallel-size >= 1, got ", etp);
  int64_t product = 0;  // tp x cp x pp, unless it overflows int64
  const bool fits = !__builtin_mul_overflow(tp, pp, &product) && !__builtin_mul_overflow(product, cp, &product);
  // Without CP the message names only the sizes the user set.
  const std::string kinds = cp == 1 ? "tensor-model-parallel-size x pipeline-model-parallel-size"
                                    : "tensor-model-parallel-size x context-parallel-size x pipeline-model-parallel-size";
  const std::string sizes = std::to_string(tp) + (cp == 1 ? "" : " x " + std::to_string(cp)) + " x " + std::to_string(pp);
  MEGATORCH_CHECK(fits && world_size % product == 0, "expected the world size to be divisible by ", kinds, " = ",
                  sizes, fits ? " = " + std::to_string(product) : std::string(" (more than int64 holds)"),
                  ", got world size ", world_size, "; choose ", cp == 1 ? "tp and pp" : "tp, cp and pp",
                  " whose product divides the number of ranks");
  dp_ = world_size / (tp * cp * pp);
  // The expert layers re-split each pipeline stage's ranks, so ep x etp must divide them.
  const int64_t stage = world_size / pp;  // tp x cp x dp
  int64_t experts = 0;                    // ep x etp, unless it overflows int64
  const bool experts_fit = !__builtin_mul_overflow(ep, etp, &experts);
  MEGATORCH_CHECK(experts_fit && stage % experts == 0,
                  "expected --expert-model-parallel-size x --expert-tensor-parallel-size to divide tp x cp x dp = ", tp,
                  " x ", cp, " x ", dp_, " = ", stage, " ranks per pipeline stage, got ", ep, " x ", etp,
                  experts_fit ? " = " + std::to_string(experts) : std::string(" (more than int64 holds)"),
                  "; choose ep and etp whose product divides ", stage,
                  " (the expert layers fold into each stage's ranks)");
  edp_ = stage / experts;
}

int64_t RankLayout::size(GroupKind kind) const {
  switch (kind) {
    case GroupKind::kWorld: return world_;
    case GroupKind::kTensor: return tp_;
    case GroupKind::kData: return dp_;
    case GroupKind::kPipeline: return pp_;
    case GroupKind::kContext: return cp_;
    case GroupKind::kDataContext: return dp_ * cp_;
    case GroupKind::kExpert: return ep_;
    case GroupKind::kExpertTensor: return etp_;
    case GroupKind::kExpertData: return edp_;
  }
  return 0;
}

RankCoord RankLayout::coord(int64_t rank) const {
  MEGATORCH_CHECK(rank >= 0 && rank < world_, "expected a rank in [0, ", world_, "), got ", rank);
  RankCoord c;
  c.tp = rank % tp_;
  c.cp = (rank / tp_) % cp_;
  c.dp = (rank / (tp_ * cp_)) % dp_;
  c.pp = rank / (tp_ * cp_ * dp_);
  return c;
}

int64_t RankLayout::rank_of(const RankCoord& c) const {
  MEGATORCH_CHECK(c.tp >= 0 && c.tp < tp_ && c.dp >= 0 && c.dp < dp_ && c.pp >= 0 && c.pp < pp_ && c.cp >= 0 &&
                      c.cp < cp_,
                  "expected a coordinate inside tp ", tp_, " x cp ", cp_, " x dp ", dp_, " x pp ", pp_, ", got (tp ",
                  c.tp, ", cp ", c.cp, ", dp ", c.dp, ", pp ", c.pp, ")");
  return c.tp + tp_ * (c.cp + cp_ * (c.dp + dp_ * c.pp));
}

ExpertCoord RankLayout::expert_coord(int64_t rank) const {
  MEGATORCH_CHECK(rank >= 0 && rank < world_, "expected a rank in [0, ", world_, "), got ", rank);
  const int64_t stage = tp_ * cp_ * dp_;
  const int64_t local = rank % stage;
  ExpertCoord c;
  c.etp = local % etp_;
  c.ep = (local / etp_) % ep_;
  c.edp = local / (etp_ * ep_);
  c.pp = rank / stage;
  return c;
}

int64_t RankLayout::expert_rank_of(const ExpertCoord& c) const {
  MEGATORCH_CHECK(c.etp >= 0 && c.etp < etp_ && c.ep >= 0 && c.ep < ep_ && c.edp >= 0 && c.edp < edp_ && c.pp >= 0 &&
                      c.pp < pp_,
                  "expected an expert coordinate inside etp ", etp_, " x ep ", ep_, " x edp ", edp_, " x pp ", pp_,
                  ", got (etp ", c.etp, ", ep ", c.ep, ", edp ", c.edp, ", pp ", c.pp, ")");
  return c.etp + etp_ * (c.ep + ep_ * (c.edp + edp_ * c.pp));
}

// A group is the set of ranks that differ only in the coordinates of its kind. Its index
// enumerates the remaining coordinates with the faster-varying one first, which gives
// Megatron's order: tp groups by (cp, dp, pp), cp groups by (tp, dp, pp), dp groups by
// (tp, cp, pp), dp x cp groups by (tp, pp), pp groups by (tp, cp, dp); and in the expert
// layout ep groups by (etp, edp, pp), etp groups by (ep, edp, pp), edp groups by (etp, ep, pp).
int64_t RankLayout::group_index(GroupKind kind, int64_t rank) const {
  const RankCoord c = coord(rank);
  const ExpertCoord e = is_expert(kind) ? expert_coord(rank) : ExpertCoord{};  // unused otherwise
  switch (kind) {
    case GroupKind::kWorld: return 0;
    case GroupKind::kTensor: return c.cp + cp_ * (c.dp + dp_ * c.pp);
    case GroupKind::kData: return c.tp + tp_ * (c.cp + cp_ * c.pp);
    case GroupKind::kPipeline: return c.tp + tp_ * (c.cp + cp_ * c.dp);
    case GroupKind::kContext: return c.tp + tp_ * (c.dp + dp_ * c.pp);
    case GroupKind::kDataContext: return c.tp + tp_ * c.pp;
    case GroupKind::kExpert: return e.etp + etp_ * (e.edp + edp_ * e.pp);
    case GroupKind::kExpertTensor: return e.ep + ep_ * (e.edp + edp_ * e.pp);
    case GroupKind::kExpertData: return e.etp + etp_ * (e.ep + ep_ * e.pp);
  }
  return 0;
}

// Members in ascending global rank: the varying coordinates with cp faster than dp (and
// one expert coordinate at a time), as the rank order has them.
std::vector<int64_t> RankLayout::group_ranks(GroupKind kind, int64_t rank) const {
  const RankCoord c = coord(rank);
  const ExpertCoord e = is_expert(kind) ? expert_coord(rank) : ExpertCoord{};  // unused otherwise
  std::vector<int64_t> ranks;
  ranks.reserve(size(kind));
  for (int64_t i = 0; i < size(kind); ++i) {
    RankCoord m = c;
    ExpertCoord x = e;
    switch (kind) {
      case GroupKind::kWorld: ranks.push_back(i); continue;
      case GroupKind::kTensor: m.tp = i; break;
      case GroupKind::kData: m.dp = i; break;
      case GroupKind::kPipeline: m.pp = i; break;
      case GroupKind::kContext: m.cp = i; break;
      case GroupKind::kDataContext:
        m.cp = i % cp_;
        m.dp = i / cp_;
        break;
      case GroupKind::kExpert: x.ep = i; ranks.push_back(expert_rank_of(x)); continue;
      case GroupKind::kExpertTensor: x.etp = i; ranks.push_back(expert_rank_of(x)); continue;
      case GroupKind::kExpertData: x.edp = i; ranks.push_back(expert_rank_of(x)); continue;
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
  os << "world " << world_ << " = tp " << tp_;
  if (cp_ > 1) os << " x cp " << cp_;
  os << " x dp " << dp_ << " x pp " << pp_;
  if (ep_ * etp_ > 1) os << " (experts: etp " << etp_ << " x ep " << ep_ << " x edp " << edp_ << ")";
  return os.str();
}

}  // namespace megatorch::parallel
