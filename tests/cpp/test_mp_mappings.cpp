// Every mapping's forward and backward, exactly, with rank-valued inputs (as Megatron's
// mapping tests), on TP groups of every size the world allows, plus the byte counters.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "mp_util.h"

using megatorch::comm::CommOp;
using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
namespace comm = megatorch::comm;

namespace {
std::vector<int64_t> tp_sizes() {
  std::vector<int64_t> sizes{mp::world_size()};
  if (mp::world_size() > 2 && mp::world_size() % 2 == 0) sizes.push_back(2);
  return sizes;
}
// [s, b, h] activations; the value of element (i, j, k) on tp rank r: i*100 + k + 1000 r.
torch::Tensor ranked(int64_t s, int64_t b, int64_t h, int64_t r) {
  auto i = torch::arange(s, torch::kDouble).view({s, 1, 1}) * 100;
  auto k = torch::arange(h, torch::kDouble).view({1, 1, h});
  return (i + k + 1000.0 * r).expand({s, b, h}).contiguous();
}
constexpr int64_t S = 4, B = 2, H = 6;
}  // namespace

TEST_CASE("f and g: copy_to_tp_region and reduce_from_tp_region", "[mp]") {
  for (int64_t tp : tp_sizes()) {
    auto st = mp::state(tp, 1, "map_fg_" + std::to_string(tp));
    Group g(*st, GroupKind::kTensor);
    const int64_t r = g.rank(), n = g.size();
    g.reset_stats();
    auto x = torch::full({S, B, H}, static_cast<double>(r), torch::dtype(torch::kDouble).requires_grad(true));
    auto y = comm::copy_to_tp_region(x, g.name());
    CHECK(torch::equal(y, x));  // identity forward, no communication
    CHECK(g.stats().total().calls == 0);
    (y * static_cast<double>(r + 1)).sum().backward();  // grad of y on rank r: r + 1
    CHECK(torch::equal(x.grad(), torch::full({S, B, H}, n * (n + 1) / 2.0)));  // all-reduced
    CHECK(g.stats()[CommOp::kAllReduce].calls == 1);
    CHECK(g.stats()[CommOp::kAllReduce].bytes == S * B * H * 8);

    g.reset_stats();
    auto x2 = torch::full({S, B, H}, static_cast<double>(r), torch::dtype(torch::kDouble).requires_grad(true));
    auto z = comm::reduce_from_tp_region(x2, g.name());
    CHECK(torch::equal(z, torch::full({S, B, H}, n * (n - 1) / 2.0)));
    (z * static_cast<double>(r + 1)).sum().backward();
    CHECK(torch::equal(x2.grad(), torch::full({S, B, H}, static_cast<double>(r + 1))));  // identity backward
    CHECK(g.stats()[CommOp::kAllReduce].calls == 1);
    CHECK(g.stats()[CommOp::kAllReduce].bytes == S * B * H * 8);
  }
}

TEST_CASE("reduce_from_tp_region_: g in place on a partial result, with g's backward", "[mp]") {
  for (int64_t tp : tp_sizes()) {
    auto st = mp::state(tp, 1, "map_g_inplace_" + std::to_string(tp));
    Group g(*st, GroupKind::kTensor);
    const int64_t r = g.rank(), n = g.size();
    auto x = torch::full({S, B, H}, static_cast<double>(r), torch::dtype(torch::kDouble).requires_grad(true));
    g.reset_stats();
    auto partial = x * 2.0;  // a computed (non-leaf) tensor, as a row-parallel GEMM's output
    const void* memory = partial.data_ptr();
    auto z = comm::reduce_from_tp_region_(partial, g.name());
    CHECK(z.data_ptr() == memory);  // summed where it was: no copy
    CHECK(torch::equal(z, torch::full({S, B, H}, n * (n - 1.0))));
    CHECK(g.stats()[CommOp::kAllReduce].calls == (n > 1 ? 1 : 0));
    CHECK(g.stats()[CommOp::kAllReduce].bytes == (n > 1 ? S * B * H * 8 : 0));
    (z * static_cast<double>(r + 1)).sum().backward();
    CHECK(torch::equal(x.grad(), torch::full({S, B, H}, 2.0 * (r + 1))));  // identity backward, then x*2's
    // The same without autograd (inference) and on a leaf that needs no gradient.
    auto plain = torch::full({S, B, H}, static_cast<double>(r), torch::kDouble);
    CHECK(torch::equal(comm::reduce_from_tp_region_(plain, g.name()), torch::full({S, B, H}, n * (n - 1) / 2.0)));
    CHECK(torch::equal(plain, torch::full({S, B, H}, n * (n - 1) / 2.0)));
    // A leaf that requires grad cannot be modified in place: refused, before any collective.
    CHECK_THROWS_WITH(comm::reduce_from_tp_region_(x, g.name()), Catch::Contains("leaf that requires grad"));
    // A saved output modified in place is autograd's own error at backward, not a wrong gradient.
    auto y = torch::full({S, B, H}, 1.0 + r, torch::dtype(torch::kDouble).requires_grad(true));
    auto e = y.exp();  // exp saves its output for backward
    comm::reduce_from_tp_region_(e, g.name());
    if (n > 1) CHECK_THROWS_WITH(e.sum().backward(), Catch::Contains("modified by an inplace operation"));
  }
}

TEST_CASE("scatter_to_tp_region and gather_from_tp_region along the last dim", "[mp]") {
  for (int64_t tp : tp_sizes()) {
    auto st = mp::state(tp, 1, "map_tp_" + std::to_string(tp));
    Group g(*st, GroupKind::kTensor);
    const int64_t r = g.rank(), n = g.size();
    g.reset_stats();
    // scatter: every rank holds the same full tensor, keeps its slice of the last dim.
    auto full = ranked(S, B, H * n, 0).requires_grad_(true);
    auto part = comm::scatter_to_tp_region(full, g.name());
    CHECK(torch::equal(part, full.detach().narrow(2, r * H, H)));
    part.backward(torch::full_like(part, static_cast<double>(r + 1)));
    // backward all-gathers: slice j of the grad comes from rank j.
    for (int64_t j = 0; j < n; ++j) CHECK(torch::equal(full.grad().narrow(2, j * H, H), torch::full({S, B, H}, j + 1.0)));
    CHECK(g.stats()[CommOp::kAllGather].bytes == (n > 1 ? S * B * H * 8 : 0));

    g.reset_stats();
    auto mine = ranked(S, B, H, r).requires_grad_(true);
    auto all = comm::gather_from_tp_region(mine, g.name());
    for (int64_t j = 0; j < n; ++j) CHECK(torch::equal(all.detach().narrow(2, j * H, H), ranked(S, B, H, j)));
    auto grad = ranked(S, B, H * n, 7);
    all.backward(grad);
    CHECK(torch::equal(mine.grad(), grad.narrow(2, r * H, H)));  // backward splits, no communication
    CHECK(g.stats()[CommOp::kAllGather].calls == (n > 1 ? 1 : 0));
    CHECK(g.stats()[CommOp::kAllGather].bytes == (n > 1 ? S * B * H * 8 : 0));
  }
}

TEST_CASE("sequence-parallel mappings along dim 0", "[mp]") {
  for (int64_t tp : tp_sizes()) {
    auto st = mp::state(tp, 1, "map_sp_" + std::to_string(tp));
    Group g(*st, GroupKind::kTensor);
    const int64_t r = g.rank(), n = g.size();
    const int64_t bytes = S * B * H * 8;  // one rank's [s/t, b, h] shard

    g.reset_stats();
    auto full = ranked(S * n, B, H, 0).requires_grad_(true);
    auto shard = comm::scatter_to_sp_region(full, g.name());
    CHECK(torch::equal(shard, full.detach().narrow(0, r * S, S)));
    shard.backward(torch::full_like(shard, static_cast<double>(r)));
    for (int64_t j = 0; j < n; ++j) CHECK(torch::equal(full.grad().narrow(0, j * S, S), torch::full({S, B, H}, j * 1.0)));

    // Korthikanti's g (before a column-parallel layer): all-gather s, backward reduce-scatter.
    g.reset_stats();
    auto mine = ranked(S, B, H, r).requires_grad_(true);
    auto gathered = comm::gather_from_sp_region(mine, g.name());
    for (int64_t j = 0; j < n; ++j) CHECK(torch::equal(gathered.detach().narrow(0, j * S, S), ranked(S, B, H, j)));
    gathered.backward(ranked(S * n, B, H, r));  // grad on rank q: i*100 + k + 1000 q
    auto expect = ranked(S * n, B, H, 0).narrow(0, r * S, S) * n + 1000.0 * n * (n - 1) / 2;
    CHECK(torch::equal(mine.grad(), expect));
    if (n > 1) {
      CHECK(g.stats()[CommOp::kAllGather].bytes == bytes);
      CHECK(g.stats()[CommOp::kReduceScatter].bytes == bytes * n);
    }

    // After a row-parallel layer: reduce-scatter s, backward all-gather.
    g.reset_stats();
    auto partial = ranked(S * n, B, H, r).requires_grad_(true);
    auto reduced = comm::reduce_scatter_to_sp_region(partial, g.name());
    CHECK(torch::equal(reduced, expect));
    reduced.backward(torch::full_like(reduced, static_cast<double>(r)));
    for (int64_t j = 0; j < n; ++j) CHECK(torch::equal(partial.grad().narrow(0, j * S, S), torch::full({S, B, H}, j * 1.0)));
    if (n > 1) {
      CHECK(g.stats()[CommOp::kReduceScatter].bytes == bytes * n);
      CHECK(g.stats()[CommOp::kAllGather].bytes == bytes);
      CHECK(g.stats().total().calls == 2);
    }
    // SP with a sequence length that the group does not divide fails on every rank, early.
    if (n > 1) CHECK_THROWS_WITH(comm::scatter_to_sp_region(torch::ones({n + 1, B, H}), g.name()),
                                 Catch::Contains("sequence length must be a multiple"));
  }
}
