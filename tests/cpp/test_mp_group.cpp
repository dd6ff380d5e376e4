// Group collectives on the world group, checked exactly with rank-valued inputs.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "mp_util.h"

using megatorch::comm::CommOp;
using megatorch::comm::Group;
using megatorch::comm::ReduceOp;
using megatorch::parallel::GroupKind;

TEST_CASE("all_reduce sum, avg and max", "[mp]") {
  auto st = mp::state(1, 1, "grp_ar");
  Group g(*st, GroupKind::kWorld);
  const int64_t n = g.size(), r = g.rank();
  g.reset_stats();
  auto x = torch::full({3, 5}, static_cast<double>(r));
  g.all_reduce(x);
  CHECK(torch::equal(x, torch::full({3, 5}, n * (n - 1) / 2.0)));
  auto y = torch::full({4}, static_cast<double>(r + 1));
  g.all_reduce(y, ReduceOp::kAvg);  // Gloo has no AVG: emulated, must still be exact
  CHECK(torch::allclose(y, torch::full({4}, (n + 1) / 2.0), 0, 0));
  auto z = torch::full({2}, static_cast<double>(r * 7 % 5));
  double mx = 0;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, static_cast<double>(i * 7 % 5));
  g.all_reduce(z, ReduceOp::kMax);
  CHECK(torch::equal(z, torch::full({2}, mx)));
  // A non-contiguous tensor is reduced and written back in place.
  auto base = torch::full({4, 6}, static_cast<double>(r));
  auto view = base.t();
  g.all_reduce(view);
  CHECK(torch::equal(base, torch::full({4, 6}, n * (n - 1) / 2.0)));
  const auto s = g.stats()[CommOp::kAllReduce];
  CHECK(s.calls == 4);
  CHECK(s.bytes == (15 + 4 + 2 + 24) * 4);
  auto ints = torch::ones({2}, torch::kLong);
  CHECK_THROWS_WITH(g.all_reduce(ints, ReduceOp::kAvg), Catch::Contains("floating-point"));
}

TEST_CASE("all_gather and reduce_scatter along any dim", "[mp]") {
  auto st = mp::state(1, 1, "grp_ag");
  Group g(*st, GroupKind::kWorld);
  const int64_t n = g.size(), r = g.rank();
  g.reset_stats();
  auto x = torch::full({2, 3}, static_cast<double>(r));
  for (int64_t dim : {0, 1, -1}) {
    auto out = g.all_gather(x, dim);
    const int64_t d = dim < 0 ? dim + 2 : dim;
    REQUIRE(out.size(d) == x.size(d) * n);
    for (int64_t i = 0; i < n; ++i) CHECK(torch::equal(out.narrow(d, i * x.size(d), x.size(d)), torch::full_like(x, i)));
  }
  CHECK(g.stats()[CommOp::kAllGather].bytes == 3 * 6 * 4);  // the local shard, per call
  // Row i of rank r holds i + 100 r: the reduced chunk of rank r is sum over ranks.
  auto rows = torch::arange(2 * n, torch::kDouble).unsqueeze(1).expand({2 * n, 3}) + 100.0 * r;
  auto mine = g.reduce_scatter(rows, 0);
  auto expect = torch::arange(2 * r, 2 * r + 2, torch::kDouble).unsqueeze(1).expand({2, 3}) * n + 100.0 * n * (n - 1) / 2;
  CHECK(torch::equal(mine, expect));
  auto cols = rows.t().contiguous();
  CHECK(torch::equal(g.reduce_scatter(cols, 1), expect.t()));
  auto avg = g.reduce_scatter(rows, 0, ReduceOp::kAvg);
  CHECK(torch::allclose(avg, expect / n, 1e-12, 0));
  CHECK(g.stats()[CommOp::kReduceScatter].calls == 3);
  CHECK(g.stats()[CommOp::kReduceScatter].bytes == 3 * rows.numel() * 8);  // the full input, per call
  if (n > 1) {
    CHECK_THROWS_WITH(g.reduce_scatter(torch::ones({2 * n + 1, 2}), 0),
                      Catch::Contains("divisible by the group size"));
  }
}

TEST_CASE("all_to_all along any pair of dims, and its bytes", "[mp]") {
  auto st = mp::state(1, 1, "grp_a2a");
  Group g(*st, GroupKind::kWorld);
  const int64_t n = g.size(), r = g.rank();
  g.reset_stats();
  // Element [i, j, k] of rank r is 1000 r + 100 i + 10 j + k: the sender and its index are visible.
  auto make = [](int64_t a, int64_t b, int64_t c, int64_t from) {
    return torch::arange(a, torch::kDouble).view({a, 1, 1}) * 100 +
           torch::arange(b, torch::kDouble).view({1, b, 1}) * 10 + torch::arange(c, torch::kDouble).view({1, 1, c}) +
           1000.0 * from;
  };
  const auto x = make(2 * n, 3, 2, r);
  // Ulysses' swap: split dim 0 (heads), concatenate along dim 1 (sequence).
  auto y = g.all_to_all(x, 0, 1);
  REQUIRE(y.sizes() == torch::IntArrayRef({2, 3 * n, 2}));
  for (int64_t j = 0; j < n; ++j) CHECK(torch::equal(y.narrow(1, 3 * j, 3), make(2 * n, 3, 2, j).narrow(0, 2 * r, 2)));
  // And back: the inverse swap restores the input; negative dims and a non-contiguous input.
  CHECK(torch::equal(g.all_to_all(y.transpose(0, 2), -2, -1).transpose(0, 2), x));
  // split_dim == concat_dim: a plain exchange of chunks.
  auto z = g.all_to_all(x, 0, 0);
  for (int64_t j = 0; j < n; ++j) CHECK(torch::equal(z.narrow(0, 2 * j, 2), make(2 * n, 3, 2, j).narrow(0, 2 * r, 2)));
  const auto s = g.stats()[CommOp::kAllToAll];
  CHECK(s.calls == (n > 1 ? 3 : 0));
  CHECK(s.bytes == (n > 1 ? 3 * static_cast<int64_t>(x.nbytes()) / n * (n - 1) : 0));  // what leaves this rank
  CHECK(g.stats().total().bytes == s.bytes);
  if (n > 1) {
    CHECK_THROWS_WITH(g.all_to_all(torch::ones({n + 1, 2}), 0, 1), Catch::Contains("divisible by the group size"));
  }
}

TEST_CASE("broadcast, send/recv ring, barrier, async handles", "[mp]") {
  auto st = mp::state(1, 1, "grp_p2p");
  Group g(*st, GroupKind::kWorld);
  const int64_t n = g.size(), r = g.rank();
  g.reset_stats();
  auto b = torch::full({5}, r == n - 1 ? 42.0 : -1.0);
  g.broadcast(b, n - 1);
  CHECK(torch::equal(b, torch::full({5}, 42.0)));
  // Ring: each rank sends its rank to the next. Even ranks send first, odd ones receive
  // first: at n = 2 both ends share one connection, where NCCL runs ops in issue order and
  // two receives posted first would wait for each other's sends forever.
  auto inbox = torch::empty({3});
  const auto out = torch::full({3}, static_cast<double>(r));
  megatorch::comm::Work recv, send;
  if (r % 2 == 0) {
    send = g.send_async(out, (r + 1) % n);
    recv = g.recv_async(inbox, (r + n - 1) % n);
  } else {
    recv = g.recv_async(inbox, (r + n - 1) % n);
    send = g.send_async(out, (r + 1) % n);
  }
  send.wait();
  CHECK(torch::equal(recv.wait(), torch::full({3}, static_cast<double>((r + n - 1) % n))));
  auto x = torch::ones({8});
  auto work = g.all_reduce_async(x);
  CHECK(torch::equal(work.wait(), torch::full({8}, static_cast<double>(n))));
  CHECK(work.is_completed());
  g.barrier();
  CHECK(g.stats()[CommOp::kSend].bytes == 12);
  CHECK(g.stats()[CommOp::kRecv].bytes == 12);
  CHECK_THROWS_WITH(g.send(x, r), Catch::Contains("other than this rank"));
}
