#include "megatorch/comm/comm_stats.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace megatorch::comm {
namespace detail {

struct CounterSlot {
  std::array<std::atomic<int64_t>, kNumCommOps> calls{};
  std::array<std::atomic<int64_t>, kNumCommOps> bytes{};
  std::atomic<int64_t> next_seq{0};  // not reset with the stats: it identifies collectives in errors
};

}  // namespace detail
namespace {

using detail::CounterSlot;

// Keyed by group name like c10d's own group registry, so counters survive handles. The
// lock guards the map only (making a slot, snapshots, resets), never a collective's count.
std::mutex& slots_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<std::string, std::unique_ptr<CounterSlot>>& slots() {
  static auto* s = new std::unordered_map<std::string, std::unique_ptr<CounterSlot>>();  // outlives every handle
  return *s;
}

}  // namespace

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::kAllReduce: return "all_reduce";
    case CommOp::kAllGather: return "all_gather";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kSend: return "send";
    case CommOp::kRecv: return "recv";
    case CommOp::kBarrier: return "barrier";
    case CommOp::kAllToAll: return "all_to_all";
    case CommOp::kCount: break;
  }
  return "?";
}

OpStats CommStats::total() const {
  OpStats t;
  for (const auto& s : ops) {
    t.calls += s.calls;
    t.bytes += s.bytes;
  }
  return t;
}

std::map<std::string, int64_t> CommStats::to_map() const {
  std::map<std::string, int64_t> out;
  for (int i = 0; i < kNumCommOps; ++i) {
    const std::string name = comm_op_name(static_cast<CommOp>(i));
    out[name + ".calls"] = ops[i].calls;
    out[name + ".bytes"] = ops[i].bytes;
  }
  out["total.calls"] = total().calls;
  out["total.bytes"] = total().bytes;
  return out;
}

CommStats comm_stats(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(slots_mutex());
  CommStats out;
  auto it = slots().find(group_name);
  if (it == slots().end()) return out;
  const CounterSlot& slot = *it->second;
  for (int i = 0; i < kNumCommOps; ++i) {
    out.ops[i].calls = slot.calls[i].load(std::memory_order_relaxed);
    out.ops[i].bytes = slot.bytes[i].load(std::memory_order_relaxed);
  }
  return out;
}

void reset_comm_stats(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(slots_mutex());
  for (auto& [name, slot] : slots()) {
    if (!group_name.empty() && name != group_name) continue;
    for (int i = 0; i < kNumCommOps; ++i) {
      slot->calls[i].store(0, std::memory_order_relaxed);
      slot->bytes[i].store(0, std::memory_order_relaxed);
    }
  }
}

namespace detail {

CounterSlot* counter_slot(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(slots_mutex());
  auto& slot = slots()[group_name];
  if (!slot) slot = std::make_unique<CounterSlot>();
  return slot.get();
}

int64_t record_comm(CounterSlot& slot, CommOp op, int64_t bytes) {
  const int i = static_cast<int>(op);
  slot.calls[i].fetch_add(1, std::memory_order_relaxed);
  slot.bytes[i].fetch_add(bytes, std::memory_order_relaxed);
  return slot.next_seq.fetch_add(1, std::memory_order_relaxed);
}

int64_t record_comm(const std::string& group_name, CommOp op, int64_t bytes) {
  return record_comm(*counter_slot(group_name), op, bytes);
}

}  // namespace detail
}  // namespace megatorch::comm
