#include "group_cache.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <cstdlib>
#include <unordered_map>

#include "megatorch/check.h"
#include "megatorch/parallel/launch_env.h"

namespace megatorch::comm::detail {
namespace {

std::chrono::milliseconds group_timeout(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  if (std::getenv("MEGATORCH_COMM_TIMEOUT_S")) return parallel::default_comm_timeout();
  try {
    auto opts = pg->getDefaultBackend()->getBackendOptions();
    if (opts && opts->timeout.count() > 0) return opts->timeout;
  } catch (const std::exception&) {
    // A backend without getBackendOptions: fall through to the default.
  }
  return parallel::default_comm_timeout();
}

// Entries of destroyed groups whose names are not looked up again are dropped once the
// cache holds this many (tests make many short-lived groups, each under its own name).
constexpr size_t kSweepAt = 64;

}  // namespace

const ResolvedGroup& resolve_group(const std::string& name, c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  try {
    pg = c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    MEGATORCH_FAIL("expected a process group registered under the name '", name,
                   "', found none; pass the name of a group made by megatorch's ParallelState "
                   "(e.g. state.group_name(GroupKind::kTensor)) or of one made in Python by "
                   "torch.distributed.new_group(...) (its .group_name)");
  }
  // Per thread: a hit takes no lock (the autograd engine's threads have caches of their own).
  thread_local std::unordered_map<std::string, ResolvedGroup> cache;
  auto it = cache.find(name);
  if (it != cache.end() && it->second.group._unsafe_get_target() == pg.get()) return it->second;
  if (it == cache.end() && cache.size() >= kSweepAt) {
    for (auto e = cache.begin(); e != cache.end();) e = e->second.group.expired() ? cache.erase(e) : std::next(e);
  }
  ResolvedGroup r(pg);
  r.rank = pg->getRank();
  r.size = pg->getSize();
  r.timeout = group_timeout(pg);
  r.counters = counter_slot(name);
  return cache.insert_or_assign(name, std::move(r)).first->second;
}

}  // namespace megatorch::comm::detail
