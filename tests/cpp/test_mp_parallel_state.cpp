// ParallelState under torchrun: the groups this rank joins match the layout, and a
// collective on each group reaches exactly its members.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "mp_util.h"

using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
using megatorch::parallel::RankLayout;

TEST_CASE("every group of every valid (tp, cp, pp) reaches exactly its members", "[mp]") {
  const int64_t world = mp::world_size();
  for (int64_t tp = 1; tp <= world; ++tp) {
    for (int64_t pp = 1; tp * pp <= world; ++pp) {
     for (int64_t cp = 1; tp * pp * cp <= world; ++cp) {
      if (world % (tp * pp * cp)) continue;
      auto st = mp::state(tp, pp, "ps_" + std::to_string(tp) + "_" + std::to_string(pp) + "_" + std::to_string(cp), cp);
      RankLayout layout(world, tp, pp, cp);
      CHECK(st->rank() == mp::rank());
      CHECK(st->coord() == layout.coord(mp::rank()));
      CHECK(st->cp_size() == cp);
      for (GroupKind kind : {GroupKind::kWorld, GroupKind::kTensor, GroupKind::kData, GroupKind::kPipeline,
                             GroupKind::kContext, GroupKind::kDataContext}) {
        Group g(*st, kind);
        const auto members = layout.group_ranks(kind, mp::rank());
        REQUIRE(st->group_ranks(kind) == members);
        CHECK(g.size() == static_cast<int64_t>(members.size()));
        // Sum of 2^rank over the group identifies the member set exactly.
        auto x = torch::full({1}, static_cast<double>(int64_t{1} << mp::rank()), torch::kDouble);
        g.all_reduce(x);
        double expect = 0;
        for (int64_t m : members) expect += static_cast<double>(int64_t{1} << m);
        CHECK(x.item<double>() == expect);
        CHECK(members[g.rank()] == mp::rank());
      }
     }
    }
  }
}

TEST_CASE("a world that tp x pp does not divide fails on every rank before connecting", "[mp]") {
  const int64_t world = mp::world_size();
  CHECK_THROWS_WITH(mp::state(world + 1, 1, "ps_bad"), Catch::Contains("divisible") && Catch::Contains(std::to_string(world)));
}
