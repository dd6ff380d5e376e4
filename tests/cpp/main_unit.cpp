// Single-process tests: no torchrun needed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "rounding_path.h"

int main(int argc, char** argv) {
  rounding_path::configure_and_report();
  return Catch::Session().run(argc, argv);
}
