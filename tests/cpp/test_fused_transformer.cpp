// TransformerConfig::fused_kernels: the GPT model with megatorch's fused kernels (norms,
// bias-GeLU, SwiGLU, bias-dropout-add, RoPE, the loss's local part) against the same
// model built from unfused ATen ops. Same weights; the loss and every gradient to 1e-5
// relative in fp32 (only the summation order differs), dropout included (the fused
// kernel draws the masks at::dropout draws).
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "gpt_test_util.h"
#include "tolerance.h"

using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using namespace gpt_test;

namespace {

struct Run {
  torch::Tensor loss;
  std::map<std::string, torch::Tensor> grads;
};

Run run_gpt(TransformerConfig c, bool fused, const torch::Tensor& ids, const torch::Tensor& labels, bool train) {
  c.fused_kernels(fused);
  GPTModel model{GPTModelOptions(c)};
  model->train(train);
  // The norms follow the flag (the other kernels are chosen in forward).
  for (const auto& m : model->modules()) {
    if (auto* n = m->as<megatorch::transformer::Norm>()) REQUIRE(n->options.fused() == fused);
  }
  torch::manual_seed(123);  // same dropout draws in both runs
  Run r;
  r.loss = model->loss(ids, labels);
  r.loss.backward();
  for (const auto& p : model->named_parameters()) {
    REQUIRE(p.value().grad().defined());
    r.grads[p.key()] = p.value().grad().clone();
  }
  return r;
}

void check_same(const Run& fused, const Run& plain) {
  INFO("loss fused " << fused.loss.item<double>() << " unfused " << plain.loss.item<double>());
  CHECK(torch::allclose(fused.loss, plain.loss, 1e-5, 0));
  for (const auto& [name, g] : plain.grads) {
    INFO(name);
    CHECK_CLOSE(fused.grads.at(name), g);
  }
}

}  // namespace

TEST_CASE("fused kernels on and off give the same GPT loss and gradients", "[gpt][kernels]") {
  std::vector<Variant> all = variants();
  all.push_back({"dropout-train", base_config().hidden_dropout(0.1).attention_dropout(0.1)});
  all.push_back({"dropout-train-rope-swiglu", base_config()
                                                  .hidden_dropout(0.2)
                                                  .position_embedding_type(Positions::kRope)
                                                  .activation(Activation::kSwiGLU)
                                                  .normalization(Normalization::kRMSNorm)});
  for (const auto& v : all) {
    INFO(v.name);
    const auto& c = v.config;
    const auto data = batch_ids(3, c.seq_length(), c.vocab_size(), 21);
    const auto ids = data.narrow(1, 0, c.seq_length()), labels = data.narrow(1, 1, c.seq_length());
    const bool train = c.hidden_dropout() > 0;
    check_same(run_gpt(c, true, ids, labels, train), run_gpt(c, false, ids, labels, train));
  }
}

TEST_CASE("the loss's fused local part equals the unfused one: padding, smoothing, ignored tokens", "[kernels]") {
  // 40 columns of which 37 are real (Megatron's vocabulary padding).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto logits = (at::randn({6, 3, 40}, gen) * 4).requires_grad_(true);
  auto target = at::randint(37, {6, 3}, gen, at::TensorOptions().dtype(at::kLong));
  target[1][2] = -100;
  target[4][0] = -100;
  for (double smoothing : {0.0, 0.1}) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      INFO("smoothing " << smoothing << " dtype " << dtype);
      std::vector<torch::Tensor> loss, grad;
      for (bool fused : {true, false}) {
        const auto x = logits.detach().to(dtype).requires_grad_(true);
        auto l = megatorch::tp::vocab_parallel_cross_entropy(x, target, "", smoothing, -100, 37, fused);
        (l * at::linspace(0.5, 1.5, l.numel()).view(l.sizes())).sum().backward();
        loss.push_back(l.detach());
        grad.push_back(x.grad().to(at::kFloat));
      }
      CHECK(loss[0].dtype() == at::kFloat);
      CHECK(loss[0][1][2].item<float>() == 0);  // ignored
      CHECK_CLOSE(loss[0], loss[1]);
      CHECK_CLOSE(grad[0], grad[1]);  // shared backward; log-sum-exp to rounding
    }
  }
}
