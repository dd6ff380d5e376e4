#include "megatorch/pipeline/nccl_order_model.h"

#include <algorithm>
#include <sstream>

#include "megatorch/check.h"
#include "wake_queue.h"

namespace megatorch::pipeline {
namespace {

constexpr int64_t kNone = -1;

struct Op {
  Action action;
  int64_t step = 0;        // index of its batch in the rank's steps
  int64_t ordinal = 0;     // k: the k-th send to (or receive from) its peer
  int64_t partner = kNone; // index of the k-th matching op in the peer's ops
  bool done = false;
  int64_t time = 0;        // when it completed (timing run)
};

class Model {
 public:
  Model(const std::vector<std::vector<P2PStep>>& steps, const SimulatorOptions& costs, ChunkLayout layout)
      : steps_(steps), p_(static_cast<int64_t>(steps.size())), costs_(costs), layout_(layout) {
    MEGATORCH_CHECK(p_ >= 1, "NCCL order model: expected one step list per pipeline rank, got none");
    MEGATORCH_CHECK(costs.forward_cost >= 0 && costs.backward_cost >= 0 && costs.backward_input_cost >= 0 &&
                        costs.backward_weight_cost >= 0 && costs.p2p_cost >= 0,
                    "NCCL order model: expected costs >= 0, got forward ", costs.forward_cost, ", backward ",
                    costs.backward_cost, ", p2p ", costs.p2p_cost);
    ops_.resize(p_);
    first_op_.resize(p_);
    // Per ordered pair (from, to): the sends on `from` and the receives on `to`, in issue order.
    std::vector<std::vector<int64_t>> sends(p_ * p_), recvs(p_ * p_);
    for (int64_t r = 0; r < p_; ++r) {
      first_op_[r].reserve(steps_[r].size() + 1);
      for (int64_t i = 0; i < static_cast<int64_t>(steps_[r].size()); ++i) {
        const P2PStep& s = steps_[r][i];
        first_op_[r].push_back(static_cast<int64_t>(ops_[r].size()));
        report_.steps += 1;
        if (!s.is_batch()) {
          MEGATORCH_CHECK(is_compute(s.compute.kind), "NCCL order model: rank ", r, " step #", i,
                          " is neither a compute action nor a batch: ", to_string(s.compute));
          continue;
        }
        report_.batches += 1;
        report_.max_batch = std::max(report_.max_batch, static_cast<int64_t>(s.batch.size()));
        for (const Action& a : s.batch) {
          MEGATORCH_CHECK(is_send(a.kind) || is_recv(a.kind), "NCCL order model: rank ", r, " step #", i,
                          " batches a compute action, ", to_string(a), "; a batch holds only sends and receives");
          MEGATORCH_CHECK(a.peer >= 0 && a.peer < p_ && a.peer != r, "NCCL order model: rank ", r, " step #", i,
                          ": expected ", to_string(a), " to name a peer in [0, ", p_, ") other than rank ", r);
          auto& list = is_send(a.kind) ? sends[r * p_ + a.peer] : recvs[a.peer * p_ + r];
          ops_[r].push_back({a, i, static_cast<int64_t>(list.size()), kNone, false});
          list.push_back(static_cast<int64_t>(ops_[r].size()) - 1);
          report_.ops += 1;
        }
      }
      first_op_[r].push_back(static_cast<int64_t>(ops_[r].size()));
    }
    for (int64_t from = 0; from < p_; ++from) {
      for (int64_t to = 0; to < p_; ++to) {
        const auto& s = sends[from * p_ + to];
        const auto& rv = recvs[from * p_ + to];
        for (size_t k = 0; k < std::min(s.size(), rv.size()); ++k) {
          ops_[from][s[k]].partner = rv[k];
          ops_[to][rv[k]].partner = s[k];
        }
      }
    }
  }

  NcclOrderReport run() {
    std::vector<int64_t> cur(p_, 0);
    // now[r]: when rank r's current step started (its previous one completed); busy[r]: compute time.
    std::vector<int64_t> now(p_, 0), busy(p_, 0);
    // A rank advances until its current batch waits for a peer; completing an op wakes
    // the peer, whose batch may now be complete. Each op is looked at once plus once per
    // wake-up of its rank.
    WakeQueue queue(p_);
    while (!queue.empty()) {
      const int64_t r = queue.pop();
      while (cur[r] < static_cast<int64_t>(steps_[r].size())) {
        const P2PStep& step = steps_[r][cur[r]];
        if (!step.is_batch()) {
          const int64_t cost = compute_cost(step.compute.kind);
          now[r] += cost;
          busy[r] += cost;
          cur[r] += 1;
          continue;
        }
        bool complete = true;
        for (int64_t j = first_op_[r][cur[r]]; j < first_op_[r][cur[r] + 1]; ++j) {
          Op& op = ops_[r][j];
          if (op.done) continue;
          const int64_t peer = op.action.peer;
          Op* other = op.partner == kNone ? nullptr : &ops_[peer][op.partner];
          if (!other || cur[peer] != other->step) {
            complete = false;
            continue;
          }
          check_match(r, op);
          op.done = other->done = true;
          op.time = other->time = std::max(now[r], now[peer]) + costs_.p2p_cost;
          queue.wake(peer);
        }
        if (!complete) break;
        for (int64_t j = first_op_[r][cur[r]]; j < first_op_[r][cur[r] + 1]; ++j)
          now[r] = std::max(now[r], ops_[r][j].time);
        cur[r] += 1;
      }
    }
    report_deadlock(cur);
    for (int64_t r = 0; r < p_; ++r)
      for (const Op& op : ops_[r])
        MEGATORCH_CHECK(op.done, "NCCL order model: rank ", r, "'s ", to_string(op.action), " at step #", op.step,
                        " was never matched");
    int64_t idle = 0, total_busy = 0;
    for (int64_t r = 0; r < p_; ++r) report_.makespan = std::max(report_.makespan, now[r]);
    for (int64_t r = 0; r < p_; ++r) {
      idle += report_.makespan - busy[r];
      total_busy += busy[r];
    }
    report_.bubble_fraction = total_busy > 0 ? Ratio::of(idle, total_busy) : Ratio{};
    return report_;
  }

 private:
  int64_t compute_cost(ActionKind kind) const {
    switch (kind) {
      case ActionKind::kForward: return costs_.forward_cost;
      case ActionKind::kBackward: return costs_.backward_cost;
      case ActionKind::kBackwardInput: return costs_.backward_input_cost;
      default: return costs_.backward_weight_cost;
    }
  }

  // On NCCL the k-th send and the k-th receive of a pair exchange data whatever they
  // were meant to carry: they must carry the same message.
  void check_match(int64_t r, const Op& op) const {
    const int64_t peer = op.action.peer;
    const Op& other = ops_[peer][op.partner];
    const bool send = is_send(op.action.kind);
    const int64_t sr = send ? r : peer, rr = send ? peer : r;
    const Op& s = send ? op : other;
    const Op& rv = send ? other : op;
    const P2PMessage sent = p2p_message(s.action, sr, p_, layout_),
                     expected = p2p_message(rv.action, rr, p_, layout_);
    MEGATORCH_CHECK(sent == expected, "NCCL order model: mismatch between rank ", sr, " and rank ", rr, ": send #",
                    s.ordinal, " from rank ", sr, " to rank ", rr, " is ", to_string(s.action), " at step #", s.step,
                    " (", to_string(sent), "), but receive #", rv.ordinal, " on rank ", rr, " from rank ", sr, " is ",
                    to_string(rv.action), " at step #", rv.step, " (", to_string(expected),
                    "); NCCL pairs them by issue order and would deliver the wrong tensor. Both ranks must issue "
                    "their transfers between each other in the same order.");
  }

  void report_deadlock(const std::vector<int64_t>& cur) const {
    std::vector<int64_t> stuck;
    for (int64_t r = 0; r < p_; ++r)
      if (cur[r] < static_cast<int64_t>(steps_[r].size())) stuck.push_back(r);
    if (stuck.empty()) return;
    std::ostringstream os;
    os << "NCCL order model: the steps deadlock: " << stuck.size() << " of " << p_
       << " ranks cannot progress under NCCL's rules (ops complete in issue order; between two ranks the k-th "
          "send pairs with the k-th receive; both must be posted at once):";
    for (int64_t r : stuck) {
      os << "\n  rank " << r << " step #" << cur[r] << " " << to_string(steps_[r][cur[r]]) << ":";
      for (int64_t j = first_op_[r][cur[r]]; j < first_op_[r][cur[r] + 1]; ++j) {
        const Op& op = ops_[r][j];
        if (op.done) continue;
        const int64_t peer = op.action.peer;
        const bool send = is_send(op.action.kind);
        os << "\n    " << to_string(op.action) << " (" << (send ? "send" : "receive") << " #" << op.ordinal
           << ") waits for rank " << peer << "'s " << (send ? "receive" : "send") << " #" << op.ordinal;
        if (op.partner == kNone) {
          os << ", which rank " << peer << " never posts";
        } else {
          const Op& other = ops_[peer][op.partner];
          os << ", " << to_string(other.action) << " at its step #" << other.step << "; rank " << peer;
          if (cur[peer] < static_cast<int64_t>(steps_[peer].size())) {
            os << " is at step #" << cur[peer] << " " << to_string(steps_[peer][cur[peer]]);
          } else {
            os << " has finished";
          }
        }
      }
    }
    os << "\nPost the transfers that must meet in one batch (p2p_steps), or reorder the schedule so that every "
          "rank's next batch is matched by its peers' current ones.";
    MEGATORCH_FAIL(os.str());
  }

  const std::vector<std::vector<P2PStep>>& steps_;
  int64_t p_;
  SimulatorOptions costs_;
  ChunkLayout layout_;
  std::vector<std::vector<Op>> ops_;             // per rank, in issue order
  std::vector<std::vector<int64_t>> first_op_;   // per rank: step i's ops are [first_op_[i], first_op_[i+1])
  NcclOrderReport report_;
};

}  // namespace

NcclOrderReport verify_nccl_order(const std::vector<std::vector<P2PStep>>& steps, const SimulatorOptions& costs,
                                  ChunkLayout layout) {
  return Model(steps, costs, layout).run();
}

namespace {
// Every rank's p2p steps of one schedule (`steps_of(r)`), run through the model.
template <typename StepsOf>
NcclOrderReport verify_every_rank(ScheduleKind kind, int64_t p, int64_t m, int64_t v, const SimulatorOptions& costs,
                                  StepsOf steps_of) {
  check_schedule_args(kind, p, m, v);
  std::vector<std::vector<P2PStep>> steps;
  steps.reserve(p);
  for (int64_t r = 0; r < p; ++r) steps.push_back(steps_of(r));
  return verify_nccl_order(steps, costs, chunk_layout(kind));
}
}  // namespace

NcclOrderReport verify_schedule_nccl_order(ScheduleKind kind, int64_t p, int64_t m, int64_t v,
                                           const SimulatorOptions& costs) {
  return verify_every_rank(kind, p, m, v, costs, [&](int64_t r) { return schedule_p2p_steps(kind, p, m, v, r); });
}

NcclOrderReport verify_forward_only_nccl_order(ScheduleKind kind, int64_t p, int64_t m, int64_t v,
                                               const SimulatorOptions& costs) {
  return verify_every_rank(kind, p, m, v, costs, [&](int64_t r) { return forward_only_p2p_steps(kind, p, m, v, r); });
}

}  // namespace megatorch::pipeline
