// Several DistributedOptimizers stepped as one (optim::step_together: one norm, one
// overflow decision, one loss-scaler update), and grad_average_over, against one
// optimizer over the whole model.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "gpt_test_util.h"
#include "mp_util.h"
#include "optim_test_util.h"

using megatorch::comm::Group;
using megatorch::optim::step_together;
using namespace optim_test;

namespace {

// The parameters whose dotted names do (`mlp`) or do not contain ".mlp.": the layers' MLP
// weights and biases, or everything else; units without any dropped.
megatorch::train::ModelParameters split_mlp(const megatorch::train::ModelParameters& all, bool mlp) {
  megatorch::train::ModelParameters out;
  size_t i = 0;
  for (const auto& unit : all.units) {
    std::vector<torch::Tensor> kept;
    for (const auto& p : unit) {
      if ((all.names[i].find(".mlp.") != std::string::npos) == mlp) {
        kept.push_back(p);
        out.info.push_back(all.info[i]);
        out.names.push_back(all.names[i]);
      }
      ++i;
    }
    if (!kept.empty()) out.units.push_back(std::move(kept));
  }
  return out;
}

// One backward on this DP rank's rows of `batch`, the loss multiplied by `scale`, after
// zeroing every optimizer's gradients.
void backward_on_rows(GPTModel& model, const ParallelState& st, const torch::Tensor& batch,
                      const std::vector<DistributedOptimizer*>& opts, double scale = 1.0) {
  const auto& c = model->options.config();
  const int64_t rows = batch.size(0) / st.dp_size();
  for (auto* o : opts) o->zero_grad();
  const auto data = batch.narrow(0, st.dp_rank() * rows, rows);
  (model->loss(data.narrow(1, 0, c.seq_length()), data.narrow(1, 1, c.seq_length())) * scale).backward();
}

// A GPT over DP = world with two optimizers: its MLP parameters and the rest.
struct ChainedSetup {
  std::unique_ptr<ParallelState> st;
  GPTModel model{nullptr};
  std::unique_ptr<DistributedOptimizer> mlp, rest;
  std::vector<DistributedOptimizer*> both() { return {mlp.get(), rest.get()}; }
};

ChainedSetup make_chained(const gpt_test::TransformerConfig& c, const std::string& name, const DistributedOptimizerOptions& o) {
  ChainedSetup s;
  s.st = mp::state(1, 1, name);
  const std::string tp = s.st->group_name(GroupKind::kTensor), dp = s.st->group_name(GroupKind::kData);
  s.model = GPTModel(GPTModelOptions(c).group(tp));
  const auto all = megatorch::train::gpt_model_parameters({s.model});
  auto options = o;
  options.model_parallel_groups({tp});
  const auto mlp = split_mlp(all, true), rest = split_mlp(all, false);
  REQUIRE(!mlp.units.empty());
  REQUIRE(!rest.units.empty());
  s.mlp = std::make_unique<DistributedOptimizer>(mlp.units, dp, options, mlp.info);
  s.rest = std::make_unique<DistributedOptimizer>(rest.units, dp, options, rest.info);
  return s;
}

}  // namespace

TEST_CASE("step_together over a model's MLP and other parameters equals one optimizer's step(), clipped and scaled",
          "[mp][optim]") {
  const auto c = small_config();
  const int64_t b = 2 * mp::world_size();
  const double clip = 0.05, scale = 1024;  // a power of two: scaling and unscaling are exact
  for (int64_t stage : {0, 1, 2}) {
    INFO("zero stage " << stage);
    const std::string tag = std::to_string(stage);
    // One parameter per bucket in both runs: every bucket's reduction and norm sees the
    // same elements, so the two runs differ only in how the optimizers are chained.
    auto options = [&](std::shared_ptr<megatorch::optim::DynamicLossScaler> scaler) {
      return DistributedOptimizerOptions().zero_stage(stage).lr(kLr).eps(kEps).weight_decay(kWd).bucket_size(1).clip_grad(clip).loss_scaler(
          std::move(scaler));
    };
    auto scaler_options = megatorch::optim::LossScalerOptions().initial_scale(scale);
    auto one = make(c, 1, stage, "chained_one_" + tag, options(std::make_shared<megatorch::optim::DynamicLossScaler>(scaler_options)));
    auto two = make_chained(c, "chained_two_" + tag, options(std::make_shared<megatorch::optim::DynamicLossScaler>(scaler_options)));
    for (int step = 0; step < 3; ++step) {
      INFO("step " << step);
      const auto batch = global_batch(c, b, step);
      backward_on_rows(one.model, *one.st, batch, {one.opt.get()}, scale);
      REQUIRE(one.opt->step());
      backward_on_rows(two.model, *two.st, batch, two.both(), scale);
      REQUIRE(step_together(two.both()));
      CHECK(one.opt->grad_norm() > clip);  // clipping took part
      CHECK(two.mlp->grad_norm() == one.opt->grad_norm());
      CHECK(two.rest->grad_norm() == one.opt->grad_norm());
      CHECK(two.mlp->step_count() == step + 1);
      CHECK(two.rest->step_count() == step + 1);
    }
    const auto want = one.model->named_parameters();
    for (const auto& p : two.model->named_parameters()) {
      INFO(p.key());
      CHECK(torch::equal(p.value(), want[p.key()]));
    }
  }
}

TEST_CASE("step_together: an overflow in one optimizer skips all of them, with one update of the shared scaler",
          "[mp][optim]") {
  const auto c = small_config();
  const int64_t world = mp::world_size();
  auto scaler = std::make_shared<megatorch::optim::DynamicLossScaler>(
      megatorch::optim::LossScalerOptions().initial_scale(1024).hysteresis(1));
  // Reductions start in step: the inf injected after backward is part of them.
  auto s = make_chained(c, "chained_skip",
                        DistributedOptimizerOptions().zero_stage(1).loss_scaler(scaler).clip_grad(1.0).overlap_grad_reduce(false));
  backward_on_rows(s.model, *s.st, global_batch(c, 2 * world, 0), s.both(), scaler->scale());
  std::vector<torch::Tensor> before;
  for (const auto& p : s.model->parameters()) before.push_back(p.detach().clone());
  // inf on the last rank only, in one MLP gradient: only the MLP optimizer sees it.
  if (mp::rank() == world - 1) s.mlp->parameters().front().grad().view(-1)[0] = std::numeric_limits<float>::infinity();
  CHECK_FALSE(step_together(s.both()));
  CHECK(scaler->scale() == 512);  // halved once, not once per optimizer
  CHECK(s.mlp->last_step_skipped());
  CHECK(s.rest->last_step_skipped());
  CHECK(s.rest->step_count() == 0);
  size_t i = 0;
  for (const auto& p : s.model->parameters()) CHECK(torch::equal(p.detach(), before[i++]));
  backward_on_rows(s.model, *s.st, global_batch(c, 2 * world, 1), s.both(), scaler->scale());
  CHECK(step_together(s.both()));
  CHECK_FALSE(s.mlp->last_step_skipped());
  CHECK_FALSE(s.rest->last_step_skipped());
  CHECK(s.mlp->step_count() == 1);
}

TEST_CASE("grad_average_over divides the reduced sum by the given count, also over a group of one rank", "[mp][optim]") {
  const auto c = small_config();
  const int64_t world = mp::world_size();
  // The reduced gradients of this rank (its owned range of every bucket) after backward on
  // this DP rank's rows, over the group `kind` of a fresh state.
  auto reduced = [&](GroupKind kind, int64_t stage, int64_t average_over, const std::string& name) {
    auto st = mp::state(1, 1, name);
    auto model = GPTModel(GPTModelOptions(c).group(st->group_name(GroupKind::kTensor)));
    const auto params = megatorch::train::gpt_model_parameters({model});
    DistributedOptimizer opt(params.units, st->group_name(kind),
                             DistributedOptimizerOptions().zero_stage(stage).bucket_size(3000).grad_average_over(average_over),
                             params.info);
    backward_on_rows(model, *st, global_batch(c, 2 * world, 0), {&opt});
    opt.prepare_step();
    std::vector<torch::Tensor> out;
    for (const auto& bs : opt.buffer().buckets()) out.push_back(bs.grad_shard.clone());
    return out;
  };
  for (int64_t stage : {0, 1}) {
    INFO("zero stage " << stage);
    const std::string tag = std::to_string(stage);
    // Over DP (all ranks): a sum where the default is the mean; world is a power of two,
    // so the two differ by exactly that factor.
    const auto mean = reduced(GroupKind::kData, stage, 0, "avg_mean_" + tag);
    const auto sum = reduced(GroupKind::kData, stage, 1, "avg_sum_" + tag);
    REQUIRE(sum.size() == mean.size());
    for (size_t b = 0; b < sum.size(); ++b) CHECK(torch::equal(sum[b], mean[b] * static_cast<double>(world)));
    // Over a group of one rank (TP = 1, as an expert-DP group of one), averaged over the
    // world: the rank's own gradients divided by it.
    const auto own = reduced(GroupKind::kTensor, stage, 0, "avg_own_" + tag);
    const auto divided = reduced(GroupKind::kTensor, stage, world, "avg_div_" + tag);
    REQUIRE(divided.size() == own.size());
    for (size_t b = 0; b < own.size(); ++b) CHECK(torch::equal(divided[b], own[b] * (1.0 / static_cast<double>(world))));
  }
}

TEST_CASE("step_together refuses optimizers with different loss scalers or clip values; grad_average_over < 0 fails",
          "[mp][optim]") {
  const auto c = small_config();
  auto scaler = std::make_shared<megatorch::optim::DynamicLossScaler>();
  auto other = std::make_shared<megatorch::optim::DynamicLossScaler>();
  auto s = make_chained(c, "chained_refuse", DistributedOptimizerOptions().loss_scaler(scaler).clip_grad(1.0));
  CHECK_THROWS_WITH(step_together({}), Catch::Contains("expected at least one DistributedOptimizer"));
  CHECK_THROWS_WITH(step_together({s.mlp.get(), s.mlp.get()}), Catch::Contains("pass each optimizer once"));
  // The others over models of their own: refused before any collective, they never step.
  const std::string dp = s.st->group_name(GroupKind::kData);
  auto with = [&](DistributedOptimizerOptions o) {
    auto model = GPTModel(GPTModelOptions(c));
    return std::make_unique<DistributedOptimizer>(megatorch::train::gpt_model_parameters({model}).units, dp, o);
  };
  auto other_scaler = with(DistributedOptimizerOptions().loss_scaler(other).clip_grad(1.0));
  CHECK_THROWS_WITH(step_together({s.mlp.get(), other_scaler.get()}),
                    Catch::Contains("expected every optimizer to share optimizer 0's loss scaler") &&
                        Catch::Contains("the same std::shared_ptr<DynamicLossScaler>"));
  auto no_scaler = with(DistributedOptimizerOptions().clip_grad(1.0));
  CHECK_THROWS_WITH(step_together({s.mlp.get(), no_scaler.get()}), Catch::Contains("optimizer 1 has none"));
  auto other_clip = with(DistributedOptimizerOptions().loss_scaler(scaler).clip_grad(0.5));
  CHECK_THROWS_WITH(step_together({s.mlp.get(), other_clip.get()}),
                    Catch::Contains("expected every optimizer to have optimizer 0's clip_grad (1)") &&
                        Catch::Contains("optimizer 1 has 0.5"));
  CHECK_THROWS_WITH(with(DistributedOptimizerOptions().grad_average_over(-2)),
                    Catch::Contains("expected grad_average_over >= 0, got -2"));
}
