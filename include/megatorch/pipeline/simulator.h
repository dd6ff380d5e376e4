#pragma once
// Runs the action lists of all pipeline ranks against each other with per-action costs,
// without a model: checks that the schedule is complete and free of deadlock, and
// measures makespan, bubble and activations in flight. Times are integer ticks, so the
// bubble is an exact fraction that tests compare with docs/reference.md's formulas.
//
// Execution model (the one the executor follows): each rank runs its list in order, one
// action at a time. A compute waits for its inputs on this rank. A send is posted and
// never waits for its receiver (isend); the transfer overlaps compute and delivers the
// tensor p2p_cost after the send was posted. A recv waits until then: it runs from when
// it is posted to max(posted, send posted + p2p_cost). Only compute counts as busy.
#include <cstdint>
#include <string>
#include <vector>

#include "megatorch/pipeline/schedule.h"

namespace megatorch::pipeline {

// Costs in integer ticks. Defaults: a backward costs two forwards; transfers are free.
struct SimulatorOptions {
  int64_t forward_cost = 1;
  int64_t backward_cost = 2;
  int64_t backward_input_cost = 1;   // zero-bubble split of backward_cost
  int64_t backward_weight_cost = 1;
  int64_t p2p_cost = 0;              // latency of a transfer (it occupies neither rank)
  bool record_timeline = true;  // per-action start/end (off saves memory at p=64, m=512)
};

// A non-negative fraction in lowest terms.
struct Ratio {
  int64_t num = 0;
  int64_t den = 1;
  static Ratio of(int64_t num, int64_t den);  // reduces; throws on den <= 0
  double value() const { return static_cast<double>(num) / static_cast<double>(den); }
  std::string str() const;  // "3/8", or "2" when den is 1
  bool operator==(const Ratio& o) const { return num == o.num && den == o.den; }
  bool operator!=(const Ratio& o) const { return !(*this == o); }
};

struct ActionTiming {
  Action action;
  int64_t start = 0;
  int64_t end = 0;
};

struct RankReport {
  int64_t busy = 0;    // time in compute
  int64_t idle = 0;    // makespan - busy: waiting, transfers, and after the rank's last action
  int64_t finish = 0;  // end of the rank's last action
  Ratio bubble;        // idle / busy
  // Most forwards whose backward had not finished yet (in chunk activations: one chunk
  // of one micro-batch). A split backward releases at backward_weight.
  int64_t peak_inflight = 0;
  std::vector<ActionTiming> timeline;  // in list order; empty unless record_timeline
};

struct SimulationResult {
  int64_t makespan = 0;
  // Sum of idle / sum of busy over ranks: every stage's bubble when stages are balanced.
  Ratio bubble_fraction;
  std::vector<RankReport> ranks;
};

// Simulates schedules[r] on rank r, with p = schedules.size() ranks, each holding
// num_chunks model chunks placed by `layout`. Throws, naming ranks and actions, when an action is malformed
// (micro-batch, chunk or peer out of place), duplicated, when the lists deadlock, or when
// at the end some (micro-batch, chunk) missed its forward or backward or a transfer was
// never received.
SimulationResult simulate(const std::vector<std::vector<Action>>& schedules, int64_t num_microbatches,
                          int64_t num_chunks, const SimulatorOptions& options = {},
                          ChunkLayout layout = ChunkLayout::kLooped);

// simulate(build_schedules(kind, p, m, v), m, v, options, chunk_layout(kind)).
SimulationResult simulate_schedule(ScheduleKind kind, int64_t p, int64_t m, int64_t v,
                                   const SimulatorOptions& options = {});

// The published bubble (idle / busy per rank): Narayanan et al. 2021, (p-1)/m for GPipe
// and 1F1B, (p-1)/(v*m) interleaved; Qi et al. 2023, (p-1)(F+B-W) / (m(F+B+W)) for ZB-H1
// with the costs' split backward (B = backward_input_cost, W = backward_weight_cost),
// which holds when W <= F and W <= B. The V schedules (two chunks per rank, costs per
// chunk, busy 2m(F+B+W)): ZB-V idles (p-1)F per rank, the first micro-batch's way down
// the V, when F = B = W; DualPipeV idles DualPipe's (PP/2-1)(F&B+B-3W) with PP = 2p (the
// DualPipe it folds) and F&B = F + B (run one after the other), when B = 2W and
// B <= F <= B + W. Throws where the formula does not hold.
Ratio formula_bubble_fraction(ScheduleKind kind, int64_t p, int64_t m, int64_t v, const SimulatorOptions& costs = {});

}  // namespace megatorch::pipeline
