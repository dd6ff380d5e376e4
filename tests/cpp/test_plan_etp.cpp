// megatorch::plan with expert tensor parallelism (ETP, Megatron-core's parallel folding):
// each EP rank's experts split over etp ranks as TP MLPs. The rank's expert shards and their
// ZeRO states over expert-DP, the layout rules, the ETP group's all-gather and reduce-scatter
// bytes and seconds, the activations of the gathered rows, and the search.
#include <catch2/catch.hpp>

#include <set>
#include <utility>
#include <vector>

#include "megatorch/plan/moe.h"
#include "plan_test_util.h"
#include "megatorch/plan/planner.h"

using namespace megatorch;
using namespace megatorch::plan;

namespace {

Layout layout(int64_t tp, int64_t pp, int64_t dp, int64_t ep, int64_t etp = 1) {
  Layout l{tp, pp, dp, 1, 1, 1, Recompute::kNone, tp > 1};
  l.ep = ep, l.etp = etp;
  return l;
}

using plan_test::mixtral;

}  // namespace

TEST_CASE("Expert tensor parallelism: E/ep experts' 1/etp shards per rank, ZeRO over EDP = TP*CP*DP/(EP*ETP)",
          "[plan][moe][etp]") {
  const ModelSpec m = mixtral();  // SwiGLU without biases: fc1 [h, 2F], fc2 [F, h]
  const int64_t h = 4096, F = 14336;
  // fc1 keeps 2F/etp columns (gate and up each split), fc2 F/etp rows.
  CHECK(params_per_expert_shard(m, 1) == params_per_expert(m));
  CHECK(params_per_expert_shard(m, 2) == h * 2 * F / 2 + F / 2 * h);
  CHECK(params_per_expert_shard(m, 8) == h * 2 * F / 8 + F / 8 * h);
  for (int64_t tp : {1, 2})
    for (const auto& [ep, etp] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {2, 2}, {2, 4}, {4, 2}, {1, 8}}) {
      const Layout l = layout(tp, 2, 8 / tp, ep, etp);
      INFO(l.str());
      REQUIRE(layout_error(m, l, 16, 64).empty());
      // 16 MoE layers a stage, 8 / ep experts each, every one a 1/etp shard.
      const int64_t shard = h * 2 * F / etp + F / etp * h;
      CHECK(expert_params_per_rank(m, l, 0) == 16 * (8 / ep) * shard);
      CHECK(params_per_rank(m, l, 1) == dense_params_per_rank(m, l, 1) + 16 * (8 / ep) * shard);
      CHECK(l.edp() == 8 / (ep * etp));
      for (int zero : {0, 1, 2}) {
        Layout z = l;
        z.zero_stage = zero;
        const StateBytes e = expert_zero_bytes_per_rank(m, z, Precision::kBf16, 0);
        const StateBytes want = zero_state_bytes(static_cast<double>(16 * (8 / ep) * shard), 8 / (ep * etp), zero,
                                                 Precision::kBf16);
        CHECK(e.total() == want.total());
        CHECK(e.optimizer_state_bytes == want.optimizer_state_bytes);
        CHECK(e.grad_bytes == want.grad_bytes);
      }
      // The dense part does not change with the experts' layout.
      Layout whole = l;
      whole.ep = 1, whole.etp = 1;
      CHECK(dense_params_per_rank(m, l, 0) == dense_params_per_rank(m, whole, 0));
    }
  // With biases: fc1's split like its weight, fc2's [h] whole on every ETP rank, so the ETP
  // group holds an expert's parameters once plus etp - 1 copies of fc2's bias.
  for (const bool swiglu : {false, true}) {
    ModelSpec b = m;
    b.swiglu = swiglu, b.add_bias_linear = true, b.moe_ffn_hidden_size = 96, b.hidden_size = 32;
    b.num_attention_heads = 4, b.num_query_groups = 0;
    const int64_t f1 = swiglu ? 192 : 96;
    for (int64_t etp : {1, 2, 4, 8}) {
      INFO("swiglu " << swiglu << " etp " << etp);
      CHECK(params_per_expert_shard(b, etp) == 32 * f1 / etp + 96 / etp * 32 + f1 / etp + 32);
      CHECK(etp * params_per_expert_shard(b, etp) - (etp - 1) * 32 == params_per_expert(b));
      if (etp > 4) continue;  // EP 2 x ETP must fit a stage's 8 ranks
      const Layout l = layout(1, 2, 8, 2, etp);
      REQUIRE(layout_error(b, l, 16, 64).empty());
      CHECK(expert_params_per_rank(b, l, 1) == 16 * (8 / 2) * (32 * f1 / etp + 96 / etp * 32 + f1 / etp + 32));
    }
    CHECK_THROWS_WITH(params_per_expert_shard(b, 5), Catch::Contains("--expert-tensor-parallel-size") &&
                                                         Catch::Contains("--moe-ffn-hidden-size 96") &&
                                                         Catch::Contains("got 5"));
  }
}

TEST_CASE("Layouts with ETP: EP*ETP divides TP*CP*DP, ETP divides the expert FFN, dense stays at ETP 1",
          "[plan][moe][etp]") {
  const ModelSpec m = mixtral();
  const Layout l = layout(2, 1, 4, 4, 2);
  CHECK(layout_error(m, l, 8, 64).empty());
  // ETP prints after EP, and only when > 1.
  CHECK(l.str() == "TP=2 PP=1 DP=4 EP=4 ETP=2 ZeRO-1 mb=1 recompute=none SP");
  const Layout no_ep = layout(2, 1, 4, 1, 4);
  CHECK(no_ep.str() == "TP=2 PP=1 DP=4 ETP=4 ZeRO-1 mb=1 recompute=none SP");
  CHECK(layout_error(m, no_ep, 8, 64).empty());
  // 4 x 4 expert ranks do not fit the 8 of a stage.
  CHECK_THAT(layout_error(m, layout(2, 1, 4, 4, 4), 8, 64),
             Catch::Contains("EP*ETP = 4*4 = 16 does not divide the TP*CP*DP = 8") &&
                 Catch::Contains("--expert-tensor-parallel-size >= 1 dividing 2"));
  CHECK_THAT(layout_error(m, layout(2, 1, 4, 4, 0), 8, 64), Catch::Contains("EP*ETP = 4*0"));
  // The expert FFN must split evenly over ETP.
  ModelSpec odd = m;
  odd.moe_ffn_hidden_size = 1001;
  CHECK_THAT(layout_error(odd, l, 8, 64), Catch::Contains("ETP=2 does not divide the expert FFN size "
                                                          "(--moe-ffn-hidden-size 1001)"));
  odd.moe_ffn_hidden_size = 1002;
  CHECK(layout_error(odd, l, 8, 64).empty());
  CHECK_THAT(layout_error(odd, layout(1, 1, 8, 2, 4), 8, 64),
             Catch::Contains("dividing 1002 or an FFN size divisible by 4"));
  // A dense model has no experts to split.
  ModelSpec dense = m;
  dense.num_experts = 0;
  CHECK_THAT(layout_error(dense, layout(2, 1, 4, 1, 2), 8, 64),
             Catch::Contains("--expert-tensor-parallel-size 1 for a dense model") && Catch::Contains("ETP=2"));
}

TEST_CASE("ETP traffic: (etp-1) R h E bytes each for the all-gather and the reduce-scatter, twice each way",
          "[plan][moe][etp]") {
  ModelSpec m = mixtral();
  Layout l = layout(2, 1, 4, 2);  // T = b S / t = 2048 tokens per rank under SP
  const double T = 2048, k = 2, h = 4096, E = 2;
  const MoeDispatch one = moe_dispatch(m, l, E);
  CHECK(one.etp_rows == T * k);
  CHECK(one.etp_forward_bytes == 0);
  CHECK(one.etp_backward_bytes == 0);
  for (int64_t etp : {2, 4}) {
    INFO("etp " << etp);
    l.etp = etp;
    const MoeDispatch d = moe_dispatch(m, l, E);
    const double R = T * k;
    CHECK(d.etp_rows == etp * R);
    // Forward: the all-gather of the rank's R rows and the reduce-scatter of the partial
    // sums; backward the transposes.
    CHECK(d.etp_forward_bytes == 2 * (etp - 1) * R * h * E);
    CHECK(d.etp_backward_bytes == d.etp_forward_bytes);
    // The EP dispatch before it is the same as at ETP 1.
    CHECK(d.forward_bytes == one.forward_bytes);
    CHECK(d.backward_bytes == one.backward_bytes);
    CHECK(d.expert_rows == R);
  }
  // The busiest EP rank's margin: its ETP group holds the same experts, all take margin x.
  m.moe_imbalance_margin = 1.5;
  l.etp = 2;
  CHECK(moe_dispatch(m, l, E).etp_forward_bytes == 2 * 1.5 * T * k * h * E);
  // At EP 1 nothing is dispatched, but the ETP group still gathers and reduces its rows.
  m.moe_imbalance_margin = 1;
  const MoeDispatch d1 = moe_dispatch(m, layout(2, 1, 4, 1, 4), E);
  CHECK(d1.forward_bytes == 0);
  CHECK(d1.etp_forward_bytes == 2 * 3 * T * k * h * E);
  // Seconds: over NVLink when the ETP group fits in a node; the EP group spans EP*ETP ranks.
  const Cluster node;
  const MoeTraffic tr = moe_traffic_per_layer(m, l, node, Calibration{});
  CHECK(tr.etp_intra_node);
  CHECK(tr.etp_forward_s == moe_dispatch(m, l, E).etp_forward_bytes / (600e9 / 2));
  CHECK(tr.etp_backward_s == tr.etp_forward_s);
  CHECK(tr.etp_recompute_s == 0);
  Cluster two = node;
  two.nodes = 2;
  Layout wide = layout(1, 1, 16, 2, 8);
  const MoeTraffic w = moe_traffic_per_layer(m, wide, two, Calibration{});
  CHECK(w.etp_intra_node);
  CHECK_FALSE(w.intra_node);  // EP ranks 8 apart: 16 ranks, two nodes
  wide.ep = 1, wide.etp = 16;
  CHECK_FALSE(moe_traffic_per_layer(m, wide, two, Calibration{}).etp_intra_node);
  // In the step: not overlapped, in EP comm, repeated by full recompute.
  const Layout pp2 = layout(1, 2, 4, 2, 2);
  const TimeBreakdown t = predict_time(m, pp2, 64, node, Calibration{});
  const MoeTraffic p = moe_traffic_per_layer(m, pp2, node, Calibration{});
  // 16 MoE layers a stage, 16 micro-batches.
  CHECK(t.etp_comm == Approx(16 * 16 * (p.etp_forward_s + p.etp_backward_s)).epsilon(1e-12));
  CHECK(t.ep_comm == Approx(16 * 16 * (p.forward_s + p.backward_s + p.etp_forward_s + p.etp_backward_s))
                         .epsilon(1e-12));
  CHECK(t.pipeline == Approx(t.compute + t.tp_comm + t.cp_comm + t.ep_comm + t.p2p + t.bubble).epsilon(1e-9));
  Layout full = pp2;
  full.recompute = Recompute::kFull;
  const MoeTraffic f = moe_traffic_per_layer(m, full, node, Calibration{});
  CHECK(f.etp_recompute_s == f.etp_forward_s);
  CHECK(predict_time(m, full, 64, node, Calibration{}).etp_comm ==
        Approx(16 * 16 * (2 * f.etp_forward_s + f.etp_backward_s)).epsilon(1e-12));
  CHECK(predict_time(m, layout(1, 2, 4, 2), 64, node, Calibration{}).etp_comm == 0);
}

TEST_CASE("ETP activations: the gathered input etp-fold, fc1 and the activation unchanged, the indices",
          "[plan][moe][etp]") {
  // The layer of the activation test above: GeLU with biases, h = 32, F = 96, T = 128,
  // k = 2, fp32: R = 256 rows at EP 1.
  ModelSpec m = plan_test::small_moe_layer();
  const ActivationOptions cpu = plan_test::cpu_fp32_activations();
  const double R = 256, h = 32;
  for (int64_t ep : {1, 2}) {
    Layout l = layout(1, 1, 8, ep);
    l.micro_batch = 2;
    const double base = moe_activation_bytes_per_layer(m, l, cpu);
    for (int64_t etp : {2, 4}) {
      INFO("ep " << ep << " etp " << etp);
      Layout e = l;
      e.etp = etp;
      // Input [etp R, h] (etp - 1 more copies of R rows); fc1's and GeLU's outputs
      // [etp R, F/etp]: the same bytes; fc1's bias index on etp R rows (fc2's on R, shared
      // by both at ETP 1); the gathered rows' order and inverse (2 int64 per gathered row).
      CHECK(moe_activation_bytes_per_layer(m, e, cpu) - base ==
            (etp - 1) * R * h * 4 + 8 * etp * R + 16 * etp * R);
    }
  }
  // SwiGLU without biases: the input and the regrouping only.
  m.swiglu = true, m.add_bias_linear = false;
  Layout l = layout(1, 1, 8, 1);
  l.micro_batch = 2;
  const double base = moe_activation_bytes_per_layer(m, l, cpu);
  l.etp = 2;
  CHECK(moe_activation_bytes_per_layer(m, l, cpu) - base == R * h * 4 + 16 * 2 * R);
  // Full recompute keeps the layer input only, whatever ETP.
  l.recompute = Recompute::kFull;
  CHECK(moe_activation_bytes_per_layer(m, l, cpu) == activation_bytes_per_layer(m, l, cpu));
}

TEST_CASE("The planner keeps ETP at 1 unless told: fixed, or searched over what divides", "[plan][moe][etp]") {
  PlanRequest r;
  r.model = mixtral();
  r.model.num_layers = 8, r.model.seq_length = 1024;
  r.cluster.nodes = 2;  // 16 GPUs
  r.global_batch = 64;
  r.max_vpp = 1, r.max_micro_batch = 2;
  r.cp = 1;
  for (const auto& c : plan::plan(r).ranked) CHECK(c.layout.etp == 1);
  r.etp = 2;
  const PlanResult fixed = plan::plan(r);
  REQUIRE_FALSE(fixed.ranked.empty());
  for (const auto& c : fixed.ranked) {
    INFO(c.layout.str());
    CHECK(c.layout.etp == 2);
    CHECK(c.memory.expert_parameters == expert_params_per_rank(r.model, c.layout, c.memory.stage));
    CHECK(c.memory.expert_states.total() ==
          expert_zero_bytes_per_rank(r.model, c.layout, r.precision, c.memory.stage).total());
  }
  r.etp.reset();
  std::set<int64_t> etps;
  for (const auto& c : plan::plan(r).ranked) {
    const Layout& l = c.layout;
    INFO(l.str());
    etps.insert(l.etp);
    CHECK((l.tp * l.cp * l.dp) % (l.ep * l.etp) == 0);
    CHECK(r.model.moe_ffn() % l.etp == 0);
  }
  CHECK(etps.count(1) == 1);
  CHECK(etps.size() > 1);
  // Dense models: ETP 1 only.
  r.model.num_experts = 0;
  for (const auto& c : plan::plan(r).ranked) CHECK(c.layout.etp == 1);
  r.etp = 2;
  CHECK_THROWS_WITH(plan::plan(r), Catch::Contains("--expert-tensor-parallel-size 1 for a dense model"));
  r.model = mixtral();
  r.etp = 0;
  CHECK_THROWS_WITH(plan::plan(r), Catch::Contains("--expert-tensor-parallel-size >= 1, got 0"));
}
