#pragma once
// TransformerConfig: the one description of a GPT-style model, passed down to every
// layer (Megatron-core's TransformerConfig). validate() checks it against a TP size.
#include <torch/arg.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

#include "megatorch/fp8/recipe.h"
#include "megatorch/tp/init.h"
#include "megatorch/transformer/context_parallel.h"
#include "megatorch/transformer/rope.h"

namespace megatorch::transformer {

enum class Normalization { kLayerNorm, kRMSNorm };
enum class Activation { kGeluTanh, kSwiGLU };
enum class Positions { kLearned, kRope };
enum class Recompute { kNone, kSelective, kFull };
// Mixture of experts (moe/moe_layer.h): how the router scores experts, and how tokens
// reach the expert-parallel ranks that hold their experts.
enum class RouterScore { kSoftmax, kSigmoid };
enum class TokenDispatcher { kAllToAll, kAllGather };

struct TransformerConfig {
  TORCH_ARG(int64_t, hidden_size) = 64;
  TORCH_ARG(int64_t, num_attention_heads) = 4;
  // Key/value heads (GQA); 0 means num_attention_heads (MHA). Must be divisible by tp.
  TORCH_ARG(int64_t, num_query_groups) = 0;
  // Each head's channels (Megatron's --kv-channels, HF's head_dim); 0: hidden_size / heads.
  // Qwen3 and Gemma use heads x head_dim != hidden_size.
  TORCH_ARG(int64_t, kv_channels) = 0;
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
  // RoPE over the first rotary_percent of each head's channels (HF's partial_rotary_factor,
  // Megatron's --rotary-percent), with a context-extension scheme (rope.h). Both change
  // what the weights mean, so checkpoints record them.
  TORCH_ARG(double, rotary_percent) = 1.0;
  TORCH_ARG(RopeScaling, rope_scaling) = {};
  TORCH_ARG(double, attention_dropout) = 0.0;
  TORCH_ARG(double, hidden_dropout) = 0.0;
  // Biases on the linear layers (and LayerNorm's beta).
  TORCH_ARG(bool, add_bias_linear) = true;
  // Biases on the QKV projection even when add_bias_linear is false (Qwen2; Megatron-core's
  // add_qkv_bias). Changes the parameter shapes, so checkpoints record it.
  TORCH_ARG(bool, add_qkv_bias) = false;
  // Biases on q, k, v and the output projection (HF Llama's attention_bias), and on the MLP's
  // linears (mlp_bias; the experts' too) when add_bias_linear is false. Shapes: recorded.
  TORCH_ARG(bool, add_attention_bias) = false;
  TORCH_ARG(bool, add_mlp_bias) = false;
  // Norm of each query and key head over its head_dim before RoPE, one weight shared by the
  // heads (Qwen3, OLMo 2; Megatron's --qk-layernorm), of the config's normalization.
  TORCH_ARG(bool, qk_layernorm) = false;
  TORCH_ARG(bool, tie_embeddings) = true;
  // Sliding-window attention (Mistral, Qwen2, Gemma): a query at position i sees keys j with
  // i - sliding_window < j <= i; 0: none. layer_types names each layer's kind as HF's
  // config.json does, "sliding_attention" or "full_attention" (empty: every layer slides
  // when sliding_window > 0). Not shapes, but what the weights compute: recorded.
  TORCH_ARG(int64_t, sliding_window) = 0;
  TORCH_ARG(std::vector<std::string>, layer_types) = {};
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
  // Mixture of experts (Megatron-core's flag names; moe/moe_layer.h). 0 experts: a dense
  // model. Layer i (0-based) is an MoE layer when i % moe_layer_freq == 0 and i >=
  // moe_first_k_dense (DeepSeek's first_k_dense_replace).
  TORCH_ARG(int64_t, num_experts) = 0;
  TORCH_ARG(int64_t, moe_router_topk) = 2;
  TORCH_ARG(int64_t, moe_ffn_hidden_size) = 0;  // per expert; 0: ffn()
  TORCH_ARG(int64_t, moe_layer_freq) = 1;
  TORCH_ARG(int64_t, moe_first_k_dense) = 0;
  // Shared experts (DeepSeek, Qwen2-MoE): one dense MLP of this width every token passes
  // through, added to the routed experts' output; 0: none.
  TORCH_ARG(int64_t, moe_shared_expert_intermediate_size) = 0;
  // softmax: top-k of the logits, then a softmax over the k (Megatron's default), or with
  // pre_softmax the top-k of the softmax over all experts (Mixtral); sigmoid: DeepSeek-V3.
  TORCH_ARG(RouterScore, moe_router_score_function) = RouterScore::kSoftmax;
  TORCH_ARG(bool, moe_router_pre_softmax) = false;
  // Renormalise the k weights to sum to 1 (HF's norm_topk_prob), then scale them.
  TORCH_ARG(bool, moe_router_norm_topk_prob) = false;
  TORCH_ARG(double, moe_router_topk_scaling_factor) = 1.0;
  // Load balancing: Switch's auxiliary loss alpha * E * sum_i f_i * P_i, the router z-loss
  // beta * mean(logsumexp(logits)^2), and DeepSeek-V3's selection-only expert bias moved
  // by rate * sign(mean load - load) after each step.
  TORCH_ARG(double, moe_aux_loss_coeff) = 0.0;
  TORCH_ARG(double, moe_z_loss_coeff) = 0.0;
  TORCH_ARG(bool, moe_router_enable_expert_bias) = false;
  TORCH_ARG(double, moe_router_bias_update_rate) = 1e-3;
  // Capacity: <= 0 is dropless; else each expert takes at most ceil(T * k * cf / E) of a
  // rank's T tokens, dropping the lowest-probability ones, and with pad_to_capacity
  // exactly that many (zero-weight fillers), so every shape is static.
  TORCH_ARG(double, moe_expert_capacity_factor) = 0.0;
  TORCH_ARG(bool, moe_pad_expert_input_to_capacity) = false;
  TORCH_ARG(TokenDispatcher, moe_token_dispatcher_type) = TokenDispatcher::kAllToAll;
  // One grouped GEMM over every local expert (at::_grouped_mm); off: a GEMM per expert,
  // for comparison.
  TORCH_ARG(bool, moe_grouped_gemm) = true;
  // The expert-parallel group's registered name ("" for none: every expert on every rank).
  // A layout, not a property of the weights: checkpoints do not record it.
  TORCH_ARG(std::string, expert_parallel_group) = "";
  // The expert-tensor-parallel group's name ("" for none: each expert whole on its rank).
  TORCH_ARG(std::string, expert_tensor_parallel_group) = "";
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
  // Run the layer stack's forward and backward in training as captured CUDA graphs
  // (transformer/cuda_graph.h; Megatron's enable_cuda_graph). Where it cannot (not CUDA,
  // collectives between layers, dropout, recomputation, ZeRO-3) the layers run eagerly and
  // the model says why once. The same numbers either way.
  TORCH_ARG(bool, cuda_graph) = false;
  // FP8 GEMMs in the attention and MLP linear layers (fp8/recipe.h; Megatron's --fp8-format
  // and friends): format kNone keeps them in params_dtype. The first and last layers given
  // here keep bf16 GEMMs (Megatron's --first-last-layers-bf16 with
  // --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16): they see the embedding's
  // and the loss's least regular values.
  TORCH_ARG(fp8::Fp8Options, fp8) = {};
  TORCH_ARG(int64_t, num_layers_at_start_in_bf16) = 0;
  TORCH_ARG(int64_t, num_layers_at_end_in_bf16) = 0;

  // TORCH_ARG leaves the struct in `private:`.
 public:
  int64_t query_groups() const { return num_query_groups_ > 0 ? num_query_groups_ : num_attention_heads_; }
  int64_t head_dim() const { return kv_channels_ > 0 ? kv_channels_ : hidden_size_ / num_attention_heads_; }
  int64_t ffn() const;
  int64_t moe_ffn() const { return moe_ffn_hidden_size_ > 0 ? moe_ffn_hidden_size_ : ffn(); }
  bool is_moe_layer(int64_t layer) const {
    return num_experts_ > 0 && layer >= moe_first_k_dense_ && layer % moe_layer_freq_ == 0;
  }
  // Whether layer `layer` (global, 0-based) runs its GEMMs in FP8.
  bool fp8_layer(int64_t layer) const {
    return fp8_.enabled() && layer >= num_layers_at_start_in_bf16_ && layer < num_layers_ - num_layers_at_end_in_bf16_;
  }
  // The channels RoPE rotates: int(head_dim · rotary_percent), as HF rounds it.
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim()) * rotary_percent_); }
  int64_t max_positions() const { return max_position_embeddings_ > 0 ? max_position_embeddings_ : seq_length_; }
  // Which linears carry biases: Megatron's add_bias_linear (all), plus Qwen2's QKV-only and
  // HF Llama's attention / MLP ones.
  bool qkv_bias() const { return add_bias_linear_ || add_qkv_bias_ || add_attention_bias_; }
  bool proj_bias() const { return add_bias_linear_ || add_attention_bias_; }
  bool mlp_bias() const { return add_bias_linear_ || add_mlp_bias_; }
  // Layer `layer`'s (global, 0-based) attention window in tokens; 0: the whole causal prefix.
  int64_t attention_window(int64_t layer) const;

  // Every constraint against a TP (and CP, EP, expert-TP) size, failing with what was
  // expected and given.
  void validate(int64_t tp_size, int64_t cp_size = 1, int64_t ep_size = 1, int64_t etp_size = 1) const;
  // The constraints context parallelism adds (a no-op for cp 1).
  void validate_context_parallel(int64_t tp_size, int64_t cp_size) const;
  // The constraints mixture of experts adds (a no-op without experts).
  void validate_moe(int64_t tp_size, int64_t ep_size, int64_t etp_size = 1) const;
};

// How a parameter named `name` of this model is initialised (seed, std, dtype, device).
tp::ParamInitOptions param_init(const TransformerConfig& config, const std::string& name);

const char* to_string(Normalization n);
const char* to_string(Activation a);
const char* to_string(Positions p);
const char* to_string(Recompute r);
const char* to_string(RouterScore s);
const char* to_string(TokenDispatcher d);
// The inverses of to_string (Megatron's strings), failing with the valid names.
Normalization parse_normalization(const std::string& s);  // "LayerNorm" | "RMSNorm"
Activation parse_activation(const std::string& s);        // "gelu_tanh" | "swiglu"
Positions parse_positions(const std::string& s);          // "learned_absolute" | "rope"
Recompute parse_recompute(const std::string& s);          // "none" | "selective" | "full"
RouterScore parse_router_score(const std::string& s);     // "softmax" | "sigmoid"
TokenDispatcher parse_token_dispatcher(const std::string& s);  // "alltoall" | "allgather"

}  // namespace megatorch::transformer
