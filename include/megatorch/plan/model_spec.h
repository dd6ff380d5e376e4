#pragma once
// What the planner knows about a model and a layout: the model's shape (from Megatron-style
// flags, a preset or a TransformerConfig), the parallel layout of one training run, and the
// exact parameter counts and FLOPs those imply. Plain numbers, no tensors.
#include <cstdint>
#include <string>
#include <vector>

#include "megatorch/transformer/config.h"

namespace megatorch::plan {

using transformer::Recompute;

struct ModelSpec {
  std::string name = "custom";
  int64_t num_layers = 24;
  int64_t hidden_size = 2048;
  int64_t num_attention_heads = 16;
  int64_t num_query_groups = 0;  // 0: MHA
  int64_t ffn_hidden_size = 0;   // 0: 4h (GeLU) or Llama's 8h/3 rounded to 64 (SwiGLU)
  int64_t vocab_size = 51200;
  int64_t make_vocab_size_divisible_by = 128;
  int64_t seq_length = 2048;
  bool swiglu = false;
  bool rms_norm = false;
  bool learned_positions = true;
  bool add_bias_linear = true;
  bool add_qkv_bias = false;  // QKV biases without the other biases (Qwen2)
  bool tie_embeddings = true;

  int64_t query_groups() const { return num_query_groups > 0 ? num_query_groups : num_attention_heads; }
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t ffn() const;
  void validate() const;  // positive sizes, heads divide hidden, groups divide heads
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

// One parallel layout of a training run on tp * pp * dp GPUs.
struct Layout {
  int64_t tp = 1, pp = 1, dp = 1;
  int64_t vpp = 1;  // virtual pipeline chunks per stage (interleaved 1F1B when > 1)
  int zero_stage = 0;
  int64_t micro_batch = 1;
  Recompute recompute = Recompute::kNone;
  bool sequence_parallel = false;

  int64_t gpus() const { return tp * pp * dp; }
  // Micro-batches per step of one pipeline: global_batch / (micro_batch * dp).
  int64_t num_microbatches(int64_t global_batch) const { return global_batch / (micro_batch * dp); }
  std::string str() const;  // "TP=8 PP=8 DP=24 VP=2 ZeRO-1 mb=1 recompute=full SP"
};

// Checks the layout against the model, the GPU count and the global batch; fails naming the
// constraint (e.g. TP*PP*DP != GPUs, heads not divisible by TP, batch not divisible by mb*DP).
void validate_layout(const ModelSpec& model, const Layout& layout, int64_t num_gpus, int64_t global_batch);
// The same checks, returning the first failure's message instead of throwing ("" when valid).
std::string layout_error(const ModelSpec& model, const Layout& layout, int64_t num_gpus, int64_t global_batch);

// ---- parameters (exact counts, as megatorch's GPTModel builds them)

int64_t padded_vocab(const ModelSpec& m, int64_t tp);
// One transformer layer, unsharded.
int64_t layer_params(const ModelSpec& m);
// One TP rank's share of one layer: column-parallel weights and biases and row-parallel
// weights divided by tp, row-parallel biases and norms whole.
int64_t layer_params_per_tp_rank(const ModelSpec& m, int64_t tp);
// The whole model (tp = 1, one copy of a tied embedding).
int64_t total_params(const ModelSpec& m);
// What pipeline rank `pp_rank` of tp*pp holds on one TP rank: its layers (layers are split
// evenly: virtual stage s = chunk * pp + rank holds layers [s*L/(pp*v), (s+1)*L/(pp*v))),
// the embedding (+ learned positions) on rank 0, the final norm and the output head on the
// last rank (a copy of the tied embedding when pp > 1, as GPTModel does).
int64_t params_per_rank(const ModelSpec& m, int64_t tp, int64_t pp, int64_t pp_rank);

// docs/reference.md (Narayanan et al. 2021): 12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h)).
double narayanan_params(const ModelSpec& m);
// FLOPs of one iteration over global_batch sequences, the docs/reference.md count: the GEMMs of
// forward and backward, plus a second forward with full recompute (96 B s L h^2 (1 + s/(6h)
// + V/(16 L h)) for the GPT of Table 1), plus the attention core again with selective
// recompute. Generalised to GQA and SwiGLU by counting each GEMM.
double flops_per_iteration(const ModelSpec& m, int64_t global_batch, Recompute recompute);
// Forward FLOPs of one transformer layer for `micro_batch` sequences, split as GEMMs with the
// weights and the attention core (Q K^T and P V).
struct LayerFlops {
  double weights = 0;
  double attention = 0;
  double total() const { return weights + attention; }
};
LayerFlops layer_forward_flops(const ModelSpec& m, int64_t micro_batch);
// Forward FLOPs of the output head (logits) for `micro_batch` sequences.
double head_forward_flops(const ModelSpec& m, int64_t micro_batch);

}  // namespace megatorch::plan
