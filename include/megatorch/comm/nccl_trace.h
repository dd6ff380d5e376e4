#pragma once
// What this process posted to its communicators, in issue order, for the NCCL-semantics
// check (nccl_semantics.h). Gloo pairs point-to-point ops by tag and never blocks a
// send, so a multi-rank run on CPU ranks passes even where NCCL, which pairs by issue
// order and blocks each op until its peer posts the match, would deliver the wrong tensor
// or hang. With the check on, every comm::Group operation is recorded here (a collective,
// a lone send or receive, or a batch_p2p group) together with the waits the caller made
// before posting it; the check then replays every rank's trace under NCCL's rules.
//
// On (MEGATORCH_NCCL_CHECK=1, or set_nccl_check_enabled) it also makes every group follow
// NCCL's rules where they differ from Gloo's (Group::follows_nccl_rules): the pipeline
// executor then posts its transfers the way it does on NCCL, so the check sees the NCCL
// code path run on Gloo underneath.
#include <c10/core/DeviceType.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "megatorch/comm/comm_stats.h"

namespace megatorch::comm {

// One send or receive of a traced op; `peer` is a rank within the communicator.
struct TracedTransfer {
  bool send = true;
  int64_t peer = 0;
  int64_t tag = 0;    // what the caller meant to pair by (Gloo's tag): equal on both ends of a correct pair
  int64_t bytes = 0;
};

// One posted operation.
struct TracedOp {
  // The communicator: the same string on every member, distinct for every group instance.
  std::string comm;
  std::string group;  // the name the caller used (for messages)
  int64_t group_rank = 0;
  int64_t group_size = 1;
  CommOp op = CommOp::kBarrier;
  // Several transfers posted as one group (batch_p2p: ncclGroupStart ... ncclGroupEnd).
  // A lone send or receive has one transfer and batch = false.
  bool batch = false;
  std::vector<TracedTransfer> transfers;  // empty for a collective
  // What every member's matching collective must agree on (dtype, count, reduce op, root).
  std::string signature;
  // How many waits this rank had made before posting it: on a GPU the op's stream waits
  // for the compute stream, which waited for those works.
  int64_t waits_before = 0;
};

// One rank's trace: its ops in issue order and the ops it waited for, in wait order
// (indices into `ops`).
struct RankTrace {
  int64_t rank = 0;
  std::vector<TracedOp> ops;
  std::vector<int64_t> waits;
};

// MEGATORCH_NCCL_CHECK=1 turns the check on for the process (read once); the setter wins.
bool nccl_check_enabled();
void set_nccl_check_enabled(bool on);

// The communicator string of `pg` (as `name` resolved it): its group name and description,
// which megatorch's groups make unique per instance and equal on every member.
std::string comm_identity(const c10d::ProcessGroup& pg, const std::string& name);

namespace detail {
// Recording, for comm::Group. Each returns the op's handle for trace_wait, or -1 when
// nothing is recorded (check off).
int64_t trace_op(TracedOp op);
void trace_wait(int64_t handle);
}  // namespace detail

// This process's trace since the last take (or clear), under `rank`; recording restarts empty.
RankTrace take_trace(int64_t rank);
void clear_trace();

// A line-based text form, for exchanging traces between ranks.
std::string serialize_trace(const RankTrace& trace);
RankTrace parse_trace(const std::string& text);

}  // namespace megatorch::comm
