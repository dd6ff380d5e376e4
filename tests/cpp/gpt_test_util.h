#pragma once
// Shared by the GPT tests: small configurations, a batch, how a TP shard of each
// parameter relates to the TP=1 tensor, and a stage's gradients against the one-rank model's.
#include <catch2/catch.hpp>
#include <megatorch/megatorch.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace gpt_test {

using megatorch::transformer::Activation;
using megatorch::transformer::Normalization;
using megatorch::transformer::Positions;
using megatorch::transformer::TransformerConfig;

struct Variant {
  std::string name;
  TransformerConfig config;
};

inline TransformerConfig base_config() {
  return TransformerConfig()
      .hidden_size(32)
      .num_attention_heads(4)
      .num_layers(2)
      .seq_length(8)
      .vocab_size(200)  // padded to 256 at tp 1 and 2, to 512 at tp 4
      .seed(7);
}

// MHA/GQA x learned/RoPE x GeLU/SwiGLU x LayerNorm/RMSNorm, covered in three variants; the
// fourth is today's open models' attention (Qwen3-like QK-norm, heads x kv_channels !=
// hidden, Llama's attention and MLP biases without the others, a window on layer 1 only).
inline std::vector<Variant> variants() {
  return {
      {"mha-learned-gelu-layernorm", base_config()},
      {"gqa-rope-swiglu-rmsnorm", base_config()
                                      .num_attention_heads(8)
                                      .num_query_groups(4)
                                      .position_embedding_type(Positions::kRope)
                                      .activation(Activation::kSwiGLU)
                                      .normalization(Normalization::kRMSNorm)
                                      .add_bias_linear(false)},
      {"mha-learned-gelu-untied", base_config().tie_embeddings(false).ffn_hidden_size(48)},
      {"qknorm-kvchannels-biases-window", base_config()
                                              .num_attention_heads(8)
                                              .num_query_groups(4)
                                              .kv_channels(8)
                                              .position_embedding_type(Positions::kRope)
                                              .activation(Activation::kSwiGLU)
                                              .normalization(Normalization::kRMSNorm)
                                              .add_bias_linear(false)
                                              .add_attention_bias(true)
                                              .add_mlp_bias(true)
                                              .qk_layernorm(true)
                                              .sliding_window(3)
                                              .layer_types({"full_attention", "sliding_attention"})},
  };
}

// The config with n layers, its layer_types (if any) repeated over them.
inline TransformerConfig with_layers(TransformerConfig c, int64_t n) {
  std::vector<std::string> types;
  for (int64_t i = 0; i < n && !c.layer_types().empty(); ++i) types.push_back(c.layer_types()[i % c.layer_types().size()]);
  c.num_layers(n).layer_types(types);
  return c;
}

inline torch::Tensor batch_ids(int64_t b, int64_t s, int64_t vocab, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randint(vocab, {b, s + 1}, gen, at::TensorOptions().dtype(at::kLong));
}

// (partition dim, parts) of a GPT parameter by its name; dim -1: replicated.
inline std::pair<int64_t, int64_t> partition_of(const std::string& name, const TransformerConfig& c) {
  auto ends = [&name](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  const int64_t glu = c.activation() == Activation::kSwiGLU ? 2 : 1;
  if (ends("qkv.weight") || ends("qkv.bias")) return {0, 1};
  if (ends("fc1.weight") || ends("fc1.bias")) return {0, glu};  // SwiGLU's bias: [gate; up] too
  if (ends("proj.weight") || ends("fc2.weight")) return {1, 1};
  if (ends("embedding.weight") || name == "output_layer") return {0, 1};  // vocab rows
  return {-1, 1};
}

// The rank's slice of a TP=1 tensor (vocab rows: only the real, unpadded ones compared).
inline torch::Tensor expected_shard(const std::string& name, const torch::Tensor& full, const torch::Tensor& shard,
                                    int64_t rank, int64_t world, const TransformerConfig& c) {
  const auto [dim, parts] = partition_of(name, c);
  if (dim < 0) return full;
  if (name.find("embedding.weight") != std::string::npos || name == "output_layer") {
    const int64_t rows = shard.size(0), start = rank * rows;
    const int64_t real = std::max<int64_t>(0, std::min(rows, c.vocab_size() - start));
    auto out = torch::zeros_like(shard);
    if (real > 0) out.narrow(0, 0, real).copy_(full.narrow(0, start, real));
    return out;
  }
  megatorch::tp::ShardSpec spec{full.sizes().vec(), dim, rank, world, parts};
  return megatorch::tp::slice_for_rank(full, spec);
}

// For every parameter of the stage's chunks: check(local name, global name, the parameter,
// the part of the one-rank model `full`'s gradient it should hold). Both have gradients.
template <typename Check>
void for_each_stage_gradient(megatorch::pipeline::PipelineStage& stage, megatorch::models::GPTModel& full,
                             const TransformerConfig& c, int64_t tp_rank, int64_t tp_size, Check&& check) {
  auto full_params = full->named_parameters();
  for (int64_t k = 0; k < stage->num_chunks(); ++k) {
    auto chunk = stage->chunk(k);
    for (const auto& p : chunk->named_parameters()) {
      const std::string name =
          megatorch::ckpt::gpt_global_name(p.key(), chunk->options.layer_begin(), c.tie_embeddings());
      REQUIRE(full_params.contains(name));
      REQUIRE(p.value().grad().defined());
      check(p.key(), name, p.value(), expected_shard(name, full_params[name].grad(), p.value(), tp_rank, tp_size, c));
    }
  }
}

}  // namespace gpt_test
