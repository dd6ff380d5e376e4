#pragma once
// Step time of a layout: compute from the FLOPs at a calibrated GEMM efficiency plus a
// memory-bound share, TP/SP and DP/ZeRO communication from their exact volumes over the
// link bandwidths, and the pipeline (bubble included) from the schedule simulator run with
// the layout's per-chunk forward and backward times (zb-h1, zb-v, dualpipev: the backward's B
// and W; in their V a chunk is half a stage).
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "megatorch/pipeline/simulator.h"
#include "megatorch/plan/memory.h"
#include "megatorch/plan/model_spec.h"
#include "megatorch/plan/moe.h"

namespace megatorch::plan {

// The machines. Bandwidths in GB/s (gigabytes): intra_node_gbps as vendors quote NVLink per
// GPU (both directions; one direction is half), inter_node_gbps for a whole node's NICs
// (8 x 200 Gb/s InfiniBand = 200 GB/s), shared by its GPUs.
struct Cluster {
  int64_t gpus_per_node = 8;
  int64_t nodes = 1;
  double gpu_memory_gb = 80;
  double peak_tflops = 312;
  double intra_node_gbps = 600;
  double inter_node_gbps = 200;
  double memory_bandwidth_gbps = 2039;  // HBM, for the memory-bound share of a layer
  // Dense FP8 TFLOP/s per GPU for FP8 runs (1979 on H100/H200); 0: 2 x peak_tflops. Last,
  // so that positional initialisations written before it keep their meaning.
  double fp8_peak_tflops = 0;
  int64_t gpus() const { return gpus_per_node * nodes; }
  double memory_bytes() const { return gpu_memory_gb * 1e9; }
};

// What the hardware achieves of its nominal numbers. One calibration serves every model and
// layout: the defaults are one fit for A100 clusters (docs/plan.md); --calibrate measures them
// on the current machine.
struct Calibration {
  double matmul_efficiency = 0.6;   // of peak, for large GEMMs
  double matmul_half_width = 0;     // GEMM inner width (h/t) at which efficiency halves; 0: flat
  double memory_bound_passes = 0.5; // HBM passes over a layer's activations per forward
  double intra_node_efficiency = 1.0;  // of intra_node_gbps / 2 (ring bus bandwidth)
  double inter_node_efficiency = 0.6;  // of inter_node_gbps / gpus_per_node
  double p2p_latency_s = 1e-3;      // fixed cost of one blocking pipeline transfer
  std::string source = "default: A100 fit (docs/plan.md)";

  double matmul_efficiency_at(double width) const { return matmul_efficiency * width / (width + matmul_half_width); }
};
nlohmann::json to_json(const Calibration& c);
Calibration calibration_from_json(const nlohmann::json& j);  // fails naming a missing or bad field
Calibration load_calibration(const std::string& path);
void save_calibration(const Calibration& c, const std::string& path);

// Seconds of one step, by kind (per GPU of the slowest pipeline stage).
struct TimeBreakdown {
  double compute = 0;      // forward + backward (+ recompute) GEMMs and memory-bound work
  double recompute = 0;    // the part of compute spent recomputing
  double tp_comm = 0;      // TP/SP all-reduces or all-gathers + reduce-scatters (not overlapped)
  double cp_comm = 0;      // CP exchange not hidden under attention (cp_traffic_per_layer; 0 at cp = 1)
  double ep_comm = 0;      // MoE token dispatch and combine (moe_traffic_per_layer; 0 without experts or at EP 1)
  double etp_comm = 0;     // of which expert tensor parallelism's all-gathers and reduce-scatters (0 at ETP 1)
  double p2p = 0;          // pipeline sends/receives (blocking)
  double bubble = 0;       // pipeline idle time of the slowest stage, from the simulator
  double dp_comm = 0;      // gradient reduction (+ ZeRO-3 parameter gathers), after the pipeline
  double expert_dp_comm = 0;  // of which the experts' gradients over expert-DP
  double pipeline = 0;     // simulated makespan: compute + tp_comm + cp_comm + ep_comm + p2p + bubble
  double step = 0;         // pipeline + dp_comm
  // Idle / busy of the slowest stage, as the executor runs on the layout's backend: the
  // simulator's on both, since no send holds a compute there (Gloo never holds a send; on
  // NCCL each waits on its own channel, pipeline/p2p_channels.h). Kept apart from
  // simulated_bubble_fraction for a backend whose posting would add to it.
  double bubble_fraction = 0;
  double simulated_bubble_fraction = 0;  // the simulator's (sends never wait)
  int64_t peak_inflight_chunks = 0;  // first stage, from the same simulation
  double tflops_per_gpu = 0;  // flops_per_iteration(recompute as run) / step / GPUs
  double mfu = 0;             // without recompute FLOPs, of peak
};

struct CostOptions {
  Precision precision = Precision::kBf16;
  // The transformer layers' linear GEMMs in FP8 (gpt_pretrain --fp8-format): at
  // Cluster::fp8_peak_tflops; attention, the head and MoE experts stay 16-bit.
  bool fp8 = false;
};

// What one CP rank exchanges for one transformer layer and one micro-batch, and how long it
// takes. E bytes per element, K = b (S/c) (n_kv/t) d and Q = b (S/c) (a/t) d elements:
//   p2p (ring attention): forward c-1 K,V blocks, 2 K E each; backward twice that (K,V
//     again and the dK,dV that travel back to their owner). A transfer runs under the
//     attention step before the one that needs it: c-1 of the c steps hide transfers, so
//     exposed = max(0, transfer - (c-1)/c x attention time); backward the same with 2x both.
//   a2a (Ulysses): forward one all-to-all over Q, K, V and one over the output, a rank
//     sending (c-1)/c of them: (c-1)/c (2Q + 2K) E; backward the same again. Nothing hides
//     them: exposed = transfer.
// Recomputation repeats the forward exchange: full recompute for both; selective recompute
// (the attention core) for p2p only, whose core is the ring itself, while a2a's core runs
// on the exchanged tensors it saved. Over NVLink when the CP group (tp*cp consecutive
// ranks) fits in a node, else over the node's network share. All zero at cp = 1.
struct CpTraffic {
  double forward_bytes = 0, backward_bytes = 0;  // one rank sends, per layer and micro-batch
  double forward_s = 0, backward_s = 0;          // the transfers at the link's bandwidth
  double exposed_forward_s = 0, exposed_backward_s = 0;  // not hidden under attention
  double exposed_recompute_s = 0;                // the forward's again, when recompute repeats it
  bool recompute_repeats = false;
  bool intra_node = true;
};
CpTraffic cp_traffic_per_layer(const ModelSpec& model, const Layout& layout, const Cluster& cluster,
                               const Calibration& cal, Precision precision = Precision::kBf16);

// What one rank's token dispatch sends for one MoE layer and micro-batch (moe_dispatch,
// moe.h: all-to-all or all-gather + reduce-scatter, the busiest rank's share under the
// imbalance margin) and how long it takes. Nothing hides it (megatorch does not overlap the
// dispatch with compute): exposed = transfer; full recompute repeats the forward's. Over
// NVLink when the EP group (ep ranks etp apart: ep*etp consecutive ranks of a stage) fits
// in a node, else over the node's network share. All zero at EP 1. The ETP group's
// all-gather and reduce-scatter the same way (not overlapped, repeated by full recompute),
// over NVLink when its etp consecutive ranks fit in a node; zero at ETP 1.
struct MoeTraffic {
  MoeDispatch dispatch;
  double forward_s = 0, backward_s = 0, recompute_s = 0;
  bool intra_node = true;
  double etp_forward_s = 0, etp_backward_s = 0, etp_recompute_s = 0;
  bool etp_intra_node = true;
};
MoeTraffic moe_traffic_per_layer(const ModelSpec& model, const Layout& layout, const Cluster& cluster,
                                 const Calibration& cal, Precision precision = Precision::kBf16);

// The per-chunk costs handed to the simulator and the simulation itself.
struct PipelineCosts {
  double chunk_forward = 0, chunk_backward = 0;  // seconds, slowest stage, incl. TP comm and p2p
  // Of chunk_backward, what a split backward (zb-h1, zb-v, dualpipev) defers as W: the weight-gradient GEMMs,
  // the FLOPs of the chunk's forward linear layers (the output head's included) at their GEMM
  // rate. The rest is B: the input-gradient GEMMs, attention's score and context products,
  // elementwise work, recompute and communication. 0 with full recompute, whose replay
  // computes the layers' weight gradients inside B (the head's, on the last stage alone,
  // left there too).
  double chunk_backward_weight = 0;
  double tick = 0;                               // seconds per simulator tick
  // B and W in ticks, B + W = options.backward_cost (the whole backward, as 1F1B runs it,
  // and as dualpipev runs the backwards it does not split).
  int64_t backward_input_ticks = 0, backward_weight_ticks = 0;
  // Forward and backward ticks; backward_input_cost and backward_weight_cost are the ticks
  // above, except that a W of 0 ticks runs as 1 taken from B (the simulator's least cost).
  pipeline::SimulatorOptions options;
};
PipelineCosts pipeline_costs(const ModelSpec& model, const Layout& layout, const Cluster& cluster,
                             const Calibration& cal, const CostOptions& options = {});

TimeBreakdown predict_time(const ModelSpec& model, const Layout& layout, int64_t global_batch, const Cluster& cluster,
                           const Calibration& cal, const CostOptions& options = {});
// The same from a simulation already run with pipeline_costs(...).options.
TimeBreakdown predict_time(const ModelSpec& model, const Layout& layout, int64_t global_batch, const Cluster& cluster,
                           const Calibration& cal, const CostOptions& options, const PipelineCosts& costs,
                           const pipeline::SimulationResult& sim);

}  // namespace megatorch::plan
