// Parity of the GPT loss and of every parameter's gradient between TP=n (n = 2, 4,
// whatever the world allows), with and without SP, and TP=1 — 1e-5 relative in fp32,
// since only the summation order differs. Initial shards equal the slices of the TP=1
// weights exactly (same generator, same numbers). Communication counted exactly.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "gpt_test_util.h"
#include "mp_util.h"
#include "tolerance.h"

using megatorch::comm::CommOp;
using megatorch::comm::Group;
using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using megatorch::parallel::GroupKind;

namespace {

// Every parity check also shows the comparison would catch an error of 1e-4 relative.
void check_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  INFO(what);
  CHECK_CLOSE(got, want);
  CHECK_DETECTS_ERROR(got, want);
}

}  // namespace

TEST_CASE("GPT at TP=n matches TP=1: init exactly, loss and grads to 1e-5, with and without SP", "[mp][gpt]") {
  const int64_t world = mp::world_size();
  std::vector<int64_t> tps{world};
  if (world == 4) tps.push_back(2);
  for (int64_t tpn : tps) {
    auto st = mp::state(tpn, 1, "gpt_parity_" + std::to_string(tpn));
    Group g(*st, GroupKind::kTensor);
    for (const auto& variant : gpt_test::variants()) {
      for (bool sp : {false, true}) {
        auto config = variant.config;
        config.sequence_parallel(sp);
        const std::string tag = variant.name + (sp ? " +SP" : "") + " tp=" + std::to_string(tpn);
        INFO(tag);
        const auto data = gpt_test::batch_ids(2, config.seq_length(), config.vocab_size(), 99);
        const auto ids = data.narrow(1, 0, config.seq_length()), labels = data.narrow(1, 1, config.seq_length());

        GPTModel full(GPTModelOptions(config.sequence_parallel(false)));  // TP=1, no group
        GPTModel part(GPTModelOptions(config.sequence_parallel(sp)).group(g.name()));
        auto full_params = full->named_parameters();
        for (const auto& p : part->named_parameters()) {
          REQUIRE(full_params.contains(p.key()));
          INFO("initial " << p.key());
          CHECK(torch::equal(p.value(), gpt_test::expected_shard(p.key(), full_params[p.key()], p.value(), g.rank(),
                                                                 g.size(), config)));
        }
        auto full_loss = full->loss(ids, labels);
        full_loss.backward();
        auto part_loss = part->loss(ids, labels);
        part_loss.backward();
        part->allreduce_sequence_parallel_grads();
        check_close(part_loss, full_loss, "loss");
        for (const auto& p : part->named_parameters()) {
          REQUIRE(p.value().grad().defined());
          check_close(p.value().grad(),
                      gpt_test::expected_shard(p.key(), full_params[p.key()].grad(), p.value(), g.rank(), g.size(),
                                               config),
                      "grad of " + p.key());
        }
      }
    }
  }
}

TEST_CASE("GPT communication per forward is exactly Megatron's", "[mp][gpt]") {
  const int64_t t = mp::world_size();
  auto st = mp::state(t, 1, "gpt_bytes");
  Group g(*st, GroupKind::kTensor);
  for (bool sp : {false, true}) {
    auto config = gpt_test::base_config().num_layers(3).sequence_parallel(sp);
    GPTModel model(GPTModelOptions(config).group(g.name()));
    const int64_t b = 2, s = config.seq_length(), h = config.hidden_size(), L = config.num_layers();
    const auto data = gpt_test::batch_ids(b, s, config.vocab_size(), 5);
    g.reset_stats();
    torch::NoGradGuard no_grad;
    auto logits = model->forward(data.narrow(1, 0, s));
    const auto fwd = g.stats();
    const int64_t act = b * s * h * 4;  // one fp32 [s, b, h] activation
    if (!sp) {
      // One all-reduce for the embedding (g), two per layer (after attention and MLP).
      CHECK(fwd[CommOp::kAllReduce].calls == 1 + 2 * L);
      CHECK(fwd[CommOp::kAllReduce].bytes == (1 + 2 * L) * act);
      CHECK(fwd[CommOp::kAllGather].calls == 0);
    } else {
      // SP: each all-reduce becomes a reduce-scatter (same input bytes) plus, before the
      // next column-parallel layer, an all-gather of the [s/t, b, h] shard.
      CHECK(fwd[CommOp::kAllReduce].calls == 0);
      CHECK(fwd[CommOp::kReduceScatter].calls == 1 + 2 * L);
      CHECK(fwd[CommOp::kReduceScatter].bytes == (1 + 2 * L) * act);
      CHECK(fwd[CommOp::kAllGather].calls == 2 * L + 1);  // + the gather before the head
      CHECK(fwd[CommOp::kAllGather].bytes == (2 * L + 1) * act / t);
    }
    g.reset_stats();
    model->per_token_loss(logits, data.narrow(1, 1, s));
    // The loss: exactly three all-reduces of b·s fp32 values (max, target logit, sum of exps).
    CHECK(g.stats()[CommOp::kAllReduce].calls == 3);
    CHECK(g.stats()[CommOp::kAllReduce].bytes == 3 * b * s * 4);
    CHECK(g.stats().total().calls == 3);
  }
}

TEST_CASE("vocab-parallel loss: fused local part equals the unfused one at TP=n, three all-reduces each",
          "[mp][kernels]") {
  const int64_t t = mp::world_size();
  auto st = mp::state(t, 1, "ce_fused");
  Group g(*st, GroupKind::kTensor);
  // 8 columns per rank; the real vocabulary ends inside rank t-2's shard at t = 4, so the
  // last rank's shard is all padding (local max -inf, no sum of exps).
  const int64_t local = 8, vocab = t == 4 ? 20 : 13, b = 3, s = 5;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  const auto full = at::randn({s, b, local * t}, gen) * 3;
  auto target = at::randint(vocab, {s, b}, gen, at::TensorOptions().dtype(at::kLong));
  target[2][1] = -100;
  const auto shard = full.narrow(-1, g.rank() * local, local);
  for (double smoothing : {0.0, 0.1}) {
    std::vector<torch::Tensor> loss, grad;
    for (bool fused : {true, false}) {
      INFO("smoothing " << smoothing << (fused ? " fused" : " unfused"));
      const auto x = shard.clone().requires_grad_(true);
      g.reset_stats();
      auto l = megatorch::tp::vocab_parallel_cross_entropy(x, target, g.name(), smoothing, -100, vocab, fused);
      CHECK(g.stats()[CommOp::kAllReduce].calls == 3);
      CHECK(g.stats()[CommOp::kAllReduce].bytes == (smoothing > 0 ? 4 : 3) * b * s * 4);
      CHECK(g.stats().total().calls == 3);
      l.sum().backward();
      loss.push_back(l.detach());
      grad.push_back(x.grad());
    }
    // The unfused loss of the whole (unsharded) vocabulary is the reference of both.
    const auto ref = megatorch::tp::vocab_parallel_cross_entropy(full, target, "", smoothing, -100, vocab, false);
    check_close(loss[0], ref, "fused loss");
    check_close(loss[1], ref, "unfused loss");
    check_close(grad[0], grad[1], "grad");
  }
}
