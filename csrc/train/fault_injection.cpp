#include "megatorch/train/fault_injection.h"

#include <cstdlib>
#include <sstream>
#include <tuple>

#include "megatorch/check.h"

namespace megatorch::train {
namespace {

constexpr const char* kUsage =
    "; expected a comma-separated list of nan_grad@ITER:RANK, slow_rank@RANK:MS, slow_save@MS, loss_spike@ITER:RANK "
    "and loss_spike_persistent@ITER:RANK";

int64_t number(const std::string& text, const std::string& entry) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  MEGATORCH_CHECK(!text.empty() && end != nullptr && *end == '\0' && v >= 0, "MEGATORCH_FAULT_INJECTION: '", entry,
                  "' holds '", text, "' where a non-negative integer belongs", kUsage);
  return v;
}

// "A:B" -> {A, B}.
std::pair<int64_t, int64_t> pair_of(const std::string& args, const std::string& entry) {
  const auto colon = args.find(':');
  MEGATORCH_CHECK(colon != std::string::npos, "MEGATORCH_FAULT_INJECTION: '", entry, "' needs two numbers", kUsage);
  return {number(args.substr(0, colon), entry), number(args.substr(colon + 1), entry)};
}

}  // namespace

FaultInjection FaultInjection::parse(const std::string& spec) {
  FaultInjection f;
  std::stringstream in(spec);
  std::string entry;
  while (std::getline(in, entry, ',')) {
    if (entry.empty()) continue;
    const auto at = entry.find('@');
    MEGATORCH_CHECK(at != std::string::npos, "MEGATORCH_FAULT_INJECTION: '", entry, "' has no '@'", kUsage);
    const std::string kind = entry.substr(0, at), args = entry.substr(at + 1);
    if (kind == "nan_grad") {
      std::tie(f.nan_grad_iteration, f.nan_grad_rank) = pair_of(args, entry);
      MEGATORCH_CHECK(f.nan_grad_iteration >= 1, "MEGATORCH_FAULT_INJECTION: '", entry,
                      "' names iteration 0; iterations count from 1");
    } else if (kind == "loss_spike" || kind == "loss_spike_persistent") {
      std::tie(f.loss_spike_iteration, f.loss_spike_rank) = pair_of(args, entry);
      f.loss_spike_persistent = kind == "loss_spike_persistent";
      MEGATORCH_CHECK(f.loss_spike_iteration >= 1, "MEGATORCH_FAULT_INJECTION: '", entry,
                      "' names iteration 0; iterations count from 1");
    } else if (kind == "slow_rank") {
      std::tie(f.slow_rank, f.slow_rank_ms) = pair_of(args, entry);
    } else if (kind == "slow_save") {
      f.slow_save_ms = number(args, entry);
    } else {
      MEGATORCH_FAIL("MEGATORCH_FAULT_INJECTION: unknown fault '", kind, "' in '", entry, "'", kUsage);
    }
  }
  return f;
}

FaultInjection FaultInjection::from_environment() {
  const char* spec = std::getenv("MEGATORCH_FAULT_INJECTION");
  return parse(spec == nullptr ? "" : spec);
}

}  // namespace megatorch::train
