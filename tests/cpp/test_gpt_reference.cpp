// GPTModel at TP=1 against an independent plain-LibTorch implementation of the same
// architecture written here (batch-first layout, explicit softmax attention, manual
// norms, GeLU, RoPE, QK-norm, sliding windows and cross entropy), sharing only the weights:
// loss and every gradient to 1e-5 relative in fp32.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cmath>

#include "gpt_test_util.h"
#include "tolerance.h"

using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using namespace gpt_test;

namespace {

torch::Tensor norm(const torch::Tensor& x, const TransformerConfig& c, torch::OrderedDict<std::string, torch::Tensor>& P,
                   const std::string& prefix) {
  const auto w = P[prefix + ".weight"];
  if (c.normalization() == Normalization::kRMSNorm) return x / torch::sqrt(x.pow(2).mean(-1, true) + c.norm_epsilon()) * w;
  const auto mean = x.mean(-1, true), var = (x - mean).pow(2).mean(-1, true);
  auto y = (x - mean) / torch::sqrt(var + c.norm_epsilon()) * w;
  return P.contains(prefix + ".bias") ? y + P[prefix + ".bias"] : y;
}

torch::Tensor linear(const torch::Tensor& x, torch::OrderedDict<std::string, torch::Tensor>& P, const std::string& p) {
  auto y = x.matmul(P[p + ".weight"].t());
  return P.contains(p + ".bias") ? y + P[p + ".bias"] : y;
}

torch::Tensor rope(const torch::Tensor& x, double base) {  // x [b, s, heads, d]
  const int64_t s = x.size(1), d = x.size(3);
  auto inv = torch::pow(base, -torch::arange(0, d, 2, torch::kDouble) / d);
  auto ang = torch::arange(s, torch::kDouble).unsqueeze(1) * inv.unsqueeze(0);  // [s, d/2]
  auto cos = ang.cos().to(torch::kFloat).view({1, s, 1, d / 2}), sin = ang.sin().to(torch::kFloat).view({1, s, 1, d / 2});
  auto x1 = x.narrow(3, 0, d / 2), x2 = x.narrow(3, d / 2, d / 2);
  return torch::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, 3);
}

torch::Tensor reference_loss(GPTModel& model, const TransformerConfig& c, const torch::Tensor& ids,
                             const torch::Tensor& labels) {
  auto P = model->named_parameters();
  const int64_t b = ids.size(0), s = ids.size(1), h = c.hidden_size(), heads = c.num_attention_heads();
  const int64_t groups = c.query_groups(), d = c.head_dim(), per = heads / groups, V = c.vocab_size();
  auto x = P["embedding.weight"].index_select(0, ids.reshape(-1)).view({b, s, h});
  if (c.position_embedding_type() == Positions::kLearned) x = x + P["position_embedding"].narrow(0, 0, s);
  const auto causal = torch::ones({s, s}, torch::kBool).triu(1);
  const auto distance = torch::arange(s).unsqueeze(1) - torch::arange(s).unsqueeze(0);  // query - key
  for (int64_t i = 0; i < c.num_layers(); ++i) {
    const std::string L = "layers." + std::to_string(i) + ".";
    auto qkv = linear(norm(x, c, P, L + "input_norm"), P, L + "attention.qkv").view({b, s, groups, per + 2, d});
    auto q = qkv.narrow(3, 0, per).reshape({b, s, heads, d});
    auto k = qkv.select(3, per).repeat_interleave(per, 2);
    auto v = qkv.select(3, per + 1).repeat_interleave(per, 2);
    if (c.qk_layernorm()) {  // over each head's d channels, before RoPE
      q = norm(q, c, P, L + "attention.q_norm");
      k = norm(k, c, P, L + "attention.k_norm");
    }
    // A sliding window of w: keys more than w - 1 positions back are masked too.
    const int64_t window = c.attention_window(i);
    const auto masked = window > 0 ? causal.logical_or(distance >= window) : causal;
    if (c.position_embedding_type() == Positions::kRope) {
      q = rope(q, c.rotary_base());
      k = rope(k, c.rotary_base());
    }
    auto scores = torch::einsum("bqhd,bkhd->bhqk", {q, k}) / std::sqrt(static_cast<double>(d));
    auto probs = torch::softmax(scores.masked_fill(masked, -INFINITY), -1);
    auto ctx = torch::einsum("bhqk,bkhd->bqhd", {probs, v}).reshape({b, s, heads * d});
    x = x + linear(ctx, P, L + "attention.proj");
    auto f = linear(norm(x, c, P, L + "post_attention_norm"), P, L + "mlp.fc1");
    if (c.activation() == Activation::kSwiGLU) {
      auto halves = f.chunk(2, -1);
      f = halves[0] * torch::sigmoid(halves[0]) * halves[1];
    } else {
      f = 0.5 * f * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (f + 0.044715 * f.pow(3))));
    }
    x = x + linear(f, P, L + "mlp.fc2");
  }
  x = norm(x, c, P, "final_norm");
  const auto head = c.tie_embeddings() ? P["embedding.weight"] : P["output_layer"];
  auto logits = x.matmul(head.narrow(0, 0, V).t()).view({b * s, V});
  auto logp = logits - logits.logsumexp(-1, true);
  return -logp.gather(1, labels.reshape({b * s, 1})).mean();
}

}  // namespace

TEST_CASE("GPTModel (TP=1) equals an independent plain implementation", "[gpt]") {
  for (const auto& variant : variants()) {
    INFO(variant.name);
    const auto& c = variant.config;
    GPTModel model{GPTModelOptions(c)};
    const auto data = batch_ids(3, c.seq_length(), c.vocab_size(), 11);
    const auto ids = data.narrow(1, 0, c.seq_length()), labels = data.narrow(1, 1, c.seq_length());
    auto loss = model->loss(ids, labels);
    loss.backward();
    std::map<std::string, torch::Tensor> grads;
    for (const auto& p : model->named_parameters()) {
      REQUIRE(p.value().grad().defined());
      grads[p.key()] = p.value().grad().clone();
      p.value().mutable_grad().zero_();
    }
    auto ref = reference_loss(model, c, ids, labels);
    ref.backward();
    CHECK(torch::allclose(loss, ref, 1e-5, 0));
    for (const auto& p : model->named_parameters()) {
      INFO(p.key());
      CHECK_CLOSE(grads[p.key()], p.value().grad());
    }
  }
}

TEST_CASE("recomputation gives the same loss and gradients, dropout included", "[gpt]") {
  using megatorch::transformer::Recompute;
  auto base = base_config().hidden_dropout(0.1).attention_dropout(0.1);
  const auto data = batch_ids(2, base.seq_length(), base.vocab_size(), 3);
  const auto ids = data.narrow(1, 0, base.seq_length()), labels = data.narrow(1, 1, base.seq_length());
  std::vector<torch::Tensor> losses;
  std::vector<std::map<std::string, torch::Tensor>> grads;
  for (auto r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    auto c = base;
    c.recompute(r);
    torch::manual_seed(0);
    GPTModel model{GPTModelOptions(c)};
    model->train();
    auto loss = model->loss(ids, labels);
    loss.backward();
    losses.push_back(loss.detach());
    grads.emplace_back();
    for (const auto& p : model->named_parameters()) grads.back()[p.key()] = p.value().grad().clone();
  }
  for (size_t i = 1; i < losses.size(); ++i) {
    CHECK(torch::equal(losses[i], losses[0]));  // same masks, same arithmetic
    for (const auto& [k, g] : grads[0]) {
      INFO("recompute mode " << i << ", " << k);
      CHECK(torch::equal(grads[i][k], g));  // the recomputed forward is the same arithmetic
    }
  }
}

TEST_CASE("bad model configurations fail at construction", "[gpt]") {
  CHECK_THROWS_WITH(base_config().num_attention_heads(3).validate(1), Catch::Contains("divisible by num_attention_heads"));
  CHECK_THROWS_WITH(base_config().num_attention_heads(4).validate(8), Catch::Contains("tensor-parallel size (8)"));
  CHECK_THROWS_WITH(base_config().num_query_groups(2).validate(4), Catch::Contains("num_query_groups (2)"));
  CHECK_THROWS_WITH(base_config().ffn_hidden_size(30).validate(4), Catch::Contains("ffn_hidden_size (30)"));
  CHECK_THROWS_WITH(base_config().seq_length(6).sequence_parallel(true).validate(4),
                    Catch::Contains("seq_length (6)"));
  CHECK_THROWS_WITH(GPTModel(GPTModelOptions(base_config()).layer_begin(1).layer_end(5)),
                    Catch::Contains("layer range inside [0, 2]"));
  CHECK_THROWS_WITH(megatorch::tp::ColumnParallelLinear(megatorch::tp::ColumnParallelLinearOptions(4, 6).parts(4)),
                    Catch::Contains("divisible"));
}
