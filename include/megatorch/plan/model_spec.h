#pragma once
// What the planner knows about a model and a layout: the model's shape (from Megatron-style
// flags, a preset or a TransformerConfig), the parallel layout of one training run, and the
// exact parameter counts and FLOPs those imply. Plain numbers, no tensors.
#include <cstdint>
#include <string>
#include <vector>

#include "megatorch/pipeline/schedule.h"
#include "megatorch/transformer/config.h"

namespace megatorch::plan {

using transformer::Recompute;
using transformer::TokenDispatcher;

struct ModelSpec {
  std::string name = "custom";
  int64_t num_layers = 24;
  int64_t hidden_size = 2048;
  int64_t num_attention_heads = 16;
  int64_t num_query_groups = 0;  // 0: MHA
  int64_t kv_channels = 0;       // each head's channels; 0: hidden_size / num_attention_heads
  int64_t ffn_hidden_size = 0;   // 0: 4h (GeLU) or Llama's 8h/3 rounded to 64 (SwiGLU)
  int64_t vocab_size = 51200;
  int64_t make_vocab_size_divisible_by = 128;
  int64_t seq_length = 2048;
  bool swiglu = false;
  bool rms_norm = false;
  bool learned_positions = true;
  bool add_bias_linear = true;
  bool add_qkv_bias = false;  // QKV biases without the other biases (Qwen2)
  bool add_attention_bias = false;  // QKV and output-projection biases (HF Llama's attention_bias)
  bool add_mlp_bias = false;        // the MLP's (and experts') biases (mlp_bias)
  bool qk_layernorm = false;        // a norm over head_dim on q and on k (Qwen3)
  bool mlp_bias() const { return add_bias_linear || add_mlp_bias; }
  bool tie_embeddings = true;
  // Mixture of experts, as TransformerConfig names it (Megatron's flags); 0 experts: dense.
  // Layer i (0-based) is an MoE layer when i % moe_layer_freq == 0 and i >= moe_first_k_dense.
  int64_t num_experts = 0;
  int64_t moe_router_topk = 2;
  int64_t moe_ffn_hidden_size = 0;  // per expert; 0: ffn()
  int64_t moe_layer_freq = 1;
  int64_t moe_first_k_dense = 0;
  int64_t moe_shared_expert_intermediate_size = 0;  // one dense MLP every token passes; 0: none
  TokenDispatcher moe_token_dispatcher = TokenDispatcher::kAllToAll;
  // A planning assumption, not a shape: the busiest expert-parallel rank receives margin x
  // the mean routed rows (1: perfectly balanced routing). Applied only at EP > 1, capped at
  // EP (one rank cannot receive more than every rank's rows). See docs/plan.md.
  double moe_imbalance_margin = 1.0;
  // What each query attends to, for the attention FLOPs: packed documents' mean length
  // (--reset-attention-mask; 0: one document per sequence) and a sliding window on
  // `sliding_layers` of the layers (0: none).
  int64_t mean_document_length = 0;
  int64_t sliding_window = 0;
  int64_t sliding_layers = 0;

  int64_t query_groups() const { return num_query_groups > 0 ? num_query_groups : num_attention_heads; }
  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : hidden_size / num_attention_heads; }
  int64_t ffn() const;
  // Keys per query, averaged over the layers, in the full-square count (the sequence
  // without packing or windows): a document of L tokens is an L x L block, so documents of
  // mean length m give s·m scores per sequence; a window of w caps a layer's at s·w.
  double attention_keys_per_query() const;
  bool is_moe() const { return num_experts > 0; }
  int64_t moe_ffn() const { return moe_ffn_hidden_size > 0 ? moe_ffn_hidden_size : ffn(); }
  bool is_moe_layer(int64_t layer) const {
    return num_experts > 0 && layer >= moe_first_k_dense && layer % moe_layer_freq == 0;
  }
  // Positive sizes, heads divide hidden, groups divide heads; with experts, the MoE fields.
  void validate() const;
};

// "gpt3-175b", "megatron-1t", "llama3-8b", "llama3-70b"; anything else fails listing them.
ModelSpec preset(const std::string& name);
std::vector<std::string> preset_names();
// The planner's view of a megatorch model configuration (the fields that size memory and time).
ModelSpec from_transformer_config(const transformer::TransformerConfig& config);

// Mixed-precision recipes, by the bytes per parameter each keeps (docs/reference.md).
enum class Precision {
  kBf16,   // bf16 params, fp32 grads, fp32 master + Adam: Megatron's 18 -> 6 + 12/d
  kFp16,   // fp16 params and grads, fp32 grad copy, master + Adam: Megatron's 20 -> 4 + 16/d
  kFp32,   // fp32 params and grads, Adam: 16 -> 8 + 8/d
  kMixed,  // the ZeRO paper's mixed-precision Adam: 2 + 2 + 12 = 16 bytes
};
const char* to_string(Precision p);
Precision parse_precision(const std::string& s);  // "bf16" | "fp16" | "fp32" | "mixed"
int64_t activation_dtype_bytes(Precision p);      // 2, or 4 for fp32

// How the ranks of a context-parallel group exchange what attention needs across the
// sequence split: p2p is ring attention (K and V travel the ring, overlapped with the
// attention steps), a2a is DeepSpeed-Ulysses (all-to-alls swap sequence shards for head
// shards around attention, not overlapped). The attention's own type and names
// (transformer/context_parallel.h), as --cp-comm-type spells them.
using transformer::CpCommType;
using transformer::parse_cp_comm_type;
using transformer::to_string;

// The backend the pipeline's p2p transfers run on, as gpt_pretrain's --distributed-backend
// names it. NCCL (the GPU default) pairs sends and receives by issue order and holds a send
// until its receive is posted; the executor posts every transfer alone on its channel's
// communicator there (pipeline/p2p_channels.h), so every schedule runs and a send holds
// only its channel. Gloo pairs by tag and never holds a send.
enum class DistributedBackend { kNccl, kGloo };
const char* to_string(DistributedBackend b);  // "nccl", "gloo"
DistributedBackend parse_distributed_backend(const std::string& s);

// One parallel layout of a training run on tp * cp * pp * dp GPUs (Megatron's rank order
// tp-cp-dp-pp). Context parallelism splits each sequence over cp ranks; parameters are
// replicated over CP, so gradients are reduced and ZeRO shards over dp * cp.
struct Layout {
  int64_t tp = 1, pp = 1, dp = 1;
  int64_t vpp = 1;  // virtual pipeline chunks per stage (interleaved 1F1B when > 1)
  int zero_stage = 0;
  int64_t micro_batch = 1;
  Recompute recompute = Recompute::kNone;
  bool sequence_parallel = false;
  // Last, so that the positional initialisations written before CP keep meaning cp = 1.
  int64_t cp = 1;
  CpCommType cp_comm = CpCommType::kP2P;
  // Expert parallelism (MoE): each pipeline stage's tp*cp*dp ranks re-split for the expert
  // layers as etp x ep x edp, etp fastest (Megatron's parallel folding). An EP rank holds
  // num_experts / ep experts of each MoE layer; expert tensor parallelism splits each of them
  // over etp ranks as a TP MLP (fc1 by columns, fc2 by rows; 1: every expert whole).
  int64_t ep = 1;
  int64_t etp = 1;
  // The pipeline schedule: 1F1B, or ZB-H1 (each backward split into B, the input gradient,
  // and W, the weight gradients, W's deferred into the bubbles); interleaved 1F1B whenever
  // vpp > 1. Read it through schedule_of, which applies that rule. ZB-V and DualPipeV keep
  // vpp = 1: their two chunks per rank (a V) come with the schedule (model_chunks).
  pipeline::ScheduleKind schedule = pipeline::ScheduleKind::kOneFOneB;
  // Where the pipeline's transfers run: which schedules can run, and zb-h1's bubble. The
  // same for every layout of a plan, so str() leaves it out.
  DistributedBackend backend = DistributedBackend::kNccl;

  int64_t gpus() const { return tp * cp * pp * dp; }
  // The ranks holding the same expert shards: expert gradients are reduced and ZeRO shards
  // over them.
  int64_t edp() const { return tp * cp * dp / (ep * etp); }
  // Micro-batches per step of one pipeline: global_batch / (micro_batch * dp). CP ranks work
  // on the same sequences, so cp does not divide the batch.
  int64_t num_microbatches(int64_t global_batch) const { return global_batch / (micro_batch * dp); }
  // The ranks that hold the same parameters: gradients are reduced and ZeRO shards over them.
  int64_t dp_cp() const { return dp * cp; }
  // "TP=8 PP=8 DP=24 VP=2 ZeRO-1 mb=1 recompute=full SP"; with CP after TP, as in the rank
  // order: "TP=2 CP=4(p2p) PP=2 DP=1 ...", EP after DP: "... DP=4 EP=8 ZeRO-1 ...", and ETP
  // after EP: "... EP=4 ETP=2 ZeRO-1 ...". cp, ep and etp = 1 print as before they existed.
  // A schedule other than the one vpp implies is appended: "... recompute=none sched=zb-h1".
  std::string str() const;
};

// The schedule a layout runs: interleaved when vpp > 1 and the schedule is left at 1F1B,
// else layout.schedule. The planner, the cost model and the memory model all ask this.
pipeline::ScheduleKind schedule_of(const Layout& layout);
// Whether that is the schedule vpp alone implies (1F1B, or interleaved at vpp > 1): only
// another one is named (Layout::str's "sched=", gpt_pretrain's --schedule).
bool schedule_implied(const Layout& layout);
// What a schedule needs ("" when it holds): 1f1b VP = 1; interleaved VP > 1; zb-h1, zb-v and
// dualpipev PP > 1 and VP = 1 (the V's two chunks are implied); gpipe is not planned (it holds every
// micro-batch in flight for 1F1B's bubble). layout_error asks it of schedule_of(layout) and
// adds what needs the model and the batch (the V: 2 x PP dividing the layers, at least 2 x PP
// micro-batches); the planner asks it of a fixed --schedule against the fixed knobs.
std::string schedule_error(pipeline::ScheduleKind kind, int64_t pp, int64_t vpp);
// 0.2's signature: neither the ZeRO stage nor the backend refuses a schedule any more.
[[deprecated("use schedule_error(kind, pp, vpp): neither ZeRO nor the backend refuses a schedule any more")]]
inline std::string schedule_error(pipeline::ScheduleKind kind, int64_t pp, int64_t vpp, int /*zero_stage*/,
                                  DistributedBackend /*backend*/ = DistributedBackend::kNccl) {
  return schedule_error(kind, pp, vpp);
}
// The model chunks each pipeline rank holds: vpp, or 2 under zb-v and dualpipev.
int64_t model_chunks(const Layout& layout);
// Where the virtual stages live: the V for zb-v and dualpipev (rank r holds stages r and
// 2p-1-r), else looped (stage chunk * pp + rank).
pipeline::ChunkLayout chunk_layout_of(const Layout& layout);
// The pipeline rank that holds the last virtual stage (final norm, output layer, loss):
// pp - 1 looped, 0 in a V. The embedding (virtual stage 0) is always on rank 0.
int64_t head_rank(const Layout& layout);

// Checks the layout against the model, the GPU count and the global batch; fails naming the
// constraint (e.g. TP*PP*DP != GPUs, heads not divisible by TP, batch not divisible by mb*DP,
// the sequence not divisible by 2*CP, a2a's heads per TP rank not divisible by CP; with
// experts: EP not dividing TP*CP*DP or the experts, EP*ETP not dividing TP*CP*DP, ETP not
// dividing the expert FFN size, ZeRO-3; EP or ETP > 1 for a dense model; schedule_error).
void validate_layout(const ModelSpec& model, const Layout& layout, int64_t num_gpus, int64_t global_batch);
// The same checks, returning the first failure's message instead of throwing ("" when valid).
std::string layout_error(const ModelSpec& model, const Layout& layout, int64_t num_gpus, int64_t global_batch);

// ---- parameters (exact counts, as megatorch's GPTModel builds them)

int64_t padded_vocab(const ModelSpec& m, int64_t tp);
// One dense transformer layer, unsharded.
int64_t layer_params(const ModelSpec& m);
// One TP rank's share of one dense layer: column-parallel weights and biases and
// row-parallel weights divided by tp, row-parallel biases and norms whole.
int64_t layer_params_per_tp_rank(const ModelSpec& m, int64_t tp);
// One TP rank's share of one MoE layer without its experts: the attention and norms as in
// a dense layer, the router [E, h] whole (replicated over TP), the shared expert as a TP MLP.
int64_t moe_layer_dense_params_per_tp_rank(const ModelSpec& m, int64_t tp);
// The whole model (tp = 1, one copy of a tied embedding, every expert once): the count
// TrainingLoop::num_parameters() reports.
int64_t total_params(const ModelSpec& m);
// What pipeline rank `pp_rank` of tp*pp holds on one TP rank: its layers (layers are split
// evenly: virtual stage s holds layers [s*L/(pp*v), (s+1)*L/(pp*v)), s = chunk * pp + rank,
// or in a V (zb-v, dualpipev: v = 2) rank r holds stages r and 2pp-1-r), the embedding
// (+ learned positions) on rank 0 (virtual stage 0), the final norm and the output head on
// head_rank (the last virtual stage: the last rank, or rank 0 in a V; a copy of the tied
// embedding when pp > 1, as PipelineStage builds it). With experts: every expert of its MoE
// layers (EP 1) at one virtual chunk per rank.
int64_t params_per_rank(const ModelSpec& m, int64_t tp, int64_t pp, int64_t pp_rank);
// The same under a layout: the dense parameters (what the DP x CP optimizer holds) plus the
// experts (num_experts / ep per MoE layer of the rank's chunks, each its 1/etp shard: what
// the expert-DP optimizer holds; moe.h). Equal to the 4-argument form for dense models.
int64_t params_per_rank(const ModelSpec& m, const Layout& layout, int64_t pp_rank);
int64_t dense_params_per_rank(const ModelSpec& m, const Layout& layout, int64_t pp_rank);

// docs/reference.md (Narayanan et al. 2021): 12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h)).
double narayanan_params(const ModelSpec& m);
// FLOPs of one iteration over global_batch sequences, the docs/reference.md count: the GEMMs of
// forward and backward, plus a second forward with full recompute (96 B s L h^2 (1 + s/(6h)
// + V/(16 L h)) for the GPT of Table 1), plus the attention core again with selective
// recompute. Generalised to GQA and SwiGLU by counting each GEMM, and to MoE layers by
// their router, shared expert and k routed experts per token (the active parameters).
double flops_per_iteration(const ModelSpec& m, int64_t global_batch, Recompute recompute);
// Forward FLOPs of one transformer layer for `micro_batch` sequences, split as GEMMs with the
// weights, the attention core (Q K^T and P V) and, in an MoE layer, the routed experts' GEMMs
// (k experts per token; the router and the shared expert are in `weights`).
struct LayerFlops {
  double weights = 0;
  double attention = 0;
  double experts = 0;
  double total() const { return weights + attention + experts; }
};
LayerFlops layer_forward_flops(const ModelSpec& m, int64_t micro_batch);      // a dense layer
LayerFlops moe_layer_forward_flops(const ModelSpec& m, int64_t micro_batch);  // an MoE layer
// Forward FLOPs of the output head (logits) for `micro_batch` sequences.
double head_forward_flops(const ModelSpec& m, int64_t micro_batch);

// ---- context parallelism: the sequence split (the same on every layer)

// A sequence of S tokens is cut into 2c chunks of S/(2c); CP rank r holds chunks r and
// 2c-1-r so that under the causal mask every rank has the same attention work.
struct CpShare {
  int64_t tokens = 0;        // S / c per rank
  int64_t chunk_tokens = 0;  // S / (2c)
  int64_t num_chunks = 0;    // 2c
};
CpShare cp_share(const ModelSpec& m, int64_t cp);  // fails unless S is divisible by 2c (c > 1)

}  // namespace megatorch::plan
