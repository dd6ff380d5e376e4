#pragma once
// The planner: enumerates the layouts of a model on a cluster (TP <= GPUs per node, CP, PP,
// DP, EP and ETP for a mixture of experts, virtual stages, ZeRO stage, micro-batch, recompute, SP,
// and the pipeline schedule), predicts each one's memory and step time, rejects those that do
// not fit and ranks the rest. Any knob can be fixed.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "megatorch/plan/cost_model.h"
#include "megatorch/plan/memory.h"
#include "megatorch/plan/model_spec.h"

namespace megatorch::plan {

struct PlanRequest {
  ModelSpec model;
  Cluster cluster;
  Calibration calibration;
  int64_t global_batch = 512;
  Precision precision = Precision::kBf16;
  bool fp8 = false;  // the layers' linear GEMMs in FP8 (CostOptions::fp8)
  ActivationOptions activations;  // activation_bytes follows the precision
  double reserved_gb = 2.0;  // runtime, communication buffers, fragmentation
  // Fixed knobs; unset ones are searched.
  std::optional<int64_t> tp, pp, dp, vpp, micro_batch;
  // Context parallelism: unset searches the powers of two c that divide the GPUs left by TP
  // and PP and split the sequence into 2c chunks (S/c divisible by TP under SP; a2a: the
  // heads and key/value heads per TP rank divisible by c). The comm type is not searched.
  std::optional<int64_t> cp;
  CpCommType cp_comm_type = CpCommType::kP2P;
  // Expert parallelism (models with experts; dense models run EP 1): unset searches the
  // divisors of TP*CP*DP that divide the experts. Searched layouts of an MoE model leave
  // out ZeRO-3, which the trainer refuses with experts.
  std::optional<int64_t> ep;
  // Expert tensor parallelism: fixed at 1 (every expert whole) unless set otherwise; reset
  // to search the divisors of TP*CP*DP/EP that divide the expert FFN size. Dense models run
  // ETP 1.
  std::optional<int64_t> etp = 1;
  std::optional<int> zero_stage;
  std::optional<Recompute> recompute;
  std::optional<bool> sequence_parallel;
  // The pipeline schedule (1f1b, interleaved, zb-h1, zb-v or dualpipev). Unset: interleaved
  // at VP > 1, and at VP 1 1F1B and next to it zb-h1, zb-v and dualpipev
  // wherever it is valid (layout_error) and has W to defer (not under full recompute, whose
  // W is empty: 1F1B's time with more in flight). Fixed: only layouts that run it (VP > 1 for
  // interleaved, VP 1 otherwise: the V's two chunks come with zb-v and dualpipev).
  std::optional<pipeline::ScheduleKind> schedule;
  // The pipeline's p2p backend (gpt_pretrain's --distributed-backend), set on every layout:
  // NCCL, the GPU default, or Gloo; every schedule runs on both as the simulator times it
  // (on NCCL each transfer holds only its own channel: pipeline/p2p_channels.h).
  DistributedBackend backend = DistributedBackend::kNccl;
  int64_t max_micro_batch = 8;
  int64_t max_vpp = 8;
};

struct Candidate {
  Layout layout;
  MemoryBreakdown memory;
  TimeBreakdown time;
};

struct PlanResult {
  // Layouts that fit, fastest first; less memory breaks ties, then 1F1B before zb-h1, zb-v
  // and dualpipev, in that order.
  std::vector<Candidate> ranked;
  int64_t considered = 0;         // valid layouts looked at
  int64_t too_big = 0;            // valid layouts that do not fit in GPU memory
  std::vector<std::string> invalid_examples;  // why some requested combinations were invalid
};

// Memory and time of one layout (fails if the layout is not valid for the request).
Candidate evaluate(const PlanRequest& request, const Layout& layout);

// Every layout allowed by the fixed knobs. Fails when the fixed knobs admit no valid layout
// (saying which constraint, e.g. TP*PP*DP != GPUs) and when no valid layout fits (saying how
// much memory is short, per GPU and in total).
PlanResult plan(const PlanRequest& request);

// One line on why `c` ranks below `best`: its step time difference, by the kinds that grew.
std::string why_lost(const Candidate& c, const Candidate& best);

// A layout under one of the schedules the planner models, for --explain: why it is left out
// ("" when it is not: layout_error, e.g. zb-v with too few micro-batches, or a split backward with no W to
// defer), its ticks (per chunk: half a stage's in the V), and its memory and time (when not
// left out).
struct ScheduleChoice {
  pipeline::ScheduleKind kind = pipeline::ScheduleKind::kOneFOneB;
  Layout layout;
  std::string error;
  PipelineCosts costs;
  Candidate candidate;
};
// `chosen` at its PP, micro-batches and backend under 1f1b, interleaved (at chosen's VP, or
// 2), zb-h1, zb-v and dualpipev, in that order.
std::vector<ScheduleChoice> schedule_choices(const PlanRequest& request, const Layout& chosen);

// The flags gpt_pretrain takes for `layout` (besides the model's and the data's): the
// parallel sizes, batch sizes, ZeRO stage, recompute, SP, and --schedule when vpp does not
// imply it ("... --schedule zb-h1", "... --schedule zb-v": the V's chunks need no
// --num-layers-per-virtual-pipeline-stage), and --distributed-backend gloo on Gloo. DP is
// what the launch's world size leaves.
std::string gpt_pretrain_flags(const PlanRequest& request, const Layout& layout);

MemoryOptions memory_options(const PlanRequest& request);

}  // namespace megatorch::plan
