#include "megatorch/comm/comm_stats.h"

#include <mutex>
#include <unordered_map>

namespace megatorch::comm {
namespace {

struct GroupCounters {
  CommStats stats;
  int64_t next_seq = 0;  // not reset with the stats: it identifies collectives in errors
};

// Keyed by group name like c10d's own group registry, so counters survive handles.
std::mutex& counters_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<std::string, GroupCounters>& counters() {
  static std::unordered_map<std::string, GroupCounters> c;
  return c;
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
  std::lock_guard<std::mutex> lock(counters_mutex());
  auto it = counters().find(group_name);
  return it == counters().end() ? CommStats{} : it->second.stats;
}

void reset_comm_stats(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  for (auto& [name, c] : counters()) {
    if (group_name.empty() || name == group_name) c.stats = CommStats{};
  }
}

namespace detail {
int64_t record_comm(const std::string& group_name, CommOp op, int64_t bytes) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  auto& c = counters()[group_name];
  c.stats[op].calls += 1;
  c.stats[op].bytes += bytes;
  return c.next_seq++;
}
}  // namespace detail

}  // namespace megatorch::comm
