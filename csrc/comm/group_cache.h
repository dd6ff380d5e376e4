#pragma once
// What comm::Group(name) resolves a name to, cached per thread: the process group's
// rank, size and timeout and the name's counters, looked up once rather than on every
// mapping call or collective (each of those makes a Group by name).
//
// The cache never outlives the registry's word: every lookup asks c10d's registry which
// group holds the name now and compares it with the cached one, so a name registered
// again after its group was destroyed (a ParallelState made anew under the same name,
// torch.distributed.destroy_process_group and new_group) resolves to the new group, and
// an unregistered name fails as before.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "megatorch/comm/comm_stats.h"

namespace megatorch::comm::detail {

struct ResolvedGroup {
  explicit ResolvedGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) : group(pg) {}
  // Identity only. A weak reference keeps the group object's memory, so no later group
  // can be allocated at its address and pass for it, but not its backends: a destroyed
  // group's connections close as they did without the cache.
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
  int64_t rank = 0;
  int64_t size = 1;
  // MEGATORCH_COMM_TIMEOUT_S if set, else the process group's own timeout.
  std::chrono::milliseconds timeout{0};
  CounterSlot* counters = nullptr;
};

// The group registered under `name` now (into `pg`) and what is known of it. Fails,
// naming the ways to register one, when nothing is registered under `name`. The
// reference stays valid until this thread's next call.
const ResolvedGroup& resolve_group(const std::string& name, c10::intrusive_ptr<c10d::ProcessGroup>& pg);

}  // namespace megatorch::comm::detail
