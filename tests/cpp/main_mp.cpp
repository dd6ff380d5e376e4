// Multi-rank tests: run under `torchrun --no-python`, every rank runs every test case in
// the same order (they call collectives). Rank 0 reports in full, the others compactly,
// and every rank's exit code counts (torchrun fails if any rank fails).
//
// Every test case runs under the NCCL-semantics check (megatorch/comm/nccl_semantics.h):
// the ops each rank posted are exchanged through the launch store when the case ends and
// replayed under NCCL's rules; a violation fails the run with its report. Off with
// MEGATORCH_NCCL_CHECK=0 (for timing); a case that breaks the rules on purpose carries the
// tag [nccl_unchecked].
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <megatorch/comm/nccl_semantics.h>
#include <megatorch/parallel/parallel_state.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>

#include "rounding_path.h"

namespace {

int nccl_violations = 0;

class NcclCheckListener : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;

  void testCaseStarting(const Catch::TestCaseInfo&) override { megatorch::comm::clear_trace(); }

  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    namespace comm = megatorch::comm;
    const auto& tags = stats.testInfo.tags;
    // Every rank has the same tags, so every rank skips alike. An unchecked case exchanges
    // nothing: one that outlives a timeout on purpose ([timeout]) would otherwise race its
    // sleeping peer for the "passed" key under the same short store timeout.
    const bool unchecked = std::find(tags.begin(), tags.end(), "nccl_unchecked") != tags.end();
    if (!comm::nccl_check_enabled() || unchecked) {
      comm::clear_trace();
      return;
    }
    const auto env = megatorch::parallel::LaunchEnv::from_environment();
    if (!store_) store_ = megatorch::parallel::connect_store(env, megatorch::parallel::default_comm_timeout());
    const std::string key = "megatorch_nccl_check/" + std::to_string(case_++);
    // A case that failed on some rank left partial traces: nothing to check then.
    const std::string passed = stats.totals.assertions.failed == 0 ? "1" : "0";
    store_->set(key + "/passed/" + std::to_string(env.rank), std::vector<uint8_t>(passed.begin(), passed.end()));
    bool all_passed = true;
    for (int64_t r = 0; r < env.world_size; ++r) {
      const auto v = store_->get(key + "/passed/" + std::to_string(r));
      all_passed = all_passed && !v.empty() && v[0] == '1';
    }
    if (!all_passed) {
      comm::clear_trace();
      return;
    }
    try {
      comm::check_nccl_semantics_across_ranks(store_, key, env.rank, env.world_size);
    } catch (const std::exception& e) {
      nccl_violations += 1;
      std::cerr << "\nNCCL-semantics check FAILED in test case '" << stats.testInfo.name << "' (rank " << env.rank
                << "):\n" << e.what() << "\n";
    }
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  int64_t case_ = 0;
};

}  // namespace

CATCH_REGISTER_LISTENER(NcclCheckListener)

int main(int argc, char** argv) {
  rounding_path::configure_and_report();
  if (!std::getenv("MEGATORCH_NCCL_CHECK")) megatorch::comm::set_nccl_check_enabled(true);
  Catch::Session session;
  if (int rc = session.applyCommandLine(argc, argv)) return rc;
  const char* rank = std::getenv("RANK");
  if (rank && std::string(rank) != "0") session.configData().reporterName = "compact";
  const int failed = session.run();
  if (nccl_violations > 0) {
    std::cerr << nccl_violations << " test case(s) broke NCCL's rules (see above)\n";
    return failed > 0 ? failed : 1;
  }
  return failed;
}
