// Single-process tests: no torchrun needed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <torch/torch.h>

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  return Catch::Session().run(argc, argv);
}
