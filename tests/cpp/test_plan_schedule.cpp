// megatorch::plan's pipeline schedules: zb-h1 next to 1F1B. Its B and W ticks (W: the chunk's
// weight GEMMs, 0 under full recompute), its bubble against Qi et al.'s formula, the search
// choosing it where it is faster and leaving it out where it cannot run or gains nothing;
// 1F1B and interleaved as before.
#include <catch2/catch.hpp>
#include <megatorch/pipeline/nccl_order_model.h>

#include <cmath>

#include "megatorch/plan/planner.h"

using namespace megatorch;
using namespace megatorch::plan;
using pipeline::ScheduleKind;

namespace {

// ModelSpec's defaults: 24 layers, h = 2048, 16 heads, S = 2048 (1.3B parameters), on one
// node of 8 GPUs: every layout below fits in 80 GB.
PlanRequest small_request(int64_t global_batch = 64) {
  PlanRequest r;
  r.model.name = "small";
  r.cluster.nodes = 1;
  r.global_batch = global_batch;
  return r;
}

// A search with everything but the schedule fixed to pp4's layout.
PlanRequest pp4_request(int64_t global_batch, Recompute recompute) {
  PlanRequest r = small_request(global_batch);
  r.tp = 1, r.pp = 4, r.cp = 1, r.vpp = 1, r.zero_stage = 1, r.micro_batch = 1;
  r.recompute = recompute, r.sequence_parallel = false;
  return r;
}

// TP1 PP4 DP2 ZeRO-1 mb=1: 6 layers a stage, 32 micro-batches of 64.
Layout pp4(Recompute recompute, ScheduleKind schedule = ScheduleKind::kOneFOneB) {
  Layout l{1, 4, 2, 1, 1, 1, recompute, false};
  l.schedule = schedule;
  return l;
}

int count_schedule(const PlanResult& res, ScheduleKind kind) {
  int n = 0;
  for (const auto& c : res.ranked) n += schedule_of(c.layout) == kind;
  return n;
}

}  // namespace

TEST_CASE("Schedules: interleaved whenever VP > 1, and only zb-h1 is named in a layout", "[plan][schedule]") {
  Layout l{8, 8, 24, 2, 1, 1, Recompute::kFull, true};
  CHECK(schedule_of(l) == ScheduleKind::kInterleaved);
  CHECK(l.str() == "TP=8 PP=8 DP=24 VP=2 ZeRO-1 mb=1 recompute=full SP");
  l.schedule = ScheduleKind::kInterleaved;  // the same layout, said outright
  CHECK(l.str() == "TP=8 PP=8 DP=24 VP=2 ZeRO-1 mb=1 recompute=full SP");
  l.vpp = 1, l.schedule = ScheduleKind::kOneFOneB;
  CHECK(schedule_of(l) == ScheduleKind::kOneFOneB);
  CHECK(l.str() == "TP=8 PP=8 DP=24 ZeRO-1 mb=1 recompute=full SP");
  l.schedule = ScheduleKind::kZeroBubbleH1;
  CHECK(schedule_of(l) == ScheduleKind::kZeroBubbleH1);
  CHECK(l.str() == "TP=8 PP=8 DP=24 ZeRO-1 mb=1 recompute=full SP sched=zb-h1");

  // gpt_pretrain's flags name the schedule only when its virtual stages do not imply it.
  const PlanRequest r = small_request();
  CHECK_THAT(gpt_pretrain_flags(r, pp4(Recompute::kNone, ScheduleKind::kZeroBubbleH1)),
             Catch::Equals("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --micro-batch-size 1 "
                           "--global-batch-size 64 --zero-stage 1 --schedule zb-h1 --bf16"));
  CHECK_THAT(gpt_pretrain_flags(r, pp4(Recompute::kSelective)), !Catch::Contains("--schedule"));
  Layout il = pp4(Recompute::kFull);
  il.vpp = 2;
  CHECK_THAT(gpt_pretrain_flags(r, il), Catch::Contains("--num-layers-per-virtual-pipeline-stage 3") &&
                                            Catch::Contains("--recompute-granularity full") &&
                                            !Catch::Contains("--schedule"));
}

TEST_CASE("zb-h1's W is the chunk's weight GEMMs, B the rest of 1F1B's backward; W = 0 under full recompute",
          "[plan][schedule]") {
  const PlanRequest r = small_request();
  const ModelSpec& m = r.model;
  const double peak = r.cluster.peak_tflops * 1e12, eff = r.calibration.matmul_efficiency_at(2048.0);
  // 6 layers' linear layers, and the output head the cost model charges every chunk (TP 1).
  const double weights = 6 * layer_forward_flops(m, 1).weights / (peak * eff) +
                         head_forward_flops(m, 1) * padded_vocab(m, 1) / m.vocab_size / (peak * eff);
  PipelineCosts none_costs;
  for (Recompute rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    INFO("recompute " << transformer::to_string(rc));
    const PipelineCosts one = pipeline_costs(m, pp4(rc), r.cluster, r.calibration);
    const PipelineCosts zb = pipeline_costs(m, pp4(rc, ScheduleKind::kZeroBubbleH1), r.cluster, r.calibration);
    // The schedule changes no chunk cost: 1F1B's forward and whole backward are as before.
    CHECK(zb.chunk_forward == one.chunk_forward);
    CHECK(zb.chunk_backward == one.chunk_backward);
    CHECK(zb.options.forward_cost == one.options.forward_cost);
    CHECK(zb.options.backward_cost == one.options.backward_cost);
    CHECK(zb.backward_input_ticks + zb.backward_weight_ticks == zb.options.backward_cost);
    if (rc == Recompute::kFull) {
      // The replay computes the weight gradients inside B: nothing left to defer.
      CHECK(zb.chunk_backward_weight == 0);
      CHECK(zb.backward_weight_ticks == 0);
      CHECK(zb.backward_input_ticks == zb.options.backward_cost);
      continue;
    }
    CHECK(zb.chunk_backward_weight == Approx(weights).epsilon(1e-12));
    CHECK(zb.backward_weight_ticks == std::llround(zb.chunk_backward_weight / zb.tick));
    CHECK(zb.options.backward_weight_cost == zb.backward_weight_ticks);
    CHECK(zb.options.backward_input_cost == zb.backward_input_ticks);
    // Where Qi et al.'s formula holds: W <= F and W <= B.
    CHECK(zb.backward_weight_ticks <= zb.options.forward_cost);
    CHECK(zb.backward_weight_ticks <= zb.backward_input_ticks);
    if (rc == Recompute::kNone) none_costs = zb;
    // Selective recompute keeps the weight gradients split: the same W, a longer B.
    if (rc == Recompute::kSelective) {
      CHECK(zb.chunk_backward_weight == none_costs.chunk_backward_weight);
      CHECK(zb.backward_input_ticks > none_costs.backward_input_ticks);
    }
  }
}

TEST_CASE("zb-h1's simulated bubble is Qi et al.'s (p-1)(F+B-W) / (m(F+B+W)), its planned one NCCL's; every stage "
          "holds min(p, m)", "[plan][schedule]") {
  const PlanRequest r = small_request();
  const Layout zb_layout = pp4(Recompute::kNone, ScheduleKind::kZeroBubbleH1);
  const Candidate zb = evaluate(r, zb_layout), one = evaluate(r, pp4(Recompute::kNone));
  const PipelineCosts pc = pipeline_costs(r.model, zb_layout, r.cluster, r.calibration);
  CHECK(zb.time.simulated_bubble_fraction ==
        pipeline::formula_bubble_fraction(ScheduleKind::kZeroBubbleH1, 4, 32, 1, pc.options).value());
  // Planned as the executor's NCCL batches run it: at m = 32 > p they hold B's sends and
  // cost zb-h1 more than its simulated gain, so it loses to 1F1B.
  CHECK(zb.time.bubble_fraction ==
        pipeline::verify_schedule_nccl_order(ScheduleKind::kZeroBubbleH1, 4, 32, 1, pc.options).bubble_fraction.value());
  CHECK(zb.time.bubble_fraction > one.time.bubble_fraction);
  CHECK(one.time.bubble_fraction == pipeline::formula_bubble_fraction(ScheduleKind::kOneFOneB, 4, 32, 1).value());
  CHECK(one.time.simulated_bubble_fraction == one.time.bubble_fraction);
  CHECK(zb.time.compute == one.time.compute);  // the same work: B + W is 1F1B's backward
  // Without a simulation at hand, the cost model simulates the layout's own schedule.
  CostOptions co;
  CHECK(predict_time(r.model, zb_layout, r.global_batch, r.cluster, r.calibration, co).step == zb.time.step);
  // Activations wait for their W: the last stage holds p = 4 micro-batches, 1F1B's 1.
  const auto sim = pipeline::simulate_schedule(ScheduleKind::kZeroBubbleH1, 4, 32, 1, pc.options);
  for (const auto& rank : sim.ranks) CHECK(rank.peak_inflight == 4);
  CHECK(zb.memory.inflight_microbatches == 4);
  const MemoryOptions mo = memory_options(r);
  CHECK(predict_memory(r.model, zb_layout, sim, mo).total() == zb.memory.total());
  CHECK(zb.memory.total() >= one.memory.total());
  CHECK(predict_memory(r.model, zb_layout, r.global_batch, mo).total() == zb.memory.total());
}

TEST_CASE("Without recompute at PP > 1 and m = p the planner picks zb-h1 over 1F1B", "[plan][schedule]") {
  // m = p = 4 micro-batches: no steady state, so NCCL's rendezvous leaves zb-h1 its gain.
  PlanRequest r = pp4_request(8, Recompute::kNone);
  const PlanResult res = plan::plan(r);
  // One layout (DP = 2), under both schedules, both fitting.
  CHECK(res.considered == 2);
  REQUIRE(res.ranked.size() == 2);
  CHECK(schedule_of(res.ranked[0].layout) == ScheduleKind::kZeroBubbleH1);
  CHECK(schedule_of(res.ranked[1].layout) == ScheduleKind::kOneFOneB);
  CHECK(res.ranked[0].layout.str() == res.ranked[1].layout.str() + " sched=zb-h1");
  CHECK(res.ranked[0].time.step < res.ranked[1].time.step);
  CHECK(why_lost(res.ranked[1], res.ranked[0]) != "best");
  // Fixed, each is the only one.
  r.schedule = ScheduleKind::kOneFOneB;
  const PlanResult fixed = plan::plan(r);
  REQUIRE(fixed.ranked.size() == 1);
  CHECK(schedule_of(fixed.ranked[0].layout) == ScheduleKind::kOneFOneB);
  CHECK(fixed.ranked[0].time.step == res.ranked[1].time.step);
}

TEST_CASE("With full recompute W is 0: zb-h1 is not proposed and 1F1B is kept", "[plan][schedule]") {
  PlanRequest r = pp4_request(64, Recompute::kFull);
  const PlanResult res = plan::plan(r);
  CHECK(res.considered == 1);
  REQUIRE(res.ranked.size() == 1);
  CHECK(schedule_of(res.ranked[0].layout) == ScheduleKind::kOneFOneB);
  // The explanation says why.
  const auto choices = schedule_choices(r, res.ranked[0].layout);
  REQUIRE(choices.size() == 3);
  CHECK(choices[2].kind == ScheduleKind::kZeroBubbleH1);
  CHECK_THAT(choices[2].error, Catch::Contains("W = 0 ticks"));
  // Asked for, it is planned all the same (W runs as the simulator's least cost, 1 tick).
  r.schedule = ScheduleKind::kZeroBubbleH1;
  const PlanResult fixed = plan::plan(r);
  REQUIRE(fixed.ranked.size() == 1);
  CHECK(schedule_of(fixed.ranked[0].layout) == ScheduleKind::kZeroBubbleH1);
}

TEST_CASE("zb-h1 is never proposed with ZeRO-3, VP > 1 or PP 1, and a fixed one says which", "[plan][schedule]") {
  PlanRequest r = small_request();
  r.cp = 1, r.max_micro_batch = 2, r.max_vpp = 2;
  const PlanResult res = plan::plan(r);
  int zb = 0;
  for (const auto& c : res.ranked) {
    if (schedule_of(c.layout) != ScheduleKind::kZeroBubbleH1) continue;
    ++zb;
    INFO(c.layout.str());
    CHECK(c.layout.pp > 1);
    CHECK(c.layout.vpp == 1);
    CHECK(c.layout.zero_stage < 3);
    CHECK(c.layout.recompute != Recompute::kFull);
  }
  CHECK(zb > 0);
  CHECK(count_schedule(res, ScheduleKind::kInterleaved) > 0);
  CHECK(count_schedule(res, ScheduleKind::kOneFOneB) > 0);

  Layout l = pp4(Recompute::kNone, ScheduleKind::kZeroBubbleH1);
  l.zero_stage = 3;
  CHECK_THAT(layout_error(r.model, l, 8, 64), Catch::Contains("expected ZeRO stage 0, 1 or 2, got ZeRO-3"));
  l.zero_stage = 1, l.vpp = 2;
  CHECK_THAT(layout_error(r.model, l, 8, 64), Catch::Contains("expected VP=1, got VP=2"));
  l.vpp = 1, l.pp = 1, l.dp = 8;
  CHECK_THAT(layout_error(r.model, l, 8, 64), Catch::Contains("expected PP > 1, got PP=1"));
  CHECK_THROWS_WITH(evaluate(r, l), Catch::Contains("sched=zb-h1 is not valid"));

  r.schedule = ScheduleKind::kZeroBubbleH1;
  r.zero_stage = 3;
  CHECK_THROWS_WITH(plan::plan(r), Catch::Contains("--schedule zb-h1 does not run with the fixed settings") &&
                                       Catch::Contains("got ZeRO-3") && Catch::Contains("--zero-stage 1 or 2"));
  r.zero_stage.reset();
  r.vpp = 2;
  CHECK_THROWS_WITH(plan::plan(r), Catch::Contains("expected VP=1, got VP=2"));
  r.vpp.reset();
  // Searched otherwise, every layout runs it.
  const PlanResult only = plan::plan(r);
  CHECK(count_schedule(only, ScheduleKind::kZeroBubbleH1) == static_cast<int>(only.ranked.size()));
  r.schedule = ScheduleKind::kInterleaved;
  r.vpp = 1;
  CHECK_THROWS_WITH(plan::plan(r), Catch::Contains("expected VP > 1, got VP=1"));
}

TEST_CASE("Explaining a layout: each schedule at its PP and micro-batches, or why not", "[plan][schedule]") {
  // 18 micro-batches: not a multiple of PP = 4, so no interleaving.
  PlanRequest r = small_request(36);
  const auto choices = schedule_choices(r, pp4(Recompute::kSelective));
  REQUIRE(choices.size() == 3);
  CHECK(choices[0].kind == ScheduleKind::kOneFOneB);
  CHECK(choices[0].error.empty());
  CHECK(choices[0].candidate.time.bubble_fraction ==
        pipeline::formula_bubble_fraction(ScheduleKind::kOneFOneB, 4, 18, 1).value());
  CHECK(choices[1].kind == ScheduleKind::kInterleaved);
  CHECK(choices[1].layout.vpp == 2);
  CHECK_THAT(choices[1].error, Catch::Contains("multiple of PP"));
  CHECK(choices[2].error.empty());
  CHECK(choices[2].candidate.time.simulated_bubble_fraction ==
        pipeline::formula_bubble_fraction(ScheduleKind::kZeroBubbleH1, 4, 18, 1, choices[2].costs.options).value());
  CHECK(choices[2].candidate.time.bubble_fraction ==
        pipeline::verify_schedule_nccl_order(ScheduleKind::kZeroBubbleH1, 4, 18, 1, choices[2].costs.options)
            .bubble_fraction.value());
  // 64: interleaved at VP 2, (p-1)/(v m).
  r.global_batch = 64;
  const auto at64 = schedule_choices(r, pp4(Recompute::kSelective));
  REQUIRE(at64[1].error.empty());
  CHECK(at64[1].candidate.time.bubble_fraction ==
        pipeline::formula_bubble_fraction(ScheduleKind::kInterleaved, 4, 32, 2).value());
  // An interleaved layout said outright predicts what the implied one does.
  Layout implied = pp4(Recompute::kSelective), named = implied;
  implied.vpp = named.vpp = 2;
  named.schedule = ScheduleKind::kInterleaved;
  CHECK(evaluate(r, named).time.step == evaluate(r, implied).time.step);
  CHECK(evaluate(r, named).time.step == at64[1].candidate.time.step);
}
