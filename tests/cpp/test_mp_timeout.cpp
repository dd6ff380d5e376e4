// Run alone, 2 ranks, MEGATORCH_COMM_TIMEOUT_S=3: rank 1 skips a collective; rank 0 must
// fail with an error naming the group, the operation and its sequence number.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "mp_util.h"

using megatorch::comm::Group;
using megatorch::parallel::GroupKind;

TEST_CASE("a skipped collective times out with the group, op and sequence number", "[.][timeout][nccl_unchecked]") {
  auto st = mp::state(1, 1, "timeout");
  Group g(*st, GroupKind::kWorld);
  REQUIRE(g.timeout() == std::chrono::milliseconds(3000));
  auto x = torch::ones({4});
  g.all_reduce(x);  // #0 on both ranks
  const auto start = std::chrono::steady_clock::now();
  if (g.rank() == 0) {
    CHECK_THROWS_WITH(g.all_reduce(x), Catch::Contains("collective all_reduce #1 on group 'timeout.world'") &&
                                           Catch::Contains("timeout 3 s"));
    const auto waited = std::chrono::steady_clock::now() - start;
    CHECK(waited < std::chrono::seconds(20));
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(6));  // skip #1, outlive the timeout
  }
}
