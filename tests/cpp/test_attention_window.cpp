// Sliding-window attention (TransformerConfig::sliding_window, layer_types) and QK-norm in
// one process: the mask's convention, what a token's logits depend on, the checks. Exactness
// against transformers is tests/python/unit/test_hf_families.py; TP, PP and the KV cache
// are the "qknorm-kvchannels-biases-window" variant of the parity, layout and cache tests.
#include <catch2/catch.hpp>
#include <megatorch/megatorch.h>
#include <torch/torch.h>

#include <cmath>

using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using namespace megatorch::transformer;

namespace {

TransformerConfig windowed(int64_t layers, int64_t window) {
  return TransformerConfig()
      .hidden_size(32)
      .num_attention_heads(4)
      .num_layers(layers)
      .seq_length(10)
      .vocab_size(64)
      .init_std(0.2)
      .position_embedding_type(Positions::kRope)
      .normalization(Normalization::kRMSNorm)
      .activation(Activation::kSwiGLU)
      .add_bias_linear(false)
      .qk_layernorm(true)
      .sliding_window(window)
      .seed(3);
}

// Whether the logits at `query` change when the token at `key` does.
bool depends(GPTModel& model, int64_t query, int64_t key) {
  torch::NoGradGuard no_grad;
  auto ids = torch::arange(10, torch::kLong).unsqueeze(0);
  const at::Tensor before = model->forward(ids).select(0, query);
  ids.select(1, key).fill_(50);
  return !torch::equal(before, model->forward(ids).select(0, query));
}

}  // namespace

TEST_CASE("causal_window_mask: key j visible to query i when 0 <= i - j < window", "[attention]") {
  const auto pos = torch::arange(5, torch::kLong);
  const auto mask = causal_window_mask(pos, pos, 2);
  const auto want = torch::tensor({1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1},
                                  torch::kBool)
                        .view({5, 5});
  CHECK(torch::equal(mask, want));
  CHECK(torch::equal(causal_window_mask(pos, pos, 0), torch::ones({5, 5}, torch::kBool).tril()));
  // Queries after a cache: positions 3, 4 over keys 0..4.
  CHECK(torch::equal(causal_window_mask(pos.narrow(0, 3, 2), pos, 2), want.narrow(0, 3, 2)));
}

TEST_CASE("a window of w: one layer's logits at i see tokens i-w+1..i; each layer reaches w-1 further",
          "[attention]") {
  GPTModel one{GPTModelOptions(windowed(1, 3))};
  CHECK(depends(one, 8, 6));
  CHECK_FALSE(depends(one, 8, 5));
  GPTModel two{GPTModelOptions(windowed(2, 3))};
  CHECK(depends(two, 8, 4));
  CHECK_FALSE(depends(two, 8, 3));
  // Layer 0 full, layer 1 sliding: the full layer carries everything before.
  GPTModel mixed{GPTModelOptions(windowed(2, 3).layer_types({"full_attention", "sliding_attention"}))};
  CHECK(depends(mixed, 8, 0));
  // A window as long as the sequence is no window: the same logits.
  GPTModel full{GPTModelOptions(windowed(1, 0))}, wide{GPTModelOptions(windowed(1, 10))};
  torch::NoGradGuard no_grad;
  const auto ids = torch::arange(10, torch::kLong).unsqueeze(0);
  CHECK(torch::equal(full->forward(ids), wide->forward(ids)));
}

TEST_CASE("QK-norm: a norm over head_dim on q and k, its weights trained", "[attention]") {
  GPTModel model{GPTModelOptions(windowed(1, 0).kv_channels(16))};
  const auto& attention = model->layers[0]->as<TransformerLayer>()->attention;
  REQUIRE(attention->q_norm);
  CHECK(attention->q_norm->weight.sizes() == torch::IntArrayRef{16});
  CHECK(attention->qkv->weight.size(0) == (4 + 2 * 4) * 16);  // heads x kv_channels, not hidden / heads
  const auto ids = torch::randint(64, {2, 10}, torch::kLong);
  model->loss(ids, ids).backward();
  CHECK(attention->q_norm->weight.grad().abs().sum().item<double>() > 0);
  CHECK(attention->k_norm->weight.grad().abs().sum().item<double>() > 0);
}

TEST_CASE("windows and layer types are checked by name", "[attention]") {
  CHECK_THROWS_WITH(windowed(2, 3).layer_types({"full_attention"}).validate(1),
                    Catch::Contains("expected layer_types to name each of the 2 layers, got 1"));
  CHECK_THROWS_WITH(windowed(1, 3).layer_types({"chunked_attention"}).validate(1),
                    Catch::Contains("'sliding_attention' or 'full_attention', got 'chunked_attention'"));
  CHECK_NOTHROW(windowed(1, 4).seq_length(8).validate(1, 2));  // context parallelism masks windows too
  CHECK(windowed(2, 3).layer_types({"full_attention", "sliding_attention"}).attention_window(0) == 0);
  CHECK(windowed(2, 3).layer_types({"full_attention", "sliding_attention"}).attention_window(1) == 3);
  CHECK(windowed(2, 3).attention_window(0) == 3);
}

TEST_CASE("document_causal_attention equals SDPA under the block-causal mask it never builds", "[attention]") {
  const auto q = torch::randn({2, 4, 9, 8}), k = torch::randn({2, 2, 9, 8}), v = torch::randn({2, 2, 9, 8});
  const auto document_ids = torch::tensor({0, 0, 0, 1, 1, 1, 1, 1, 2, 0, 1, 1, 1, 1, 1, 1, 1, 1}, torch::kLong).view({2, 9});
  const auto runs = document_runs(document_ids);
  REQUIRE(runs[0] == DocumentRuns::value_type{{0, 3}, {3, 5}, {8, 1}});
  REQUIRE(runs[1] == DocumentRuns::value_type{{0, 1}, {1, 8}});
  for (int64_t window : {0, 2}) {
    CAPTURE(window);
    const auto pos = torch::arange(9, torch::kLong);
    std::vector<torch::Tensor> masks;
    for (int64_t r = 0; r < 2; ++r) {
      const auto row = document_ids[r];
      masks.push_back(causal_window_mask(pos, pos, window).logical_and(row.unsqueeze(1) == row.unsqueeze(0)));
    }
    const auto want = at::scaled_dot_product_attention(q, k, v, torch::stack(masks).unsqueeze(1), 0.0, false,
                                                       c10::nullopt, /*enable_gqa=*/true);
    CHECK(torch::allclose(document_causal_attention(q, k, v, runs, 0.0, 1.0 / std::sqrt(8.0), window), want, 1e-5,
                          1e-6));
  }
  CHECK_THROWS_WITH(document_runs(torch::tensor({1, 0}, torch::kLong).view({1, 2})),
                    Catch::Contains("expected non-decreasing document ids"));
}

TEST_CASE("pack_documents: positions restart and documents split after each EOD", "[attention]") {
  const auto tokens = torch::tensor({7, 9, 7, 3, 7, 7}, torch::kLong).view({1, 6});
  const auto p = pack_documents(tokens, 7, true, true);
  CHECK(torch::equal(p.position_ids, torch::tensor({0, 0, 1, 0, 1, 0}, torch::kLong).view({1, 6})));
  CHECK(torch::equal(p.document_ids, torch::tensor({0, 1, 1, 2, 2, 3}, torch::kLong).view({1, 6})));
  CHECK(pack_documents(tokens, 7, false, false).empty());
  // RoPE angles at those positions, row by row.
  const auto table = rope_frequencies(6, 4, 10000.0, c10::kCPU);
  const auto angles = rope_at_positions(table, p.position_ids);
  REQUIRE(angles.sizes() == torch::IntArrayRef{6, 1, 1, 4});
  CHECK(torch::equal(angles[3], table[0]));
  CHECK(torch::equal(angles[2], table[1]));
}
