#pragma once
// How a rank's action list is posted to the PP group: an ordered list of steps, each one
// compute action or one batch of sends and receives posted together (an NCCL group:
// ncclGroupStart ... ncclGroupEnd, which c10d spells startCoalescing / endCoalescing).
//
// Why batches: NCCL pairs a send and a receive between two ranks by issue order, not by
// tag, and a send or receive holds its rank's stream until the peer posts the match.
// Posted one at a time, 1F1B's steady state deadlocks: rank r sends activation i while
// rank r+1 sends gradient j, and each waits for the other's receive. Posting the
// transfers between two computes as one group lets both complete together, which is
// Megatron's send_forward_recv_backward / send_backward_recv_forward.
//
// The rule (docs/pipeline.md): sends stay right after the compute that produced them,
// receives are posted where RecvPosting says, and all the transfers that land between
// two computes form one batch, ordered by peer, receives first, then by message
// (activation before gradient, micro-batch, receiving virtual stage), which both ends of
// a pair compute alike. verify_nccl_order (nccl_order_model.h) proves for every looped
// schedule that these batches neither deadlock nor pair the wrong send and receive.
//
// The executor posts these steps on Gloo (each op alone, with its tag). Where NCCL's rules
// apply it posts through channels instead (p2p_channels.h): one communicator cannot carry
// the V schedules' crossing streams, and a batch makes each receive wait for the sends
// beside it, which costs zb-h1 and interleaved their overlap when m > p. The batches stay
// as Megatron's single-communicator design, which the order model times for comparison.
#include <cstdint>
#include <string>
#include <vector>

#include "megatorch/pipeline/schedule.h"

namespace megatorch::pipeline {

struct P2PStep {
  // A compute step when `batch` is empty; else the sends and receives posted together,
  // in issue order (`compute` unused).
  Action compute;
  std::vector<Action> batch;

  bool is_batch() const { return !batch.empty(); }
};

// "forward(mb 0, chunk 0)", or "[send_activation(mb 0, chunk 0) to rank 1, ...]".
std::string to_string(const P2PStep& step);

// What a transfer carries, the same for its send on one rank and its receive on the
// other: activation or gradient, micro-batch, and the virtual stage it is delivered to.
struct P2PMessage {
  bool gradient = false;
  int64_t microbatch = 0;
  int64_t to_stage = 0;

  bool operator==(const P2PMessage& o) const {
    return gradient == o.gradient && microbatch == o.microbatch && to_stage == o.to_stage;
  }
  bool operator!=(const P2PMessage& o) const { return !(*this == o); }
  bool operator<(const P2PMessage& o) const;
};

// The message of a send or receive `a` in rank `rank`'s list of a p-rank pipeline whose
// chunks are placed by `layout`.
P2PMessage p2p_message(const Action& a, int64_t rank, int64_t p, ChunkLayout layout = ChunkLayout::kLooped);
// "activation of mb 3 for virtual stage 5".
std::string to_string(const P2PMessage& message);
// A distinct tag per message of a (p ranks, v chunks) pipeline, which sender and receiver
// compute alike: Gloo pairs by it, and the NCCL check compares it across a pair.
int64_t p2p_tag(const P2PMessage& message, int64_t p, int64_t v);

// Where a receive is posted. A batch completes only when every op in it has met its
// peer's, so a receive posted late holds up the sender's stream until the receiver gets
// there; one posted early holds up the receiver's. Which is right depends on the
// schedule's slack:
enum class RecvPosting {
  // In the batch right before the compute that consumes it (Megatron's
  // forward_backward_pipelining_without_interleaving: send_forward_recv_backward,
  // send_backward_recv_forward). 1F1B has no slack: each stage's warm-up is exactly what
  // keeps its neighbours busy, so any earlier receive closes a cycle and deadlocks.
  kBeforeConsumer,
  // In the batch right after the previous compute of the same direction (forward or
  // backward), or before the consumer if there is none: one round ahead, as Megatron's
  // interleaved schedule does with overlapped p2p (send_forward_recv_forward,
  // send_backward_recv_backward). Interleaved needs it: its longer warm-up puts the
  // senders a round ahead, and a receive posted only before its consumer would hold the
  // sender's stream across computes that the receiver waits for (a deadlock for every
  // v > 1 with m > p).
  kAfterPreviousSameDirection,
};

// The posting each schedule runs with: kBeforeConsumer for GPipe and 1F1B (for GPipe
// both postings coincide), kAfterPreviousSameDirection for interleaved.
RecvPosting recv_posting(ScheduleKind kind);
const char* recv_posting_name(RecvPosting posting);  // "before_consumer", "after_previous_same_direction"

// The batched steps of one rank's action list (build_schedule's output): sends stay right
// after the compute that produced them, receives move as `posting` says, and all the
// transfers that land between two computes form one batch.
std::vector<P2PStep> p2p_steps(const std::vector<Action>& actions, int64_t rank, int64_t p, RecvPosting posting,
                               ChunkLayout layout = ChunkLayout::kLooped);

// p2p_steps of build_schedule(kind, p, m, v, rank) with recv_posting(kind).
std::vector<P2PStep> schedule_p2p_steps(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t rank);

// p2p_steps of build_forward_only_schedule(kind, p, m, v, rank) with recv_posting(kind).
std::vector<P2PStep> forward_only_p2p_steps(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t rank);

// One op per batch, in list order: what posting each action alone means on NCCL (the
// executor's former order). The tests show that it deadlocks where the batches do not.
std::vector<P2PStep> unbatched_p2p_steps(const std::vector<Action>& actions);

// Why a schedule was refused on NCCL: never any more (every schedule posts on per-channel
// communicators there, p2p_channels.h), so always "". Kept for callers of 0.2; removed in 0.4.
[[deprecated("no schedule is refused on NCCL any more, drop the check")]]
inline std::string nccl_refusal(ScheduleKind) { return ""; }

}  // namespace megatorch::pipeline
