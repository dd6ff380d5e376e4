// megatorch::plan with mixture of experts: parameters against what GPTModel builds (every
// expert once, per stage and per virtual chunk), the experts' share per EP rank and their
// ZeRO states over expert-DP, the layout rules, the token dispatch bytes, the FLOPs of k of
// E experts, the busiest rank's margin in compute, activations and traffic, and the search
// over EP. Multi-rank comparisons with the real optimizer and counters: test_mp_plan_moe.cpp.
#include <catch2/catch.hpp>

#include <set>

#include "gpt_test_util.h"
#include "plan_test_util.h"
#include "megatorch/models/gpt_model.h"
#include "megatorch/moe/moe_layer.h"
#include "megatorch/plan/moe.h"
#include "megatorch/plan/planner.h"

using namespace megatorch;
using namespace megatorch::plan;

namespace {

int64_t count(torch::nn::Module& mod) {
  int64_t n = 0;
  for (const auto& p : mod.parameters()) n += p.numel();
  return n;
}

int64_t count_experts(torch::nn::Module& mod) {
  int64_t n = 0;
  for (auto* layer : moe::moe_layers(mod))
    for (const auto& p : layer->experts->parameters()) n += p.numel();
  return n;
}

// GeLU with biases, tied; SwiGLU without biases, a shared expert, every second layer;
// GeLU untied with one dense layer first and every third layer an MoE layer, which puts
// different numbers of MoE layers on the chunks of a stage (layers 0, 3, 6 of 8).
std::vector<gpt_test::Variant> moe_variants() {
  return {
      {"gelu-bias-tied", gpt_test::base_config().num_layers(4).num_experts(4).moe_ffn_hidden_size(24)},
      {"swiglu-shared-freq2", gpt_test::variants()[1]
                                  .config.num_layers(4)
                                  .num_experts(8)
                                  .moe_router_topk(3)
                                  .moe_shared_expert_intermediate_size(32)
                                  .moe_layer_freq(2)},
      {"gelu-untied-freq3", gpt_test::variants()[2]
                                .config.num_layers(8)
                                .num_experts(2)
                                .moe_router_topk(1)
                                .moe_layer_freq(3)
                                .moe_shared_expert_intermediate_size(16)},
  };
}

Layout layout(int64_t tp, int64_t pp, int64_t dp, int64_t ep, int zero = 1, int64_t vpp = 1) {
  Layout l{tp, pp, dp, vpp, zero, 1, Recompute::kNone, tp > 1};
  l.ep = ep;
  return l;
}

using plan_test::mixtral;

}  // namespace

TEST_CASE("MoE parameters equal what GPTModel builds: every expert once, per stage and per virtual chunk",
          "[plan][moe]") {
  for (const auto& [name, config] : moe_variants()) {
    INFO(name);
    const ModelSpec m = from_transformer_config(config);
    auto whole = models::GPTModel(models::GPTModelOptions(config));
    CHECK(count(*whole) == total_params(m));
    CHECK(count(*whole) == params_per_rank(m, 1, 1, 0));
    CHECK(count_experts(*whole) == expert_params(m));
    CHECK(active_params(m) == total_params(m) - num_moe_layers(m) * (m.num_experts - m.moe_router_topk) *
                                                    params_per_expert(m));
    const int64_t L = config.num_layers();
    for (int64_t v : {1, 2}) {
      for (int64_t r = 0; r < 2; ++r) {
        INFO("pp 2, vpp " << v << ", rank " << r);
        // The rank's chunks as PipelineStage builds them: virtual stage s = chunk * pp + rank.
        int64_t all = 0, experts = 0, moe_layers = 0;
        for (int64_t c = 0; c < v; ++c) {
          const int64_t s = c * 2 + r, per = L / (2 * v);
          auto chunk = models::GPTModel(models::GPTModelOptions(config)
                                            .layer_begin(s * per)
                                            .layer_end((s + 1) * per)
                                            .pre_process(s == 0)
                                            .post_process(s == 2 * v - 1));
          all += count(*chunk), experts += count_experts(*chunk);
          moe_layers += static_cast<int64_t>(moe::moe_layers(*chunk).size());
          CHECK(chunk_layer_counts(m, 2, v, r, c).moe == static_cast<int64_t>(moe::moe_layers(*chunk).size()));
        }
        const Layout l = layout(1, 2, 1, 1, 1, v);
        CHECK(params_per_rank(m, l, r) == all);
        CHECK(expert_params_per_rank(m, l, r) == experts);
        CHECK(dense_params_per_rank(m, l, r) == all - experts);
        CHECK(stage_layer_counts(m, 2, v, r).moe == moe_layers);
      }
    }
  }
  // Layers 0, 3, 6 of 8: rank 0 holds 0 and 3 at one chunk per stage, only 0 at two.
  const ModelSpec m = from_transformer_config(moe_variants()[2].config);
  CHECK(stage_layer_counts(m, 2, 1, 0).moe == 2);
  CHECK(stage_layer_counts(m, 2, 2, 0).moe == 1);
  // Mixtral 8x7B: 46.7B parameters of which 12.9B active per token.
  CHECK(total_params(mixtral()) == 46702792704);
  CHECK(active_params(mixtral()) == 12879925248);
  CHECK(params_per_expert(mixtral()) == 3 * 4096 * 14336);
}

TEST_CASE("An EP rank holds E/ep whole experts; ZeRO 1-2 shard them over expert-DP, ZeRO 0 replicates",
          "[plan][moe]") {
  const ModelSpec m = mixtral();
  const int64_t per_layer = 8 * params_per_expert(m);
  for (int64_t tp : {1, 2, 4})
    for (int64_t ep : {1, 2, 8}) {
      const Layout l = layout(tp, 2, 8 / tp, ep);
      INFO(l.str());
      REQUIRE(layout_error(m, l, 16, 64).empty());
      // Whole experts whatever the TP rank: 16 MoE layers a stage, 8 / ep experts each.
      CHECK(expert_params_per_rank(m, l, 0) == 16 * per_layer / ep);
      CHECK(params_per_rank(m, l, 1) == dense_params_per_rank(m, l, 1) + 16 * per_layer / ep);
      CHECK(l.edp() == 8 / ep);
      for (int zero : {0, 1, 2}) {
        Layout z = l;
        z.zero_stage = zero;
        for (Precision p : {Precision::kBf16, Precision::kFp32}) {
          const StateBytes e = expert_zero_bytes_per_rank(m, z, p, 0);
          const StateBytes want = zero_state_bytes(static_cast<double>(16 * per_layer / ep), 8 / ep, zero, p);
          CHECK(e.total() == want.total());
          CHECK(e.grad_bytes == want.grad_bytes);
          const StateBytes dense =
              zero_state_bytes(static_cast<double>(dense_params_per_rank(m, z, 0)), z.dp_cp(), zero, p);
          const StateBytes all = zero_bytes_per_rank(m, z, p, 0);
          CHECK(all.param_bytes == dense.param_bytes + e.param_bytes);
          CHECK(all.optimizer_state_bytes == dense.optimizer_state_bytes + e.optimizer_state_bytes);
        }
      }
    }
  // ZeRO 0 keeps every state of the rank's experts; ZeRO-2 shards gradients too.
  const Layout l = layout(1, 1, 8, 2, 0);
  const double n = static_cast<double>(expert_params_per_rank(m, l, 0));
  CHECK(expert_zero_bytes_per_rank(m, l, Precision::kBf16).total() == 18 * n);
  Layout two = l;
  two.zero_stage = 2;
  CHECK(expert_zero_bytes_per_rank(m, two, Precision::kBf16).total() == 2 * n + 16 * n / 4);
  Layout three = l;
  three.zero_stage = 3;
  CHECK_THROWS_WITH(expert_zero_bytes_per_rank(m, three, Precision::kBf16), Catch::Contains("--zero-stage 1 or 2"));
  // A dense model holds no experts, and its bytes are the dense count.
  ModelSpec dense = m;
  dense.num_experts = 0;
  CHECK(expert_params_per_rank(dense, layout(1, 1, 8, 1), 0) == 0);
  CHECK(expert_zero_bytes_per_rank(dense, layout(1, 1, 8, 1), Precision::kBf16).total() == 0);
}

TEST_CASE("Layouts with experts: EP divides TP*CP*DP and the experts, no ZeRO-3; dense stays at EP 1",
          "[plan][moe]") {
  const ModelSpec m = mixtral();
  CHECK(layout_error(m, layout(2, 1, 4, 8), 8, 64).empty());
  CHECK_THAT(layout_error(m, layout(1, 1, 8, 16), 8, 64), Catch::Contains("EP=16 does not divide the TP*CP*DP = 8"));
  ModelSpec six = m;
  six.num_experts = 6;
  CHECK_THAT(layout_error(six, layout(1, 1, 8, 4), 8, 64), Catch::Contains("EP=4 does not divide the 6 experts"));
  Layout no_sp = layout(2, 1, 4, 2);
  no_sp.sequence_parallel = false;
  CHECK(layout_error(m, no_sp, 8, 64).empty());  // the TP ranks route the same tokens
  CHECK_THAT(layout_error(m, layout(1, 1, 8, 2, 3), 8, 64), Catch::Contains("ZeRO-3 does not shard expert"));
  ModelSpec shared = m;
  shared.moe_shared_expert_intermediate_size = 1004;
  CHECK_THAT(layout_error(shared, layout(8, 1, 1, 1), 8, 64), Catch::Contains("--moe-shared-expert-intermediate-size"));
  ModelSpec dense = m;
  dense.num_experts = 0;
  CHECK_THAT(layout_error(dense, layout(1, 1, 8, 2), 8, 64), Catch::Contains("--expert-model-parallel-size 1 for a dense"));
  CHECK(layout_error(dense, layout(1, 1, 8, 2, 3), 8, 64).find("ZeRO-3") == std::string::npos);
  // EP prints after DP, and only when > 1.
  CHECK(layout(2, 1, 4, 8).str() == "TP=2 PP=1 DP=4 EP=8 ZeRO-1 mb=1 recompute=none SP");
  CHECK(layout(2, 1, 4, 1).str() == "TP=2 PP=1 DP=4 ZeRO-1 mb=1 recompute=none SP");
  // The model's MoE fields are checked by name.
  ModelSpec bad = m;
  bad.moe_router_topk = 9;
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("--moe-router-topk in [1, 8]"));
  bad = m;
  bad.moe_imbalance_margin = 0.5;
  CHECK_THROWS_WITH(bad.validate(), Catch::Contains("--moe-imbalance-margin >= 1"));
}

TEST_CASE("Token dispatch: all-to-all 4 T k h E (ep-1)/ep margin a layer, all-gather whatever the routing",
          "[plan][moe]") {
  ModelSpec m = mixtral();
  Layout l = layout(2, 1, 4, 4);  // T = b S / t = 2048 tokens per rank under SP
  l.micro_batch = 1;
  const double T = 4096 / 2, k = 2, h = 4096, E = 2;
  MoeDispatch d = moe_dispatch(m, l, E);
  CHECK(d.tokens == T);
  CHECK(d.routed_rows == T * k);
  CHECK(d.expert_rows == T * k);
  CHECK(d.forward_bytes == 2 * T * k * h * E * 3 / 4);  // dispatch + combine, 3 of 4 rows leave
  CHECK(d.forward_bytes + d.backward_bytes == 4 * T * k * h * E * 3 / 4);
  CHECK_FALSE(d.recompute_repeats);
  // The busiest rank: margin times the mean, capped at EP; 1 at EP 1, where nothing moves.
  m.moe_imbalance_margin = 1.5;
  CHECK(moe_dispatch(m, l, E).forward_bytes == 1.5 * d.forward_bytes);
  CHECK(moe_dispatch(m, l, E).expert_rows == 1.5 * T * k);
  m.moe_imbalance_margin = 16;
  CHECK(effective_imbalance_margin(m, 4) == 4);
  CHECK(effective_imbalance_margin(m, 1) == 1);
  const MoeDispatch one = moe_dispatch(m, layout(2, 1, 4, 1), E);
  CHECK(one.forward_bytes == 0);
  CHECK(one.expert_rows == T * k);
  // Without SP every TP rank routes the whole sequence share; CP and the micro-batch scale T.
  Layout no_sp = l;
  no_sp.sequence_parallel = false;
  CHECK(moe_dispatch(m, no_sp, E).tokens == 4096);
  m.moe_imbalance_margin = 1;
  Layout cp = l;
  cp.cp = 2, cp.dp = 2, cp.micro_batch = 4;
  CHECK(moe_dispatch(m, cp, E).tokens == 4 * 4096 / 2 / 2);
  // Full recompute repeats the forward's dispatch.
  Layout full = l;
  full.recompute = Recompute::kFull;
  CHECK(moe_dispatch(m, full, E).recompute_repeats);
  // All-gather: tokens, fp32 weights and byte selections in, outputs back; no selections back.
  m.moe_token_dispatcher = TokenDispatcher::kAllGather;
  const MoeDispatch ag = moe_dispatch(m, l, E);
  CHECK(ag.forward_bytes == 3 * T * (h * E + 4 * 8 + 8) + 3 * T * h * E);
  CHECK(ag.backward_bytes == 3 * T * h * E + 3 * T * 4 * 8 + 3 * T * h * E);
  m.moe_imbalance_margin = 2;
  CHECK(moe_dispatch(m, l, E).forward_bytes == ag.forward_bytes);
  // Seconds: over NVLink inside a node, the node's network share beyond.
  m = mixtral();
  const Cluster one_node;
  const MoeTraffic tr = moe_traffic_per_layer(m, l, one_node, Calibration{});
  CHECK(tr.intra_node);
  CHECK(tr.forward_s == d.forward_bytes / (600e9 / 2));
  Cluster two = one_node;
  two.nodes = 2;
  CHECK_FALSE(moe_traffic_per_layer(m, layout(1, 1, 16, 16), two, Calibration{}).intra_node);
}

TEST_CASE("MoE FLOPs: the router and shared expert for every token, k of the E experts", "[plan][moe]") {
  ModelSpec m = mixtral();
  m.moe_shared_expert_intermediate_size = 1024;
  const double tokens = 2.0 * 4096, h = 4096;
  const LayerFlops d = layer_forward_flops(m, 2), e = moe_layer_forward_flops(m, 2);
  CHECK(e.attention == d.attention);
  CHECK(d.experts == 0);
  CHECK(e.experts == 2 * tokens * 2 * static_cast<double>(params_per_expert(m)));  // no biases: weights only
  const double dense_mlp = 2 * tokens * 3 * h * 14336;
  CHECK(e.weights == d.weights - dense_mlp + 2 * tokens * (h * 8 + 3 * h * 1024));
  const int64_t moe = num_moe_layers(m);
  CHECK(flops_per_iteration(m, 2, Recompute::kNone) == moe * 3 * e.total() + 3 * head_forward_flops(m, 2));
  CHECK(flops_per_iteration(m, 2, Recompute::kFull) == moe * 4 * e.total() + 3 * head_forward_flops(m, 2));
  m.moe_first_k_dense = 2;
  CHECK(num_moe_layers(m) == 30);
  CHECK(flops_per_iteration(m, 2, Recompute::kSelective) ==
        2 * (3 * d.total() + d.attention) + 30 * (3 * e.total() + e.attention) + 3 * head_forward_flops(m, 2));
}

TEST_CASE("MoE activations: the routed rows on the busiest rank, to the byte of a real layer at EP 1",
          "[plan][moe]") {
  // The layer tests/python/unit/test_plan_cli.py measures: (s, b, h, a) = (64, 2, 32, 4), 4
  // experts of F = 96, top-2, GeLU with biases, fp32 on CPU with 4-byte hidden-dropout masks,
  // flash attention and the LayerNorm statistics: 477216 bytes without recompute.
  ModelSpec m = plan_test::small_moe_layer();
  const ActivationOptions cpu = plan_test::cpu_fp32_activations();
  Layout l = layout(1, 1, 1, 1);
  l.micro_batch = 2;
  CHECK(moe_activation_bytes_per_layer(m, l, cpu) == 477216);
  l.recompute = Recompute::kSelective;
  CHECK(moe_activation_bytes_per_layer(m, l, cpu) == 477216 - 4 * 4 * 64 * 2);  // the log-sum-exp
  l.recompute = Recompute::kFull;
  CHECK(moe_activation_bytes_per_layer(m, l, cpu) == activation_bytes_per_layer(m, l, cpu));  // the layer input
  // Against a dense layer: the MLP's inside term goes, the routed part comes.
  l.recompute = Recompute::kNone;
  const double T = 128, N = 256;
  CHECK(moe_activation_bytes_per_layer(m, l, cpu) - activation_bytes_per_layer(m, l, cpu) ==
        -4 * 2 * 128 * T + 4 * T * 4 + 12 * T * 2 + N * (2 * 32 * 4 + 4 + 24) + N * (4 * (32 + 2 * 96) + 8) +
            2 * 4 * 4);
  // At EP > 1 the busiest rank's experts take margin x the mean rows, and regroup them
  // (the biases' shared index, the regrouping order and inverse).
  Layout ep = layout(1, 1, 2, 2);
  ep.micro_batch = 2;
  const double balanced = moe_activation_bytes_per_layer(m, ep, cpu);
  m.moe_imbalance_margin = 2;
  CHECK(moe_activation_bytes_per_layer(m, ep, cpu) - balanced == N * (4 * (32 + 2 * 96) + 8 + 16));
  // Dense models have no MoE layer.
  m.num_experts = 0;
  CHECK(moe_activation_bytes_per_layer(m, l, cpu) == 0);
}

TEST_CASE("The cost model: expert compute and dispatch on the busiest rank; EP comm in the step", "[plan][moe]") {
  ModelSpec m = mixtral();
  const Cluster cl;  // 8 GPUs
  const Calibration k;
  const Layout l = layout(1, 2, 4, 4);
  const TimeBreakdown t1 = predict_time(m, l, 64, cl, k);
  const MoeTraffic tr = moe_traffic_per_layer(m, l, cl, k);
  // 16 MoE layers a stage, 16 micro-batches: every dispatch exposed.
  CHECK(t1.ep_comm == Approx(16 * 16 * (tr.forward_s + tr.backward_s)).epsilon(1e-12));
  CHECK(t1.pipeline == Approx(t1.compute + t1.tp_comm + t1.cp_comm + t1.ep_comm + t1.p2p + t1.bubble).epsilon(1e-9));
  CHECK(t1.expert_dp_comm == 0);  // EP 4 of 4 ranks: one replica of each expert, nothing to reduce
  CHECK(predict_time(m, layout(1, 2, 4, 2), 64, cl, k).expert_dp_comm > 0);
  m.moe_imbalance_margin = 2;
  const TimeBreakdown t2 = predict_time(m, l, 64, cl, k);
  CHECK(t2.ep_comm == Approx(2 * t1.ep_comm).epsilon(1e-12));
  CHECK(t2.compute > t1.compute);
  // TP 2 without SP: both TP ranks route all the tokens, twice the rows to dispatch.
  m.moe_imbalance_margin = 1;
  Layout sp = layout(2, 2, 2, 4), no_sp = sp;
  no_sp.sequence_parallel = false;
  CHECK(predict_time(m, no_sp, 64, cl, k).ep_comm == Approx(2 * predict_time(m, sp, 64, cl, k).ep_comm).epsilon(1e-12));
  m.moe_imbalance_margin = 2;
  // At EP 1 nothing moves and the margin does nothing.
  const TimeBreakdown e1 = predict_time(m, layout(1, 2, 4, 1), 64, cl, k);
  m.moe_imbalance_margin = 1;
  const TimeBreakdown e1b = predict_time(m, layout(1, 2, 4, 1), 64, cl, k);
  CHECK(e1.ep_comm == 0);
  CHECK(e1.compute == e1b.compute);
  // MFU counts the active parameters' FLOPs: k of E experts.
  CHECK(e1.mfu == Approx(flops_per_iteration(m, 64, Recompute::kNone) / e1.step / 8 / 312e12));
}

TEST_CASE("The planner searches EP for models with experts and keeps dense models at EP 1", "[plan][moe]") {
  PlanRequest r;
  r.model = mixtral();
  r.model.num_layers = 8, r.model.seq_length = 1024;
  r.cluster.nodes = 2;  // 16 GPUs
  r.global_batch = 64;
  r.max_vpp = 1, r.max_micro_batch = 2;
  r.cp = 1;
  const PlanResult res = plan::plan(r);
  std::set<int64_t> eps;
  for (const auto& c : res.ranked) {
    const Layout& l = c.layout;
    INFO(l.str());
    eps.insert(l.ep);
    CHECK((l.tp * l.cp * l.dp) % l.ep == 0);
    CHECK(8 % l.ep == 0);
    CHECK(l.zero_stage <= 2);
    CHECK(c.memory.expert_parameters == expert_params_per_rank(r.model, l, c.memory.stage));
  }
  CHECK(eps.count(1) == 1);
  CHECK(eps.count(8) == 1);
  r.ep = 4;
  for (const auto& c : plan::plan(r).ranked) CHECK(c.layout.ep == 4);
  r.zero_stage = 3;
  CHECK_THROWS_WITH(plan::plan(r), Catch::Contains("no valid layout") && Catch::Contains("ZeRO-3"));
  r.zero_stage.reset();
  r.model.num_experts = 0;
  CHECK_THROWS_WITH(plan::plan(r), Catch::Contains("--expert-model-parallel-size 1 for a dense model"));
  r.ep.reset();
  for (const auto& c : plan::plan(r).ranked) CHECK(c.layout.ep == 1);
}

TEST_CASE("With experts the fullest pipeline stage may be a middle one", "[plan][moe]") {
  // 10 layers over 5 stages, experts only in layer 5 (layers >= 1, every 5th): stage 2.
  ModelSpec m = mixtral();
  m.num_layers = 10, m.moe_first_k_dense = 1, m.moe_layer_freq = 5, m.vocab_size = 1024;
  REQUIRE(num_moe_layers(m) == 1);
  const MemoryBreakdown mem = predict_memory(m, layout(1, 5, 1, 1), 8);
  CHECK(mem.stage == 2);
  CHECK(mem.expert_parameters == 8 * params_per_expert(m));
}
