// TransformerConfig::cuda_graph: the layer stack captured as CUDA graphs where it can be,
// eager with a stated reason where it cannot. On a CPU: the model trains exactly as
// without the option, captures nothing and says why; each configuration graphs cannot
// replay is named. On a GPU: the captured stack gives the eager stack's loss and
// gradients, captures once per shape, and a second capture when two micro-batches are in
// flight at once.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "gpt_test_util.h"
#include "tolerance.h"

using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using megatorch::transformer::cuda_graph_unsupported;
using namespace gpt_test;

namespace {

struct Step {
  std::vector<double> losses;
  std::map<std::string, torch::Tensor> grads;  // after the last step
};

// Three steps of plain SGD on fixed batches: forward, backward, update in place.
Step train(GPTModel& model, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches) {
  Step s;
  for (const auto& [ids, labels] : batches) {
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    auto loss = model->loss(ids, labels);
    loss.backward();
    s.losses.push_back(loss.item<double>());
    for (const auto& p : model->named_parameters()) s.grads[p.key()] = p.value().grad().clone();
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.sub_(p.grad(), 0.1);
  }
  return s;
}

std::vector<std::pair<torch::Tensor, torch::Tensor>> batches(const TransformerConfig& c, c10::Device device) {
  std::vector<std::pair<torch::Tensor, torch::Tensor>> out;
  for (int64_t i = 0; i < 3; ++i) {
    const auto t = batch_ids(2, c.seq_length(), c.vocab_size(), 40 + i);
    out.emplace_back(t.narrow(1, 0, c.seq_length()).to(device), t.narrow(1, 1, c.seq_length()).to(device));
  }
  return out;
}

}  // namespace

TEST_CASE("cuda_graph on a CPU: the layers run eagerly, the same numbers, and the model says why", "[gpt][cuda_graph]") {
  for (const auto& v : variants()) {
    INFO(v.name);
    GPTModel plain{GPTModelOptions(v.config)};
    GPTModel graphed{GPTModelOptions(TransformerConfig(v.config).cuda_graph(true))};
    const auto data = batches(v.config, torch::kCPU);
    const Step a = train(plain, data), b = train(graphed, data);
    CHECK(a.losses == b.losses);  // the same computation: bit for bit
    for (const auto& [name, g] : a.grads) CHECK(torch::equal(g, b.grads.at(name)));
    CHECK(graphed->cuda_graph_captures() == 0);
    CHECK_THAT(graphed->cuda_graph_fallback_reason(),
               Catch::Contains("the layers run on cpu") && Catch::Contains("CUDA work only"));
    CHECK(plain->cuda_graph_fallback_reason().empty());  // not asked for: nothing said
  }
}

TEST_CASE("cuda_graph names each configuration a replay cannot run", "[cuda_graph]") {
  const auto x = torch::zeros({8, 2, 32});
  const auto c = base_config().hidden_dropout(0).attention_dropout(0);
  CHECK_THAT(cuda_graph_unsupported(c, x, 2, 1, false), Catch::Contains("tensor parallelism (TP 2)"));
  CHECK_THAT(cuda_graph_unsupported(TransformerConfig(c).sequence_parallel(true), x, 2, 1, false),
             Catch::Contains("sequence parallel"));
  CHECK_THAT(cuda_graph_unsupported(c, x, 1, 2, false), Catch::Contains("context parallelism (CP 2)"));
  CHECK_THAT(cuda_graph_unsupported(TransformerConfig(c).num_experts(4), x, 1, 1, false),
             Catch::Contains("mixture-of-experts"));
  CHECK_THAT(cuda_graph_unsupported(TransformerConfig(c).hidden_dropout(0.1), x, 1, 1, false),
             Catch::Contains("dropout (hidden 0.1"));
  CHECK_THAT(cuda_graph_unsupported(TransformerConfig(c).recompute(megatorch::transformer::Recompute::kFull), x, 1,
                                    1, false),
             Catch::Contains("activation recomputation"));
  CHECK_THAT(cuda_graph_unsupported(c, x, 1, 1, true), Catch::Contains("ZeRO-3"));
  CHECK_THAT(cuda_graph_unsupported(c, x, 1, 1, false), Catch::Contains("the layers run on cpu"));
  if (torch::cuda::is_available()) CHECK(cuda_graph_unsupported(c, x.cuda(), 1, 1, false).empty());
}

TEST_CASE("cuda_graph on a GPU: the captured layers give the eager loss and gradients", "[cuda_graph][cuda]") {
  if (!torch::cuda::is_available()) {
    WARN("skipped: no CUDA device visible (the capture itself needs a GPU)");
    return;
  }
  for (const auto& v : variants()) {
    INFO(v.name);
    const auto c = TransformerConfig(v.config).device(torch::kCUDA).hidden_dropout(0).attention_dropout(0);
    GPTModel plain{GPTModelOptions(c)};
    GPTModel graphed{GPTModelOptions(TransformerConfig(c).cuda_graph(true))};
    const auto data = batches(c, torch::kCUDA);
    const Step a = train(plain, data), b = train(graphed, data);
    REQUIRE(graphed->cuda_graph_fallback_reason().empty());
    CHECK(graphed->cuda_graph_captures() == 1);  // one shape, one micro-batch in flight at a time
    for (size_t i = 0; i < a.losses.size(); ++i) CHECK(b.losses[i] == Approx(a.losses[i]).epsilon(1e-5));
    for (const auto& [name, g] : a.grads) {
      INFO(name);
      CHECK_CLOSE(b.grads.at(name).cpu(), g.cpu(), 1e-4);
    }
    // Two forwards before their backwards: the second cannot reuse the first's capture.
    const auto& [ids, labels] = data[0];
    auto l1 = graphed->loss(ids, labels), l2 = graphed->loss(ids, labels);
    CHECK(graphed->cuda_graph_captures() == 2);
    CHECK(l1.item<double>() == l2.item<double>());
    (l1 + l2).backward();
  }
}
