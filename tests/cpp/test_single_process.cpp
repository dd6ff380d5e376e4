// A world of one rank, from an explicit store: the group machinery without torchrun.
#include <catch2/catch.hpp>
#include <megatorch/megatorch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

using megatorch::comm::CommOp;
using megatorch::comm::Group;
using megatorch::comm::Mapping;
using megatorch::parallel::GroupKind;
using megatorch::parallel::ParallelState;
using megatorch::parallel::ParallelStateOptions;

namespace {
std::unique_ptr<ParallelState> single(const std::string& name) {
  return std::make_unique<ParallelState>(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                         ParallelStateOptions().name(name).device("cpu"));
}
}  // namespace

TEST_CASE("a one-rank ParallelState registers its groups by name", "[single]") {
  auto state = single("solo");
  CHECK(state->group_name(GroupKind::kTensor) == "solo.tp");
  CHECK(state->group_name(GroupKind::kWorld) == "solo.world");
  Group tp("solo.tp");
  CHECK(tp.size() == 1);
  CHECK(tp.rank() == 0);
  CHECK_THROWS_WITH(single("solo"), Catch::Contains("already registered") && Catch::Contains("name(...)"));
  state.reset();
  CHECK_THROWS_WITH(Group("solo.tp"), Catch::Contains("expected a process group registered under the name 'solo.tp'"));
  CHECK_NOTHROW(single("solo"));  // the name is free again
}

TEST_CASE("a one-rank group communicates nothing and counts nothing", "[single]") {
  auto state = single("solo_comm");
  Group g(*state, GroupKind::kTensor);
  g.reset_stats();
  auto x = torch::arange(6, torch::kFloat).reshape({2, 3});
  auto y = x.clone();
  g.all_reduce(y);
  CHECK(torch::equal(y, x));
  CHECK(torch::equal(g.all_gather(x, 1), x));
  CHECK(torch::equal(g.reduce_scatter(x, 0), x));
  CHECK(g.stats().total().calls == 0);
  for (int i = 0; i < megatorch::comm::kNumMappings; ++i) {
    const auto m = static_cast<Mapping>(i);
    const auto op = c10::Dispatcher::singleton()
                        .findSchemaOrThrow((std::string("megatorch::") + megatorch::comm::mapping_name(m)).c_str(), "")
                        .typed<at::Tensor(const at::Tensor&, c10::string_view)>();
    auto in = x.clone().requires_grad_(true);
    auto out = op.call(in, g.name());
    CHECK(torch::equal(out, x));
    CHECK_FALSE(out.data_ptr() == in.data_ptr());  // operators never alias their input
    out.sum().backward();
    CHECK(torch::equal(in.grad(), torch::ones_like(x)));
    // In C++ every mapping over one rank is the identity: the input itself, both ways.
    auto in2 = x.clone().requires_grad_(true);
    auto same = megatorch::comm::apply_mapping(m, in2, g.name());
    CHECK(same.is_same(in2));
    same.sum().backward();
    CHECK(torch::equal(in2.grad(), torch::ones_like(x)));
  }
  CHECK(g.stats().total().bytes == 0);
}

TEST_CASE("mapping shapes and divisibility checks", "[single]") {
  using megatorch::comm::mapping_output_shape;
  auto shape = [](Mapping m, std::vector<int64_t> in, int64_t n) {
    std::vector<int64_t> out;
    for (const auto& s : mapping_output_shape(m, c10::fromIntArrayRefSlow(in), n)) out.push_back(s.expect_int());
    return out;
  };
  CHECK(shape(Mapping::kScatterToTP, {4, 2, 8}, 4) == std::vector<int64_t>{4, 2, 2});
  CHECK(shape(Mapping::kGatherFromTP, {4, 2, 8}, 4) == std::vector<int64_t>{4, 2, 32});
  CHECK(shape(Mapping::kScatterToSP, {4, 2, 8}, 2) == std::vector<int64_t>{2, 2, 8});
  CHECK(shape(Mapping::kGatherFromSP, {4, 2, 8}, 2) == std::vector<int64_t>{8, 2, 8});
  CHECK(shape(Mapping::kReduceScatterToSP, {4, 2, 8}, 4) == std::vector<int64_t>{1, 2, 8});
  CHECK(shape(Mapping::kCopyToTP, {4, 2, 8}, 4) == std::vector<int64_t>{4, 2, 8});
  CHECK_THROWS_WITH(shape(Mapping::kScatterToTP, {4, 2, 6}, 4),
                    Catch::Contains("dim 2 of the input") && Catch::Contains("divisible by the group size 4"));
  CHECK_THROWS_WITH(shape(Mapping::kReduceScatterToSP, {6, 2, 8}, 4), Catch::Contains("sequence length"));
  using megatorch::comm::mapping_adjoint;  // backward of each = forward of its adjoint
  CHECK(mapping_adjoint(Mapping::kCopyToTP) == Mapping::kReduceFromTP);
  CHECK(mapping_adjoint(Mapping::kReduceFromTP) == Mapping::kCopyToTP);
  CHECK(mapping_adjoint(Mapping::kScatterToTP) == Mapping::kGatherFromTP);
  CHECK(mapping_adjoint(Mapping::kGatherFromTP) == Mapping::kScatterToTP);
  CHECK(mapping_adjoint(Mapping::kScatterToSP) == Mapping::kGatherFromSP);
  CHECK(mapping_adjoint(Mapping::kGatherFromSP) == Mapping::kReduceScatterToSP);
  CHECK(mapping_adjoint(Mapping::kReduceScatterToSP) == Mapping::kGatherFromSP);
}

TEST_CASE("comm stats are per group name and resettable", "[single]") {
  namespace detail = megatorch::comm::detail;
  megatorch::comm::reset_comm_stats("stats_a");
  megatorch::comm::reset_comm_stats("stats_b");
  CHECK(detail::record_comm("stats_a", CommOp::kAllReduce, 100) >= 0);
  detail::record_comm("stats_a", CommOp::kAllReduce, 28);
  detail::record_comm("stats_b", CommOp::kSend, 4);
  const auto a = megatorch::comm::comm_stats("stats_a");
  CHECK(a[CommOp::kAllReduce].calls == 2);
  CHECK(a[CommOp::kAllReduce].bytes == 128);
  CHECK(a.total().bytes == 128);
  CHECK(a.to_map().at("all_reduce.bytes") == 128);
  CHECK(a.to_map().at("total.calls") == 2);
  megatorch::comm::reset_comm_stats("stats_a");
  CHECK(megatorch::comm::comm_stats("stats_a").total().calls == 0);
  CHECK(megatorch::comm::comm_stats("stats_b").total().calls == 1);
  CHECK(megatorch::comm::comm_stats("never_used").total().calls == 0);
}

TEST_CASE("bucket layout: a parameter marked alone gets a bucket of its own, padded to the DP size", "[single][optim]") {
  using megatorch::optim::build_bucket_layout;
  // Two units in backward order: unit 1's parameters (c, then b), then unit 0's (a).
  const auto a = torch::zeros({10}), b = torch::zeros({7}), c = torch::zeros({5});
  const std::vector<std::vector<at::Tensor>> units{{a}, {b, c}};
  const auto plain = build_bucket_layout(units, /*bucket_size=*/1000, /*dp=*/4, false);
  CHECK(plain.buckets.size() == 1);
  // b (flattened index 1) alone: c's bucket closes before it, a starts a new one after.
  const auto layout = build_bucket_layout(units, 1000, 4, false, {false, true, false});
  REQUIRE(layout.buckets.size() == 3);
  CHECK(layout.buckets[0].params == std::vector<int64_t>{2});
  CHECK(layout.buckets[1].params == std::vector<int64_t>{1});
  CHECK(layout.buckets[2].params == std::vector<int64_t>{0});
  // Its range is [0, 8) of its own bucket whatever else the model holds: copies of b in
  // two differently built models are sharded alike over the same DP size.
  CHECK(layout.params[1].offset == 0);
  CHECK(layout.buckets[1].used == 7);
  CHECK(layout.buckets[1].numel == 8);
  const auto other = build_bucket_layout({{b}, {torch::zeros({3})}}, 1000, 4, false, {true, false});
  CHECK(other.params[0].offset == 0);
  CHECK(other.buckets[other.params[0].bucket].numel == 8);
  // ZeRO-3's bucket per unit: the alone parameter still splits its unit.
  CHECK(build_bucket_layout(units, 1000, 4, true, {false, true, false}).buckets.size() == 3);
}
