// FP8 GEMMs on CPU (torch's CPU _scaled_mm): every recipe's forward, data and weight
// gradients against a quantise -> dequantise -> fp32 matmul reference computed here, the
// delayed recipe's amax history and scales against TE's rule written out independently,
// the split backward (B then W) quantising the output gradient once, and the layers'
// construction-time refusals.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>

#include "megatorch/fp8/linear.h"
#include "megatorch/pipeline/split_backward.h"
#include "megatorch/tp/column_parallel_linear.h"
#include "megatorch/tp/fp8_layer.h"
#include "megatorch/tp/row_parallel_linear.h"
#include "tolerance.h"

namespace fp8 = megatorch::fp8;
namespace tp = megatorch::tp;

namespace {

double fp8_max(c10::ScalarType t) { return t == at::kFloat8_e4m3fn ? 448.0 : 57344.0; }

// x as the GEMM sees it: x·s saturated to the format's range, rounded by the cast, / s.
torch::Tensor dequantised(const torch::Tensor& x, float s, c10::ScalarType t) {
  const double m = fp8_max(t);
  return (x * s).clamp(-m, m).to(t).to(at::kFloat) / s;
}

// Current scaling's scale: fp8_max / amax, 1 where amax is 0.
float tensorwise_scale(const torch::Tensor& x, c10::ScalarType t) {
  const float amax = x.abs().max().item<float>();
  return amax > 0 ? static_cast<float>(fp8_max(t)) / amax : 1.0f;
}

fp8::Fp8Options recipe(fp8::Format f, fp8::Recipe r) { return fp8::Fp8Options().format(f).recipe(r); }

c10::intrusive_ptr<fp8::LinearScaling> scaling_for(const fp8::Fp8Options& o) {
  return c10::make_intrusive<fp8::LinearScaling>(o, c10::Device(c10::kCPU),
                                                 std::array<std::vector<std::string>, fp8::kNumRoles>{});
}

void check_close(const torch::Tensor& got, const torch::Tensor& want, const torch::Tensor& abs_product) {
  // Both are fp32 GEMMs of the same dequantised values; only where the scales multiply
  // in (before or after the sum) and the summation order differ.
  const auto c = tolerance::compare(got, want, tolerance::kRtol, abs_product.abs().max().item<double>());
  INFO(c.describe());
  CHECK(c.ok);
}

}  // namespace

TEST_CASE("fp8::linear: forward, data and weight gradients equal the quantise-dequantise-fp32 reference", "[fp8]") {
  torch::manual_seed(3);
  // 15 tokens: the weight gradient's K is padded to 16 for cuBLASLt.
  const int64_t in = 32, out = 48;
  for (auto format : {fp8::Format::kE4M3, fp8::Format::kHybrid}) {
    for (auto r : {fp8::Recipe::kTensorwise, fp8::Recipe::kDelayed}) {
      INFO(fp8::to_string(format) << " / " << fp8::to_string(r));
      const auto o = recipe(format, r);
      auto scaling = scaling_for(o);
      const auto gt = fp8::dtype_of(format, fp8::Role::kGradOutput);
      auto w = (torch::randn({out, in}) * 0.3).requires_grad_(true);
      auto b = torch::randn({out}).requires_grad_(true);
      // Delayed scaling: the first step quantises with scale 1 (values past 448 saturate),
      // the second with fp8_max / the first step's amax.
      float sx = 1, sw = 1, sg = 1;
      for (int step = 0; step < 2; ++step) {
        INFO("step " << step);
        auto x = (torch::randn({5, 3, in}) * (step == 0 ? 300.0 : 2.0)).requires_grad_(true);
        const auto g = torch::randn({5, 3, out}) * (step == 0 ? 1e-3 : 4.0);
        if (r == fp8::Recipe::kTensorwise) {
          sx = tensorwise_scale(x.detach(), at::kFloat8_e4m3fn);
          sw = tensorwise_scale(w.detach(), at::kFloat8_e4m3fn);
          sg = tensorwise_scale(g, gt);
        }
        const auto dx = dequantised(x.detach().reshape({-1, in}), sx, at::kFloat8_e4m3fn);
        const auto dw = dequantised(w.detach(), sw, at::kFloat8_e4m3fn);
        const auto dg = dequantised(g.reshape({-1, out}), sg, gt);
        if (step == 0 && r == fp8::Recipe::kDelayed) CHECK(dx.abs().max().item<double>() == 448.0);  // saturated
        w.mutable_grad() = torch::Tensor();
        b.mutable_grad() = torch::Tensor();
        const auto y = fp8::linear(x, w, b, scaling);
        y.backward(g);
        check_close(y.detach().reshape({-1, out}), dx.mm(dw.t()) + b.detach(), dx.abs().mm(dw.abs().t()));
        check_close(x.grad().reshape({-1, in}), dg.mm(dw), dg.abs().mm(dw.abs()));
        check_close(w.grad(), dg.t().mm(dx), dg.abs().t().mm(dx.abs()));
        CHECK(torch::allclose(b.grad(), g.reshape({-1, out}).sum(0)));
        if (r == fp8::Recipe::kDelayed) {  // the next step's scales: fp8_max / this step's amax
          sx = 448.0f / x.detach().abs().max().item<float>();
          sw = 448.0f / w.detach().abs().max().item<float>();
          sg = static_cast<float>(fp8_max(gt)) / g.abs().max().item<float>();
        }
      }
    }
  }
}

TEST_CASE("fp8::linear: an all-zero input (amax 0) gives the bias, no nan, and keeps the scale", "[fp8]") {
  for (auto r : {fp8::Recipe::kTensorwise, fp8::Recipe::kDelayed}) {
    auto scaling = scaling_for(recipe(fp8::Format::kHybrid, r));
    const auto w = torch::randn({16, 32}, torch::requires_grad());
    const auto b = torch::randn({16});
    const auto x = torch::zeros({4, 32}, torch::requires_grad());
    const auto y = fp8::linear(x, w, b, scaling);
    y.backward(torch::zeros_like(y));
    CHECK(torch::equal(y.detach(), b.expand({4, 16})));
    CHECK(torch::equal(w.grad(), torch::zeros_like(w)));
    CHECK(scaling->of(fp8::Role::kInput).scale.item<float>() == 1.0f);
    CHECK(scaling->of(fp8::Role::kGradOutput).scale.item<float>() == 1.0f);
  }
}

TEST_CASE("delayed scaling: amax history and scales over 10 steps follow TE's rule", "[fp8]") {
  torch::manual_seed(5);
  for (auto algo : {fp8::AmaxAlgo::kMostRecent, fp8::AmaxAlgo::kMax}) {
    for (int64_t len : {1, 4}) {
      INFO(fp8::to_string(algo) << ", history " << len);
      const int64_t margin = 1;
      const auto o = recipe(fp8::Format::kHybrid, fp8::Recipe::kDelayed)
                         .amax_history_len(len)
                         .amax_compute_algo(algo)
                         .margin(margin);
      fp8::TensorScaling scaling(o, fp8::Role::kGradOutput, c10::kCPU, {});
      // TE's rule, written out: the window of the last `len` amaxes (newest first), the
      // scale (fp8_max / amax) / 2^margin from its newest or largest, kept where amax is 0.
      std::deque<float> window;
      float scale = 1;
      for (int step = 0; step < 10; ++step) {
        INFO("step " << step);
        // Magnitudes up and down, and one all-zero step.
        const auto x = step == 6 ? torch::zeros({8, 16}) : torch::randn({8, 16}) * std::pow(3.0, (step * 7) % 5 - 2);
        const auto q = scaling.quantize(x);
        CHECK(q.scale_inv.item<float>() == 1.0f / scale);  // quantised with the scale from before
        const float amax = x.abs().max().item<float>();
        window.push_front(amax);
        if (static_cast<int64_t>(window.size()) > len) window.pop_back();
        const float a = algo == fp8::AmaxAlgo::kMax ? *std::max_element(window.begin(), window.end()) : window.front();
        if (a > 0) scale = (57344.0f / a) / static_cast<float>(1 << margin);
        CHECK(scaling.scale.item<float>() == scale);
        // The stored history after the roll: slot 0 free for the next amax, then the
        // previous len-1 amaxes oldest first.
        const auto h = scaling.amax_history;
        CHECK(h[0].item<float>() == 0.0f);
        for (int64_t i = 1; i < len; ++i) {
          const size_t back = static_cast<size_t>(len - i - 1);  // slot len-1 is the newest
          CHECK(h[i].item<float>() == (back < window.size() ? window[back] : 0.0f));
        }
      }
    }
  }
}

TEST_CASE("fp8::linear under the split backward: B then W give the plain backward's gradients and scales", "[fp8]") {
  torch::manual_seed(9);
  const auto o = recipe(fp8::Format::kHybrid, fp8::Recipe::kDelayed).amax_history_len(3);
  const auto w0 = torch::randn({32, 16}), x0 = torch::randn({6, 16}), g = torch::randn({6, 32});
  auto run = [&](bool split) {
    auto scaling = scaling_for(o);
    auto w = w0.clone().requires_grad_(true);
    for (int step = 0; step < 2; ++step) {  // the second step uses the first one's scales
      auto x = x0.clone().requires_grad_(true);
      const auto y = fp8::linear(x, w, c10::nullopt, scaling);
      if (split) {
        auto pass = megatorch::pipeline::backward_input(y, g, x);
        pass.run();
      } else {
        y.backward(g);
      }
      if (step == 1) return std::make_tuple(x.grad(), w.grad(), scaling->of(fp8::Role::kGradOutput).amax_history.clone());
    }
    return std::make_tuple(torch::Tensor(), torch::Tensor(), torch::Tensor());
  };
  const auto [dx, dw, hist] = run(false);
  const auto [sdx, sdw, shist] = run(true);
  CHECK(torch::equal(sdx, dx));
  CHECK(torch::equal(sdw, dw));
  CHECK(torch::equal(shist, hist));  // one amax per backward, not one per pass
}

TEST_CASE("FP8 layers refuse what _scaled_mm cannot take at construction, naming the layer", "[fp8]") {
  const auto o = recipe(fp8::Format::kHybrid, fp8::Recipe::kTensorwise);
  tp::ParamInitOptions init;
  init.name("layers.0.mlp.fc1");
  CHECK_THROWS_WITH(tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(24, 48).fp8(o).init(init)),
                    Catch::Contains("layers.0.mlp.fc1") && Catch::Contains("[48, 24]") &&
                        Catch::Contains("divisible by 16"));
  init.dtype(c10::kHalf);
  CHECK_THROWS_WITH(tp::RowParallelLinear(tp::RowParallelLinearOptions(32, 32).fp8(o).init(init)),
                    Catch::Contains("Half") && Catch::Contains("--bf16"));
  CHECK_THROWS_WITH(fp8::parse_recipe("blockwise"), Catch::Contains("'tensorwise' or 'delayed', got 'blockwise'"));
  CHECK_THROWS_WITH(fp8::parse_format("e5m2"), Catch::Contains("'e4m3' or 'hybrid', got 'e5m2'"));
}

TEST_CASE("tp::convert_to_fp8 gives every tensor-parallel linear the recipe, except those kept", "[fp8]") {
  torch::nn::Sequential model(tp::ColumnParallelLinear(32, 64), tp::RowParallelLinear(64, 32),
                              tp::ColumnParallelLinear(32, 16));
  CHECK(tp::fp8_recipe_of(*model) == "none");
  const auto o = recipe(fp8::Format::kE4M3, fp8::Recipe::kDelayed).amax_history_len(16).amax_compute_algo(fp8::AmaxAlgo::kMax);
  CHECK(tp::convert_to_fp8(*model, o, [](const std::string& name) { return name == "2"; }) == 2);
  CHECK(tp::fp8_recipe_of(*model) == "e4m3/delayed/len=16/max/margin=0");
  const auto layers = tp::fp8_layers(*model);
  REQUIRE(layers.size() == 3);
  CHECK(layers[0].second->fp8_scaling);
  CHECK(!layers[2].second->fp8_scaling);
  // Training through them: a step of the converted model runs and learns nothing wrong.
  const auto x = torch::randn({8, 32});
  const auto y = model->forward(x);
  y.pow(2).mean().backward();
  for (const auto& p : model->parameters()) CHECK(torch::isfinite(p.grad()).all().item<bool>());
  layers[1].second->set_fp8(recipe(fp8::Format::kHybrid, fp8::Recipe::kTensorwise));
  CHECK_THROWS_WITH(tp::fp8_recipe_of(*model), Catch::Contains("one recipe"));
}
