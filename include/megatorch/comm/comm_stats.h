#pragma once
// Per-group communication accounting.
//
// Convention (the one place it is stated): `bytes` counts the payload a rank hands to
// the operation, i.e. the bytes of its *input* tensor:
//   all_reduce      the tensor reduced                       (b*s*h elements for TP)
//   all_gather      the local shard (not the gathered result)
//   reduce_scatter  the full input (not the scattered shard)
//   broadcast       the tensor, on every rank
//   send / recv     the tensor sent / the buffer received into
//   all_to_all      the part of the input sent to other ranks: input bytes x (size-1)/size
//                   (the chunk a rank keeps for itself never leaves it)
//   barrier         0
// Groups of one rank move nothing and count nothing. Counters are kept per group name,
// so every handle on the same group (C++ Group, operator calls, Python) shares them, and a
// name registered again (a ParallelState destroyed and made anew) counts on, sequence
// numbers included, from where the old group left off. They are atomics, not one lock: a
// snapshot taken while another thread communicates may see an operation's call before
// its bytes.
#include <array>
#include <cstdint>
#include <map>
#include <string>

namespace megatorch::comm {

// kCount is no operation: it counts them, so a new one goes before it.
enum class CommOp { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kSend, kRecv, kBarrier, kAllToAll, kCount };
constexpr int kNumCommOps = static_cast<int>(CommOp::kCount);
const char* comm_op_name(CommOp op);

struct OpStats {
  int64_t calls = 0;
  int64_t bytes = 0;
};

struct CommStats {
  std::array<OpStats, kNumCommOps> ops{};
  const OpStats& operator[](CommOp op) const { return ops[static_cast<int>(op)]; }
  OpStats& operator[](CommOp op) { return ops[static_cast<int>(op)]; }
  OpStats total() const;
  // Flat view, keys "<op>.calls" / "<op>.bytes" plus "total.calls" / "total.bytes".
  std::map<std::string, int64_t> to_map() const;
};

// Snapshot of a group's counters (zeros for a group that has not communicated yet).
CommStats comm_stats(const std::string& group_name);
// Reset one group's counters, or every group's when `group_name` is empty.
void reset_comm_stats(const std::string& group_name = "");

namespace detail {
// One group name's counters and sequence number. Made on first use and never freed, so
// a handle keeps a plain pointer to it and counts without a lookup or a lock.
struct CounterSlot;
CounterSlot* counter_slot(const std::string& group_name);
// Records one operation and returns the group's sequence number for it (0, 1, ...).
int64_t record_comm(CounterSlot& slot, CommOp op, int64_t bytes);
int64_t record_comm(const std::string& group_name, CommOp op, int64_t bytes);
}  // namespace detail

}  // namespace megatorch::comm
