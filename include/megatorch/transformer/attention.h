#pragma once
// ParallelAttention: QKV column-parallel, split by heads (each TP rank holds
// heads/tp query heads and groups/tp key/value heads, MHA or GQA), causal
// scaled-dot-product attention (bidirectional with config.causal_attention false)
// through at::scaled_dot_product_attention (flash attention on GPUs), RoPE optional
// (kernels::rotary_embedding with config.fused_kernels), output projection row-parallel.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <memory>

#include "megatorch/inference/kv_cache.h"
#include "megatorch/tp/column_parallel_linear.h"
#include "megatorch/tp/rng_tracker.h"
#include "megatorch/tp/row_parallel_linear.h"
#include "megatorch/transformer/config.h"
#include "megatorch/transformer/norm.h"
#include "megatorch/transformer/packed_sequence.h"

namespace megatorch::transformer {

// RoPE tables for positions [0, s): [s, 1, 1, d] angles (rotate-half convention), default
// RoPE over the whole head; and the config's (rotary_dim channels, its rope_scaling; rope.h).
at::Tensor rope_frequencies(int64_t seq_length, int64_t head_dim, double base, c10::Device device);
at::Tensor rope_frequencies(int64_t seq_length, const TransformerConfig& config, c10::Device device);
// x [s, b, heads, d] rotated by freqs [s, 1, 1, r], r <= d (the first r channels);
// unfused, the reference of kernels::rotary_embedding.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& freqs);

struct ParallelAttentionOptions {
  explicit ParallelAttentionOptions(TransformerConfig config) : config_(std::move(config)) {}
  TORCH_ARG(TransformerConfig, config);
  TORCH_ARG(std::string, group) = "";
  TORCH_ARG(std::string, name) = "attention";  // seeds the weights
  TORCH_ARG(int64_t, layer_number) = 0;  // global index: the layer's window (config.attention_window)
  TORCH_ARG(std::shared_ptr<tp::RngTracker>, rng) = nullptr;
};

class ParallelAttentionImpl : public torch::nn::Cloneable<ParallelAttentionImpl> {
 public:
  explicit ParallelAttentionImpl(ParallelAttentionOptions options);
  void reset() override;
  // x [s, b, h] ([s/tp, b, h] with sequence parallelism) -> same shape. rope_freqs: the
  // positions' angles, [s, 1, 1, r] or per row [s, b, 1, r] (packed documents' positions);
  // documents: each row's packed documents, attention staying inside them (null: none).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& rope_freqs = {}, const Documents& documents = nullptr);
  // forward without proj's bias, which the caller adds (TransformerLayer fuses it into
  // bias-dropout-add): forward(x) = forward_without_bias(x) + proj->bias.
  at::Tensor forward_without_bias(const at::Tensor& x, const at::Tensor& rope_freqs = {},
                                  const Documents& documents = nullptr);
  // softmax(QK^T/sqrt(d)) V for q [s, b, heads, d], k/v [s, b, groups, d] -> [s, b, heads*d];
  // the part selective recomputation replays.
  at::Tensor core_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const Documents& documents = nullptr);
  // Inference with a KV cache (csrc/transformer/cached_attention.cpp): x [s, b, h] holds
  // the s tokens after the cache's `length`, rope_freqs their positions' angles [s, 1, 1, r]
  // (undefined without RoPE). Their keys and values are appended to `cache` and their
  // queries attend over the whole cache, causally. Without proj's bias, like
  // forward_without_bias. Eval mode, no sequence parallelism, causal attention.
  at::Tensor forward_cached_without_bias(const at::Tensor& x, const at::Tensor& rope_freqs, inference::KVCache& cache);

  ParallelAttentionOptions options;
  tp::ColumnParallelLinear qkv{nullptr};
  tp::RowParallelLinear proj{nullptr};
  Norm q_norm{nullptr}, k_norm{nullptr};  // with config.qk_layernorm: over head_dim, shared by the heads
  int64_t local_heads = 0, local_groups = 0;
  int64_t window = 0;  // this layer's sliding window (0: the whole causal prefix)

 private:
  at::Tensor context(const at::Tensor& x, const at::Tensor& rope_freqs, const Documents& documents);  // proj's input
  // The fused QKV output [s, b, groups*(per_group+2)*d] as q [s, b, heads, d] and k, v
  // [s, b, groups, d]: one split, whose backward is one cat (views taken one by one
  // would each zero-fill a full-size gradient and add them).
  std::array<at::Tensor, 3> split_qkv(const at::Tensor& mixed) const;
  // q or k [s, b, heads, d] rotated by the angles [s, 1, 1, r], then scaled on the rotated
  // channels by YaRN's attention factor (1 for the other types).
  at::Tensor rotate(const at::Tensor& x, const at::Tensor& rope_freqs) const;
  // q and k of the fused QKV output, QK-normed and rotated (the query/key part of both paths).
  std::array<at::Tensor, 3> project_qkv(const at::Tensor& x, const at::Tensor& rope_freqs);
  // QK-norm of q or k [s, b, heads, d]. Each TP rank normalises other heads with the same
  // weight, so the weight's gradient is a partial sum: it enters through copy_to_tp_region.
  at::Tensor norm_heads(Norm& norm, const at::Tensor& x) const;
  double rope_scale_ = 1.0;
};
TORCH_MODULE(ParallelAttention);

}  // namespace megatorch::transformer
