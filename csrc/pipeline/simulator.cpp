#include "megatorch/pipeline/simulator.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "megatorch/check.h"
#include "wake_queue.h"

namespace megatorch::pipeline {

Ratio Ratio::of(int64_t num, int64_t den) {
  MEGATORCH_CHECK(den > 0, "expected a positive denominator, got ", num, "/", den);
  const int64_t g = std::gcd(num, den);
  return Ratio{num / g, den / g};
}

std::string Ratio::str() const {
  return den == 1 ? std::to_string(num) : std::to_string(num) + "/" + std::to_string(den);
}

Ratio formula_bubble_fraction(ScheduleKind kind, int64_t p, int64_t m, int64_t v, const SimulatorOptions& costs) {
  check_schedule_args(kind, p, m, v);
  if (kind == ScheduleKind::kZeroBubbleH1) {
    const int64_t f = costs.forward_cost, b = costs.backward_input_cost, w = costs.backward_weight_cost;
    MEGATORCH_CHECK(w <= f && w <= b, "the ZB-H1 bubble formula (p-1)(F+B-W) holds for W <= F and W <= B, got F ", f,
                    ", B ", b, ", W ", w, "; simulate the schedule instead");
    return Ratio::of((p - 1) * (f + b - w), m * (f + b + w));
  }
  if (kind == ScheduleKind::kZeroBubbleV || kind == ScheduleKind::kDualPipeV) {
    const int64_t f = costs.forward_cost, b = costs.backward_input_cost, w = costs.backward_weight_cost;
    MEGATORCH_CHECK(costs.backward_cost == b + w, "the ", schedule_kind_name(kind), " bubble formula takes a whole ",
                    "backward to cost B + W = ", b + w, ", got ", costs.backward_cost, "; simulate the schedule instead");
    const int64_t busy = 2 * m * (f + b + w);  // two chunks per rank
    if (kind == ScheduleKind::kZeroBubbleV) {
      MEGATORCH_CHECK(f == b && b == w, "the ZB-V bubble formula (p-1)F holds for F = B = W, got F ", f, ", B ", b,
                      ", W ", w, "; simulate the schedule instead");
      return Ratio::of((p - 1) * f, busy);
    }
    MEGATORCH_CHECK(b == 2 * w && b <= f && f <= b + w, "the DualPipe bubble formula (p-1)(F&B+B-3W) holds for ",
                    "B = 2W and B <= F <= B + W, got F ", f, ", B ", b, ", W ", w, "; simulate the schedule instead");
    return Ratio::of((p - 1) * (f + 2 * b - 3 * w), busy);
  }
  return Ratio::of(p - 1, kind == ScheduleKind::kInterleaved ? v * m : m);
}

namespace {

constexpr int64_t kNever = -1;  // a time not reached yet

// State of every (micro-batch, virtual stage), indexed mb * stages + s. Each entry is the
// time the event happened, kNever until then. The same array answers "may this run now?"
// and "did this already happen?" (duplicates).
class Simulation {
 public:
  Simulation(const std::vector<std::vector<Action>>& lists, int64_t m, int64_t v, const SimulatorOptions& o,
             ChunkLayout layout)
      : lists_(lists), p_(static_cast<int64_t>(lists.size())), m_(m), v_(v), stages_(p_ * v), o_(o), layout_(layout) {
    const size_t n = static_cast<size_t>(m_ * stages_);
    for (auto* a : {&fwd_end_, &bwd_input_end_, &bwd_end_, &act_ready_, &grad_ready_, &act_sent_, &grad_sent_})
      a->assign(n, kNever);
    pc_.assign(p_, 0);
    clock_.assign(p_, 0);
    inflight_.assign(p_, 0);
    result_.ranks.resize(p_);
    if (o_.record_timeline)
      for (int64_t r = 0; r < p_; ++r) result_.ranks[r].timeline.reserve(lists_[r].size());
  }

  SimulationResult run() {
    // Each rank runs until it blocks; a send wakes its receiver.
    WakeQueue queue(p_);
    while (!queue.empty()) {
      const int64_t r = queue.pop();
      while (pc_[r] < static_cast<int64_t>(lists_[r].size())) {
        const int64_t woken = step(r);
        if (woken == kBlocked) break;
        if (woken >= 0) queue.wake(woken);
      }
    }
    report_deadlock();
    check_complete();
    int64_t busy = 0, idle = 0;
    for (auto& rank : result_.ranks) result_.makespan = std::max(result_.makespan, rank.finish);
    for (auto& rank : result_.ranks) {
      rank.idle = result_.makespan - rank.busy;
      rank.bubble = Ratio::of(rank.idle, rank.busy);
      busy += rank.busy;
      idle += rank.idle;
    }
    result_.bubble_fraction = Ratio::of(idle, busy);
    return std::move(result_);
  }

 private:
  static constexpr int64_t kBlocked = -2;
  static constexpr int64_t kNoWake = -1;

  int64_t host(int64_t s) const { return rank_of_virtual_stage(s, p_, layout_); }
  int64_t stage_of(const Action& a, int64_t r) const { return virtual_stage(a.chunk, r, p_, layout_); }
  size_t at(int64_t mb, int64_t s) const { return static_cast<size_t>(mb * stages_ + s); }

  std::string where(int64_t r) const {
    std::ostringstream os;
    os << "rank " << r << " action #" << pc_[r] << " " << to_string(lists_[r][pc_[r]]);
    return os.str();
  }

  // Shape checks that need no timing: ranges, and that a transfer goes to the rank that
  // holds the neighbouring virtual stage.
  void validate(int64_t r, const Action& a) const {
    MEGATORCH_CHECK(a.microbatch >= 0 && a.microbatch < m_, where(r), ": expected a micro-batch in [0, ", m_,
                    "), got ", a.microbatch);
    MEGATORCH_CHECK(a.chunk >= 0 && a.chunk < v_, where(r), ": expected a chunk in [0, ", v_, "), got ", a.chunk);
    if (is_compute(a.kind)) return;
    const int64_t s = stage_of(a, r);
    const bool downstream = a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kRecvGrad;
    const int64_t other = downstream ? s + 1 : s - 1;
    MEGATORCH_CHECK(other >= 0 && other < stages_, where(r), ": virtual stage ", s, " is the ",
                    downstream ? "last" : "first", " one, it has no ", downstream ? "next" : "previous",
                    " stage to exchange with");
    MEGATORCH_CHECK(host(other) != r, where(r), ": virtual stages ", s, " and ", other,
                    " are both on rank ", r, ", so the tensor stays local; remove the transfer");
    MEGATORCH_CHECK(a.peer == host(other), where(r), ": expected peer rank ", host(other),
                    " (it holds virtual stage ", other, "), got ", a.peer);
  }

  void duplicate_unless(bool fresh, int64_t r) const {
    MEGATORCH_CHECK(fresh, where(r), " appears twice for this rank; each (micro-batch, chunk) gets exactly ",
                    "one forward, one backward and one of each transfer");
  }

  // Runs the next action of rank r if its inputs are there. Returns kBlocked, or the rank
  // to wake (the receiver of a send), or kNoWake.
  int64_t step(int64_t r) {
    const Action& a = lists_[r][pc_[r]];
    validate(r, a);
    const int64_t s = stage_of(a, r);
    const size_t i = at(a.microbatch, s);
    const int64_t now = clock_[r];
    int64_t start = now, cost = 0, wake = kNoWake;
    switch (a.kind) {
      case ActionKind::kForward: {
        duplicate_unless(fwd_end_[i] == kNever, r);
        const int64_t input = s == 0 ? 0 : act_ready_[i];
        if (input == kNever) return kBlocked;
        start = std::max(now, input);
        cost = o_.forward_cost;
        fwd_end_[i] = start + cost;
        if (s + 1 < stages_ && host(s + 1) == r) act_ready_[i + 1] = fwd_end_[i];
        ++inflight_[r];
        auto& peak = result_.ranks[r].peak_inflight;
        peak = std::max(peak, inflight_[r]);
        break;
      }
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        duplicate_unless(bwd_input_end_[i] == kNever, r);
        const int64_t grad = s + 1 == stages_ ? 0 : grad_ready_[i];
        if (fwd_end_[i] == kNever || grad == kNever) return kBlocked;
        start = std::max({now, grad, fwd_end_[i]});
        const bool full = a.kind == ActionKind::kBackward;
        cost = full ? o_.backward_cost : o_.backward_input_cost;
        bwd_input_end_[i] = start + cost;
        if (full) {
          bwd_end_[i] = start + cost;
          --inflight_[r];
        }
        if (s > 0 && host(s - 1) == r) grad_ready_[i - 1] = bwd_input_end_[i];
        break;
      }
      case ActionKind::kBackwardWeight:
        duplicate_unless(bwd_end_[i] == kNever, r);
        if (bwd_input_end_[i] == kNever) return kBlocked;
        cost = o_.backward_weight_cost;
        bwd_end_[i] = start + cost;
        --inflight_[r];
        break;
      case ActionKind::kSendActivation:
        duplicate_unless(act_sent_[i] == kNever, r);
        if (fwd_end_[i] == kNever) return kBlocked;
        act_sent_[i] = start;
        wake = a.peer;
        break;
      case ActionKind::kSendGrad:
        duplicate_unless(grad_sent_[i] == kNever, r);
        if (bwd_input_end_[i] == kNever) return kBlocked;
        grad_sent_[i] = start;
        wake = a.peer;
        break;
      case ActionKind::kRecvActivation:
        duplicate_unless(act_ready_[i] == kNever, r);
        if (act_sent_[i - 1] == kNever) return kBlocked;
        cost = std::max(now, act_sent_[i - 1] + o_.p2p_cost) - now;  // waits until the data is here
        act_ready_[i] = now + cost;
        break;
      case ActionKind::kRecvGrad:
        duplicate_unless(grad_ready_[i] == kNever, r);
        if (grad_sent_[i + 1] == kNever) return kBlocked;
        cost = std::max(now, grad_sent_[i + 1] + o_.p2p_cost) - now;
        grad_ready_[i] = now + cost;
        break;
    }
    RankReport& rep = result_.ranks[r];
    if (is_compute(a.kind)) rep.busy += cost;
    clock_[r] = rep.finish = start + cost;
    if (o_.record_timeline) rep.timeline.push_back({a, start, start + cost});
    ++pc_[r];
    return wake;
  }

  // Why the next action of a stuck rank cannot run.
  std::string waits_for(int64_t r) const {
    const Action& a = lists_[r][pc_[r]];
    const int64_t s = stage_of(a, r);
    const size_t i = at(a.microbatch, s);
    std::ostringstream os;
    auto missing = [&](const char* what, int64_t stage) {
      const int64_t owner = host(stage);
      os << "the " << what << "(mb " << a.microbatch << ", chunk " << chunk_of_virtual_stage(stage, p_, layout_)
         << ") of rank " << owner << (owner == r ? ", which must come earlier in this rank's list" : "");
    };
    switch (a.kind) {
      case ActionKind::kForward:
        if (host(s - 1) == r) missing("forward", s - 1);
        else missing("recv_activation", s);
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        if (fwd_end_[i] == kNever) missing("forward", s);
        else if (host(s + 1) == r) missing("backward", s + 1);
        else missing("recv_grad", s);
        break;
      case ActionKind::kBackwardWeight: missing("backward_input", s); break;
      case ActionKind::kSendActivation: missing("forward", s); break;
      case ActionKind::kSendGrad: missing("backward", s); break;
      case ActionKind::kRecvActivation: missing("send_activation", s - 1); break;
      case ActionKind::kRecvGrad: missing("send_grad", s + 1); break;
    }
    return os.str();
  }

  void report_deadlock() const {
    std::ostringstream os;
    int64_t stuck = 0;
    for (int64_t r = 0; r < p_; ++r) {
      if (pc_[r] == static_cast<int64_t>(lists_[r].size())) continue;
      if (++stuck <= 8) os << "\n  " << where(r) << " waits for " << waits_for(r);
    }
    if (stuck > 8) os << "\n  ... and " << stuck - 8 << " more ranks";
    MEGATORCH_CHECK(stuck == 0, "the pipeline schedule deadlocks: ", stuck, " of ", p_,
                    " ranks cannot make progress:", os.str(),
                    "\nfix the order of the lists so that every wait is served by an earlier action");
  }

  // Every (micro-batch, chunk) had its forward and its backward, and every send was received.
  void check_complete() const {
    std::ostringstream os;
    int64_t problems = 0;
    auto note = [&](const std::string& what, int64_t mb, int64_t s) {
      if (++problems <= 8)
        os << "\n  " << what << "(mb " << mb << ", chunk " << chunk_of_virtual_stage(s, p_, layout_) << ") on rank " << host(s);
    };
    for (int64_t mb = 0; mb < m_; ++mb) {
      for (int64_t s = 0; s < stages_; ++s) {
        const size_t i = at(mb, s);
        if (fwd_end_[i] == kNever) note("no forward", mb, s);
        if (bwd_end_[i] == kNever) note("no (complete) backward", mb, s);
        if (act_sent_[i] != kNever && act_ready_[i + 1] == kNever) note("unreceived send_activation", mb, s);
        if (grad_sent_[i] != kNever && grad_ready_[i - 1] == kNever) note("unreceived send_grad", mb, s);
      }
    }
    if (problems > 8) os << "\n  ... and " << problems - 8 << " more";
    MEGATORCH_CHECK(problems == 0, "the pipeline schedule is incomplete for ", m_, " micro-batches x ", stages_,
                    " virtual stages:", os.str());
  }

  const std::vector<std::vector<Action>>& lists_;
  const int64_t p_, m_, v_, stages_;
  const SimulatorOptions o_;
  const ChunkLayout layout_;
  std::vector<int64_t> fwd_end_, bwd_input_end_, bwd_end_;  // compute finished
  std::vector<int64_t> act_ready_, grad_ready_;             // input present on the stage's rank
  std::vector<int64_t> act_sent_, grad_sent_;               // when the send was posted
  std::vector<int64_t> pc_, clock_, inflight_;
  SimulationResult result_;
};

}  // namespace

SimulationResult simulate(const std::vector<std::vector<Action>>& schedules, int64_t num_microbatches,
                          int64_t num_chunks, const SimulatorOptions& options, ChunkLayout layout) {
  MEGATORCH_CHECK(!schedules.empty(), "expected one action list per pipeline rank, got none");
  MEGATORCH_CHECK(num_microbatches >= 1, "expected num_microbatches >= 1, got ", num_microbatches);
  MEGATORCH_CHECK(num_chunks >= 1, "expected num_chunks >= 1, got ", num_chunks);
  MEGATORCH_CHECK(options.forward_cost >= 1 && options.backward_cost >= 1 && options.backward_input_cost >= 1 &&
                      options.backward_weight_cost >= 1,
                  "expected compute costs >= 1 tick (the bubble is idle / compute time), got forward ",
                  options.forward_cost, ", backward ", options.backward_cost, ", backward_input ",
                  options.backward_input_cost, ", backward_weight ", options.backward_weight_cost);
  MEGATORCH_CHECK(options.p2p_cost >= 0, "expected p2p_cost >= 0, got ", options.p2p_cost);
  MEGATORCH_CHECK(layout == ChunkLayout::kLooped || num_chunks == 2, "expected 2 chunks per rank in a V layout, got ",
                  num_chunks);
  return Simulation(schedules, num_microbatches, num_chunks, options, layout).run();
}

SimulationResult simulate_schedule(ScheduleKind kind, int64_t p, int64_t m, int64_t v,
                                   const SimulatorOptions& options) {
  return simulate(build_schedules(kind, p, m, v), m, v, options, chunk_layout(kind));
}

}  // namespace megatorch::pipeline
