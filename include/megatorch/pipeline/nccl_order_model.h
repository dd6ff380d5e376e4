#pragma once
// A model of NCCL's point-to-point rules, run over every rank's steps (p2p_batches.h) to
// prove before any GPU is involved that a schedule's batches neither deadlock nor pair
// the wrong send and receive. Gloo matches by tag and forgives both; NCCL does not, and a
// wrong pairing there silently delivers the wrong tensor.
//
// The rules modelled:
// - every rank runs its steps strictly in order (one stream: an op completes only after
//   the ones issued before it); a compute step completes at once;
// - a batch is posted when it is its rank's current step; its ops progress independently
//   (one NCCL group), and it completes when all of them have;
// - between an ordered pair of ranks, the k-th send from a to b pairs with the k-th
//   receive on b from a (issue order, no tags); the pair completes when both ranks'
//   current steps are the batches holding them.
// With costs (SimulatorOptions: compute costs, p2p_cost per transfer) the same run also
// times the steps: a pair completes p2p_cost after the later of its two batches was
// posted, a batch when its last pair did. That is the bubble the batches allow on NCCL,
// where a send waits for its receiver (the simulator's sends never wait).
#include <cstdint>
#include <vector>

#include "megatorch/pipeline/p2p_batches.h"
#include "megatorch/pipeline/simulator.h"

namespace megatorch::pipeline {

struct NcclOrderReport {
  int64_t steps = 0;      // over all ranks, compute steps included
  int64_t batches = 0;
  int64_t ops = 0;        // sends and receives
  int64_t max_batch = 0;  // most ops in one batch
  int64_t makespan = 0;   // ticks, from the costs
  Ratio bubble_fraction;  // sum of idle over sum of compute, as the simulator's
};

// Runs steps[r] on rank r (p = steps.size()), chunks placed by `layout`. Throws, naming ranks, steps and actions:
// on a deadlock (no rank can progress while some have steps left: each stuck rank's
// current batch and what each of its ops waits for), on a mismatch (a pair's k-th send
// and k-th receive carry different messages: kind, micro-batch, receiving virtual
// stage), on a malformed step, or if some op was never matched.
NcclOrderReport verify_nccl_order(const std::vector<std::vector<P2PStep>>& steps, const SimulatorOptions& costs = {},
                                  ChunkLayout layout = ChunkLayout::kLooped);

// verify_nccl_order over schedule_p2p_steps of every rank of (kind, p, m, v).
NcclOrderReport verify_schedule_nccl_order(ScheduleKind kind, int64_t p, int64_t m, int64_t v,
                                           const SimulatorOptions& costs = {});
// verify_nccl_order over forward_only_p2p_steps of every rank (evaluation's steps).
NcclOrderReport verify_forward_only_nccl_order(ScheduleKind kind, int64_t p, int64_t m, int64_t v,
                                               const SimulatorOptions& costs = {});

}  // namespace megatorch::pipeline
