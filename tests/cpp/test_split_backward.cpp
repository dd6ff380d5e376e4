// The zero-bubble split backward on plain autograd graphs: B gives the input gradient and
// no weight gradient, W the weight gradients, both equal to one whole backward; W does not
// run the input path again, also for a parameter on two paths; a first stage (no input)
// leaves the whole backward to W.
#include <catch2/catch.hpp>
#include <megatorch/pipeline/split_backward.h>
#include <torch/torch.h>

#include "gpt_test_util.h"
#include "tolerance.h"

namespace mp = megatorch::pipeline;

namespace {

// Identity that counts how often its backward runs (once per backward of the graph).
int g_count_backwards = 0;
struct CountBackward : torch::autograd::Function<CountBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    ++g_count_backwards;
    return grads;
  }
};

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    fc2 = register_module("fc2", torch::nn::Linear(torch::nn::LinearOptions(8, 5).bias(false)));
  }
  at::Tensor forward(const at::Tensor& x, bool reuse_fc1 = false) {
    at::Tensor h = torch::gelu(fc1->forward(x));
    h = CountBackward::apply(norm->forward(h));
    if (reuse_fc1) h = h + fc1->forward(x).tanh();  // fc1 on two paths from the output
    return fc2->forward(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};

struct Case {
  Net net, ref;
  at::Tensor x, x_ref, grad;
  Case() {
    torch::manual_seed(3);
    for (auto& p : ref.parameters()) p.set_requires_grad(false);
    torch::NoGradGuard no_grad;
    auto src = net.parameters(), dst = ref.parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
    x = torch::randn({3, 4, 6});
    x_ref = x.clone();
    grad = torch::randn({3, 4, 5});
    for (auto& p : ref.parameters()) p.set_requires_grad(true);
  }
};

}  // namespace

TEST_CASE("split backward: B gives the input gradient, W the weight gradients, as one backward", "[pipeline]") {
  for (bool reuse : {false, true}) {
    INFO((reuse ? "fc1 on two paths" : "one path per parameter"));
    Case c;
    at::Tensor x = c.x.requires_grad_(), x_ref = c.x_ref.requires_grad_();
    c.ref.forward(x_ref, reuse).backward(c.grad);
    g_count_backwards = 0;
    auto pass = mp::backward_input(c.net.forward(x, reuse), c.grad, x);
    REQUIRE(x.grad().defined());
    CHECK_CLOSE(x.grad(), x_ref.grad());
    // B computed no GEMM's weight gradient: they wait in W, one split node per use of a
    // linear layer (the norm's, and a bias added on its own, come in B).
    CHECK(pass.pending());
    CHECK(pass.num_roots() == (reuse ? 3 : 2));
    CHECK_FALSE(c.net.fc1->weight.grad().defined());
    CHECK_FALSE(c.net.fc2->weight.grad().defined());
    CHECK(c.net.norm->weight.grad().defined());
    pass.run();
    CHECK_FALSE(pass.pending());
    // The input path's counter ran in B only: W starts at the split nodes.
    CHECK(g_count_backwards == 1);
    auto got = c.net.named_parameters(), want = c.ref.named_parameters();
    for (const auto& item : got) {
      INFO(item.key());
      REQUIRE(item.value().grad().defined());
      CHECK_CLOSE(item.value().grad(), want[item.key()].grad());
    }
  }
}

TEST_CASE("split backward: a first stage leaves the whole backward to W; a non-leaf input is refused", "[pipeline]") {
  Case c;
  const at::Tensor x = c.x;  // the micro-batch itself: no input gradient
  c.ref.forward(c.x_ref).backward(c.grad);
  auto pass = mp::backward_input(c.net.forward(x), c.grad, at::Tensor());
  for (const auto& p : c.net.parameters()) CHECK_FALSE(p.grad().defined());
  CHECK(pass.num_roots() == 1);
  pass.run();
  auto got = c.net.named_parameters(), want = c.ref.named_parameters();
  for (const auto& item : got) CHECK_CLOSE(item.value().grad(), want[item.key()].grad());

  const at::Tensor leaf = torch::randn({3, 4, 6}).requires_grad_();
  const at::Tensor not_leaf = leaf * 2;
  CHECK_THROWS_WITH(mp::backward_input(c.net.forward(not_leaf), c.grad, not_leaf),
                    Catch::Contains("expected the stage input as a leaf that requires grad") &&
                        Catch::Contains("is not a leaf"));
}

TEST_CASE("split backward: a middle GPT stage leaves every weight gradient to W", "[pipeline][gpt]") {
  // Each variant with torch's ops and with megatorch's fused kernels; full recomputation
  // replays its layer inside B, so its weight gradients come in B, still equal.
  for (auto variant : gpt_test::variants()) {
    for (auto config : {variant.config.fused_kernels(false), variant.config.fused_kernels(true),
                        variant.config.recompute(megatorch::transformer::Recompute::kFull)}) {
      INFO(variant.name << (config.fused_kernels() ? " fused" : " unfused")
                        << (config.recompute() == megatorch::transformer::Recompute::kFull ? " recompute" : ""));
      const auto options = megatorch::models::GPTModelOptions(config.num_layers(2)).pre_process(false).post_process(false);
      megatorch::models::GPTModel split(options), whole(options);
      // Both initialised from config.seed: the same weights.
      auto ref_params = whole->parameters();
      for (size_t i = 0; i < ref_params.size(); ++i) REQUIRE(torch::equal(split->parameters()[i], ref_params[i]));
      const at::Tensor x = torch::randn({config.seq_length(), 2, config.hidden_size()}).requires_grad_();
      const at::Tensor x_ref = x.detach().clone().requires_grad_();
      const at::Tensor grad = torch::randn({config.seq_length(), 2, config.hidden_size()});
      whole->forward(x_ref).backward(grad);
      auto pass = mp::backward_input(split->forward(x), grad, x);
      CHECK_CLOSE(x.grad(), x_ref.grad());
      // The weight matrices' gradients wait in W (the norms' and biases' come in B).
      const bool replayed = config.recompute() == megatorch::transformer::Recompute::kFull;
      CHECK(pass.pending() != replayed);
      for (const auto& p : split->parameters()) {
        if (p.dim() == 2) CHECK(p.grad().defined() == replayed);
      }
      pass.run();
      auto want = whole->named_parameters();
      for (const auto& item : split->named_parameters()) {
        INFO(item.key());
        REQUIRE(item.value().grad().defined());
        CHECK_CLOSE(item.value().grad(), want[item.key()].grad());
      }
    }
  }
}

