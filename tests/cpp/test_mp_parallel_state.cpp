// ParallelState under torchrun: the groups this rank joins match the layout, and a
// collective on each group reaches exactly its members.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <iterator>
#include <tuple>
#include <utility>

#include "mp_util.h"

using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
using megatorch::parallel::RankLayout;

namespace {

// The smallest prime factor of n (n itself when prime; 1 for 1).
int64_t smallest_factor(int64_t n) {
  for (int64_t f = 2; f * f <= n; ++f)
    if (n % f == 0) return f;
  return n;
}

}  // namespace

// One ParallelState per (tp, cp, pp), as many as without experts: each Gloo group costs
// time to make and to tear down. The expert sizes take turns through (ep, etp) = (1, 1),
// (f, 1), (1, f), (f, f), f the smallest factor of a stage's ranks, skipping a turn that
// does not divide the stage, so over the sweep each expert kind is met at size 1 and
// above, as a group of its own and as another kind's alias.
TEST_CASE("every group of every valid (tp, cp, pp) reaches exactly its members", "[mp]") {
  const int64_t world = mp::world_size();
  // In the order ParallelState builds them (kinds equal to an earlier one alias it).
  const GroupKind kinds[] = {GroupKind::kWorld,    GroupKind::kTensor,       GroupKind::kData,
                             GroupKind::kPipeline, GroupKind::kContext,      GroupKind::kDataContext,
                             GroupKind::kExpert,   GroupKind::kExpertTensor, GroupKind::kExpertData};
  int64_t turn = 0;  // index of the next (ep, etp) choice
  for (int64_t tp = 1; tp <= world; ++tp) {
    for (int64_t pp = 1; tp * pp <= world; ++pp) {
     for (int64_t cp = 1; tp * pp * cp <= world; ++cp) {
      if (world % (tp * pp * cp)) continue;
      const int64_t stage = world / pp;
      const int64_t f = smallest_factor(stage);
      const std::pair<int64_t, int64_t> choices[] = {{1, 1}, {f, 1}, {1, f}, {f, f}};
      int64_t ep = 1, etp = 1;
      for (int64_t i = 0; f > 1 && i < 4; ++i) {
        const int64_t c = (turn + i) % 4;
        if (stage % (choices[c].first * choices[c].second) == 0) {
          std::tie(ep, etp) = choices[c];
          turn = (c + 1) % 4;
          break;
        }
      }
      const std::string name = "ps_" + std::to_string(tp) + "_" + std::to_string(pp) + "_" + std::to_string(cp) +
                               "_" + std::to_string(ep) + "_" + std::to_string(etp);
      auto st = std::make_unique<megatorch::parallel::ParallelState>(
          megatorch::parallel::ParallelStateOptions(tp, pp)
              .context_parallel_size(cp)
              .expert_model_parallel_size(ep)
              .expert_tensor_parallel_size(etp)
              .name(name)
              .device("cpu"));
      RankLayout layout(world, tp, pp, cp, ep, etp);
      INFO(st->describe());
      CHECK(st->rank() == mp::rank());
      CHECK(st->coord() == layout.coord(mp::rank()));
      CHECK(st->cp_size() == cp);
      CHECK(st->ep_size() == ep);
      CHECK(st->etp_size() == etp);
      CHECK(st->edp_size() == layout.edp_size());
      const auto e = layout.expert_coord(mp::rank());
      CHECK(st->ep_rank() == e.ep);
      CHECK(st->etp_rank() == e.etp);
      CHECK(st->edp_rank() == e.edp);
      for (size_t k = 0; k < std::size(kinds); ++k) {
        const GroupKind kind = kinds[k];
        Group g(*st, kind);
        const auto members = layout.group_ranks(kind, mp::rank());
        REQUIRE(st->group_ranks(kind) == members);
        CHECK(g.size() == static_cast<int64_t>(members.size()));
        CHECK(st->process_group(kind)->getSize() == static_cast<int64_t>(members.size()));
        // Sum of 2^rank over the group identifies the member set exactly.
        auto x = torch::full({1}, static_cast<double>(int64_t{1} << mp::rank()), torch::kDouble);
        g.all_reduce(x);
        double expect = 0;
        for (int64_t m : members) expect += static_cast<double>(int64_t{1} << m);
        CHECK(x.item<double>() == expect);
        CHECK(members[g.rank()] == mp::rank());
        // The first kind with these members owns the connection; later ones alias it
        // (size-1 groups included), and kinds with other members never share it.
        size_t first = 0;
        while (layout.group_ranks(kinds[first], mp::rank()) != members) ++first;
        CHECK(st->process_group(kind).get() == st->process_group(kinds[first]).get());
        for (size_t j = 0; j < k; ++j) {
          if (layout.group_ranks(kinds[j], mp::rank()) != members)
            CHECK(st->process_group(kind).get() != st->process_group(kinds[j]).get());
        }
      }
     }
    }
  }
}

TEST_CASE("a world that tp x pp does not divide fails on every rank before connecting", "[mp]") {
  const int64_t world = mp::world_size();
  CHECK_THROWS_WITH(mp::state(world + 1, 1, "ps_bad"), Catch::Contains("divisible") && Catch::Contains(std::to_string(world)));
  CHECK_THROWS_WITH(megatorch::parallel::ParallelState(megatorch::parallel::ParallelStateOptions()
                                                           .expert_model_parallel_size(world + 1)
                                                           .name("ps_bad_ep")
                                                           .device("cpu")),
                    Catch::Contains("--expert-model-parallel-size") && Catch::Contains("got " + std::to_string(world + 1)));
}
