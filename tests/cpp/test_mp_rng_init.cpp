// The TP RNG tracker and initialisation across TP ranks.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "mp_util.h"

using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
namespace tp = megatorch::tp;

TEST_CASE("dropout masks: same in replicated regions, different inside TP regions, reproducible", "[mp][rng]") {
  auto st = mp::state(mp::world_size(), 1, "rng");
  Group g(*st, GroupKind::kTensor);
  auto masks = [&](tp::RngTracker& rng) {
    auto replicated = at::dropout(torch::ones({64}), 0.5, true);
    at::Tensor parallel;
    {
      auto fork = rng.fork();
      parallel = at::dropout(torch::ones({64}), 0.5, true);
    }
    auto after = at::dropout(torch::ones({64}), 0.5, true);  // the default stream resumes
    return std::vector<at::Tensor>{replicated, parallel, after};
  };
  tp::RngTracker rng;
  rng.seed(1234, g.rank());
  const auto first = masks(rng);
  const int64_t n = g.size();
  auto gathered = [&](const at::Tensor& t) { return g.all_gather(t.unsqueeze(0), 0); };
  const auto rep = gathered(first[0]), par = gathered(first[1]), aft = gathered(first[2]);
  for (int64_t r = 1; r < n; ++r) {
    CHECK(torch::equal(rep[r], rep[0]));     // replicated: one mask for the whole group
    CHECK_FALSE(torch::equal(par[r], par[0]));  // TP region: each rank its own
    CHECK(torch::equal(aft[r], aft[0]));     // forking does not disturb the default stream
  }
  CHECK_FALSE(torch::equal(first[0], first[2]));
  // Reseeding reproduces every mask; a snapshot replays them (what recomputation does).
  tp::RngTracker again;
  again.seed(1234, g.rank());
  const auto snap = again.snapshot();
  const auto second = masks(again);
  for (size_t i = 0; i < first.size(); ++i) CHECK(torch::equal(first[i], second[i]));
  again.restore(snap);
  const auto third = masks(again);
  for (size_t i = 0; i < first.size(); ++i) CHECK(torch::equal(first[i], third[i]));
  CHECK_THROWS_WITH(tp::RngTracker().fork("nope"), Catch::Contains("expected RNG stream 'nope' to be seeded"));
}

TEST_CASE("every TP shard is the exact slice of the TP=1 weight; shard-local init is its own", "[mp][init]") {
  auto st = mp::state(mp::world_size(), 1, "init");
  Group g(*st, GroupKind::kTensor);
  const auto init = tp::ParamInitOptions().name("layer").seed(42);
  tp::ColumnParallelLinear full_col(tp::ColumnParallelLinearOptions(8, 4 * g.size()).init(init));
  tp::ColumnParallelLinear col(tp::ColumnParallelLinearOptions(8, 4 * g.size()).group(g.name()).init(init));
  CHECK(torch::equal(col->weight, full_col->weight.chunk(g.size(), 0)[g.rank()]));
  tp::RowParallelLinear full_row(tp::RowParallelLinearOptions(4 * g.size(), 6).init(init));
  tp::RowParallelLinear row(tp::RowParallelLinearOptions(4 * g.size(), 6).group(g.name()).init(init));
  CHECK(torch::equal(row->weight, full_row->weight.chunk(g.size(), 1)[g.rank()]));
  // SwiGLU's fused [gate; up]: each block sliced on its own.
  tp::ColumnParallelLinear full_glu(tp::ColumnParallelLinearOptions(8, 8 * g.size()).parts(2).init(init));
  tp::ColumnParallelLinear glu(tp::ColumnParallelLinearOptions(8, 8 * g.size()).parts(2).group(g.name()).init(init));
  const auto halves = full_glu->weight.chunk(2, 0);
  CHECK(torch::equal(glu->weight, torch::cat({halves[0].chunk(g.size(), 0)[g.rank()],
                                              halves[1].chunk(g.size(), 0)[g.rank()]})));
  // Shard-local: drawn per rank without a full tensor — reproducible, not a slice.
  auto local_init = init;
  local_init.shard_local(true);
  tp::ColumnParallelLinear local(tp::ColumnParallelLinearOptions(8, 4 * g.size()).group(g.name()).init(local_init));
  tp::ColumnParallelLinear local2(tp::ColumnParallelLinearOptions(8, 4 * g.size()).group(g.name()).init(local_init));
  CHECK(torch::equal(local->weight, local2->weight));
  CHECK_FALSE(torch::equal(local->weight, col->weight));
  auto all = g.all_gather(local->weight, 0);
  for (int64_t r = 1; r < g.size(); ++r) CHECK_FALSE(torch::equal(all.chunk(g.size(), 0)[r], all.chunk(g.size(), 0)[0]));
}
