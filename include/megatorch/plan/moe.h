#pragma once
// Mixture of experts in the planner: which layers are MoE layers on each pipeline chunk,
// the expert parameters (all of them, the active ones per token, one rank's under expert
// parallelism), the tokens a rank routes and the bytes its token dispatch moves, and what
// the routed part of an MoE layer keeps for backward. Plain numbers, as model_spec.h.
#include <cstdint>

#include "megatorch/plan/model_spec.h"

namespace megatorch::plan {

struct LayerCounts {
  int64_t dense = 0, moe = 0;
};
int64_t num_moe_layers(const ModelSpec& m);
// The layers of virtual chunk `chunk` of pipeline rank `pp_rank` (virtual stage
// pipeline::virtual_stage(chunk, pp_rank, pp, layout): chunk * pp + pp_rank looped, or in a
// V (vpp = 2) pp_rank and 2pp-1-pp_rank, as PipelineStage splits them), by kind.
LayerCounts chunk_layer_counts(const ModelSpec& m, int64_t pp, int64_t vpp, int64_t pp_rank, int64_t chunk,
                               pipeline::ChunkLayout layout = pipeline::ChunkLayout::kLooped);
// Over all the rank's chunks.
LayerCounts stage_layer_counts(const ModelSpec& m, int64_t pp, int64_t vpp, int64_t pp_rank,
                               pipeline::ChunkLayout layout = pipeline::ChunkLayout::kLooped);
// The same under a layout: its model_chunks placed by its chunk_layout_of.
LayerCounts chunk_layer_counts(const ModelSpec& m, const Layout& layout, int64_t pp_rank, int64_t chunk);
LayerCounts stage_layer_counts(const ModelSpec& m, const Layout& layout, int64_t pp_rank);

// One expert, as GroupedExperts stacks it: fc1 [h, F g] (g = 2 for SwiGLU's gate and up),
// fc2 [F, h], and with biases fc1's F g and fc2's h.
int64_t params_per_expert(const ModelSpec& m);
// One ETP rank's shard of one expert under expert tensor parallelism, split as a TP MLP:
// fc1 column-parallel [h, F g / etp] (gate and up each split), fc2 row-parallel [F / etp, h],
// and with biases fc1's F g / etp and fc2's h whole (replicated over ETP). Fails unless etp
// divides F. params_per_expert at etp 1.
int64_t params_per_expert_shard(const ModelSpec& m, int64_t etp);
// Every expert of every MoE layer: num_moe_layers x E x params_per_expert.
int64_t expert_params(const ModelSpec& m);
// What one token passes through: total_params less the E - k experts of each MoE layer it
// is not routed to (router and shared expert included). MoE FLOPs accounting counts
// 6 x this per token for training.
int64_t active_params(const ModelSpec& m);
// One rank's experts: E / ep of each MoE layer on its chunks, whatever its TP rank, each
// its params_per_expert_shard (whole at layout.etp 1). These are the parameters of
// TrainingLoop's expert optimizer on that rank, which ZeRO shards over the expert-DP group
// (layout.edp() = tp*cp*dp / (ep*etp) ranks).
int64_t expert_params_per_rank(const ModelSpec& m, const Layout& layout, int64_t pp_rank);

// The margin in effect: 1 at EP 1 (one rank holds every expert: nothing to balance), else
// min(margin, EP) (a rank cannot receive more than every EP rank's rows).
double effective_imbalance_margin(const ModelSpec& m, int64_t ep);

// One rank's tokens in one MoE layer and micro-batch, and what its token dispatch sends.
//   T = b S / c (/ t under SP): the tokens the rank routes. Without SP the TP ranks route
//     the same tokens, each its own copy (experts do not split over TP: t times the expert work).
//   alltoall: the dispatch sends the rank's T k (token, expert) rows of h elements to the EP
//     ranks holding those experts, (ep-1)/ep of them to other ranks under uniform routing,
//     and the combine returns as many; the busiest rank moves `margin` times that. Backward
//     the same again: 4 T k h E (ep-1)/ep margin bytes per layer and micro-batch, E bytes per
//     element. (The [E] int64 count exchange before each dispatch is not counted.)
//   allgather: forward, all-gathers of the tokens [T, h], the routing weights [T, E] (fp32)
//     and selections [T, E] (bytes), a rank sending (ep-1) times its own part, and a
//     reduce-scatter of the outputs [ep T, h], (ep-1) T h E bytes sent; backward,
//     reduce-scatters of the token and weight gradients and an all-gather of the output
//     gradient. Whatever the routing: no margin.
// Zero at EP 1. Full recompute runs the forward again in backward, its dispatch included.
// Expert tensor parallelism (etp > 1) adds, after the dispatch, an all-gather of the R =
// T k margin expert rows [R, h] over the ETP group (each ETP rank's expert shards then run on
// the group's etp R rows) and a reduce-scatter of the partial fc2 outputs back to the R rows:
// (etp-1) R h E bytes each, a rank sending (etp-1) times its own part (ring); backward the
// transpose, the same again. Same rows on every rank of the group (they hold the same
// experts). Zero at ETP 1, at EP 1 too.
struct MoeDispatch {
  double tokens = 0;       // T
  double routed_rows = 0;  // T k: the rank's (token, expert) rows, sent out and combined back
  double expert_rows = 0;  // T k margin: the rows the busiest rank's experts receive (R)
  double forward_bytes = 0, backward_bytes = 0;  // one rank sends, per MoE layer and micro-batch
  bool recompute_repeats = false;
  double etp_rows = 0;  // etp R: the rows the rank's expert shards process (R at ETP 1)
  double etp_forward_bytes = 0, etp_backward_bytes = 0;  // one rank sends over ETP, likewise
};
MoeDispatch moe_dispatch(const ModelSpec& m, const Layout& layout, double bytes_per_element);

// What the routed part of one MoE layer keeps for backward on the busiest rank, per
// micro-batch, with E-byte activations (docs/plan.md, "Mixture of experts"): the router
// (fp32 logits [T, E], top-k indices and weights [T, k]; with 16-bit activations fp32
// copies of its input [T, h] and weight [E, h], and not the 16-bit input the dense count
// has as fc1's unless a shared expert keeps it), per routed row (T k) the expert output
// and its weighted copy (2 h E), the row's weight (E) and three int64 indices; per row the
// rank receives (R = T k margin) the regrouping's two int64 indices (EP > 1); per row the
// experts process (etp R) their input (h E), fc1's output and the activation's at 1/etp of
// the width (2 F E / etp, SwiGLU's fused kernel 3 F E / etp: the ETP 1 bytes whatever
// etp); with biases the row's expert (int64) for fc1's bias on the etp R rows and another
// for fc2's on the rank's own R rows; at ETP > 1 the two int64 indices regrouping the
// gathered rows by expert and back; and the grouped GEMMs' int32 offsets, 2 x 4 bytes
// per local expert. Zero under full recompute (the layer input only). Exact against the
// layer at EP 1 and ETP 1 (tests/python/unit/test_plan_cli.py) for the default router
// (softmax over the top k, no auxiliary losses, no capacity).
double moe_routed_activation_bytes(const ModelSpec& m, const Layout& layout, double activation_bytes);

}  // namespace megatorch::plan
