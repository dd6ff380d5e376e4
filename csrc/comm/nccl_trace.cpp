#include "megatorch/comm/nccl_trace.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "megatorch/check.h"

namespace megatorch::comm {
namespace {

// A handle packs the trace's epoch (bumped by every take or clear) with the op's index,
// so a Work posted before a take and waited after it records nothing.
constexpr int kIndexBits = 40;

struct Recorder {
  std::mutex mu;
  RankTrace trace;
  int64_t epoch = 0;
};

Recorder& recorder() {
  static Recorder r;
  return r;
}

std::atomic<int>& enabled_flag() {
  static std::atomic<int> flag{[] {
    const char* v = std::getenv("MEGATORCH_NCCL_CHECK");
    return v && std::string(v) != "0" && std::string(v) != "" ? 1 : 0;
  }()};
  return flag;
}

// Names travel as whitespace-free tokens.
std::string token(std::string s) {
  if (s.empty()) return "-";
  for (char& c : s)
    if (c == ' ' || c == '\t' || c == '\n') c = '_';
  return s;
}

}  // namespace

bool nccl_check_enabled() { return enabled_flag().load() != 0; }
void set_nccl_check_enabled(bool on) { enabled_flag().store(on ? 1 : 0); }

std::string comm_identity(const c10d::ProcessGroup& pg, const std::string& name) {
  const std::string desc = pg.getGroupDesc();
  return token(desc.empty() ? pg.getGroupName() + "|" + name : pg.getGroupName() + "|" + desc);
}

namespace detail {

int64_t trace_op(TracedOp op) {
  if (!nccl_check_enabled()) return -1;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  op.waits_before = static_cast<int64_t>(r.trace.waits.size());
  r.trace.ops.push_back(std::move(op));
  return (r.epoch << kIndexBits) | static_cast<int64_t>(r.trace.ops.size() - 1);
}

void trace_wait(int64_t handle) {
  if (handle < 0) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  if ((handle >> kIndexBits) != r.epoch) return;
  r.trace.waits.push_back(handle & ((int64_t{1} << kIndexBits) - 1));
}

}  // namespace detail

RankTrace take_trace(int64_t rank) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  RankTrace out = std::move(r.trace);
  out.rank = rank;
  r.trace = RankTrace{};
  r.epoch += 1;
  return out;
}

void clear_trace() { take_trace(0); }

std::string serialize_trace(const RankTrace& trace) {
  std::ostringstream os;
  os << "R " << trace.rank << "\n";
  for (const TracedOp& op : trace.ops) {
    os << "O " << token(op.comm) << " " << token(op.group) << " " << op.group_rank << " " << op.group_size << " "
       << static_cast<int>(op.op) << " " << (op.batch ? 1 : 0) << " " << op.waits_before << " "
       << token(op.signature) << " " << op.transfers.size();
    for (const TracedTransfer& t : op.transfers)
      os << " " << (t.send ? 1 : 0) << " " << t.peer << " " << t.tag << " " << t.bytes;
    os << "\n";
  }
  for (int64_t w : trace.waits) os << "W " << w << "\n";
  return os.str();
}

RankTrace parse_trace(const std::string& text) {
  RankTrace trace;
  std::istringstream in(text);
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    std::istringstream ls(line);
    char kind = 0;
    ls >> kind;
    bool ok = true;
    if (kind == 'R') {
      ok = static_cast<bool>(ls >> trace.rank);
    } else if (kind == 'O') {
      TracedOp op;
      int code = 0, batch = 0;
      size_t n = 0;
      ok = static_cast<bool>(ls >> op.comm >> op.group >> op.group_rank >> op.group_size >> code >> batch >>
                             op.waits_before >> op.signature >> n);
      op.op = static_cast<CommOp>(code);
      op.batch = batch != 0;
      if (op.signature == "-") op.signature.clear();
      for (size_t i = 0; ok && i < n; ++i) {
        TracedTransfer t;
        int send = 0;
        ok = static_cast<bool>(ls >> send >> t.peer >> t.tag >> t.bytes);
        t.send = send != 0;
        op.transfers.push_back(t);
      }
      trace.ops.push_back(std::move(op));
    } else if (kind == 'W') {
      int64_t w = 0;
      ok = static_cast<bool>(ls >> w) && w >= 0 && w < static_cast<int64_t>(trace.ops.size());
      trace.waits.push_back(w);
    } else {
      ok = false;
    }
    MEGATORCH_CHECK(ok, "NCCL trace: line ", line_no, " is garbled: '", line,
                    "'; expected lines 'R <rank>', 'O <op ...>' or 'W <op index>' as serialize_trace writes them");
  }
  return trace;
}

}  // namespace megatorch::comm
