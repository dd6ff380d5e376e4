#pragma once
// Helpers for tests run under torchrun: every rank runs the same test cases in order.
#include <megatorch/megatorch.h>

#include <cstdlib>
#include <memory>
#include <string>

namespace mp {

inline int64_t world_size() { return std::atoll(std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : "1"); }
inline int64_t rank() { return std::atoll(std::getenv("RANK") ? std::getenv("RANK") : "0"); }

// A ParallelState with a name of its own (each test case makes fresh groups).
inline std::unique_ptr<megatorch::parallel::ParallelState> state(int64_t tp, int64_t pp, const std::string& name,
                                                                 int64_t cp = 1, int64_t ep = 1, int64_t etp = 1) {
  return std::make_unique<megatorch::parallel::ParallelState>(megatorch::parallel::ParallelStateOptions(tp, pp)
                                                                  .context_parallel_size(cp)
                                                                  .expert_model_parallel_size(ep)
                                                                  .expert_tensor_parallel_size(etp)
                                                                  .name(name)
                                                                  .device("cpu"));
}

}  // namespace mp
