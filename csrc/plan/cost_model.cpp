#include "megatorch/plan/cost_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "megatorch/check.h"

namespace megatorch::plan {

nlohmann::json to_json(const Calibration& c) {
  return {{"matmul_efficiency", c.matmul_efficiency},
          {"matmul_half_width", c.matmul_half_width},
          {"memory_bound_passes", c.memory_bound_passes},
          {"intra_node_efficiency", c.intra_node_efficiency},
          {"inter_node_efficiency", c.inter_node_efficiency},
          {"p2p_latency_s", c.p2p_latency_s},
          {"source", c.source}};
}

Calibration calibration_from_json(const nlohmann::json& j) {
  Calibration c;
  auto get = [&j](const char* key, double& out) {
    MEGATORCH_CHECK(j.contains(key) && j.at(key).is_number(), "calibration: expected a number field '", key,
                    "', got ", j.contains(key) ? j.at(key).dump() : std::string("nothing"),
                    "; write the file with megatorch-plan --calibrate");
    out = j.at(key).get<double>();
    MEGATORCH_CHECK(out >= 0 && std::isfinite(out), "calibration: expected '", key, "' >= 0, got ", out);
  };
  get("matmul_efficiency", c.matmul_efficiency);
  get("matmul_half_width", c.matmul_half_width);
  get("memory_bound_passes", c.memory_bound_passes);
  get("intra_node_efficiency", c.intra_node_efficiency);
  get("inter_node_efficiency", c.inter_node_efficiency);
  get("p2p_latency_s", c.p2p_latency_s);
  MEGATORCH_CHECK(c.matmul_efficiency > 0 && c.intra_node_efficiency > 0 && c.inter_node_efficiency > 0,
                  "calibration: efficiencies must be > 0, got matmul ", c.matmul_efficiency, ", intra ",
                  c.intra_node_efficiency, ", inter ", c.inter_node_efficiency);
  c.source = j.value("source", std::string("file"));
  return c;
}

Calibration load_calibration(const std::string& path) {
  std::ifstream in(path);
  MEGATORCH_CHECK(in.good(), "calibration: cannot read '", path, "'; write one with megatorch-plan --calibrate ", path);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception& e) {
    MEGATORCH_FAIL("calibration: '", path, "' is not JSON (", e.what(), ")");
  }
  Calibration c = calibration_from_json(j);
  if (!j.contains("source")) c.source = path;
  return c;
}

void save_calibration(const Calibration& c, const std::string& path) {
  std::ofstream out(path);
  MEGATORCH_CHECK(out.good(), "calibration: cannot write '", path, "'");
  out << to_json(c).dump(2) << "\n";
}

namespace {

// Ring collectives: an all-reduce moves 2 (n-1)/n of the buffer through every rank's link,
// an all-gather + reduce-scatter pair the same.
double ring_allreduce_s(double bytes, int64_t n, double bytes_per_s) {
  return n <= 1 ? 0.0 : 2.0 * (n - 1) / n * bytes / bytes_per_s;
}
double intra_bw(const Cluster& c, const Calibration& k) { return c.intra_node_gbps * 1e9 / 2 * k.intra_node_efficiency; }
double inter_bw(const Cluster& c, const Calibration& k) {
  return c.inter_node_gbps * 1e9 / c.gpus_per_node * k.inter_node_efficiency;
}

// FLOP/s of the linear layers' GEMMs: the FP8 peak with FP8 on, else the 16-bit one.
double weight_gemm_peak(const Cluster& c, const CostOptions& o) {
  if (!o.fp8) return c.peak_tflops * 1e12;
  return (c.fp8_peak_tflops > 0 ? c.fp8_peak_tflops : 2 * c.peak_tflops) * 1e12;
}

// Seconds of the attention core's forward (Q K^T and P V) on one TP and CP rank.
double attention_forward_s(const ModelSpec& m, const Layout& l, const Cluster& c, const Calibration& k) {
  const double t = static_cast<double>(l.tp), peak = c.peak_tflops * 1e12;
  const double eff = k.matmul_efficiency_at(static_cast<double>(m.hidden_size) / t);
  return layer_forward_flops(m, l.micro_batch).attention / t / static_cast<double>(l.cp) / (peak * eff);
}

struct LayerCost {
  double compute_fwd = 0;    // GEMMs + memory-bound work of one forward
  double weight_grad = 0;    // of which the GEMMs with the weights: a split backward's W
  double selective = 0;      // the attention core again (selective recompute)
  double tp_fwd = 0;         // the forward's two TP collectives (backward has two more)
  CpTraffic cp;              // the CP exchange (zero at cp = 1)
  MoeTraffic ep;             // an MoE layer's token dispatch (zero in a dense layer)
};

// Per CP rank: a CP rank runs every GEMM and the attention core on its S/c tokens (its
// queries against all keys), so the FLOPs, the memory-bound bytes and the TP collectives'
// [S/c, b, h] tensors are the cp = 1 ones / c.
LayerCost layer_cost(const ModelSpec& m, const Layout& l, const Cluster& c, const Calibration& k, const CostOptions& o) {
  const Precision p = o.precision;
  const double t = static_cast<double>(l.tp), cp = static_cast<double>(l.cp), peak = c.peak_tflops * 1e12;
  const double eff = k.matmul_efficiency_at(static_cast<double>(m.hidden_size) / t);
  const LayerFlops f = layer_forward_flops(m, l.micro_batch);
  ActivationOptions paper;
  paper.activation_bytes = static_cast<double>(activation_dtype_bytes(p));
  // Memory-bound kernels (norms, dropout, softmax, activation, residual) read and write about
  // what the layer saves for backward: the Korthikanti count, a few passes over HBM.
  Layout none = l;
  none.recompute = Recompute::kNone;
  const double traffic = activation_bytes_per_layer(m, none, paper);
  const double hbm = c.memory_bandwidth_gbps * 1e9;
  const double A = static_cast<double>(m.num_attention_heads) * m.seq_length * (m.seq_length / l.cp) * l.micro_batch;
  const auto gemm_s = [&](double flops) { return flops / t / cp / (peak * eff); };
  // FP8: the linear layers' GEMMs at the FP8 rate; the attention core stays 16-bit.
  const double weights_s = gemm_s(f.weights) * peak / weight_gemm_peak(c, o);
  LayerCost lc;
  lc.compute_fwd = weights_s + gemm_s(f.attention + f.experts) + k.memory_bound_passes * traffic / hbm;
  lc.weight_grad = weights_s;
  lc.selective = gemm_s(f.attention) + k.memory_bound_passes * (2 * paper.activation_bytes + 1) * A / t / hbm;
  const double act = static_cast<double>(l.micro_batch) * (m.seq_length / l.cp) * m.hidden_size * paper.activation_bytes;
  const double bw = l.tp <= c.gpus_per_node ? intra_bw(c, k) : inter_bw(c, k);
  // Under SP the column layers' backward also re-gathers their input shards (one
  // all-gather each), but under the input-gradient GEMM: overlapped, so not charged.
  lc.tp_fwd = 2 * ring_allreduce_s(act, l.tp, bw);
  lc.cp = cp_traffic_per_layer(m, l, c, k, p);
  return lc;
}

// An MoE layer per rank: the attention half and the shared expert (a TP MLP) as the dense
// GEMMs (/ t, / c); the router on the rank's T tokens and the experts' GEMMs on the busiest
// rank's T k margin rows (inner width h; under ETP etp x the rows at 1/etp of the width,
// the same FLOPs): / t only under SP, as without it every TP rank routes the same tokens;
// the memory-bound share over what the MoE layer
// saves. TP collectives: the attention's, and the shared expert's when there is one; the
// routed experts need none.
LayerCost moe_layer_cost(const ModelSpec& m, const Layout& l, const Cluster& c, const Calibration& k, const CostOptions& o) {
  const Precision p = o.precision;
  LayerCost lc = layer_cost(m, l, c, k, o);  // the attention core, the CP exchange, one TP collective pair
  const double t = static_cast<double>(l.tp), cp = static_cast<double>(l.cp), peak = c.peak_tflops * 1e12;
  const double eff = k.matmul_efficiency_at(static_cast<double>(m.hidden_size) / t);
  const double eff_experts = k.matmul_efficiency_at(static_cast<double>(m.hidden_size));
  const LayerFlops f = moe_layer_forward_flops(m, l.micro_batch);
  ActivationOptions paper;
  paper.activation_bytes = static_cast<double>(activation_dtype_bytes(p));
  Layout none = l;
  none.recompute = Recompute::kNone;
  const double traffic = moe_activation_bytes_per_layer(m, none, paper);
  const double margin = effective_imbalance_margin(m, l.ep);
  const double routed_t = l.sequence_parallel ? t : 1.0;  // the TP ranks that share the routing
  const double router = 2.0 * l.micro_batch * m.seq_length * m.hidden_size * static_cast<double>(m.num_experts);
  const double routed = (router + f.experts * margin) / routed_t / cp / (peak * eff_experts);
  // FP8: the dense linear layers' GEMMs at the FP8 rate; the router and the experts'
  // grouped GEMM stay 16-bit.
  const double dense_s = (f.weights - router) / t / cp / (weight_gemm_peak(c, o) * eff);
  lc.compute_fwd = dense_s + f.attention / t / cp / (peak * eff) + routed +
                   k.memory_bound_passes * traffic / (c.memory_bandwidth_gbps * 1e9);
  lc.weight_grad = dense_s + routed;
  if (m.moe_shared_expert_intermediate_size == 0) lc.tp_fwd /= 2;
  lc.ep = moe_traffic_per_layer(m, l, c, k, p);
  return lc;
}

struct StageCost {
  double compute = 0, recompute = 0, tp = 0, cp = 0, ep = 0, etp = 0, p2p = 0;  // per micro-batch, slowest stage
  double chunk_forward = 0, chunk_backward = 0;
  double chunk_weight_grad = 0;  // of chunk_backward, the weight GEMMs (before recompute's rule)
};

// One layer's seconds in a chunk's forward and backward, and its shares of the totals.
struct LayerTimes {
  double forward = 0, backward = 0, compute = 0, recompute = 0, tp = 0, cp = 0, ep = 0, etp = 0, weight_grad = 0;
};
LayerTimes layer_times(const LayerCost& lc, Recompute r) {
  double rec = 0, rec_tp = 0;
  if (r == Recompute::kFull) rec = lc.compute_fwd, rec_tp = lc.tp_fwd;
  if (r == Recompute::kSelective) rec = lc.selective;
  const double cp_fwd = lc.cp.exposed_forward_s, cp_bwd = lc.cp.exposed_backward_s + lc.cp.exposed_recompute_s;
  const double etp_fwd = lc.ep.etp_forward_s, etp_bwd = lc.ep.etp_backward_s + lc.ep.etp_recompute_s;
  const double ep_fwd = lc.ep.forward_s + etp_fwd, ep_bwd = lc.ep.backward_s + lc.ep.recompute_s + etp_bwd;
  LayerTimes lt;
  lt.forward = lc.compute_fwd + lc.tp_fwd + cp_fwd + ep_fwd;
  lt.backward = 2 * lc.compute_fwd + lc.tp_fwd + rec + rec_tp + cp_bwd + ep_bwd;
  lt.compute = 3 * lc.compute_fwd + rec;
  lt.recompute = rec;
  lt.tp = 2 * lc.tp_fwd + rec_tp;
  lt.cp = cp_fwd + cp_bwd;
  lt.ep = ep_fwd + ep_bwd;
  lt.etp = etp_fwd + etp_bwd;
  lt.weight_grad = lc.weight_grad;
  return lt;
}

StageCost stage_cost(const ModelSpec& m, const Layout& l, const Cluster& c, const Calibration& k, const CostOptions& o) {
  const LayerCost lc = layer_cost(m, l, c, k, o);
  // The rank's chunks: vpp, or the V's two (each half a stage's layers).
  const int64_t chunks = model_chunks(l);
  const double layers_per_chunk = static_cast<double>(m.num_layers / (l.pp * chunks));
  const double v = static_cast<double>(chunks), t = static_cast<double>(l.tp);
  const double peak = c.peak_tflops * 1e12;
  // The last stage also runs the output head (its GEMM is [b s/c, h] x [h, V/t]), spread
  // over the chunks of its rank (head_rank: the last rank, or rank 0 in a V).
  const double head = head_forward_flops(m, l.micro_batch) * padded_vocab(m, l.tp) / m.vocab_size / t /
                      static_cast<double>(l.cp) / (peak * k.matmul_efficiency_at(static_cast<double>(m.hidden_size)));
  double rec = 0, rec_tp = 0;
  if (l.recompute == Recompute::kFull) rec = lc.compute_fwd, rec_tp = lc.tp_fwd;
  if (l.recompute == Recompute::kSelective) rec = lc.selective;
  double p2p = 0;
  if (l.pp > 1) {
    // Megatron's scatter-gather: each TP rank sends its 1/t of the [s/c, b, h] activation.
    const double bytes = static_cast<double>(l.micro_batch) * (m.seq_length / l.cp) * m.hidden_size *
                         activation_dtype_bytes(o.precision) / t;
    const bool same_node = l.tp * l.cp * l.dp < c.gpus_per_node;  // neighbours are tp*cp*dp ranks apart
    p2p = bytes / (same_node ? intra_bw(c, k) : inter_bw(c, k)) + k.p2p_latency_s;
  }
  const double cp_fwd = lc.cp.exposed_forward_s, cp_bwd = lc.cp.exposed_backward_s + lc.cp.exposed_recompute_s;
  StageCost s;
  if (!m.is_moe()) {
    s.chunk_forward = layers_per_chunk * (lc.compute_fwd + lc.tp_fwd + cp_fwd) + head / v + p2p;
    s.chunk_backward = layers_per_chunk * (2 * lc.compute_fwd + lc.tp_fwd + rec + rec_tp + cp_bwd) + 2 * head / v + p2p;
    s.chunk_weight_grad = layers_per_chunk * lc.weight_grad + head / v;  // the head's weight GEMM too
    const double layers = layers_per_chunk * v;
    s.compute = layers * (3 * lc.compute_fwd + rec) + 3 * head;
    s.recompute = layers * rec;
    s.tp = layers * (2 * lc.tp_fwd + rec_tp);
    s.cp = layers * (cp_fwd + cp_bwd);
    s.p2p = 2 * v * p2p;
    return s;
  }
  // Chunks differ in their MoE layers: the simulator runs the slowest chunk of any stage on
  // every stage, and the totals are those of the slowest stage.
  const LayerTimes d = layer_times(lc, l.recompute), e = layer_times(moe_layer_cost(m, l, c, k, o), l.recompute);
  const auto sum = [&](const LayerCounts& n, double LayerTimes::*part) {
    return static_cast<double>(n.dense) * (d.*part) + static_cast<double>(n.moe) * (e.*part);
  };
  double slowest_chunk = -1, slowest_stage = -1;
  for (int64_t r = 0; r < l.pp; ++r) {
    for (int64_t ch = 0; ch < chunks; ++ch) {
      const LayerCounts n = chunk_layer_counts(m, l, r, ch);
      const double f = sum(n, &LayerTimes::forward), b = sum(n, &LayerTimes::backward);
      if (f + b <= slowest_chunk) continue;
      slowest_chunk = f + b, s.chunk_forward = f, s.chunk_backward = b;
      s.chunk_weight_grad = sum(n, &LayerTimes::weight_grad);
    }
    const LayerCounts n = stage_layer_counts(m, l, r);
    const double busy = sum(n, &LayerTimes::forward) + sum(n, &LayerTimes::backward);
    if (busy <= slowest_stage) continue;
    slowest_stage = busy;
    s.compute = sum(n, &LayerTimes::compute) + 3 * head;
    s.recompute = sum(n, &LayerTimes::recompute);
    s.tp = sum(n, &LayerTimes::tp);
    s.cp = sum(n, &LayerTimes::cp);
    s.ep = sum(n, &LayerTimes::ep);
    s.etp = sum(n, &LayerTimes::etp);
  }
  s.chunk_forward += head / v + p2p;
  s.chunk_backward += 2 * head / v + p2p;
  s.chunk_weight_grad += head / v;
  s.p2p = 2 * v * p2p;
  return s;
}

}  // namespace

CpTraffic cp_traffic_per_layer(const ModelSpec& m, const Layout& l, const Cluster& c, const Calibration& k,
                               Precision p) {
  CpTraffic tr;
  tr.intra_node = l.tp * l.cp <= c.gpus_per_node;  // the CP group: tp*cp consecutive ranks
  if (l.cp == 1) return tr;
  const CpShare share = cp_share(m, l.cp);
  const double cp = static_cast<double>(l.cp), t = static_cast<double>(l.tp), E = activation_dtype_bytes(p);
  const double per_head = static_cast<double>(l.micro_batch) * share.tokens * m.head_dim();  // b (S/c) d
  const double kv = per_head * m.query_groups() / t, q = per_head * m.num_attention_heads / t;  // K and Q elements
  const double bw = tr.intra_node ? intra_bw(c, k) : inter_bw(c, k);
  if (l.cp_comm == CpCommType::kP2P) {
    tr.forward_bytes = (cp - 1) * 2 * kv * E;
    tr.backward_bytes = 2 * tr.forward_bytes;
    tr.forward_s = tr.forward_bytes / bw, tr.backward_s = tr.backward_bytes / bw;
    const double hidden_under = attention_forward_s(m, l, c, k) * (cp - 1) / cp;
    tr.exposed_forward_s = std::max(0.0, tr.forward_s - hidden_under);
    tr.exposed_backward_s = std::max(0.0, tr.backward_s - 2 * hidden_under);  // the backward core: 2x the forward's
    tr.recompute_repeats = l.recompute != Recompute::kNone;
  } else {
    tr.forward_bytes = (cp - 1) / cp * (2 * q + 2 * kv) * E;  // Q, K, V in and the output back
    tr.backward_bytes = tr.forward_bytes;
    tr.forward_s = tr.exposed_forward_s = tr.forward_bytes / bw;
    tr.backward_s = tr.exposed_backward_s = tr.backward_bytes / bw;
    tr.recompute_repeats = l.recompute == Recompute::kFull;
  }
  if (tr.recompute_repeats) tr.exposed_recompute_s = tr.exposed_forward_s;
  return tr;
}

MoeTraffic moe_traffic_per_layer(const ModelSpec& m, const Layout& l, const Cluster& c, const Calibration& k,
                                 Precision p) {
  MoeTraffic tr;
  tr.dispatch = moe_dispatch(m, l, static_cast<double>(activation_dtype_bytes(p)));
  tr.intra_node = l.ep * l.etp <= c.gpus_per_node;  // the EP group: ep ranks etp apart
  const double bw = tr.intra_node ? intra_bw(c, k) : inter_bw(c, k);
  tr.forward_s = tr.dispatch.forward_bytes / bw;
  tr.backward_s = tr.dispatch.backward_bytes / bw;
  if (tr.dispatch.recompute_repeats) tr.recompute_s = tr.forward_s;
  tr.etp_intra_node = l.etp <= c.gpus_per_node;  // the ETP group: etp consecutive ranks
  const double etp_bw = tr.etp_intra_node ? intra_bw(c, k) : inter_bw(c, k);
  tr.etp_forward_s = tr.dispatch.etp_forward_bytes / etp_bw;
  tr.etp_backward_s = tr.dispatch.etp_backward_bytes / etp_bw;
  if (tr.dispatch.recompute_repeats) tr.etp_recompute_s = tr.etp_forward_s;
  return tr;
}

PipelineCosts pipeline_costs(const ModelSpec& m, const Layout& l, const Cluster& c, const Calibration& k,
                             const CostOptions& o) {
  const StageCost s = stage_cost(m, l, c, k, o);
  PipelineCosts pc;
  pc.chunk_forward = s.chunk_forward, pc.chunk_backward = s.chunk_backward;
  // Integer ticks: a forward is 200 ticks, the backward its ratio to it (0.5% resolution).
  constexpr int64_t kForwardTicks = 200;
  pc.tick = s.chunk_forward / kForwardTicks;
  pc.options.forward_cost = kForwardTicks;
  pc.options.backward_cost = std::max<int64_t>(1, std::llround(s.chunk_backward / pc.tick));
  // Full recompute's replay runs inside B and accumulates the weight gradients there.
  pc.chunk_backward_weight = l.recompute == Recompute::kFull ? 0 : s.chunk_weight_grad;
  pc.backward_weight_ticks =
      std::min<int64_t>(pc.options.backward_cost, std::llround(pc.chunk_backward_weight / pc.tick));
  pc.backward_input_ticks = pc.options.backward_cost - pc.backward_weight_ticks;
  pc.options.backward_weight_cost =
      std::clamp<int64_t>(pc.backward_weight_ticks, 1, std::max<int64_t>(1, pc.options.backward_cost - 1));
  pc.options.backward_input_cost = std::max<int64_t>(1, pc.options.backward_cost - pc.options.backward_weight_cost);
  pc.options.p2p_cost = 0;  // transfers are blocking: they are inside the chunk costs
  pc.options.record_timeline = false;
  return pc;
}

TimeBreakdown predict_time(const ModelSpec& m, const Layout& l, int64_t global_batch, const Cluster& c,
                           const Calibration& k, const CostOptions& o) {
  const PipelineCosts pc = pipeline_costs(m, l, c, k, o);
  const auto sim =
      pipeline::simulate_schedule(schedule_of(l), l.pp, l.num_microbatches(global_batch), model_chunks(l), pc.options);
  return predict_time(m, l, global_batch, c, k, o, pc, sim);
}

TimeBreakdown predict_time(const ModelSpec& m, const Layout& l, int64_t global_batch, const Cluster& c,
                           const Calibration& k, const CostOptions& o, const PipelineCosts& pc,
                           const pipeline::SimulationResult& sim) {
  validate_layout(m, l, c.gpus(), global_batch);
  const StageCost s = stage_cost(m, l, c, k, o);
  const double mb = static_cast<double>(l.num_microbatches(global_batch));
  TimeBreakdown t;
  t.compute = mb * s.compute;
  t.recompute = mb * s.recompute;
  t.tp_comm = mb * s.tp;
  t.cp_comm = mb * s.cp;
  t.ep_comm = mb * s.ep;
  t.etp_comm = mb * s.etp;
  t.p2p = mb * s.p2p;
  // The simulator ran the slowest stage's costs on every stage, in ticks; its bubble (idle /
  // busy) turns the busy seconds into the makespan.
  const pipeline::RankReport& first = sim.ranks.front();
  t.simulated_bubble_fraction = first.bubble.value();
  // On NCCL the executor posts each transfer alone on its channel (pipeline/p2p_channels.h):
  // a send holds no compute, so there too the simulator's bubble is the executor's.
  t.bubble_fraction = t.simulated_bubble_fraction;
  const double busy = mb * static_cast<double>(model_chunks(l)) * (pc.chunk_forward + pc.chunk_backward);
  t.bubble = busy * t.bubble_fraction;
  t.pipeline = busy + t.bubble;
  t.peak_inflight_chunks = first.peak_inflight;
  // Gradient reduction after the last backward: reduce-scatter + all-gather (or all-reduce)
  // of the stage's gradients, 1.5x with ZeRO-3's parameter gathers (docs/reference.md).
  int64_t params = 0;
  // Rank 0 holds the embedding (in a V the head too), the last rank the head looped.
  for (int64_t r : {int64_t{0}, l.pp - 1}) params = std::max(params, dense_params_per_rank(m, l, r));
  // Parameters are replicated over CP: the gradients are reduced over DP x CP.
  const double grad_bytes = static_cast<double>(params) * precision_bytes(o.precision).grad;
  const double bw = l.tp * l.cp * l.dp <= c.gpus_per_node ? intra_bw(c, k) : inter_bw(c, k);
  t.dp_comm = ring_allreduce_s(grad_bytes, l.dp_cp(), bw) * (l.zero_stage == 3 ? 1.5 : 1.0);
  if (m.is_moe()) {
    // The experts' gradients, reduced by their own optimizer over expert-DP (inside the stage).
    int64_t experts = 0;
    for (int64_t r = 0; r < l.pp; ++r) experts = std::max(experts, expert_params_per_rank(m, l, r));
    t.expert_dp_comm = ring_allreduce_s(static_cast<double>(experts) * precision_bytes(o.precision).grad, l.edp(), bw);
    t.dp_comm += t.expert_dp_comm;
  }
  t.step = t.pipeline + t.dp_comm;
  const double gpus = static_cast<double>(l.gpus());
  t.tflops_per_gpu = flops_per_iteration(m, global_batch, l.recompute) / t.step / gpus / 1e12;
  t.mfu = flops_per_iteration(m, global_batch, Recompute::kNone) / t.step / gpus / (c.peak_tflops * 1e12);
  return t;
}

}  // namespace megatorch::plan
