// TransformerConfig::causal_attention: causal by default (a token never sees later ones),
// bidirectional when false (a BERT-style encoder), and refused where causality is assumed
// (KV-cache inference, the HuggingFace causal-LM export).
#include <catch2/catch.hpp>
#include <megatorch/megatorch.h>
#include <torch/torch.h>

using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using namespace megatorch::transformer;

namespace {

TransformerConfig small(bool causal, Positions positions, bool fused) {
  return TransformerConfig()
      .hidden_size(32)
      .num_attention_heads(4)
      .num_layers(2)
      .seq_length(8)
      .vocab_size(64)
      .init_std(0.2)
      .position_embedding_type(positions)
      .fused_kernels(fused)
      .causal_attention(causal)
      .seed(3);
}

// Logits [s, b, V] of ids and of ids with its last token changed.
std::pair<at::Tensor, at::Tensor> logits_before_and_after_last_token_changes(GPTModel& model) {
  torch::NoGradGuard no_grad;
  auto ids = torch::arange(8, torch::kLong).unsqueeze(0).repeat({2, 1});  // [b, s]
  const at::Tensor before = model->forward(ids);
  ids.select(1, 7).fill_(40);
  return {before, model->forward(ids)};
}

}  // namespace

TEST_CASE("causal_attention: position 0 depends on later tokens only when false", "[attention]") {
  for (Positions positions : {Positions::kLearned, Positions::kRope}) {
    for (bool fused : {false, true}) {
      for (auto recompute : {Recompute::kNone, Recompute::kSelective}) {
        INFO("rope " << (positions == Positions::kRope) << ", fused " << fused << ", selective "
                     << (recompute == Recompute::kSelective));
        GPTModel causal{GPTModelOptions(small(true, positions, fused).recompute(recompute))};
        GPTModel bidirectional{GPTModelOptions(small(false, positions, fused).recompute(recompute))};
        for (GPTModel* m : {&causal, &bidirectional}) (*m)->train();  // selective recompute runs in training
        auto [c0, c1] = logits_before_and_after_last_token_changes(causal);
        auto [b0, b1] = logits_before_and_after_last_token_changes(bidirectional);
        CHECK(torch::equal(c0.narrow(0, 0, 7), c1.narrow(0, 0, 7)));
        CHECK(!torch::allclose(b0.select(0, 0), b1.select(0, 0), 1e-6, 1e-6));
        CHECK(!torch::allclose(c0.select(0, 7), c1.select(0, 7), 1e-6, 1e-6));
      }
    }
  }
}

TEST_CASE("causal_attention(false): the gradient of position 0 reaches later tokens' embeddings", "[attention]") {
  for (bool causal : {true, false}) {
    GPTModel model{GPTModelOptions(small(causal, Positions::kLearned, true).tie_embeddings(false))};
    const auto ids = torch::arange(8, torch::kLong).unsqueeze(0);
    model->forward(ids).select(0, 0).sum().backward();
    const double g7 = model->embedding->weight.grad()[7].abs().sum().item<double>();  // token 7: position 7
    CHECK((causal ? g7 == 0 : g7 > 0));
  }
}

TEST_CASE("causal_attention(false) is refused where causality is assumed", "[attention]") {
  const auto c = small(false, Positions::kLearned, true);
  GPTModel model{GPTModelOptions(c)};
  model->eval();
  auto caches = megatorch::inference::make_kv_caches(*model, 8, 1);
  CHECK_THROWS_WITH(model->forward_cached(torch::zeros({1, 4}, torch::kLong), 0, caches),
                    Catch::Contains("expected causal attention, got causal_attention(false)"));
  CHECK_THROWS_WITH(megatorch::ckpt::hf_arch_of(c), Catch::Contains("causal_attention 0"));
  CHECK(megatorch::ckpt::hf_arch_holds(megatorch::ckpt::HFArch::kGPT2, TransformerConfig(c).causal_attention(true)));

  // Recorded with a checkpoint's configuration; absent (older checkpoints): causal.
  auto j = megatorch::ckpt::gpt_config_json(c);
  CHECK(j.at("causal_attention") == false);
  CHECK(!megatorch::ckpt::gpt_config_from_json(j).causal_attention());
  j.erase("causal_attention");
  CHECK(megatorch::ckpt::gpt_config_from_json(j, TransformerConfig(c)).causal_attention());
}
