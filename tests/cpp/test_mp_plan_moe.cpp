// megatorch-plan's mixture-of-experts numbers against the real thing under torchrun: the
// token dispatch bytes of an MoE layer whose routing is exactly uniform equal the EP
// group's counters (all-to-all and all-gather dispatchers, forward and backward), the
// expert-TP bytes the ETP group's, and
// TrainingLoop's parameter count and each rank's dense and expert optimizers (parameters,
// and their bytes summed over the group that shards them) equal the planner's, exactly.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "gpt_test_util.h"
#include "megatorch/moe/moe_layer.h"
#include "megatorch/plan/memory.h"
#include "megatorch/plan/moe.h"
#include "mp_util.h"

using megatorch::comm::CommOp;
using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
using megatorch::parallel::ParallelState;
using megatorch::transformer::TokenDispatcher;
using megatorch::transformer::TransformerConfig;
namespace moe = megatorch::moe;
namespace plan = megatorch::plan;
namespace train = megatorch::train;

TEST_CASE("The planner's dispatch bytes equal the EP group's counters for exactly uniform routing",
          "[mp][moe][plan]") {
  const int64_t world = mp::world_size();
  auto st = mp::state(1, 1, "plan_moe_dispatch", 1, world);
  const std::string ep = st->group_name(GroupKind::kExpert);
  Group epg(ep);
  const int64_t h = 16, s = 8, b = 2, e = 2 * world, k = 2, tokens = s * b;
  REQUIRE(tokens % e == 0);
  for (TokenDispatcher type : {TokenDispatcher::kAllToAll, TokenDispatcher::kAllGather}) {
    INFO(megatorch::transformer::to_string(type));
    const auto config = TransformerConfig()
                            .hidden_size(h)
                            .num_attention_heads(2)
                            .seq_length(s)
                            .num_experts(e)
                            .moe_router_topk(k)
                            .moe_ffn_hidden_size(12)
                            .moe_token_dispatcher_type(type)
                            .expert_parallel_group(ep)
                            .seed(5);
    moe::MoELayer layer{moe::MoELayerOptions(config)};
    // Logit j of a token is its element j; token t holds 1 at t mod E and t+1 mod E, so it
    // goes to those two experts and each expert gets T k / E rows from every rank.
    {
      torch::NoGradGuard no_grad;
      layer->router->weight.zero_();
      for (int64_t j = 0; j < e; ++j) layer->router->weight[j][j] = 1.0;
    }
    at::Tensor x = at::zeros({tokens, h});
    for (int64_t t = 0; t < tokens; ++t) x[t][t % e] = 1.0, x[t][(t + 1) % e] = 1.0;
    x = x.reshape({s, b, h}).requires_grad_();
    epg.reset_stats();
    const at::Tensor out = layer->forward(x);
    const auto forward = epg.stats();
    out.backward(at::ones_like(out));
    const auto all = epg.stats();
    CHECK(torch::equal(layer->stats().routed, at::full({e}, tokens * k / e, at::kLong)));

    const plan::ModelSpec m = plan::from_transformer_config(config);
    plan::Layout l;
    l.dp = world, l.ep = world, l.micro_batch = b;
    const plan::MoeDispatch d = plan::moe_dispatch(m, l, 4);  // fp32
    REQUIRE(d.tokens == static_cast<double>(tokens));
    if (type == TokenDispatcher::kAllToAll) {
      // The counter is the bytes sent to other ranks: what the planner counts.
      CHECK(static_cast<double>(forward[CommOp::kAllToAll].bytes) == d.forward_bytes);
      CHECK(static_cast<double>(all[CommOp::kAllToAll].bytes - forward[CommOp::kAllToAll].bytes) == d.backward_bytes);
    } else {
      // A ring all-gather sends (ep - 1) x the local input (the counter), a reduce-scatter
      // (ep - 1) / ep of the full input (the counter).
      const auto sent = [world](const megatorch::comm::CommStats& c) {
        return static_cast<double>((world - 1) * c[CommOp::kAllGather].bytes +
                                   (world - 1) * c[CommOp::kReduceScatter].bytes / world);
      };
      CHECK(sent(forward) == d.forward_bytes);
      CHECK(sent(all) - sent(forward) == d.backward_bytes);
      CHECK(all[CommOp::kAllToAll].calls == 0);
    }
  }
}

TEST_CASE("The planner's expert-TP bytes equal the ETP group's counters", "[mp][moe][plan]") {
  // Every expert split over all ranks (EP 1, ETP = world): each rank's T k routed rows are
  // all-gathered over ETP and the partial outputs reduce-scattered back, whatever the routing.
  const int64_t world = mp::world_size();
  auto st = mp::state(1, 1, "plan_moe_etp", 1, 1, world);
  const std::string etp = st->group_name(GroupKind::kExpertTensor);
  Group etpg(etp);
  const int64_t h = 16, s = 8, b = 2, k = 2;
  const auto config = TransformerConfig()
                          .hidden_size(h)
                          .num_attention_heads(2)
                          .seq_length(s)
                          .num_experts(4)
                          .moe_router_topk(k)
                          .moe_ffn_hidden_size(4 * world)
                          .expert_tensor_parallel_group(etp)
                          .seed(5);
  moe::MoELayer layer{moe::MoELayerOptions(config)};
  const at::Tensor x = at::randn({s, b, h}).requires_grad_();
  etpg.reset_stats();
  const at::Tensor out = layer->forward(x);
  const auto forward = etpg.stats();
  out.backward(at::ones_like(out));
  const auto all = etpg.stats();

  const plan::ModelSpec m = plan::from_transformer_config(config);
  plan::Layout l;
  l.dp = world, l.etp = world, l.micro_batch = b;
  const plan::MoeDispatch d = plan::moe_dispatch(m, l, 4);  // fp32
  CHECK(d.etp_rows == static_cast<double>(world * s * b * k));
  // The counters are the bytes sent to other ranks (the row counts' all-gather apart).
  CHECK(static_cast<double>(forward[CommOp::kAllToAll].bytes) == d.etp_forward_bytes);
  CHECK(static_cast<double>(all[CommOp::kAllToAll].bytes - forward[CommOp::kAllToAll].bytes) == d.etp_backward_bytes);
}

namespace {

struct Case {
  int64_t tp, pp, ep;
  bool sp = true;  // at TP > 1
  int64_t etp = 1;
};

// The bytes each rank of `group` holds of every kind, summed over the group: what the
// planner's per-rank bytes (exact shares of the group's total) times its size must give.
std::map<std::string, double> summed(const std::map<std::string, int64_t>& stats, const std::string& group) {
  const std::vector<std::string> keys{"param_bytes", "grad_bytes", "master_param_bytes", "optimizer_state_bytes"};
  at::Tensor v = at::zeros({static_cast<int64_t>(keys.size())}, at::kDouble);
  for (size_t i = 0; i < keys.size(); ++i) v[static_cast<int64_t>(i)] = static_cast<double>(stats.at(keys[i]));
  Group(group).all_reduce(v);
  std::map<std::string, double> out;
  for (size_t i = 0; i < keys.size(); ++i) out[keys[i]] = v[static_cast<int64_t>(i)].item<double>();
  return out;
}

void check_states(const std::map<std::string, double>& real, const plan::StateBytes& want, int64_t replicas) {
  const double n = static_cast<double>(replicas);
  CHECK(real.at("param_bytes") == want.param_bytes * n);
  CHECK(real.at("grad_bytes") == want.grad_bytes * n);
  CHECK(real.at("master_param_bytes") == want.master_param_bytes * n);
  CHECK(real.at("optimizer_state_bytes") == want.optimizer_state_bytes * n);
}

int64_t numel(const std::vector<at::Tensor>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

}  // namespace

TEST_CASE("TrainingLoop's parameter count and every rank's dense and expert optimizers equal the planner's",
          "[mp][moe][plan]") {
  const int64_t world = mp::world_size();
  std::vector<Case> cases{{1, 1, world}, {2, 1, 2}, {1, 2, 1}};
  if (world % 2 == 0) cases.push_back({1, 1, 1, true, 2});  // each expert over two DP ranks
  if (world == 4) {
    cases.insert(cases.end(), {{1, 1, 2}, {2, 1, 4}, {1, 2, 2}, {2, 2, 2}, {2, 1, 2, false}});
    cases.insert(cases.end(), {{2, 1, 2, true, 2}, {2, 1, 1, false, 2}, {1, 2, 1, true, 2}});  // ETP = TP; in a stage
  }
  // GeLU with biases and a shared expert; SwiGLU without biases, 8 experts. Every second
  // layer of 4 an MoE layer: one per stage at PP 2.
  const std::vector<TransformerConfig> configs{
      gpt_test::base_config().num_layers(4).num_experts(4).moe_ffn_hidden_size(24).moe_shared_expert_intermediate_size(16)
          .moe_layer_freq(2),
      gpt_test::variants()[1].config.num_layers(4).num_experts(8).moe_router_topk(3).moe_layer_freq(2)};
  // (ZeRO stage, dtype, precision): each sharding rule once, both recipes.
  const std::vector<std::tuple<int, c10::ScalarType, plan::Precision>> recipes{
      {0, at::kFloat, plan::Precision::kFp32}, {1, at::kBFloat16, plan::Precision::kBf16},
      {2, at::kFloat, plan::Precision::kFp32}};
  int64_t n = 0;
  for (const Case& c : cases) {
    if (world % (c.tp * c.pp) || (world / c.pp) % (c.ep * c.etp)) continue;
    for (const auto& [zero, dtype, precision] : recipes) {
      const TransformerConfig& base = configs[n % configs.size()];
      INFO("tp " << c.tp << " pp " << c.pp << " ep " << c.ep << " etp " << c.etp << (c.sp ? "" : " no SP") << " ZeRO-"
                 << zero << " " << dtype << " config " << n % 2);
      train::TrainingLoop loop(train::TrainingLoopOptions()
                                   .tensor_parallel(c.tp)
                                   .pipeline_parallel(c.pp)
                                   .expert_parallel(c.ep)
                                   .expert_tensor_parallel(c.etp)
                                   .zero_stage(zero)
                                   .device("cpu")
                                   .print_summary(false)
                                   .name("plan_moe_loop_" + std::to_string(n++)));
      const bool sp = c.sp && c.tp > 1;
      auto config = TransformerConfig(base).sequence_parallel(sp).params_dtype(dtype);
      if (c.ep > 1) config.expert_parallel_group(loop.ep_group());
      if (c.etp > 1) config.expert_tensor_parallel_group(loop.etp_group());
      megatorch::pipeline::PipelineStage stage(
          megatorch::pipeline::PipelineStageOptions(config).tp_group(loop.tp_group()).pp_group(loop.pp_group()));
      loop.set_model(stage.ptr());

      const plan::ModelSpec m = plan::from_transformer_config(config);
      plan::Layout l{c.tp, c.pp, world / (c.tp * c.pp), 1, zero, 1, plan::Recompute::kNone, sp};
      l.ep = c.ep;
      l.etp = c.etp;
      REQUIRE(plan::layout_error(m, l, world, world).empty());
      const int64_t pp_rank = loop.parallel_state().pp_rank();
      CHECK(loop.num_parameters() == plan::total_params(m));
      CHECK(numel(loop.optimizer().parameters()) == plan::dense_params_per_rank(m, l, pp_rank));
      check_states(summed(loop.optimizer().memory_stats(), loop.grad_group()),
                   plan::zero_state_bytes(static_cast<double>(plan::dense_params_per_rank(m, l, pp_rank)), l.dp_cp(),
                                          zero, precision),
                   l.dp_cp());
      REQUIRE(loop.expert_optimizer() != nullptr);
      CHECK(numel(loop.expert_optimizer()->parameters()) == plan::expert_params_per_rank(m, l, pp_rank));
      const auto experts = loop.expert_optimizer()->memory_stats();
      const plan::StateBytes want = plan::expert_zero_bytes_per_rank(m, l, precision, pp_rank);
      CHECK(static_cast<double>(experts.at("param_bytes")) == want.param_bytes);  // stages 0-2: every rank all
      check_states(summed(experts, loop.edp_group()), want, l.edp());
    }
  }
  CHECK(n > 0);
}
