#pragma once
// TransformerConfig: the one description of a GPT-style model, passed down to every
// layer (Megatron-core's TransformerConfig). validate() checks it against a TP size.
#include <torch/arg.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

#include "megatorch/tp/init.h"
#include "megatorch/transformer/context_parallel.h"

namespace megatorch::transformer {

enum class Normalization { kLayerNorm, kRMSNorm };
enum class Activation { kGeluTanh, kSwiGLU };
enum class Positions { kLearned, kRope };
enum class Recompute { kNone, kSelective, kFull };

struct TransformerConfig {
  TORCH_ARG(int64_t, hidden_size) = 64;
  TORCH_ARG(int64_t, num_attention_heads) = 4;
  // Key/value heads (GQA); 0 means num_attention_heads (MHA). Must be divisible by tp.
  TORCH_ARG(int64_t, num_query_groups) = 0;
  // 0 means 4 * hidden_size (GeLU) or Llama's 8/3 * hidden rounded to 64 (SwiGLU).
  TORCH_ARG(int64_t, ffn_hidden_size) = 0;
  TORCH_ARG(int64_t, num_layers) = 2;
  TORCH_ARG(int64_t, seq_length) = 32;
  // Learned positions cover this many tokens; 0 means seq_length.
  TORCH_ARG(int64_t, max_position_embeddings) = 0;
  TORCH_ARG(int64_t, vocab_size) = 256;
  TORCH_ARG(int64_t, make_vocab_size_divisible_by) = 128;
  TORCH_ARG(Normalization, normalization) = Normalization::kLayerNorm;
  TORCH_ARG(double, norm_epsilon) = 1e-5;
  TORCH_ARG(Activation, activation) = Activation::kGeluTanh;
  TORCH_ARG(Positions, position_embedding_type) = Positions::kLearned;
  TORCH_ARG(double, rotary_base) = 10000.0;
  TORCH_ARG(double, attention_dropout) = 0.0;
  TORCH_ARG(double, hidden_dropout) = 0.0;
  // Biases on the linear layers (and LayerNorm's beta).
  TORCH_ARG(bool, add_bias_linear) = true;
  // Biases on the QKV projection even when add_bias_linear is false (Qwen2; Megatron-core's
  // add_qkv_bias). Changes the parameter shapes, so checkpoints record it.
  TORCH_ARG(bool, add_qkv_bias) = false;
  TORCH_ARG(bool, tie_embeddings) = true;
  // Sliding-window attention span in tokens (Mistral); 0: none. Attention here always covers
  // the whole causal prefix, which equals a window >= seq_length, so validate() refuses a
  // shorter window rather than silently attending further than the model was trained to.
  TORCH_ARG(int64_t, sliding_window) = 0;
  // Each token attends to those before it (a decoder); false gives bidirectional attention,
  // e.g. a BERT encoder. KV-cache inference and the HuggingFace export need causal.
  TORCH_ARG(bool, causal_attention) = true;
  // Split norm/dropout regions along the sequence across the TP group (Korthikanti).
  TORCH_ARG(bool, sequence_parallel) = false;
  // Context parallelism (context_parallel.h): the CP group's registered name ("" for
  // none) and how attention crosses it. Each rank then holds seq_length / cp tokens of
  // every sequence (chunks r and 2c-1-r), positions and attention included. A layout,
  // not a property of the weights: checkpoints do not record it.
  TORCH_ARG(std::string, context_parallel_group) = "";
  TORCH_ARG(CpCommType, cp_comm_type) = CpCommType::kP2P;
  TORCH_ARG(Recompute, recompute) = Recompute::kNone;
  TORCH_ARG(c10::ScalarType, params_dtype) = c10::kFloat;
  TORCH_ARG(c10::Device, device) = c10::kCPU;
  TORCH_ARG(double, init_std) = 0.02;
  TORCH_ARG(int64_t, seed) = 1234;
  // Draw each shard on its own (no full tensor) instead of slicing the full weight.
  TORCH_ARG(bool, shard_local_init) = false;
  // megatorch's fused kernels (megatorch::kernels) for the norms, bias-GeLU, SwiGLU,
  // bias-dropout-add, RoPE and the loss's local part; off: the unfused ATen chains.
  // Same numbers either way (fp32: to summation order; the dropout masks are equal).
  TORCH_ARG(bool, fused_kernels) = true;

  // TORCH_ARG leaves the struct in `private:`.
 public:
  int64_t query_groups() const { return num_query_groups_ > 0 ? num_query_groups_ : num_attention_heads_; }
  int64_t head_dim() const { return hidden_size_ / num_attention_heads_; }
  int64_t ffn() const;
  int64_t max_positions() const { return max_position_embeddings_ > 0 ? max_position_embeddings_ : seq_length_; }

  // Every constraint against a TP (and CP) size, failing with what was expected and given.
  void validate(int64_t tp_size, int64_t cp_size = 1) const;
  // The constraints context parallelism adds (a no-op for cp 1).
  void validate_context_parallel(int64_t tp_size, int64_t cp_size) const;
};

// How a parameter named `name` of this model is initialised (seed, std, dtype, device).
tp::ParamInitOptions param_init(const TransformerConfig& config, const std::string& name);

const char* to_string(Normalization n);
const char* to_string(Activation a);
const char* to_string(Positions p);
const char* to_string(Recompute r);
// The inverses of to_string (Megatron's strings), failing with the valid names.
Normalization parse_normalization(const std::string& s);  // "LayerNorm" | "RMSNorm"
Activation parse_activation(const std::string& s);        // "gelu_tanh" | "swiglu"
Positions parse_positions(const std::string& s);          // "learned_absolute" | "rope"
Recompute parse_recompute(const std::string& s);          // "none" | "selective" | "full"

}  // namespace megatorch::transformer
