#pragma once
// The rounding path a test binary runs on: ATen's CPU capability (ATEN_CPU_CAPABILITY) and
// the intra-op thread count (MEGATORCH_TEST_THREADS, default 1: 2-8 ranks share 2 cores).
// CI runs the parity suites on more than one path (tests/CMakeLists.txt), so each binary
// says which one it ran on.
#include <ATen/Version.h>
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <string>

namespace rounding_path {

inline void configure_and_report() {
  const char* threads = std::getenv("MEGATORCH_TEST_THREADS");
  const int n = threads && *threads ? std::atoi(threads) : 1;
  if (n < 1) {
    std::cerr << "MEGATORCH_TEST_THREADS must be a positive thread count, got '" << threads << "'" << std::endl;
    std::exit(2);
  }
  torch::set_num_threads(n);
  const char* rank = std::getenv("RANK");
  if (!rank || std::string(rank) == "0") {
    std::cerr << "[tests] ATen CPU capability " << at::get_cpu_capability() << ", " << n << " intra-op thread"
              << (n == 1 ? "" : "s") << std::endl;
  }
}

}  // namespace rounding_path
