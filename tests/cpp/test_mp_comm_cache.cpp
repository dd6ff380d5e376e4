// Group names made anew across ParallelStates: the cached resolution (csrc/comm/
// group_cache.h) must follow the registry, and the mappings' identity directions, which
// copy nothing in C++, must stay copies through the registered operators.
#include <ATen/core/dispatch/Dispatcher.h>
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "mp_util.h"

using megatorch::comm::CommOp;
using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
namespace comm = megatorch::comm;

namespace {
using MappingOp = at::Tensor(const at::Tensor&, c10::string_view);
c10::TypedOperatorHandle<MappingOp> mapping_op(comm::Mapping m) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("megatorch::") + comm::mapping_name(m)).c_str(), "")
      .typed<MappingOp>();
}
}  // namespace

TEST_CASE("a ParallelState made anew under the same name: its groups are the ones used", "[mp][comm_cache]") {
  const int64_t n = mp::world_size();
  const std::string tp = "cache_remade.tp";
  comm::reset_comm_stats(tp);
  // TP = n, then 1 (a group of one), then n again: each time the name's group changes size.
  for (int64_t size : {n, int64_t{1}, n}) {
    auto st = mp::state(size, 1, "cache_remade");
    Group g(tp);
    REQUIRE(g.size() == size);
    CHECK(g.process_group().get() == st->process_group(GroupKind::kTensor).get());
    auto x = torch::ones({4});
    g.all_reduce(x);
    CHECK(torch::equal(x, torch::full({4}, static_cast<float>(size))));
    // g's forward through the C++ path, on a Group made by name per call.
    auto y = comm::reduce_from_tp_region(torch::ones({2, 3}), tp);
    CHECK(torch::equal(y, torch::full({2, 3}, static_cast<float>(size))));
  }
  CHECK_THROWS_WITH(Group(tp), Catch::Contains("expected a process group registered under the name '" + tp + "'"));
  // Counted per name over all three groups; a group of one counts nothing.
  const int64_t counted = n > 1 ? 2 : 0;
  CHECK(comm::comm_stats(tp)[CommOp::kAllReduce].calls == 2 * counted);
  CHECK(comm::comm_stats(tp)[CommOp::kAllReduce].bytes == counted * (4 * 4 + 6 * 4));
}

TEST_CASE("f's identity forward: no copy in C++, a copy through the operator", "[mp][comm_cache]") {
  const int64_t n = mp::world_size();
  auto st = mp::state(n, 1, "cache_alias");
  const std::string tp = st->group_name(GroupKind::kTensor);
  Group g(tp);
  const int64_t r = g.rank();
  for (bool through_op : {false, true}) {
    g.reset_stats();
    auto x = torch::full({3, 2}, static_cast<double>(r), torch::dtype(torch::kDouble).requires_grad(true));
    auto y = through_op ? mapping_op(comm::Mapping::kCopyToTP).call(x, tp) : comm::copy_to_tp_region(x, tp);
    CHECK(torch::equal(y, x));
    CHECK((y.data_ptr() == x.data_ptr()) == !through_op);
    CHECK(g.stats().total().calls == 0);
    (y * static_cast<double>(r + 1)).sum().backward();
    CHECK(torch::equal(x.grad(), torch::full({3, 2}, n * (n + 1) / 2.0)));  // all-reduced
    CHECK(g.stats()[CommOp::kAllReduce].calls == (n > 1 ? 1 : 0));
    if (n > 1 && !through_op) {
      // The view is f's own: changing it in place, which would bypass f's backward, is refused.
      auto v = comm::copy_to_tp_region(x * 1.0, tp);
      CHECK_THROWS_WITH(v.add_(1.0), Catch::Contains("view") && Catch::Contains("inplace"));
    }
    // Without a gradient to record, the C++ path returns the input itself.
    torch::NoGradGuard no_grad;
    auto z = through_op ? mapping_op(comm::Mapping::kCopyToTP).call(x, tp) : comm::copy_to_tp_region(x, tp);
    CHECK(z.is_same(x) == !through_op);
  }
}
