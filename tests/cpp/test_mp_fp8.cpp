// FP8 scales at every TP size: a ColumnParallelLinear -> RowParallelLinear pair with delayed
// scaling, split over TP ranks, picks the scales (and amax histories) of the same pair on one
// rank, step after step, because the amax of every split operand is reduced over the group.
// Without that reduction a shard's own amax would choose another scale (checked to happen).
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "mp_util.h"
#include "tolerance.h"

using megatorch::comm::Group;
using megatorch::comm::ReduceOp;
using megatorch::parallel::GroupKind;
namespace fp8 = megatorch::fp8;
namespace tp = megatorch::tp;

namespace {

constexpr int64_t TOKENS = 24, IN = 32, HIDDEN = 64;

struct Pair {
  tp::ColumnParallelLinear col{nullptr};
  tp::RowParallelLinear row{nullptr};
};

Pair make_pair(const std::string& group, const fp8::Fp8Options& recipe) {
  tp::ParamInitOptions init;
  Pair p;
  p.col = tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(IN, HIDDEN).group(group).fp8(recipe).init(
      tp::ParamInitOptions(init).name("fc1").std(0.2)));
  p.row = tp::RowParallelLinear(
      tp::RowParallelLinearOptions(HIDDEN, IN).group(group).fp8(recipe).init(tp::ParamInitOptions(init).name("fc2").std(0.2)));
  return p;
}

}  // namespace

TEST_CASE("FP8 delayed scaling: TP ranks choose the one-rank scales and histories, step after step", "[mp][fp8]") {
  std::vector<int64_t> sizes{mp::world_size()};
  if (mp::world_size() > 2 && mp::world_size() % 2 == 0) sizes.push_back(2);
  const auto recipe = fp8::Fp8Options()
                          .format(fp8::Format::kHybrid)
                          .recipe(fp8::Recipe::kDelayed)
                          .amax_history_len(4)
                          .amax_compute_algo(fp8::AmaxAlgo::kMax);
  for (int64_t t : sizes) {
    INFO("tp " << t);
    auto st = mp::state(t, 1, "fp8_scales_" + std::to_string(t));
    const std::string group = st->group_name(GroupKind::kTensor);
    Pair split = make_pair(group, recipe), whole = make_pair("", recipe);
    bool local_amax_differs = false;
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      torch::manual_seed(40 + step);  // the same data on every rank
      const auto x = torch::randn({TOKENS, IN}) * (1 + step), g = torch::randn({TOKENS, IN}) * 1e-2;
      std::vector<torch::Tensor> ys;
      for (Pair* p : {&split, &whole}) {
        const auto xi = x.clone().requires_grad_(true);
        const auto y = p->row->forward(p->col->forward(xi));
        y.backward(g);
        ys.push_back(y.detach());
      }
      CHECK_CLOSE(ys[0], ys[1], 1e-4);
      for (auto [a, b] : {std::pair{split.col->fp8_scaling, whole.col->fp8_scaling},
                          std::pair{split.row->fp8_scaling, whole.row->fp8_scaling}}) {
        for (int r = 0; r < fp8::kNumRoles; ++r) {
          INFO(fp8::to_string(static_cast<fp8::Role>(r)));
          CHECK_CLOSE(a->roles[r].scale, b->roles[r].scale, 1e-4);
          CHECK_CLOSE(a->roles[r].amax_history, b->roles[r].amax_history, 1e-4);
        }
      }
      // A shard's own weight amax: on some rank smaller than the whole weight's.
      const float local = split.col->weight.detach().abs().max().item<float>();
      const float full = whole.col->weight.detach().abs().max().item<float>();
      local_amax_differs |= t > 1 && local < full;
    }
    auto differs = torch::tensor({local_amax_differs ? 1.0f : 0.0f});
    Group(group).all_reduce(differs, ReduceOp::kMax);
    CHECK((t == 1 || differs.item<float>() == 1.0f));
  }
}
