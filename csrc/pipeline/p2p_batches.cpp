#include "megatorch/pipeline/p2p_batches.h"

#include <algorithm>
#include <sstream>
#include <tuple>

#include "megatorch/check.h"

namespace megatorch::pipeline {

bool P2PMessage::operator<(const P2PMessage& o) const {
  return std::tie(gradient, microbatch, to_stage) < std::tie(o.gradient, o.microbatch, o.to_stage);
}

std::string to_string(const P2PStep& step) {
  if (!step.is_batch()) return to_string(step.compute);
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < step.batch.size(); ++i) os << (i ? ", " : "") << to_string(step.batch[i]);
  os << "]";
  return os.str();
}

P2PMessage p2p_message(const Action& a, int64_t rank, int64_t p, ChunkLayout layout) {
  MEGATORCH_CHECK(is_send(a.kind) || is_recv(a.kind), "expected a send or receive action, got ", to_string(a));
  const int64_t here = virtual_stage(a.chunk, rank, p, layout);
  P2PMessage msg;
  msg.gradient = a.kind == ActionKind::kSendGrad || a.kind == ActionKind::kRecvGrad;
  msg.microbatch = a.microbatch;
  // A send delivers to the neighbouring virtual stage; a receive delivers here.
  if (a.kind == ActionKind::kSendActivation) msg.to_stage = here + 1;
  else if (a.kind == ActionKind::kSendGrad) msg.to_stage = here - 1;
  else msg.to_stage = here;
  return msg;
}

int64_t p2p_tag(const P2PMessage& message, int64_t p, int64_t v) {
  return (message.microbatch * p * v + message.to_stage) * 2 + (message.gradient ? 1 : 0);
}

std::string to_string(const P2PMessage& message) {
  std::ostringstream os;
  os << (message.gradient ? "gradient" : "activation") << " of mb " << message.microbatch << " for virtual stage "
     << message.to_stage;
  return os.str();
}

RecvPosting recv_posting(ScheduleKind kind) {
  return kind == ScheduleKind::kInterleaved ? RecvPosting::kAfterPreviousSameDirection : RecvPosting::kBeforeConsumer;
}

const char* recv_posting_name(RecvPosting posting) {
  return posting == RecvPosting::kBeforeConsumer ? "before_consumer" : "after_previous_same_direction";
}

namespace {

// 0 for a forward, 1 for a compute that consumes an output gradient, -1 otherwise.
int direction(ActionKind kind) {
  if (kind == ActionKind::kForward) return 0;
  if (kind == ActionKind::kBackward || kind == ActionKind::kBackwardInput) return 1;
  return -1;
}

}  // namespace

std::vector<P2PStep> p2p_steps(const std::vector<Action>& actions, int64_t rank, int64_t p, RecvPosting posting,
                               ChunkLayout layout) {
  MEGATORCH_CHECK(p >= 1 && rank >= 0 && rank < p, "expected a pipeline rank in [0, ", p, "), got ", rank);
  std::vector<Action> computes;
  for (const Action& a : actions)
    if (is_compute(a.kind)) computes.push_back(a);
  const int64_t n = static_cast<int64_t>(computes.size());
  // gaps[i]: the transfers posted right before computes[i] (gaps[n]: after the last one).
  std::vector<std::vector<Action>> gaps(n + 1);
  int64_t next = 0;                 // index of the compute the list reaches next
  int64_t last_of[2] = {-1, -1};    // index of the latest forward / backward before it
  for (const Action& a : actions) {
    if (is_compute(a.kind)) {
      const int d = direction(a.kind);
      if (d >= 0) last_of[d] = next;
      ++next;
      continue;
    }
    MEGATORCH_CHECK(a.peer >= 0 && a.peer < p && a.peer != rank, "rank ", rank, ": expected ", to_string(a),
                    " to name a peer rank in [0, ", p, ") other than itself");
    int64_t gap = next;  // sends, and receives before their consumer
    if (is_recv(a.kind) && posting == RecvPosting::kAfterPreviousSameDirection) {
      const int d = a.kind == ActionKind::kRecvActivation ? 0 : 1;
      if (last_of[d] >= 0) gap = last_of[d] + 1;
    }
    gaps[gap].push_back(a);
  }
  std::vector<P2PStep> steps;
  steps.reserve(2 * n + 1);
  for (int64_t i = 0; i <= n; ++i) {
    if (!gaps[i].empty()) {
      // One order both ends of a pair derive alike: by peer, receives first, then by
      // message. Two receives from one peer can share a batch (p = 2); NCCL pairs them
      // with the peer's sends in issue order, which verify_nccl_order checks.
      std::vector<Action>& batch = gaps[i];
      std::stable_sort(batch.begin(), batch.end(), [&](const Action& x, const Action& y) {
        if (x.peer != y.peer) return x.peer < y.peer;
        const bool xr = is_recv(x.kind), yr = is_recv(y.kind);
        if (xr != yr) return xr;
        return p2p_message(x, rank, p, layout) < p2p_message(y, rank, p, layout);
      });
      P2PStep step;
      step.batch = std::move(batch);
      steps.push_back(std::move(step));
    }
    if (i < n) {
      P2PStep step;
      step.compute = computes[i];
      steps.push_back(std::move(step));
    }
  }
  return steps;
}

std::vector<P2PStep> schedule_p2p_steps(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t rank) {
  return p2p_steps(build_schedule(kind, p, m, v, rank), rank, p, recv_posting(kind), chunk_layout(kind));
}

std::vector<P2PStep> forward_only_p2p_steps(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t rank) {
  return p2p_steps(build_forward_only_schedule(kind, p, m, v, rank), rank, p, recv_posting(kind), chunk_layout(kind));
}

std::vector<P2PStep> unbatched_p2p_steps(const std::vector<Action>& actions) {
  std::vector<P2PStep> steps;
  steps.reserve(actions.size());
  for (const Action& a : actions) {
    P2PStep step;
    if (is_compute(a.kind)) step.compute = a;
    else step.batch = {a};
    steps.push_back(std::move(step));
  }
  return steps;
}

}  // namespace megatorch::pipeline
