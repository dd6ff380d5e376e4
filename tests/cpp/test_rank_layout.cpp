#include <catch2/catch.hpp>
#include <megatorch/parallel/rank_layout.h>

#include <algorithm>
#include <set>

using megatorch::parallel::ExpertCoord;
using megatorch::parallel::GroupKind;
using megatorch::parallel::RankCoord;
using megatorch::parallel::RankLayout;
using Groups = std::vector<std::vector<int64_t>>;

TEST_CASE("Megatron's rank order for world 16, tp 2, pp 4", "[layout]") {
  RankLayout layout(16, 2, 4);
  CHECK(layout.dp_size() == 2);
  CHECK(layout.groups(GroupKind::kTensor) ==
        Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(layout.groups(GroupKind::kData) ==
        Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(layout.groups(GroupKind::kPipeline) == Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
  CHECK(layout.groups(GroupKind::kWorld).size() == 1);
  CHECK(layout.coord(13) == RankCoord{1, 0, 3});
  CHECK(layout.rank_of(RankCoord{1, 1, 2}) == 11);
}

// Megatron-core's groups for order tp-cp-dp-pp (parallel_state.RankGenerator), world 16.
TEST_CASE("Megatron's rank order for world 16, tp 2, cp 2, pp 2", "[layout]") {
  RankLayout layout(16, 2, 2, 2);
  CHECK(layout.dp_size() == 2);
  CHECK(layout.groups(GroupKind::kTensor) ==
        Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(layout.groups(GroupKind::kContext) ==
        Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(layout.groups(GroupKind::kData) ==
        Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}});
  CHECK(layout.groups(GroupKind::kDataContext) == Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}});
  CHECK(layout.groups(GroupKind::kPipeline) ==
        Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}});
  RankCoord c;
  c.tp = 1;
  c.cp = 1;
  c.dp = 0;
  c.pp = 1;
  CHECK(layout.coord(11) == c);
  CHECK(layout.rank_of(c) == 11);
  CHECK(layout.describe() == "world 16 = tp 2 x cp 2 x dp 2 x pp 2");
  // Without CP the DP x CP group is the DP group.
  RankLayout no_cp(16, 2, 4);
  CHECK(no_cp.groups(GroupKind::kDataContext) == no_cp.groups(GroupKind::kData));
}

// Megatron-core's parallel folding example: attention at tp 2 x dp 4 x pp 2, experts at
// ep 4 (etp 1) inside each stage's 8 ranks, so the expert groups cross the TP groups.
TEST_CASE("expert parallelism folds into each pipeline stage: world 16, tp 2, pp 2, ep 4", "[layout]") {
  RankLayout layout(16, 2, 2, 1, 4, 1);
  CHECK(layout.dp_size() == 4);
  CHECK(layout.ep_size() == 4);
  CHECK(layout.etp_size() == 1);
  CHECK(layout.edp_size() == 2);
  CHECK(layout.size(GroupKind::kExpertData) == 2);
  CHECK(layout.groups(GroupKind::kExpert) == Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}});
  CHECK(layout.groups(GroupKind::kExpertData) ==
        Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}});
  Groups singles;
  for (int64_t r = 0; r < 16; ++r) singles.push_back({r});
  CHECK(layout.groups(GroupKind::kExpertTensor) == singles);
  CHECK(layout.expert_coord(13) == ExpertCoord{0, 1, 1, 1});
  CHECK(layout.expert_rank_of(ExpertCoord{0, 2, 0, 1}) == 10);
  CHECK(layout.group_index(GroupKind::kExpert, 13) == 3);
  CHECK(layout.group_index(GroupKind::kExpertData, 13) == 5);
  CHECK(layout.describe() == "world 16 = tp 2 x dp 4 x pp 2 (experts: etp 1 x ep 4 x edp 2)");
  // The attention groups are Megatron's as without experts.
  CHECK(layout.groups(GroupKind::kData) ==
        Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}});
}

// etp slots in at tp's place: experts split over etp 2, distributed over ep 2, replicated
// over edp 4 (world 16, tp 2, pp 1, so dp 8).
TEST_CASE("expert tensor parallelism: world 16, tp 2, ep 2, etp 2", "[layout]") {
  RankLayout layout(16, 2, 1, 1, 2, 2);
  CHECK(layout.edp_size() == 4);
  CHECK(layout.groups(GroupKind::kExpertTensor) ==
        Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(layout.groups(GroupKind::kExpert) ==
        Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(layout.groups(GroupKind::kExpertData) == Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
  CHECK(layout.expert_coord(11) == ExpertCoord{1, 1, 2, 0});
  CHECK(layout.describe() == "world 16 = tp 2 x dp 8 x pp 1 (experts: etp 2 x ep 2 x edp 4)");
  // Without experts the groups are trivial, except edp: the whole stage.
  RankLayout plain(16, 2, 2);
  CHECK(plain.ep_size() == 1);
  CHECK(plain.etp_size() == 1);
  CHECK(plain.edp_size() == 8);
  CHECK(plain.groups(GroupKind::kExpertData) == Groups{{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}});
  CHECK(plain.describe() == "world 16 = tp 2 x dp 4 x pp 2");
}

namespace {

// f(world, tp, pp, cp) for every world <= max_world and tp * cp * pp dividing it.
template <typename F>
void for_each_layout(int64_t max_world, F&& f) {
  for (int64_t world = 1; world <= max_world; ++world) {
    for (int64_t tp = 1; tp <= world; ++tp) {
      if (world % tp) continue;
      for (int64_t pp = 1; pp <= world / tp; ++pp) {
        if ((world / tp) % pp) continue;
        for (int64_t cp = 1; cp <= world / (tp * pp); ++cp) {
          if ((world / (tp * pp)) % cp) continue;
          f(world, tp, pp, cp);
        }
      }
    }
  }
}

// Each kind's groups partition the ranks into groups of the kind's size, found again by
// group_index; member(k, rank, first member of its group) checks the coordinates. Returns
// each rank's group index per kind (-1: in none) and clears ok on any violation.
template <typename Member>
std::vector<std::vector<int64_t>> check_partitions(const RankLayout& layout, const std::vector<GroupKind>& kinds,
                                                   bool& ok, Member&& member) {
  const int64_t world = layout.world_size();
  std::vector<std::vector<int64_t>> index_of(kinds.size(), std::vector<int64_t>(world, -1));
  for (size_t k = 0; k < kinds.size(); ++k) {
    const auto groups = layout.groups(kinds[k]);
    ok &= static_cast<int64_t>(groups.size()) * layout.size(kinds[k]) == world;
    for (size_t g = 0; g < groups.size(); ++g) {
      ok &= static_cast<int64_t>(groups[g].size()) == layout.size(kinds[k]);
      ok &= std::is_sorted(groups[g].begin(), groups[g].end());
      for (int64_t r : groups[g]) {
        ok &= index_of[k][r] == -1;  // in no other group of this kind
        index_of[k][r] = static_cast<int64_t>(g);
        ok &= layout.group_index(kinds[k], r) == static_cast<int64_t>(g);
        ok &= member(kinds[k], r, groups[g][0]);
      }
    }
  }
  return index_of;
}

// Groups of the first `n` kinds are pairwise orthogonal: any two meet in at most one rank.
bool orthogonal(const std::vector<std::vector<int64_t>>& index_of, size_t n) {
  bool ok = true;
  for (size_t a = 0; a < n; ++a) {
    for (size_t b = a + 1; b < n; ++b) {
      std::set<std::pair<int64_t, int64_t>> seen;
      for (size_t r = 0; r < index_of[a].size(); ++r) {
        ok &= index_of[a][r] >= 0;
        ok &= seen.insert({index_of[a][r], index_of[b][r]}).second;
      }
    }
  }
  return ok;
}

}  // namespace

// Every (world <= 512, tp, cp, pp) with tp * cp * pp dividing world: each rank is in
// exactly one group of each kind, groups have the kind's size, members differ only in
// the kind's coordinates, groups of different one-coordinate kinds meet in at most one
// rank (orthogonal), and a DP x CP group is a union of whole DP and whole CP groups.
TEST_CASE("rank layout invariants for every valid world <= 512", "[layout]") {
  const std::vector<GroupKind> kinds{GroupKind::kTensor, GroupKind::kData, GroupKind::kPipeline, GroupKind::kContext,
                                     GroupKind::kDataContext};
  constexpr size_t kSingle = 4;  // the kinds that vary one coordinate
  int64_t layouts = 0;
  // Plain bools inside the loops (tens of millions of checks); one REQUIRE per layout
  // names the layout that broke.
  for_each_layout(512, [&](int64_t world, int64_t tp, int64_t pp, int64_t cp) {
    ++layouts;
    RankLayout layout(world, tp, pp, cp);
    bool ok = true;
    const auto index_of = check_partitions(layout, kinds, ok, [&](GroupKind kind, int64_t r, int64_t first_rank) {
      const RankCoord c = layout.coord(r), first = layout.coord(first_rank);
      return layout.rank_of(c) == r && (kind == GroupKind::kTensor || c.tp == first.tp) &&
             (kind == GroupKind::kData || kind == GroupKind::kDataContext || c.dp == first.dp) &&
             (kind == GroupKind::kPipeline || c.pp == first.pp) &&
             (kind == GroupKind::kContext || kind == GroupKind::kDataContext || c.cp == first.cp);
    });
    for (int64_t r = 0; r < world; ++r) {
      // The DP x CP group holds this rank's whole DP group and whole CP group.
      const auto both = layout.group_ranks(GroupKind::kDataContext, r);
      for (GroupKind part : {GroupKind::kData, GroupKind::kContext}) {
        for (int64_t m : layout.group_ranks(part, r)) ok &= std::count(both.begin(), both.end(), m) == 1;
      }
    }
    ok &= orthogonal(index_of, kSingle);
    INFO("world " << world << ", tp " << tp << ", cp " << cp << ", pp " << pp);
    REQUIRE(ok);
  });
  CHECK(layouts > 20000);
}

// Every (world <= 64, tp, cp, pp, ep, etp) with tp * cp * pp dividing world and ep * etp
// dividing a stage's tp * cp * dp: each expert kind partitions the ranks into groups of its
// size inside one pipeline stage, members differ only in the kind's expert coordinate,
// ep * etp * edp = tp * cp * dp, the three kinds meet in at most one rank, and expert
// coordinates round-trip.
TEST_CASE("expert layout invariants for every valid world <= 64", "[layout]") {
  const std::vector<GroupKind> kinds{GroupKind::kExpert, GroupKind::kExpertTensor, GroupKind::kExpertData};
  int64_t layouts = 0;
  for_each_layout(64, [&](int64_t world, int64_t tp, int64_t pp, int64_t cp) {
    const int64_t stage = world / pp;
    for (int64_t ep = 1; ep <= stage; ++ep) {
      if (stage % ep) continue;
      for (int64_t etp = 1; etp <= stage / ep; ++etp) {
        if ((stage / ep) % etp) continue;
        ++layouts;
        RankLayout layout(world, tp, pp, cp, ep, etp);
        bool ok = layout.ep_size() * layout.etp_size() * layout.edp_size() ==
                  layout.tp_size() * layout.cp_size() * layout.dp_size();
        const auto index_of = check_partitions(layout, kinds, ok, [&](GroupKind kind, int64_t r, int64_t first_rank) {
          const ExpertCoord e = layout.expert_coord(r), first = layout.expert_coord(first_rank);
          return layout.expert_rank_of(e) == r && e.pp == layout.coord(r).pp  // inside one pipeline stage
                 && e.pp == first.pp && (kind == GroupKind::kExpert || e.ep == first.ep) &&
                 (kind == GroupKind::kExpertTensor || e.etp == first.etp) &&
                 (kind == GroupKind::kExpertData || e.edp == first.edp);
        });
        ok &= orthogonal(index_of, kinds.size());
        INFO("world " << world << ", tp " << tp << ", cp " << cp << ", pp " << pp << ", ep " << ep << ", etp " << etp);
        REQUIRE(ok);
      }
    }
  });
  CHECK(layouts > 5000);
}

TEST_CASE("bad layouts fail with what was expected and what was given", "[layout]") {
  CHECK_THROWS_WITH(RankLayout(6, 4, 1), Catch::Contains("divisible") && Catch::Contains("got world size 6"));
  CHECK_THROWS_WITH(RankLayout(8, 2, 3), Catch::Contains("2 x 3 = 6"));
  CHECK_THROWS_WITH(RankLayout(8, 0, 1), Catch::Contains("tensor-model-parallel-size >= 1, got 0"));
  CHECK_THROWS_WITH(RankLayout(8, 1, -2), Catch::Contains("pipeline-model-parallel-size >= 1, got -2"));
  CHECK_THROWS_WITH(RankLayout(0, 1, 1), Catch::Contains("world size >= 1"));
  CHECK_THROWS_WITH(RankLayout(4, 2, 1).coord(4), Catch::Contains("rank in [0, 4)"));
  CHECK_THROWS_WITH(RankLayout(8, 2, 1, 3), Catch::Contains("context-parallel-size") && Catch::Contains("2 x 3 x 1 = 6"));
  CHECK_THROWS_WITH(RankLayout(8, 1, 1, 0), Catch::Contains("context-parallel-size >= 1, got 0"));
  CHECK_THROWS_WITH(RankLayout(8, 2, 1, 1, 0), Catch::Contains("--expert-model-parallel-size >= 1, got 0"));
  CHECK_THROWS_WITH(RankLayout(8, 2, 1, 1, 1, -1), Catch::Contains("--expert-tensor-parallel-size >= 1, got -1"));
  // 3 does not divide a stage's tp 2 x cp 1 x dp 2 = 4 ranks (world 8, pp 2).
  CHECK_THROWS_WITH(RankLayout(8, 2, 2, 1, 3),
                    Catch::Contains("--expert-model-parallel-size x --expert-tensor-parallel-size") &&
                        Catch::Contains("2 x 1 x 2 = 4 ranks per pipeline stage") && Catch::Contains("got 3 x 1 = 3"));
  CHECK_THROWS_WITH(RankLayout(16, 2, 2, 2, 4, 4),
                    Catch::Contains("--expert-tensor-parallel-size") && Catch::Contains("got 4 x 4 = 16") &&
                        Catch::Contains("divides 8"));
  CHECK_THROWS_WITH(RankLayout(8, 1, 1, 1, int64_t{1} << 40, int64_t{1} << 40),
                    Catch::Contains("--expert-model-parallel-size") && Catch::Contains("more than int64 holds"));
  CHECK_THROWS_WITH(RankLayout(8, 2, 1).expert_rank_of(ExpertCoord{1, 0, 0, 0}),
                    Catch::Contains("expert coordinate inside etp 1 x ep 1 x edp 8 x pp 1"));
}
