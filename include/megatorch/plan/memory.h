#pragma once
// Per-GPU memory of a layout: weights, gradients and optimizer states by ZeRO stage
// (docs/reference.md's bytes per parameter), activations by Korthikanti et al. 2022 with the
// number of micro-batches in flight taken from the pipeline schedule simulator, and buffers.
#include <cstdint>
#include <string>

#include "megatorch/pipeline/simulator.h"
#include "megatorch/plan/model_spec.h"

namespace megatorch::plan {

// Bytes per parameter of each kind of state a recipe keeps, before sharding.
struct PrecisionBytes {
  double param = 2, grad = 4, master_param = 4, master_grad = 0, optimizer_state = 8;
  double total() const { return param + grad + master_param + master_grad + optimizer_state; }
};
PrecisionBytes precision_bytes(Precision p);

// Bytes one DP rank holds for `num_params` parameters (the parameters of its TP/PP shard)
// with `dp` ranks (dp * cp under context parallelism: CP ranks hold the same parameters) at
// a ZeRO stage: stage 1 shards the master params, master grads and
// optimizer states over dp, stage 2 the gradients too, stage 3 the parameters too. The names
// follow DistributedOptimizer::memory_stats() (padding left out: exact division).
struct StateBytes {
  double param_bytes = 0, grad_bytes = 0, master_param_bytes = 0, master_grad_bytes = 0, optimizer_state_bytes = 0;
  double total() const { return param_bytes + grad_bytes + master_param_bytes + master_grad_bytes + optimizer_state_bytes; }
};
StateBytes zero_state_bytes(double num_params, int64_t dp, int zero_stage, Precision precision);
// The same for one rank of a GPT model under a layout: the parameters that rank holds
// (params_per_rank of its pipeline stage) sharded by zero_state_bytes over dp * cp. With
// experts, the sum of the dense part (dense_params_per_rank over dp * cp) and the experts
// (expert_zero_bytes_per_rank).
StateBytes zero_bytes_per_rank(const ModelSpec& model, const Layout& layout, Precision precision, int64_t pp_rank = 0);
// The rank's experts (expert_params_per_rank) sharded over the expert-DP group
// (layout.edp() = tp*cp*dp/(ep*etp) ranks), as TrainingLoop's expert optimizer holds them:
// replicated at ZeRO 0, optimizer states (1) and gradients (2) sharded. Zero for dense models.
StateBytes expert_zero_bytes_per_rank(const ModelSpec& model, const Layout& layout, Precision precision,
                                      int64_t pp_rank = 0);

// How activations are stored. The defaults are the paper's: 16-bit activations, 1-byte
// dropout masks, nothing else. megatorch_extras adds what megatorch's layer keeps beyond the
// paper's count (docs/activation_memory.md): LayerNorm's fp32 mean and 1/std (L).
// math_attention adds SDPA's math path (CPU with attention dropout): Q and K held twice (Q).
// flash_attention models the attention as megatorch's layer runs it without attention dropout
// (ATen's flash SDPA; under context parallelism always: ring attention or Ulysses on the
// flash kernel): no [b, a, s, s] scores. Without recompute the paper's (2E + M)·A/t score
// term becomes the fp32 log-sum-exp, [b, a/t, s/c] (F: 4·a·(s/c)·b/t bytes); the output is
// the output projection's input, counted already. At cp > 1, without recompute, the
// attention output is kept twice (O: +E·(S/c)·b·h/t: the CP attention's [b, a/t, S/c, d] and
// the projection's [S/c, b, h/t] copy) and a2a keeps two int64 token-order indices over the
// whole sequence (I: +16·S bytes, not divided by c or t). Selective and full recompute replay
// the attention: the c = 1 bytes / c exactly. Exclusive with math_attention.
struct ActivationOptions {
  double activation_bytes = 2;
  double mask_bytes = 1;
  bool megatorch_extras = false;
  bool math_attention = false;
  bool flash_attention = false;
};

// Bytes one TP rank keeps for backward for one transformer layer and one micro-batch of
// `micro_batch` sequences (Korthikanti Table 2 for MHA + GeLU; GQA and SwiGLU counted by
// their tensors).
double activation_bytes_per_layer(const ModelSpec& model, int64_t micro_batch, int64_t tp, bool sequence_parallel,
                                  Recompute recompute, const ActivationOptions& options = {});
// The same for one rank of a layout, context parallelism included: a CP rank keeps S/c of
// the tokens, and every term is proportional to the tokens it keeps, so the bytes are the
// cp = 1 bytes / c. That holds for the attention core too: a rank's share of the
// [b, a/t, S, S] scores is [b, a/t, S/c, S] (p2p: its queries against every key) or
// [b, a/(t c), S, S] (a2a: its heads over the whole sequence). Kernels that keep no scores
// (flash attention, megatorch's ring attention) keep less; the paper's count is the bound.
// With options.flash_attention the count is megatorch's (the c = 1 flash count / c, plus
// O and I without recompute; see ActivationOptions).
double activation_bytes_per_layer(const ModelSpec& model, const Layout& layout, const ActivationOptions& options = {});
// One MoE layer on the busiest rank of the layout: the count above for its attention half
// and norms (the router's input in place of fc1's), its shared expert as the MLP (none
// without one), plus the routed part (moe_routed_activation_bytes, moe.h). 0 for a dense
// model.
double moe_activation_bytes_per_layer(const ModelSpec& model, const Layout& layout,
                                      const ActivationOptions& options = {});

struct MemoryBreakdown {
  int64_t stage = 0;   // the pipeline rank this breakdown is for (the fullest one)
  StateBytes states;   // weights, gradients, optimizer states (experts included)
  StateBytes expert_states;  // of which the experts' (zero for dense models)
  int64_t dense_parameters = 0, expert_parameters = 0;  // what the rank holds
  double activations = 0;   // saved for backward: per layer x layers per stage x in flight
                            // (with experts: the chunk of the stage with the most bytes)
  double inflight_microbatches = 0;  // micro-batches of a whole stage in flight (simulator)
  double recompute_working = 0;      // one layer's activations rebuilt during backward (recompute)
  double logits = 0;        // fp32 logits shard for the loss (head_rank's): [b, S/c, V/t]
  double reserved = 0;      // runtime, communication buffers, fragmentation
  double total() const { return states.total() + activations + recompute_working + logits + reserved; }
};

struct MemoryOptions {
  Precision precision = Precision::kBf16;
  ActivationOptions activations;
  double reserved_bytes = 2.0 * (1ull << 30);
};

// The fuller of the first and the last pipeline stage (with experts, or in the V of zb-v and
// dualpipev: the fullest stage, as MoE layers need not be spread evenly and in a V rank 0
// holds the embedding and the head). The in-flight count comes from simulate_schedule
// (schedule_of(layout): 1F1B, interleaved or zb-h1, whose stages all hold min(p, m) as each
// micro-batch's activations wait for its W; zb-v 2p and dualpipev 2p+1 chunks of half a
// stage on every rank): its peak_inflight of the stage, in chunks of L / (pp x
// model_chunks) layers.
MemoryBreakdown predict_memory(const ModelSpec& model, const Layout& layout, int64_t global_batch,
                               const MemoryOptions& options = {});
// The same with the in-flight counts of a simulation already run for this layout (any costs:
// the schedule's order fixes what is in flight).
MemoryBreakdown predict_memory(const ModelSpec& model, const Layout& layout, const pipeline::SimulationResult& sim,
                               const MemoryOptions& options = {});

}  // namespace megatorch::plan
