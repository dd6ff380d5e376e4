// Mixture of experts on one rank: the routing invariants and exact loss values, capacity
// dropping exactly the lowest-probability tokens, the expert bias steering only the
// choice, the grouped GEMM against a GEMM per expert, the MoE layer against the same
// experts applied token by token, and the auxiliary losses' gradient joining backward.
#include <catch2/catch.hpp>
#include <megatorch/megatorch.h>
#include <torch/torch.h>

#include <cmath>

#include "megatorch/kernels/grouped_gemm.h"
#include "megatorch/moe/moe_layer.h"
#include "tolerance.h"

using megatorch::moe::MoELayer;
using megatorch::moe::MoELayerOptions;
using megatorch::moe::TopKRouter;
using megatorch::moe::TopKRouterOptions;
using megatorch::transformer::Activation;
using megatorch::transformer::RouterScore;
using megatorch::transformer::TransformerConfig;

namespace {

TransformerConfig moe_config(int64_t experts = 8, int64_t topk = 2) {
  return TransformerConfig().hidden_size(16).num_attention_heads(2).num_experts(experts).moe_router_topk(topk)
      .moe_ffn_hidden_size(24).seed(11).init_std(0.5);
}

at::Tensor tokens(int64_t t, int64_t h, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({t, h}, gen);
}

}  // namespace

TEST_CASE("MoE losses: uniform routing gives exactly alpha, zero logits beta (ln E)^2", "[moe]") {
  for (int64_t e : {2, 4, 8, 64}) {
    for (int64_t k : {1, 2}) {
      const int64_t t = 16 * e;
      // Uniform probabilities (sum over tokens T / E each) and uniform assignment (T k / E).
      const at::Tensor prob_sum = at::full({e}, static_cast<double>(t) / static_cast<double>(e), at::kFloat);
      const at::Tensor routed = at::full({e}, t * k / e, at::kLong);
      CHECK(megatorch::moe::load_balancing_loss(prob_sum, routed, t, k, 0.01).item<double>() == Approx(0.01).epsilon(1e-6));
      const double z = megatorch::moe::z_loss(at::zeros({t, e}), t, 0.001).item<double>();
      CHECK(z == Approx(0.001 * std::log(e) * std::log(e)).epsilon(1e-6));
    }
  }
  // All of one expert: f = (1, 0, ...) and P = (1, 0, ...): alpha E.
  const at::Tensor p = at::tensor({10.0f, 0.0f, 0.0f, 0.0f}), c = at::tensor({10, 0, 0, 0}, at::kLong);
  CHECK(megatorch::moe::load_balancing_loss(p, c, 10, 1, 0.5).item<double>() == Approx(2.0));
}

TEST_CASE("The router assigns T k rows, k distinct experts per token, weights as the score function says", "[moe]") {
  struct Case {
    RouterScore score;
    bool pre, norm;
    double scale;
  };
  for (const Case& cs : {Case{RouterScore::kSoftmax, false, false, 1.0}, Case{RouterScore::kSoftmax, true, false, 1.0},
                         Case{RouterScore::kSoftmax, true, true, 2.5}, Case{RouterScore::kSigmoid, false, true, 2.5},
                         Case{RouterScore::kSigmoid, false, false, 1.0}}) {
    const auto c = moe_config(8, 3)
                       .moe_router_score_function(cs.score)
                       .moe_router_pre_softmax(cs.pre)
                       .moe_router_norm_topk_prob(cs.norm)
                       .moe_router_topk_scaling_factor(cs.scale)
                       .moe_aux_loss_coeff(0.01)
                       .moe_z_loss_coeff(0.001);
    TopKRouter router{TopKRouterOptions(c)};
    const at::Tensor x = tokens(40, 16, 3);
    const auto r = router->forward(x);
    INFO(megatorch::transformer::to_string(cs.score) << " pre " << cs.pre << " norm " << cs.norm);
    CHECK(r.routed.sum().item<int64_t>() == 40 * 3);
    CHECK(r.selection.sum().item<int64_t>() == 40 * 3);  // dropless: every assignment processed
    CHECK((r.selection.sum(0) == 3).all().item<bool>());
    CHECK(r.dropped == 0);
    const at::Tensor logits = at::linear(x, router->weight);
    const at::Tensor chosen = r.selection.t();
    // The chosen experts are the top-k of the scores (a monotone map of the logits).
    const at::Tensor kth = std::get<0>(logits.topk(3, -1)).select(1, 2).unsqueeze(1);
    CHECK((at::where(chosen, logits, at::full({}, 1e9)) >= kth).all().item<bool>());
    at::Tensor want;
    if (cs.score == RouterScore::kSigmoid) {
      want = at::where(chosen, at::sigmoid(logits), at::zeros({}));
    } else if (cs.pre) {
      want = at::where(chosen, at::softmax(logits, -1), at::zeros({}));
    } else {
      want = at::softmax(at::where(chosen, logits, at::full({}, -INFINITY)), -1);
    }
    if (cs.norm) want = want / want.sum(-1, true);
    want = want * cs.scale;
    CHECK_CLOSE(r.weights, want);
    // This rank is the whole token group: the losses are the formulas on its tokens.
    const at::Tensor probs = cs.score == RouterScore::kSigmoid ? at::sigmoid(logits) / at::sigmoid(logits).sum(-1, true)
                                                               : at::softmax(logits, -1);
    CHECK(r.aux_loss.item<double>() ==
          Approx(megatorch::moe::load_balancing_loss(probs.sum(0), r.routed, 40, 3, 0.01).item<double>()));
    CHECK(r.z_loss.item<double>() == Approx(0.001 * at::logsumexp(logits, -1).square().mean().item<double>()));
  }
}

TEST_CASE("Capacity drops exactly each expert's lowest-probability tokens and pads to the capacity", "[moe]") {
  for (double cf : {0.5, 0.75, 1.0}) {
    for (bool pad : {false, true}) {
      const auto c = moe_config(4, 2).moe_expert_capacity_factor(cf).moe_pad_expert_input_to_capacity(pad);
      TopKRouter router{TopKRouterOptions(c)};
      const at::Tensor x = tokens(32, 16, 5);
      const auto r = router->forward(x);
      const int64_t cap = megatorch::moe::expert_capacity(32, 2, 4, cf);
      CHECK(cap == static_cast<int64_t>(std::ceil(32 * 2 * cf / 4)));
      int64_t dropped = 0;
      for (int64_t e = 0; e < 4; ++e) {
        // Reference: the expert's routed tokens by descending weight; the first cap kept.
        const at::Tensor w = r.weights.select(1, e);
        std::vector<std::pair<float, int64_t>> mine;
        for (int64_t t = 0; t < 32; ++t) {
          if (w[t].item<float>() > 0) mine.emplace_back(w[t].item<float>(), t);
        }
        std::stable_sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
        at::Tensor want = at::zeros({32}, at::kBool);
        for (size_t i = 0; i < mine.size() && static_cast<int64_t>(i) < cap; ++i) want[mine[i].second] = true;
        dropped += std::max<int64_t>(0, static_cast<int64_t>(mine.size()) - cap);
        INFO("cf " << cf << " pad " << pad << " expert " << e);
        if (pad) {
          CHECK(r.selection[e].sum().item<int64_t>() == cap);
          CHECK((r.selection[e] | want.logical_not()).all().item<bool>());  // every kept token among them
          // Fillers carry weight 0: they change no output.
          CHECK((at::where(r.selection[e] & want.logical_not(), w, at::zeros({})) == 0).all().item<bool>());
        } else {
          CHECK(at::equal(r.selection[e], want));
        }
      }
      CHECK(r.dropped == dropped);
      CHECK(r.routed.sum().item<int64_t>() == 64);  // counted before the capacity
    }
  }
}

TEST_CASE("The expert bias steers the choice only, and moves by rate x sign(mean - load)", "[moe]") {
  const auto c = moe_config(4, 1).moe_router_score_function(RouterScore::kSigmoid).moe_router_enable_expert_bias(true)
                     .moe_router_bias_update_rate(0.25);
  TopKRouter router{TopKRouterOptions(c)};
  REQUIRE(router->expert_bias.defined());
  router->expert_bias.copy_(at::tensor({0.0f, 0.0f, 100.0f, 0.0f}));
  const at::Tensor x = tokens(20, 16, 9);
  const auto r = router->forward(x);
  CHECK(r.routed[2].item<int64_t>() == 20);  // every token picks the biased expert
  // Its weight is the unbiased score.
  const at::Tensor s = at::sigmoid(at::linear(x, router->weight)).select(1, 2);
  CHECK(torch::allclose(r.weights.select(1, 2), s));
  router->update_expert_bias(at::tensor({1, 5, 10, 4}, at::kLong));  // mean 5
  CHECK(torch::equal(router->expert_bias, at::tensor({0.25f, 0.0f, 99.75f, 0.25f})));
}

TEST_CASE("grouped_gemm equals a GEMM per group, empty groups included, in both directions", "[moe]") {
  // 8 x 12 fp32: the grouped kernel; 6 x 5: rows not 16-byte aligned, the per-group GEMMs.
  for (const auto& [k, m] : std::vector<std::pair<int64_t, int64_t>>{{8, 12}, {6, 5}}) {
  for (const std::vector<int64_t>& counts : std::vector<std::vector<int64_t>>{{3, 0, 5, 1}, {0, 0, 0, 0}, {9, 0, 0, 0}}) {
    int64_t n = 0;
    for (auto c : counts) n += c;
    auto x = tokens(n, k, 1).requires_grad_();
    auto w = at::randn({4, k, m}).requires_grad_();
    const at::Tensor g = at::randn({n, m});
    auto out = megatorch::kernels::grouped_gemm(x, w, counts, true);
    auto [gx, gw] = [&] {
      auto grads = torch::autograd::grad({out}, {x, w}, {g});
      return std::make_pair(grads[0], grads[1]);
    }();
    auto ref = megatorch::kernels::grouped_gemm(x, w, counts, false);
    auto rgrads = torch::autograd::grad({ref}, {x, w}, {g});
    CHECK_CLOSE(out, ref);
    CHECK_CLOSE(gx, rgrads[0]);
    CHECK_CLOSE(gw, rgrads[1]);
    int64_t at = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
      if (counts[e] > 0) {
        CHECK_CLOSE(out.narrow(0, at, counts[e]), at::mm(x.narrow(0, at, counts[e]), w[e]));
      }
      at += counts[e];
    }
  }
  }
  CHECK_THROWS_WITH(megatorch::kernels::grouped_gemm(at::zeros({3, 6}), at::zeros({2, 6, 5}), {1, 1}),
                    Catch::Contains("add up to 2") && Catch::Contains("3 rows"));
}

TEST_CASE("The MoE layer is each token's weighted sum over its experts, plus the shared expert", "[moe]") {
  for (Activation act : {Activation::kGeluTanh, Activation::kSwiGLU}) {
    for (bool grouped : {true, false}) {
      const auto c = moe_config(4, 2).activation(act).moe_grouped_gemm(grouped).moe_shared_expert_intermediate_size(8);
      MoELayer layer{MoELayerOptions(c)};
      const at::Tensor x = tokens(12, 16, 2).reshape({6, 2, 16});
      const at::Tensor out = layer->forward(x);
      const auto r = layer->router->forward(x.reshape({12, 16}));
      auto& ex = *layer->experts;
      at::Tensor want = layer->shared_expert->forward(x).reshape({12, 16}).clone();
      for (int64_t t = 0; t < 12; ++t) {
        for (int64_t e = 0; e < 4; ++e) {
          if (!r.selection[e][t].item<bool>()) continue;
          at::Tensor h = at::matmul(x.reshape({12, 16})[t], ex.fc1_weight[e]);
          if (ex.fc1_bias.defined()) h = h + ex.fc1_bias[e];
          h = act == Activation::kSwiGLU ? megatorch::transformer::swiglu(h) : at::gelu(h, "tanh");
          at::Tensor y = at::matmul(h, ex.fc2_weight[e]);
          if (ex.fc2_bias.defined()) y = y + ex.fc2_bias[e];
          want[t] += r.weights[t][e] * y;
        }
      }
      INFO("activation " << megatorch::transformer::to_string(act) << " grouped " << grouped);
      CHECK_CLOSE(out.reshape({12, 16}), want);
    }
  }
}

TEST_CASE("The auxiliary losses join backward with the main loss's scale", "[moe]") {
  const auto c = moe_config(4, 2).moe_aux_loss_coeff(0.1).moe_z_loss_coeff(0.01);
  MoELayer layer{MoELayerOptions(c)};
  const at::Tensor x = tokens(10, 16, 4).reshape({5, 2, 16});
  const at::Tensor g = at::randn({5, 2, 16});
  const double scale = 0.375;
  layer->set_aux_loss_backward_scale(scale);
  layer->forward(x).backward(g);
  const at::Tensor with_aux = layer->router->weight.grad().clone();
  CHECK(layer->stats().forwards == 1);
  CHECK(layer->stats().routed.sum().item<int64_t>() == 20);
  // The same without the losses, plus scale times their gradient.
  layer->zero_grad();
  auto plain_config = c;
  plain_config.moe_aux_loss_coeff(0).moe_z_loss_coeff(0);
  MoELayer plain{MoELayerOptions(plain_config)};
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : layer->named_parameters()) plain->named_parameters()[p.key()].copy_(p.value());
  }
  plain->forward(x).backward(g);
  const auto r = layer->router->forward(x.reshape({10, 16}));
  ((r.aux_loss + r.z_loss) * scale).backward();
  // Three backward passes summed in another order (and threads): rounding only.
  const at::Tensor want = plain->router->weight.grad() + layer->router->weight.grad();
  CHECK_CLOSE(with_aux, want);
  CHECK(layer->stats().aux_loss.item<double>() == Approx(r.aux_loss.item<double>()));
}

TEST_CASE("MoE configurations that cannot work are refused by flag name", "[moe]") {
  const auto c = moe_config(6, 2);
  CHECK_THROWS_WITH(c.validate(1, 1, 4), Catch::Contains("--num-experts (6)") &&
                                             Catch::Contains("--expert-model-parallel-size (4)"));
  CHECK_THROWS_WITH(TransformerConfig(c).moe_router_topk(7).validate(1), Catch::Contains("--moe-router-topk in [1, 6]"));
  CHECK_THROWS_WITH(TransformerConfig(c).moe_pad_expert_input_to_capacity(true).validate(1),
                    Catch::Contains("--moe-expert-capacity-factor > 0"));
  CHECK_THROWS_WITH(TransformerConfig().validate(1, 1, 2), Catch::Contains("--num-experts"));
  CHECK_NOTHROW(TransformerConfig(c).sequence_parallel(true).seq_length(8).validate(2, 1, 2));
}
