#include "megatorch/plan/moe.h"

#include <algorithm>

#include "megatorch/check.h"

namespace megatorch::plan {

namespace {
LayerCounts count_layers(const ModelSpec& m, int64_t begin, int64_t end) {
  LayerCounts c;
  for (int64_t i = begin; i < end; ++i) (m.is_moe_layer(i) ? c.moe : c.dense) += 1;
  return c;
}
}  // namespace

int64_t num_moe_layers(const ModelSpec& m) { return count_layers(m, 0, m.num_layers).moe; }

LayerCounts chunk_layer_counts(const ModelSpec& m, int64_t pp, int64_t vpp, int64_t pp_rank, int64_t chunk,
                               pipeline::ChunkLayout layout) {
  MEGATORCH_CHECK(pp >= 1 && vpp >= 1 && pp_rank >= 0 && pp_rank < pp && chunk >= 0 && chunk < vpp &&
                      m.num_layers % (pp * vpp) == 0 && (layout == pipeline::ChunkLayout::kLooped || vpp == 2),
                  "chunk_layer_counts: expected 0 <= pp_rank < pp, 0 <= chunk < vpp, pp x vpp dividing the ",
                  m.num_layers, " layers and vpp = 2 in a V, got pp=", pp, " vpp=", vpp, " pp_rank=", pp_rank,
                  " chunk=", chunk, " layout=", pipeline::chunk_layout_name(layout));
  const int64_t per_chunk = m.num_layers / (pp * vpp), stage = pipeline::virtual_stage(chunk, pp_rank, pp, layout);
  return count_layers(m, stage * per_chunk, (stage + 1) * per_chunk);
}

LayerCounts stage_layer_counts(const ModelSpec& m, int64_t pp, int64_t vpp, int64_t pp_rank,
                               pipeline::ChunkLayout layout) {
  LayerCounts total;
  for (int64_t c = 0; c < vpp; ++c) {
    const LayerCounts one = chunk_layer_counts(m, pp, vpp, pp_rank, c, layout);
    total.dense += one.dense, total.moe += one.moe;
  }
  return total;
}

LayerCounts chunk_layer_counts(const ModelSpec& m, const Layout& l, int64_t pp_rank, int64_t chunk) {
  return chunk_layer_counts(m, l.pp, model_chunks(l), pp_rank, chunk, chunk_layout_of(l));
}

LayerCounts stage_layer_counts(const ModelSpec& m, const Layout& l, int64_t pp_rank) {
  return stage_layer_counts(m, l.pp, model_chunks(l), pp_rank, chunk_layout_of(l));
}

int64_t params_per_expert(const ModelSpec& m) { return params_per_expert_shard(m, 1); }

int64_t params_per_expert_shard(const ModelSpec& m, int64_t etp) {
  const int64_t f = m.moe_ffn();
  MEGATORCH_CHECK(etp >= 1 && f % etp == 0, "expert tensor parallelism: expected --expert-tensor-parallel-size >= 1 "
                  "dividing the expert FFN size (--moe-ffn-hidden-size ", f, "), got ", etp,
                  "; pick a divisor of ", f);
  // fc1 column-parallel and fc2 row-parallel over ETP; fc2's bias is added after the
  // reduce-scatter, whole on every ETP rank.
  const int64_t h = m.hidden_size, shard = f / etp, fc1 = shard * (m.swiglu ? 2 : 1);
  return h * fc1 + shard * h + (m.mlp_bias() ? fc1 + h : 0);
}

int64_t expert_params(const ModelSpec& m) { return num_moe_layers(m) * m.num_experts * params_per_expert(m); }

int64_t active_params(const ModelSpec& m) {
  return total_params(m) - num_moe_layers(m) * (m.num_experts - m.moe_router_topk) * params_per_expert(m);
}

int64_t expert_params_per_rank(const ModelSpec& m, const Layout& l, int64_t pp_rank) {
  if (!m.is_moe()) return 0;
  MEGATORCH_CHECK(l.ep >= 1 && m.num_experts % l.ep == 0, "expert_params_per_rank: expected --num-experts (",
                  m.num_experts, ") divisible by --expert-model-parallel-size (", l.ep, ")");
  return stage_layer_counts(m, l, pp_rank).moe * (m.num_experts / l.ep) * params_per_expert_shard(m, l.etp);
}

double effective_imbalance_margin(const ModelSpec& m, int64_t ep) {
  return ep <= 1 ? 1.0 : std::min(m.moe_imbalance_margin, static_cast<double>(ep));
}

MoeDispatch moe_dispatch(const ModelSpec& m, const Layout& l, double E) {
  MoeDispatch d;
  if (!m.is_moe()) return d;
  const double ep = static_cast<double>(l.ep), h = static_cast<double>(m.hidden_size);
  const double k = static_cast<double>(m.moe_router_topk), experts = static_cast<double>(m.num_experts);
  // The rank's sequence share: S/c tokens of b sequences, split over TP under SP.
  d.tokens = static_cast<double>(l.micro_batch) * static_cast<double>(m.seq_length / l.cp) /
             static_cast<double>(l.sequence_parallel ? l.tp : 1);
  d.routed_rows = d.tokens * k;
  d.expert_rows = d.routed_rows * effective_imbalance_margin(m, l.ep);
  d.recompute_repeats = l.recompute == Recompute::kFull;
  const double etp = static_cast<double>(l.etp);
  d.etp_rows = etp * d.expert_rows;
  // The expert rows all-gathered over ETP and the partial outputs reduce-scattered back;
  // backward the reduce-scatter of the input gradient and the all-gather of the output's.
  d.etp_forward_bytes = 2 * (etp - 1) * d.expert_rows * h * E;
  d.etp_backward_bytes = d.etp_forward_bytes;
  if (l.ep == 1) return d;
  if (m.moe_token_dispatcher == TokenDispatcher::kAllToAll) {
    // Dispatch and combine: the rows that leave (and come back to) the busiest rank.
    d.forward_bytes = 2 * d.expert_rows * h * E * (ep - 1) / ep;
    d.backward_bytes = d.forward_bytes;
  } else {
    const double T = d.tokens;
    // Forward: tokens, fp32 weights and byte selections gathered; outputs reduce-scattered.
    d.forward_bytes = (ep - 1) * T * (h * E + 4 * experts + experts) + (ep - 1) * T * h * E;
    // Backward: token and weight gradients reduce-scattered, the output gradient gathered.
    d.backward_bytes = (ep - 1) * T * h * E + (ep - 1) * T * 4 * experts + (ep - 1) * T * h * E;
  }
  return d;
}

double moe_routed_activation_bytes(const ModelSpec& m, const Layout& l, double E) {
  if (!m.is_moe() || l.recompute == Recompute::kFull) return 0;
  const MoeDispatch d = moe_dispatch(m, l, E);
  const double h = static_cast<double>(m.hidden_size), f = static_cast<double>(m.moe_ffn());
  const double k = static_cast<double>(m.moe_router_topk), experts = static_cast<double>(m.num_experts);
  const double T = d.tokens;
  // Router: fp32 logits [T, E] (the top-k gathers from them), int64 indices and fp32 softmax
  // weights [T, k]. At 16 bits its fp32 GEMM keeps fp32 copies of the weight and of x, and
  // x itself (the dense count's fc1 input) only if the shared expert keeps it.
  double bytes = 4 * T * experts + (8 + 4) * T * k;
  if (E != 4) {
    bytes += 4 * experts * h + 4 * T * h;
    if (m.moe_shared_expert_intermediate_size == 0) bytes -= E * T * h;
  }
  // Per routed row of the rank's tokens: the expert output the combine weighs and the
  // weighted row (kept by the scatter-add), the row's weight, the [N, 2] int64 (expert,
  // token) pairs (token: a view of them) and the weight gather's flat int64 index.
  bytes += d.routed_rows * (2 * h * E + E + 16 + 8);
  // Per row the busiest rank receives: at EP > 1 the int64 regrouping order and its inverse.
  bytes += d.expert_rows * (l.ep > 1 ? 16 : 0);
  // Per row its experts process (the ETP group's etp R gathered rows, R at ETP 1): their
  // input, and fc1's and the activation's outputs at 1/etp of the width (etp x the rows:
  // the ETP 1 bytes).
  const double act = (m.swiglu ? 3.0 : 2.0) * f;
  bytes += d.etp_rows * h * E + d.expert_rows * act * E;
  // With biases each row's expert (int64) for fc2's bias, added to the rank's own R rows
  // (after the reduce-scatter under ETP); fc1's shares it at ETP 1 and has its own for the
  // gathered rows at ETP > 1.
  if (m.mlp_bias()) bytes += 8 * (l.etp > 1 ? d.etp_rows + d.expert_rows : d.expert_rows);
  // At ETP > 1 the gathered rows come by ETP rank: an int64 order groups them by expert and
  // its inverse returns the partial outputs by rank.
  if (l.etp > 1) bytes += 16 * d.etp_rows;
  // The grouped GEMMs' int32 group offsets, one per projection.
  bytes += 2 * 4 * static_cast<double>(m.num_experts / l.ep);
  return bytes;
}

}  // namespace megatorch::plan
