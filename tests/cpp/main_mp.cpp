// Multi-rank tests: run under `torchrun --no-python`, every rank runs every test case in
// the same order (they call collectives). Rank 0 reports in full, the others compactly,
// and every rank's exit code counts (torchrun fails if any rank fails).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <string>

#include "rounding_path.h"

int main(int argc, char** argv) {
  rounding_path::configure_and_report();
  Catch::Session session;
  if (int rc = session.applyCommandLine(argc, argv)) return rc;
  const char* rank = std::getenv("RANK");
  if (rank && std::string(rank) != "0") session.configData().reporterName = "compact";
  return session.run();
}
