// Links megatorch::megatorch from its install tree and uses it: the rank layout of a
// 16-rank job and a one-rank world built from an in-memory store.
#include <megatorch/megatorch.h>  // also megatorch/version.h
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <iostream>

// Compile-time: what this code needs (MEGATORCH_VERSION is MAJOR * 10000 + MINOR * 100 + PATCH).
static_assert(MEGATORCH_VERSION >= 300, "needs megatorch 0.3 or later");

int main() {
  megatorch::parallel::RankLayout layout(16, 2, 4);
  megatorch::parallel::ParallelState state(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                           megatorch::parallel::ParallelStateOptions().device("cpu"));
  auto x = torch::ones({2, 3}, torch::requires_grad());
  auto y = megatorch::comm::reduce_from_tp_region(x, state.group_name(megatorch::parallel::GroupKind::kTensor));
  y.sum().backward();
  const bool ok = layout.dp_size() == 2 && torch::equal(x.grad(), torch::ones({2, 3}));
  // Run time: the library actually loaded (megatorch::version()) and the headers compiled against.
  std::cout << "megatorch " << megatorch::version() << " (headers " << MEGATORCH_VERSION_STRING << ")\n";
  std::cout << layout.describe() << "\n" << (ok ? "consumer ok" : "consumer FAILED") << std::endl;
  return ok ? 0 : 1;
}
