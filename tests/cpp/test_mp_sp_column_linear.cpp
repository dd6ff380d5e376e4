// The sequence-parallel column-parallel linear (tp::SequenceParallelColumnLinear, reached
// through column_parallel_linear(..., sequence_parallel=true)) against the composition it
// replaces, gather_from_sp_region + at::linear: the same output and gradients, the shard
// (not the gathered input) saved for backward, and exactly one more all-gather in backward.
#include <catch2/catch.hpp>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/torch.h>

#include "mp_util.h"
#include "tolerance.h"

using megatorch::comm::CommOp;
using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
namespace comm = megatorch::comm;
namespace tp = megatorch::tp;

namespace {

std::vector<int64_t> tp_sizes() {
  std::vector<int64_t> sizes{mp::world_size()};
  if (mp::world_size() > 2 && mp::world_size() % 2 == 0) sizes.push_back(2);
  return sizes;
}

constexpr int64_t S = 3, B = 2, IN = 8, OUT = 5;  // per rank: [S, B, IN] shard, [OUT, IN] weight

void check_close(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  INFO(what);
  CHECK_CLOSE(got, want);
}

struct Leaves {
  torch::Tensor x, w, b;  // b undefined without bias
};

Leaves leaves(const Leaves& from, bool x_grad, bool w_grad) {
  Leaves l{from.x.clone().requires_grad_(x_grad), from.w.clone().requires_grad_(w_grad), {}};
  if (from.b.defined()) l.b = from.b.clone().requires_grad_(true);
  return l;
}

c10::optional<torch::Tensor> opt(const torch::Tensor& b) {
  return b.defined() ? c10::optional<torch::Tensor>(b) : c10::nullopt;
}

// The saved tensors of the layer's autograd node, and whether it is the layer's only node
// that can hold any (every edge out of it leads to a leaf's AccumulateGrad, which saves none).
std::vector<torch::Tensor> saved_by_layer(const torch::Tensor& y, bool* only_node) {
  auto* node = dynamic_cast<torch::autograd::CppNode<tp::SequenceParallelColumnLinear>*>(y.grad_fn().get());
  REQUIRE(node != nullptr);
  *only_node = true;
  for (const auto& edge : node->next_edges()) {
    if (edge.function && !dynamic_cast<torch::autograd::AccumulateGrad*>(edge.function.get())) *only_node = false;
  }
  return node->ctx_.get_saved_variables();
}

}  // namespace

TEST_CASE("SP column-parallel linear: same results as gather + linear, shard saved, one more all-gather in backward",
          "[mp][sp_linear]") {
  for (int64_t t : tp_sizes()) {
    auto st = mp::state(t, 1, "sp_linear_" + std::to_string(t));
    Group g(*st, GroupKind::kTensor);
    const int64_t r = g.rank();
    for (auto dtype : {torch::kFloat, torch::kDouble}) {
      for (bool three_d : {true, false}) {
        for (bool with_bias : {true, false}) {
          const std::string tag = std::string("t=") + std::to_string(t) + (three_d ? " [s/t, b, in]" : " [s/t, in]") +
                                  (with_bias ? " +bias" : " no bias") + " " + c10::toString(dtype);
          INFO(tag);
          auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + r);
          const auto opts = torch::TensorOptions().dtype(dtype);
          const std::vector<int64_t> shard_shape = three_d ? std::vector<int64_t>{S, B, IN} : std::vector<int64_t>{S, IN};
          const std::vector<int64_t> out_shape =
              three_d ? std::vector<int64_t>{S * t, B, OUT} : std::vector<int64_t>{S * t, OUT};
          Leaves data{at::randn(shard_shape, gen, opts), at::randn({OUT, IN}, gen, opts), {}};
          if (with_bias) data.b = at::randn({OUT}, gen, opts);
          const auto grad_y = at::randn(out_shape, gen, opts);
          const int64_t elt = c10::elementSize(dtype);
          const int64_t shard_bytes = data.x.numel() * elt;

          // Reference: the old path, the gather mapping then at::linear.
          auto ref = leaves(data, true, true);
          auto y_ref = at::linear(comm::gather_from_sp_region(ref.x, g.name()), ref.w, opt(ref.b));
          y_ref.backward(grad_y);

          auto mine = leaves(data, true, true);
          g.reset_stats();
          auto y = tp::column_parallel_linear(mine.x, mine.w, opt(mine.b), g.name(), false, true);
          const auto fwd = g.stats();
          CHECK(fwd[CommOp::kAllGather].calls == 1);
          CHECK(fwd[CommOp::kAllGather].bytes == shard_bytes);
          CHECK(fwd.total().calls == 1);

          // Saved for backward: the shard itself and the weight, nothing of the gathered input.
          bool only_node = false;
          const auto saved = saved_by_layer(y, &only_node);
          CHECK(only_node);
          REQUIRE(saved.size() == 2);
          CHECK(saved[0].is_same(mine.x));
          CHECK(saved[1].is_same(mine.w));
          for (const auto& s : saved) CHECK(s.size(0) != S * t);

          y.backward(grad_y);
          const auto all = g.stats();
          CHECK(all[CommOp::kAllGather].calls == 2);  // forward + the re-gather in backward
          CHECK(all[CommOp::kAllGather].bytes == 2 * shard_bytes);
          CHECK(all[CommOp::kReduceScatter].calls == 1);
          CHECK(all[CommOp::kReduceScatter].bytes == t * shard_bytes);  // the [s, b, in] input gradient
          CHECK(all.total().calls == 3);

          check_close(y, y_ref, "output");
          check_close(mine.x.grad(), ref.x.grad(), "input grad");
          check_close(mine.w.grad(), ref.w.grad(), "weight grad");
          if (with_bias) check_close(mine.b.grad(), ref.b.grad(), "bias grad");

          // An input without a gradient: the weight's still needs the re-gather, but there is
          // no input gradient to reduce-scatter.
          auto frozen_x = leaves(data, false, true);
          g.reset_stats();
          tp::column_parallel_linear(frozen_x.x, frozen_x.w, opt(frozen_x.b), g.name(), false, true).backward(grad_y);
          CHECK(g.stats()[CommOp::kAllGather].calls == 2);
          CHECK(g.stats()[CommOp::kReduceScatter].calls == 0);
          check_close(frozen_x.w.grad(), ref.w.grad(), "weight grad, input without grad");
          if (with_bias) check_close(frozen_x.b.grad(), ref.b.grad(), "bias grad, input without grad");

          // A frozen weight: no input saved, no re-gather; the input gradient as before.
          auto frozen_w = leaves(data, true, false);
          g.reset_stats();
          auto y_fw = tp::column_parallel_linear(frozen_w.x, frozen_w.w, opt(frozen_w.b), g.name(), false, true);
          const auto saved_fw = saved_by_layer(y_fw, &only_node);
          CHECK(!saved_fw[0].defined());
          y_fw.backward(grad_y);
          CHECK(g.stats()[CommOp::kAllGather].calls == 1);
          CHECK(g.stats()[CommOp::kReduceScatter].calls == 1);
          check_close(frozen_w.x.grad(), ref.x.grad(), "input grad, frozen weight");
        }
      }
    }
  }
}

TEST_CASE("SP column-parallel linear: module with skip_bias_add, inference, the non-SP path, no double backward",
          "[mp][sp_linear]") {
  const int64_t t = mp::world_size();
  auto st = mp::state(t, 1, "sp_linear_module");
  Group g(*st, GroupKind::kTensor);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + g.rank());
  const auto x = at::randn({S, B, IN}, gen);
  const auto grad_y = at::randn({S * t, B, OUT}, gen);

  // skip_bias_add: the layer leaves its bias out for a fused kernel to add.
  tp::ColumnParallelLinear fc(
      tp::ColumnParallelLinearOptions(IN, OUT * t).group(g.name()).sequence_parallel(true).skip_bias_add(true));
  const auto xs = x.clone().requires_grad_(true);
  auto y = fc->forward(xs);
  CHECK(dynamic_cast<torch::autograd::CppNode<tp::SequenceParallelColumnLinear>*>(y.grad_fn().get()) != nullptr);
  const auto xr = x.clone().requires_grad_(true);
  const auto w_ref = fc->weight.detach().clone().requires_grad_(true);
  auto y_ref = at::linear(comm::gather_from_sp_region(xr, g.name()), w_ref);
  check_close(y, y_ref, "skip_bias_add output");
  y.backward(grad_y);
  y_ref.backward(grad_y);
  check_close(xs.grad(), xr.grad(), "skip_bias_add input grad");
  check_close(fc->weight.grad(), w_ref.grad(), "skip_bias_add weight grad");
  CHECK(!fc->bias.grad().defined());

  // Inference: the forward all-gather only, no graph.
  {
    torch::NoGradGuard no_grad;
    g.reset_stats();
    auto y_inf = fc->forward(x);
    CHECK(!y_inf.grad_fn());
    CHECK(g.stats()[CommOp::kAllGather].calls == 1);
    CHECK(g.stats().total().calls == 1);
    check_close(y_inf, y_ref.detach(), "inference output");
  }

  // Without SP the layer is f + at::linear, as before: no SP node, no all-gather.
  const auto xf = x.clone().requires_grad_(true);
  g.reset_stats();
  auto y_tp = tp::column_parallel_linear(xf, fc->weight, c10::nullopt, g.name(), false, false);
  CHECK(dynamic_cast<torch::autograd::CppNode<tp::SequenceParallelColumnLinear>*>(y_tp.grad_fn().get()) == nullptr);
  CHECK(g.stats().total().calls == 0);

  // Double backward: refused before any collective (every rank refuses at the same point).
  const auto xd = x.clone().requires_grad_(true);
  auto y_d = fc->forward(xd);
  CHECK_THROWS_WITH(torch::autograd::grad({y_d}, {xd}, {grad_y}, /*retain_graph=*/true, /*create_graph=*/true),
                    Catch::Contains("create_graph=True"));
  CHECK_THROWS_WITH(tp::column_parallel_linear(torch::ones({IN}), fc->weight, c10::nullopt, g.name(), false, true),
                    Catch::Contains("at least 2 dims"));
}
