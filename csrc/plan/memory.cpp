#include "megatorch/plan/memory.h"

#include <algorithm>

#include "megatorch/check.h"
#include "megatorch/pipeline/simulator.h"
#include "megatorch/plan/moe.h"

namespace megatorch::plan {

PrecisionBytes precision_bytes(Precision p) {
  switch (p) {
    case Precision::kBf16: return {2, 4, 4, 0, 8};   // grads accumulate in fp32: they are the master grads
    case Precision::kFp16: return {2, 2, 4, 4, 8};   // fp16 grads and their fp32 copy
    case Precision::kFp32: return {4, 4, 0, 0, 8};   // the params are the master params
    case Precision::kMixed: return {2, 2, 4, 0, 8};  // ZeRO: K = 12 (master, momentum, variance)
  }
  MEGATORCH_FAIL("unknown precision");
}

StateBytes zero_state_bytes(double n, int64_t dp, int stage, Precision precision) {
  MEGATORCH_CHECK(dp >= 1 && stage >= 0 && stage <= 3, "zero_state_bytes: expected dp >= 1 and stage 0..3, got dp=",
                  dp, " stage=", stage);
  const PrecisionBytes b = precision_bytes(precision);
  const double d = static_cast<double>(dp);
  StateBytes s;
  s.param_bytes = n * b.param / (stage >= 3 ? d : 1);
  s.grad_bytes = n * b.grad / (stage >= 2 ? d : 1);
  s.master_param_bytes = n * b.master_param / (stage >= 1 ? d : 1);
  s.master_grad_bytes = n * b.master_grad / (stage >= 1 ? d : 1);
  s.optimizer_state_bytes = n * b.optimizer_state / (stage >= 1 ? d : 1);
  return s;
}

StateBytes expert_zero_bytes_per_rank(const ModelSpec& m, const Layout& l, Precision precision, int64_t pp_rank) {
  const int64_t n = expert_params_per_rank(m, l, pp_rank);
  if (n == 0) return {};
  MEGATORCH_CHECK(l.zero_stage <= 2, "expert parameters: ZeRO-3 does not shard them (TrainingLoop refuses it with ",
                  "experts), got ZeRO-", l.zero_stage, "; use --zero-stage 1 or 2");
  return zero_state_bytes(static_cast<double>(n), l.edp(), l.zero_stage, precision);
}

StateBytes zero_bytes_per_rank(const ModelSpec& m, const Layout& l, Precision precision, int64_t pp_rank) {
  StateBytes s = zero_state_bytes(static_cast<double>(dense_params_per_rank(m, l, pp_rank)), l.dp_cp(), l.zero_stage,
                                  precision);
  if (!m.is_moe()) return s;
  // Two optimizers: the dense one over DP x CP, the experts' over expert-DP.
  const StateBytes e = expert_zero_bytes_per_rank(m, l, precision, pp_rank);
  s.param_bytes += e.param_bytes, s.grad_bytes += e.grad_bytes, s.master_param_bytes += e.master_param_bytes;
  s.master_grad_bytes += e.master_grad_bytes, s.optimizer_state_bytes += e.optimizer_state_bytes;
  return s;
}

namespace {
// `cp` ranks share the sequence: a rank keeps s/cp tokens of every [s, b, h] tensor and s/cp
// query rows of the [b, a, s, s] scores (see the header for a2a).
// `ffn`: the width of the layer's TP MLP (an MoE layer's shared expert; 0: none).
double layer_activation_bytes(const ModelSpec& m, int64_t b, int64_t tp, bool sp, Recompute r,
                              const ActivationOptions& o, int64_t cp, CpCommType comm, double ffn) {
  MEGATORCH_CHECK(!(o.flash_attention && o.math_attention),
                  "activation memory: expected at most one attention kernel, got both flash_attention and "
                  "math_attention (--flash-attention and --math-attention); give --flash-attention for SDPA's flash "
                  "kernel (no attention dropout, and always under context parallelism) or --math-attention for its "
                  "math path (CPU with attention dropout), not both");
  const double s = m.seq_length, h = m.hidden_size, t = static_cast<double>(tp);
  const double tokens = s / static_cast<double>(cp);                      // this CP rank's
  const double u = tokens * b * h;                                        // one [s/c, b, h] tensor, elements
  const double A = static_cast<double>(m.num_attention_heads) * s * tokens * b;  // [b, a, s/c, s]
  const double outside = sp ? 1 / t : 1.0;  // norm/dropout regions: split by SP
  const double E = o.activation_bytes, M = o.mask_bytes;
  if (r == Recompute::kFull) return E * u * outside;  // the layer input only
  // Outside the TP region: the two norm inputs, the inputs of QKV and fc1 (4u) and the two
  // hidden dropout masks (2u).
  double bytes = (4 * E + 2 * M) * u * outside;
  // Inside (divided by t): Q, K, V and the output projection's input (4u for MHA), fc1's
  // output and the activation's output (8u for GeLU at 4h; SwiGLU keeps gate, up and their
  // product).
  const double qkv = (m.num_attention_heads + 2.0 * m.query_groups()) * m.head_dim() / h;
  const double mlp = (m.swiglu ? 3.0 : 2.0) * ffn / h;
  bytes += E * (qkv + 1 + mlp) * u / t;
  if (r == Recompute::kNone) {
    if (!o.flash_attention) {
      // The core attention: softmax output and dropout output (16-bit) and the dropout mask.
      bytes += (2 * E + M) * A / t;
    } else {
      // F: flash attention keeps no scores, only its fp32 log-sum-exp [b, a/t, s/c] (p2p: the
      // rank's queries; a2a: [b, a/(t c), s], the same bytes). Its output is the output
      // projection's input, counted above.
      bytes += 4.0 * m.num_attention_heads * tokens * b / t;
      if (cp > 1) {
        // O: the CP attention's output [b, a/t, S/c, d] and the projection's [S/c, b, h/t]
        // copy of it (at c = 1 the projection's input is a view of SDPA's output).
        bytes += E * u / t;
        // I: Ulysses' two int64 token-order indices over the whole sequence (not / c, not / t).
        if (comm == CpCommType::kA2A) bytes += 2 * 8 * s;
      }
    }
  }
  if (o.megatorch_extras) {
    // L: at::layer_norm's fp32 mean and 1/std per token (RMSNorm: 1/rms only), two norms.
    bytes += 2 * (m.rms_norm ? 1 : 2) * 4 * tokens * b * outside;
  }
  if (o.math_attention && r == Recompute::kNone) bytes += 2 * E * u / t;  // Q: scaled Q and K copies
  return bytes;
}
}  // namespace

double activation_bytes_per_layer(const ModelSpec& m, int64_t b, int64_t tp, bool sp, Recompute r,
                                  const ActivationOptions& o) {
  return layer_activation_bytes(m, b, tp, sp, r, o, 1, CpCommType::kP2P, static_cast<double>(m.ffn()));
}

double activation_bytes_per_layer(const ModelSpec& m, const Layout& l, const ActivationOptions& o) {
  cp_share(m, l.cp);  // fails unless the sequence splits into 2c chunks
  return layer_activation_bytes(m, l.micro_batch, l.tp, l.sequence_parallel, l.recompute, o, l.cp, l.cp_comm,
                                static_cast<double>(m.ffn()));
}

double moe_activation_bytes_per_layer(const ModelSpec& m, const Layout& l, const ActivationOptions& o) {
  if (!m.is_moe()) return 0;
  cp_share(m, l.cp);
  return layer_activation_bytes(m, l.micro_batch, l.tp, l.sequence_parallel, l.recompute, o, l.cp, l.cp_comm,
                                static_cast<double>(m.moe_shared_expert_intermediate_size)) +
         moe_routed_activation_bytes(m, l, o.activation_bytes);
}

namespace {
MemoryBreakdown stage_memory(const ModelSpec& m, const Layout& l, const MemoryOptions& o, int64_t stage, const pipeline::SimulationResult& sim) {
  MemoryBreakdown mem;
  mem.stage = stage;
  mem.states = zero_bytes_per_rank(m, l, o.precision, stage);
  mem.expert_states = expert_zero_bytes_per_rank(m, l, o.precision, stage);
  mem.dense_parameters = dense_params_per_rank(m, l, stage);
  mem.expert_parameters = expert_params_per_rank(m, l, stage);
  const double per_layer = activation_bytes_per_layer(m, l, o.activations);
  // peak_inflight counts chunk activations: a chunk holds L / (pp * chunks per rank) layers
  // (vpp, or the V's two).
  const int64_t per_rank = model_chunks(l);
  const double chunks = static_cast<double>(sim.ranks[stage].peak_inflight);
  mem.inflight_microbatches = chunks / static_cast<double>(per_rank);
  Layout none = l;
  none.recompute = Recompute::kNone;
  if (!m.is_moe()) {
    mem.activations = per_layer * chunks * static_cast<double>(m.num_layers / (l.pp * per_rank));
    // Backward rebuilds one layer's activations (full) or its attention core (selective).
    if (l.recompute != Recompute::kNone)
      mem.recompute_working = activation_bytes_per_layer(m, none, o.activations) - per_layer;
  } else {
    // Chunks of one stage may hold different numbers of MoE layers: the fullest one, in
    // flight as often as the simulator says (exact at one chunk per stage, a bound beyond).
    const double per_moe = moe_activation_bytes_per_layer(m, l, o.activations);
    double fullest = 0;
    for (int64_t c = 0; c < per_rank; ++c) {
      const LayerCounts n = chunk_layer_counts(m, l, stage, c);
      fullest = std::max(fullest, static_cast<double>(n.dense) * per_layer + static_cast<double>(n.moe) * per_moe);
    }
    mem.activations = fullest * chunks;
    if (l.recompute != Recompute::kNone) {
      const LayerCounts n = stage_layer_counts(m, l, stage);
      if (n.dense > 0) mem.recompute_working = activation_bytes_per_layer(m, none, o.activations) - per_layer;
      if (n.moe > 0)
        mem.recompute_working =
            std::max(mem.recompute_working, moe_activation_bytes_per_layer(m, none, o.activations) - per_moe);
    }
  }
  // Each CP rank computes the loss of its own S/c tokens, on the rank of the last virtual stage.
  if (stage == head_rank(l))
    mem.logits = 4.0 * l.micro_batch * (m.seq_length / l.cp) * static_cast<double>(padded_vocab(m, l.tp) / l.tp);
  mem.reserved = o.reserved_bytes;
  return mem;
}
}  // namespace

MemoryBreakdown predict_memory(const ModelSpec& m, const Layout& l, int64_t global_batch, const MemoryOptions& o) {
  const int64_t mb = l.num_microbatches(global_batch);
  pipeline::SimulatorOptions costs;
  costs.record_timeline = false;
  return predict_memory(m, l, pipeline::simulate_schedule(schedule_of(l), l.pp, mb, model_chunks(l), costs), o);
}

MemoryBreakdown predict_memory(const ModelSpec& m, const Layout& l, const pipeline::SimulationResult& sim,
                               const MemoryOptions& o) {
  MEGATORCH_CHECK(static_cast<int64_t>(sim.ranks.size()) == l.pp, "predict_memory: expected a simulation of ", l.pp,
                  " stages, got ", sim.ranks.size());
  MemoryBreakdown first = stage_memory(m, l, o, 0, sim);
  if (l.pp == 1) return first;
  MemoryBreakdown last = stage_memory(m, l, o, l.pp - 1, sim);
  MemoryBreakdown fullest = last.total() > first.total() ? last : first;
  // With experts a middle stage may hold more MoE layers than the first and the last. In a
  // V rank 0 holds the embedding and the head, and the simulator's in-flight counts are
  // per rank: every stage is looked at.
  const bool every_stage = m.is_moe() || chunk_layout_of(l) == pipeline::ChunkLayout::kV;
  for (int64_t stage = 1; every_stage && stage + 1 < l.pp; ++stage) {
    MemoryBreakdown mid = stage_memory(m, l, o, stage, sim);
    if (mid.total() > fullest.total()) fullest = mid;
  }
  return fullest;
}

}  // namespace megatorch::plan
