// Gradient-accumulation fusion, one process: tp::linear's backward adds the weight
// gradient into a registered main grad with the GEMM (addmm_), leaves the input and bias
// gradients as at::linear's, and falls back to a plain gradient where the backward does
// not accumulate into the weight (autograd::grad, create_graph).
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "megatorch/optim/main_grad.h"
#include "megatorch/tp/fused_linear.h"
#include "tolerance.h"

namespace optim = megatorch::optim;
namespace tp = megatorch::tp;

namespace {

// A main grad of its own, as ParamAndGradBuffer provides.
struct TestSink : optim::MainGradSink {
  torch::Tensor buffer;
  int added = 0;
  torch::Tensor main_grad(int64_t) override { return buffer; }
  void mark_added(int64_t) override { ++added; }
};

struct Registered {  // unregisters on scope exit, as the buffer's destructor does
  torch::Tensor param;
  Registered(const torch::Tensor& p, TestSink& sink) : param(p) { optim::register_main_grad(p, &sink, 0); }
  ~Registered() { optim::unregister_main_grad(param); }
};

// The gradients at::linear's own backward gives for micro-batches xs (summed by autograd).
struct Unfused {
  torch::Tensor weight_grad, bias_grad;
  std::vector<torch::Tensor> input_grads;
};
Unfused unfused(const torch::Tensor& w, const torch::Tensor& b, const std::vector<torch::Tensor>& xs,
                const std::vector<torch::Tensor>& gys) {
  auto wr = w.detach().clone().requires_grad_(true), br = b.detach().clone().requires_grad_(true);
  Unfused out;
  for (size_t k = 0; k < xs.size(); ++k) {
    auto x = xs[k].detach().clone().requires_grad_(true);
    at::linear(x, wr, br).backward(gys[k]);
    out.input_grads.push_back(x.grad());
  }
  out.weight_grad = wr.grad();
  out.bias_grad = br.grad();
  return out;
}

}  // namespace

TEST_CASE("tp::linear accumulates the weight gradient into its main grad; input and bias gradients unchanged",
          "[fused_linear]") {
  torch::manual_seed(7);
  const int64_t in = 24, out = 40;
  // Tokens per micro-batch: few (one BLAS pass over them) and many (the BLAS splits them
  // into blocks, and the sum into a non-zero buffer rounds differently).
  for (int64_t tokens : {48, 1200}) {
    INFO("tokens per micro-batch " << tokens);
    auto w = (torch::randn({out, in}) * 0.1).requires_grad_(true);
    auto b = torch::randn({out}).requires_grad_(true);
    std::vector<torch::Tensor> xs, gys;
    for (int k = 0; k < 3; ++k) {
      xs.push_back(torch::randn({tokens / 2, 2, in}));
      gys.push_back(torch::randn({tokens / 2, 2, out}));
    }
    const auto want = unfused(w, b, xs, gys);
    TestSink sink;
    sink.buffer = torch::zeros({out, in});
    Registered reg(w, sink);
    for (size_t k = 0; k < xs.size(); ++k) {
      auto x = xs[k].clone().requires_grad_(true);
      auto y = tp::linear(x, w, b);
      REQUIRE(y.grad_fn()->name().find("LinearWithGradAccumulation") != std::string::npos);
      CHECK(torch::equal(y, at::linear(xs[k], w, b)));
      y.backward(gys[k]);
      CHECK(torch::equal(x.grad(), want.input_grads[k]));  // at::linear's bits
      CHECK(sink.added == static_cast<int>(k) + 1);
      CHECK_FALSE(w.grad().data_ptr() == sink.buffer.data_ptr());  // the placeholder, not the buffer
      if (k == 0) {
        // Into a zero buffer the sum is the product itself, bit for bit, however the BLAS blocks.
        auto first = w.detach().clone().requires_grad_(true);
        at::linear(xs[0], first, b.detach()).backward(gys[0]);
        CHECK(torch::equal(sink.buffer, first.grad()));
      }
    }
    if (tokens <= 128) {
      CHECK(torch::equal(sink.buffer, want.weight_grad));
    } else {
      CHECK_CLOSE(sink.buffer, want.weight_grad, 1e-6);
    }
    CHECK(torch::equal(b.grad(), want.bias_grad));  // the bias is not fused
  }
}

TEST_CASE("tp::linear returns a plain weight gradient where backward does not accumulate into the weight",
          "[fused_linear]") {
  torch::manual_seed(8);
  auto w = torch::randn({6, 4}).requires_grad_(true);
  auto x = torch::randn({5, 4}).requires_grad_(true);
  TestSink sink;
  sink.buffer = torch::zeros({6, 4});
  Registered reg(w, sink);
  auto want = x.t().mm(torch::ones({5, 6})).t();  // d(sum(x Wᵀ))/dW
  // autograd::grad captures the weight's gradient: it must come back, not go to the buffer.
  auto gw = torch::autograd::grad({tp::linear(x, w, c10::nullopt).sum()}, {w})[0];
  CHECK(torch::equal(gw, torch::ones({5, 6}).t().mm(x)));
  CHECK(sink.added == 0);
  CHECK(torch::equal(sink.buffer, torch::zeros({6, 4})));
  // create_graph: the gradient stays differentiable, so no fusion.
  auto gw2 = torch::autograd::grad({tp::linear(x, w, c10::nullopt).pow(2).sum()}, {w}, {}, true, true)[0];
  CHECK(gw2.requires_grad());
  CHECK(sink.added == 0);
  CHECK_CLOSE(gw, want);
  // Without a registered main grad (or without grad mode) tp::linear is at::linear itself.
  optim::unregister_main_grad(w);
  auto y = tp::linear(x, w, c10::nullopt);
  CHECK(y.grad_fn()->name().find("LinearWithGradAccumulation") == std::string::npos);
  optim::register_main_grad(w, &sink, 0);
  torch::NoGradGuard no_grad;
  CHECK_FALSE(tp::linear(x, w, c10::nullopt).requires_grad());
}
