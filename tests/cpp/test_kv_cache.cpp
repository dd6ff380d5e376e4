// Inference: the KV-cached forward against the full forward, the length limits, sampling
// and the generation loop, in one process (TP and PP are covered by
// tests/python/unit/test_generate.py through megatorch-generate).
#include <catch2/catch.hpp>
#include <megatorch/megatorch.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <numeric>

#include "tolerance.h"

using megatorch::inference::GenerationOptions;
using megatorch::inference::KVCache;
using megatorch::inference::SamplingOptions;
using megatorch::inference::TextGenerator;
using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using namespace megatorch::transformer;

namespace {

constexpr int64_t kSeq = 12, kVocab = 100;

TransformerConfig gpt2_like(bool fused) {
  return TransformerConfig()
      .hidden_size(32)
      .num_attention_heads(4)
      .num_layers(2)
      .seq_length(kSeq)
      .vocab_size(kVocab)
      .init_std(0.2)
      .fused_kernels(fused)
      .seed(5);
}

TransformerConfig llama_like(bool fused) {
  return gpt2_like(fused)
      .num_query_groups(2)
      .ffn_hidden_size(48)
      .normalization(Normalization::kRMSNorm)
      .activation(Activation::kSwiGLU)
      .position_embedding_type(Positions::kRope)
      .rotary_base(500.0)
      .add_bias_linear(false)
      .tie_embeddings(false);
}

GPTModel eval_model(const TransformerConfig& c) {
  GPTModel model{GPTModelOptions(c)};
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) p.add_(torch::randn_like(p) * 0.1);  // norms off 1, biases off 0
  model->eval();
  return model;
}

}  // namespace

TEST_CASE("the KV-cached forward gives the full forward's logits at every position", "[inference]") {
  for (int variant : {0, 1, 2}) {  // GPT-2, Llama, Llama with QK-norm and a window of 5 on layer 1
    for (bool fused : {false, true}) {
      CAPTURE(variant, fused);
      auto c = variant == 0 ? gpt2_like(fused) : llama_like(fused);
      if (variant == 2) c.qk_layernorm(true).sliding_window(5).layer_types({"full_attention", "sliding_attention"});
      auto model = eval_model(c);
      torch::NoGradGuard no_grad;
      const auto ids = torch::randint(kVocab, {2, kSeq}, torch::kLong);
      const auto full = model->forward(ids);  // [s, b, Vp]
      auto caches = megatorch::inference::make_kv_caches(*model, kSeq, 2);
      // A prefill of 4, a chunk of 3 (new tokens behind cached ones: the offset mask),
      // then one token at a time.
      std::vector<int64_t> steps{4, 3};
      while (std::accumulate(steps.begin(), steps.end(), int64_t{0}) < kSeq) steps.push_back(1);
      int64_t at = 0;
      for (int64_t s : steps) {
        const auto got = model->forward_cached(ids.narrow(1, at, s), at, caches);
        CHECK_CLOSE(got, full.narrow(0, at, s));
        at += s;
      }
      for (const auto& cache : caches) CHECK(cache.length == kSeq);
      CHECK_THROWS_WITH(model->forward_cached(ids.narrow(1, 0, 1), 0, caches),
                        Catch::Contains("follow the 12 cached ones"));
    }
  }
}

TEST_CASE("the cache refuses sequences beyond the model's positions", "[inference]") {
  auto model = eval_model(gpt2_like(true));
  CHECK(megatorch::inference::max_sequence_length(gpt2_like(true)) == kSeq);
  CHECK_THROWS_WITH(megatorch::inference::make_kv_caches(*model, kSeq + 1),
                    Catch::Contains("learned position table of 12 tokens, got 13"));
  // RoPE has no table, and a sliding window bounds what a token sees, not the sequence.
  CHECK(megatorch::inference::max_sequence_length(llama_like(true)) == std::numeric_limits<int64_t>::max());
  CHECK(megatorch::inference::max_sequence_length(llama_like(true).sliding_window(4)) ==
        std::numeric_limits<int64_t>::max());
  model->train();
  std::vector<KVCache> caches = megatorch::inference::make_kv_caches(*model, 4);
  CHECK_THROWS_WITH(model->forward_cached(torch::zeros({1, 1}, torch::kLong), 0, caches),
                    Catch::Contains("expected eval mode"));
}

TEST_CASE("top-k then top-p filtering and seeded draws", "[inference]") {
  using megatorch::inference::filter_logits;
  using megatorch::inference::sample_token;
  const auto logits = torch::tensor({0.5, 0.3, 0.15, 0.05}, torch::kFloat).log();
  auto kept = [&](const SamplingOptions& o) { return torch::isfinite(filter_logits(logits, o)); };
  CHECK(torch::equal(kept(SamplingOptions().greedy(false).top_k(3)), torch::tensor({true, true, true, false})));
  // The nucleus: 0.5 < 0.7 keeps the second token, 0.8 > 0.7 drops the third.
  CHECK(torch::equal(kept(SamplingOptions().greedy(false).top_p(0.7)), torch::tensor({true, true, false, false})));
  CHECK(torch::equal(kept(SamplingOptions().greedy(false).top_p(0.3)), torch::tensor({true, false, false, false})));
  CHECK(torch::equal(kept(SamplingOptions().greedy(false).top_k(1).top_p(0.9)), torch::tensor({true, false, false, false})));
  CHECK(torch::allclose(filter_logits(logits, SamplingOptions().temperature(2.0)), logits / 2.0));

  at::Generator greedy_rng = at::make_generator<at::CPUGeneratorImpl>(1);
  CHECK(sample_token(torch::tensor({0.1f, 3.0f, 2.0f}), SamplingOptions(), greedy_rng) == 1);

  // Draws follow the renormalised top-2 (0.625, 0.375) and repeat under the same seed.
  const auto o = SamplingOptions().greedy(false).top_k(2);
  auto draws = [&](uint64_t seed) {
    at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int64_t> out;
    for (int i = 0; i < 4000; ++i) out.push_back(sample_token(logits, o, rng));
    return out;
  };
  const auto a = draws(3);
  CHECK(a == draws(3));
  CHECK(a != draws(4));
  const double first = std::count(a.begin(), a.end(), 0) / 4000.0;
  CHECK(std::count(a.begin(), a.end(), 0) + std::count(a.begin(), a.end(), 1) == 4000);
  CHECK(first == Approx(0.625).margin(0.03));

  CHECK_THROWS_WITH(SamplingOptions().temperature(0).validate(), Catch::Contains("--temperature > 0"));
  CHECK_THROWS_WITH(SamplingOptions().top_p(1.5).validate(), Catch::Contains("--top-p in [0, 1]"));
}

TEST_CASE("greedy generation equals re-running the whole sequence and taking the argmax", "[inference]") {
  for (bool llama : {false, true}) {
    CAPTURE(llama);
    auto model = eval_model(llama ? llama_like(true) : gpt2_like(true));
    TextGenerator generator(model);
    at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(1);
    const std::vector<int64_t> prompt{3, 14, 15, 92};
    const auto got = generator.generate(prompt, GenerationOptions().max_new_tokens(kSeq - 4), rng);
    std::vector<int64_t> want, seq = prompt;
    torch::NoGradGuard no_grad;
    for (int64_t i = 0; i < kSeq - 4; ++i) {
      auto padded = seq;  // RoPE's table is seq_length long: pad to it (causal: the tail is unseen)
      padded.resize(kSeq, 0);
      const auto logits = model->forward(torch::tensor(padded).unsqueeze(0));
      const int64_t next = logits[static_cast<int64_t>(seq.size()) - 1][0].narrow(0, 0, kVocab).argmax().item<int64_t>();
      want.push_back(next);
      seq.push_back(next);
    }
    CHECK(got == want);
    // A stop token ends generation after it; a prompt past the table is refused before any work.
    const auto stopped = generator.generate(prompt, GenerationOptions().max_new_tokens(8).stop_token(want[1]), rng);
    const auto stop_at = std::find(want.begin(), want.end(), want[1]);
    CHECK(stopped == std::vector<int64_t>(want.begin(), stop_at + 1));
    if (!llama) {
      CHECK_THROWS_WITH(generator.generate(prompt, GenerationOptions().max_new_tokens(kSeq), rng),
                        Catch::Contains("got 16 tokens"));
    }
    CHECK_THROWS_WITH(generator.generate({kVocab}, GenerationOptions(), rng), Catch::Contains("expected prompt ids in [0, 100)"));
  }
}
