// megatorch::plan's pipeline schedules: zb-h1 next to 1F1B. Its B and W ticks (W: the chunk's
// weight GEMMs, 0 under full recompute), its bubble against Qi et al.'s formula, the search
// choosing it where it is faster and leaving it out where it cannot run or gains nothing;
// 1F1B and interleaved as before. ZB-V and DualPipeV on either backend: chunks of half
// a stage, the simulator's bubble and in-flight chunks, rank 0 holding the embedding and the
// head, and what they need.
#include <catch2/catch.hpp>
#include <megatorch/pipeline/nccl_order_model.h>

#include <cmath>

#include "megatorch/plan/moe.h"
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

// pp4 under a V schedule on Gloo: 3 layers a chunk, rank r holding virtual stages r and 7-r.
Layout pp4_v(ScheduleKind schedule, Recompute recompute = Recompute::kNone) {
  Layout l = pp4(recompute, schedule);
  l.backend = DistributedBackend::kGloo;
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

TEST_CASE("zb-h1's bubble is Qi et al.'s (p-1)(F+B-W) / (m(F+B+W)) on NCCL too; every stage holds min(p, m)",
          "[plan][schedule]") {
  const PlanRequest r = small_request();
  const Layout zb_layout = pp4(Recompute::kNone, ScheduleKind::kZeroBubbleH1);
  const Candidate zb = evaluate(r, zb_layout), one = evaluate(r, pp4(Recompute::kNone));
  const PipelineCosts pc = pipeline_costs(r.model, zb_layout, r.cluster, r.calibration);
  CHECK(zb.time.simulated_bubble_fraction ==
        pipeline::formula_bubble_fraction(ScheduleKind::kZeroBubbleH1, 4, 32, 1, pc.options).value());
  // Planned as the executor's NCCL channels run it (no send holds a compute): the simulated
  // bubble, below 1F1B's, where Megatron's single-communicator batches would hold B's sends.
  CHECK(zb.time.bubble_fraction == zb.time.simulated_bubble_fraction);
  CHECK(zb.time.bubble_fraction < one.time.bubble_fraction);
  CHECK(zb.time.bubble_fraction <
        pipeline::verify_schedule_nccl_order(ScheduleKind::kZeroBubbleH1, 4, 32, 1, pc.options).bubble_fraction.value());
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
  // m = p = 4 micro-batches: W fills 1F1B's bubble.
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
  REQUIRE(choices.size() == 5);
  CHECK(choices[2].kind == ScheduleKind::kZeroBubbleH1);
  CHECK_THAT(choices[2].error, Catch::Contains("W = 0 ticks"));
  // Asked for, it is planned all the same (W runs as the simulator's least cost, 1 tick).
  r.schedule = ScheduleKind::kZeroBubbleH1;
  const PlanResult fixed = plan::plan(r);
  REQUIRE(fixed.ranked.size() == 1);
  CHECK(schedule_of(fixed.ranked[0].layout) == ScheduleKind::kZeroBubbleH1);
}

TEST_CASE("zb-h1 is never proposed with VP > 1 or PP 1, and a fixed one says which; ZeRO-3 runs it",
          "[plan][schedule]") {
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
    CHECK(c.layout.recompute != Recompute::kFull);
  }
  CHECK(zb > 0);
  CHECK(count_schedule(res, ScheduleKind::kInterleaved) > 0);
  CHECK(count_schedule(res, ScheduleKind::kOneFOneB) > 0);

  Layout l = pp4(Recompute::kNone, ScheduleKind::kZeroBubbleH1);
  l.zero_stage = 3;  // B frees each unit as it moves on (optim/param_sharding.h)
  CHECK(layout_error(r.model, l, 8, 64).empty());
  l.zero_stage = 1, l.vpp = 2;
  CHECK_THAT(layout_error(r.model, l, 8, 64), Catch::Contains("expected VP=1, got VP=2"));
  l.vpp = 1, l.pp = 1, l.dp = 8;
  CHECK_THAT(layout_error(r.model, l, 8, 64), Catch::Contains("expected PP > 1, got PP=1"));
  CHECK_THROWS_WITH(evaluate(r, l), Catch::Contains("sched=zb-h1 is not valid"));

  r.schedule = ScheduleKind::kZeroBubbleH1;
  r.zero_stage = 3;
  const PlanResult zero3 = plan::plan(r);
  REQUIRE_FALSE(zero3.ranked.empty());
  for (const auto& c : zero3.ranked) CHECK(c.layout.zero_stage == 3);
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
  REQUIRE(choices.size() == 5);
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
  CHECK(choices[2].candidate.time.bubble_fraction == choices[2].candidate.time.simulated_bubble_fraction);
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

TEST_CASE("zb-v and dualpipev: chunks of half a stage, the simulator's bubble at v = 2, 2p and 2p+1 chunks in flight",
          "[plan][schedule]") {
  PlanRequest r = small_request();
  r.backend = DistributedBackend::kGloo;
  const ModelSpec& m = r.model;
  Layout il = pp4(Recompute::kNone);  // interleaved at VP 2: also 3 layers and half the head a chunk
  il.vpp = 2;
  const PipelineCosts ipc = pipeline_costs(m, il, r.cluster, r.calibration);
  const double peak = r.cluster.peak_tflops * 1e12, eff = r.calibration.matmul_efficiency_at(2048.0);
  const double weights = 3 * layer_forward_flops(m, 1).weights / (peak * eff) +
                         head_forward_flops(m, 1) * padded_vocab(m, 1) / m.vocab_size / (peak * eff) / 2;
  const Candidate one = evaluate(r, pp4(Recompute::kNone));
  const MemoryOptions mo = memory_options(r);
  const double per_layer = activation_bytes_per_layer(m, pp4(Recompute::kNone), mo.activations);
  for (ScheduleKind kind : {ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV}) {
    INFO(pipeline::schedule_kind_name(kind));
    const Layout l = pp4_v(kind);
    CHECK(model_chunks(l) == 2);
    CHECK(chunk_layout_of(l) == pipeline::ChunkLayout::kV);
    CHECK(head_rank(l) == 0);
    CHECK(l.str() ==
          std::string("TP=1 PP=4 DP=2 ZeRO-1 mb=1 recompute=none sched=") + pipeline::schedule_kind_name(kind));
    const PipelineCosts pc = pipeline_costs(m, l, r.cluster, r.calibration);
    // A chunk of 3 layers: the ticks of interleaved's chunks, W their weight GEMMs.
    CHECK(pc.chunk_forward == ipc.chunk_forward);
    CHECK(pc.chunk_backward == ipc.chunk_backward);
    CHECK(pc.chunk_backward_weight == Approx(weights).epsilon(1e-12));
    CHECK(pc.options.forward_cost == 200);
    CHECK(pc.backward_input_ticks == 228);
    CHECK(pc.backward_weight_ticks == 140);
    // DualPipeV's whole backwards cost B + W.
    CHECK(pc.options.backward_cost == pc.options.backward_input_cost + pc.options.backward_weight_cost);
    const Candidate c = evaluate(r, l);
    const auto sim = pipeline::simulate_schedule(kind, 4, 32, 2, pc.options);
    CHECK(c.time.bubble_fraction == sim.ranks[0].bubble.value());
    CHECK(c.time.simulated_bubble_fraction == c.time.bubble_fraction);  // Gloo holds no send
    CHECK(c.time.bubble_fraction < one.time.bubble_fraction);
    // Busy: 32 micro-batches x 2 chunks x (F + B + W) a chunk.
    const double busy = 32 * 2 * (pc.chunk_forward + pc.chunk_backward);
    CHECK(c.time.pipeline == Approx(busy * (1 + c.time.bubble_fraction)).epsilon(1e-12));
    CHECK(c.time.compute == Approx(one.time.compute).epsilon(1e-12));  // the same work
    // In flight on every rank: ZB-V 2p = 8 chunks, DualPipeV 2p+1 = 9, of 3 layers each.
    const int64_t chunks = kind == ScheduleKind::kZeroBubbleV ? 8 : 9;
    for (const auto& rank : sim.ranks) CHECK(rank.peak_inflight == chunks);
    CHECK(c.time.peak_inflight_chunks == chunks);
    CHECK(c.memory.inflight_microbatches == chunks / 2.0);
    CHECK(c.memory.activations == Approx(per_layer * chunks * 3).epsilon(1e-12));
    // ZB-V holds 1F1B's first stage's activations: p micro-batches of a whole stage.
    if (kind == ScheduleKind::kZeroBubbleV)
      CHECK(c.memory.activations == Approx(one.memory.activations).epsilon(1e-12));
    // Rank 0, with the embedding, the head and the logits, is the fullest.
    CHECK(c.memory.stage == 0);
    CHECK(c.memory.logits > 0);
    CHECK(predict_memory(m, l, r.global_batch, mo).total() == c.memory.total());
    CostOptions co;
    CHECK(predict_time(m, l, r.global_batch, r.cluster, r.calibration, co).step == c.time.step);
  }
}

TEST_CASE("In a V rank 0 holds the embedding and the head, the last rank neither", "[plan][schedule]") {
  const ModelSpec m;  // 24 layers, h = 2048, GeLU with biases, tied, learned positions
  const int64_t layer = 12 * 2048 * 2048 + 13 * 2048, vocab = 51200 * 2048, positions = 2048 * 2048, norm = 2 * 2048;
  REQUIRE(layer_params(m) == layer);
  const Layout one = pp4(Recompute::kNone), v = pp4_v(ScheduleKind::kZeroBubbleV);
  // 1F1B: the embedding on rank 0, the head's tied copy and the final norm on rank 3.
  CHECK(dense_params_per_rank(m, one, 0) == 6 * layer + vocab + positions);
  CHECK(dense_params_per_rank(m, one, 3) == 6 * layer + vocab + norm);
  // The V: both on rank 0 (two tensors: PipelineStage ties the head's copy across chunks),
  // 3 + 3 layers on every rank.
  CHECK(dense_params_per_rank(m, v, 0) == 6 * layer + 2 * vocab + positions + norm);
  CHECK(dense_params_per_rank(m, v, 0) == 516063232);
  for (int64_t rank : {1, 2, 3}) CHECK(dense_params_per_rank(m, v, rank) == 6 * layer);
  CHECK(params_per_rank(m, pp4_v(ScheduleKind::kDualPipeV), 0) == 516063232);
  // Its memory is rank 0's.
  PlanRequest r = small_request();
  const Candidate c = evaluate(r, v);
  CHECK(c.memory.dense_parameters == 516063232);
  CHECK(c.memory.states.total() == zero_bytes_per_rank(m, v, r.precision, 0).total());

  // With experts, the layers of a chunk follow the V: 8 layers on PP 2, rank 0 holding
  // layers 0-1 (stage 0) and 6-7 (stage 3), rank 1 layers 2-5; the first two dense.
  ModelSpec moe = m;
  moe.num_layers = 8, moe.num_experts = 4, moe.moe_first_k_dense = 2;
  Layout mv = v;
  mv.pp = 2, mv.dp = 4;
  CHECK(chunk_layer_counts(moe, mv, 0, 0).dense == 2);
  CHECK(chunk_layer_counts(moe, mv, 0, 1).moe == 2);
  CHECK(chunk_layer_counts(moe, mv, 1, 0).moe == 2);
  CHECK(chunk_layer_counts(moe, mv, 1, 1).moe == 2);
  CHECK(stage_layer_counts(moe, mv, 0).moe == 2);
  CHECK(stage_layer_counts(moe, mv, 1).moe == 4);
  // Looped, rank 0 holds layers 0-3 (two dense).
  mv.schedule = ScheduleKind::kOneFOneB;
  CHECK(stage_layer_counts(moe, mv, 0).moe == 2);
  CHECK(chunk_layer_counts(moe, mv, 1, 0).moe == 4);
  mv.schedule = ScheduleKind::kZeroBubbleV;
  CHECK(expert_params_per_rank(moe, mv, 1) == 4 * 4 * params_per_expert(moe));
  CHECK(expert_params_per_rank(moe, mv, 0) == 2 * 4 * params_per_expert(moe));
}

TEST_CASE("zb-v and dualpipev are searched on NCCL and Gloo alike, and each invalid case says why",
          "[plan][schedule]") {
  // NCCL, the default: the executor's channels carry the V (pipeline/p2p_channels.h).
  PlanRequest r = pp4_request(64, Recompute::kSelective);
  const Layout nccl = pp4(Recompute::kSelective, ScheduleKind::kZeroBubbleV);
  CHECK(layout_error(r.model, nccl, 8, 64).empty());
  const PlanResult on_nccl = plan::plan(r);
  CHECK(on_nccl.considered == 4);
  for (ScheduleKind kind : {ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV})
    CHECK(count_schedule(on_nccl, kind) == 1);
  Layout v_on_nccl = pp4_v(ScheduleKind::kDualPipeV);
  v_on_nccl.backend = DistributedBackend::kNccl;
  CHECK_THAT(gpt_pretrain_flags(r, v_on_nccl),
             Catch::Contains("--schedule dualpipev") && !Catch::Contains("--distributed-backend"));

  // Gloo: all four at VP 1, and zb-h1 timed as the simulator runs it.
  r.schedule.reset();
  r.backend = DistributedBackend::kGloo;
  const PlanResult on_gloo = plan::plan(r);
  CHECK(on_gloo.considered == 4);
  for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleV,
                            ScheduleKind::kDualPipeV})
    CHECK(count_schedule(on_gloo, kind) == 1);
  for (const auto& c : on_gloo.ranked) CHECK(c.layout.backend == DistributedBackend::kGloo);
  const auto zb = std::find_if(on_gloo.ranked.begin(), on_gloo.ranked.end(), [](const Candidate& c) {
    return schedule_of(c.layout) == ScheduleKind::kZeroBubbleH1;
  });
  REQUIRE(zb != on_gloo.ranked.end());
  const PipelineCosts zpc = pipeline_costs(r.model, zb->layout, r.cluster, r.calibration);
  CHECK(zb->time.bubble_fraction == zb->time.simulated_bubble_fraction);
  CHECK(zb->time.bubble_fraction ==
        pipeline::formula_bubble_fraction(ScheduleKind::kZeroBubbleH1, 4, 32, 1, zpc.options).value());
  CHECK(zb->time.bubble_fraction < pipeline::verify_schedule_nccl_order(ScheduleKind::kZeroBubbleH1, 4, 32, 1,
                                                                         zpc.options).bubble_fraction.value());
  const auto choices = schedule_choices(r, on_gloo.ranked[0].layout);
  REQUIRE(choices.size() == 5);
  for (size_t i : {3, 4}) {
    CHECK(choices[i].error.empty());
    CHECK(choices[i].layout.vpp == 1);
    CHECK(choices[i].candidate.time.bubble_fraction ==
          pipeline::simulate_schedule(choices[i].kind, 4, 32, 2, choices[i].costs.options).ranks[0].bubble.value());
  }
  CHECK_THAT(gpt_pretrain_flags(r, pp4_v(ScheduleKind::kZeroBubbleV)),
             Catch::Equals("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --micro-batch-size 1 "
                           "--global-batch-size 64 --zero-stage 1 --schedule zb-v --distributed-backend gloo --bf16"));
  CHECK_THAT(gpt_pretrain_flags(r, pp4_v(ScheduleKind::kDualPipeV)),
             Catch::Contains("--schedule dualpipev --distributed-backend gloo") &&
                 !Catch::Contains("--num-layers-per-virtual-pipeline-stage"));
  // Fixed, only the V.
  r.schedule = ScheduleKind::kZeroBubbleV;
  const PlanResult fixed = plan::plan(r);
  REQUIRE(fixed.ranked.size() == 1);
  CHECK(schedule_of(fixed.ranked[0].layout) == ScheduleKind::kZeroBubbleV);

  // Full recompute: no W to defer, so not searched (as zb-h1), and --explain says why.
  PlanRequest full = pp4_request(64, Recompute::kFull);
  full.backend = DistributedBackend::kGloo;
  const PlanResult kept = plan::plan(full);
  CHECK(kept.considered == 1);
  REQUIRE(kept.ranked.size() == 1);
  CHECK(schedule_of(kept.ranked[0].layout) == ScheduleKind::kOneFOneB);
  const auto why = schedule_choices(full, kept.ranked[0].layout);
  CHECK_THAT(why[3].error, Catch::Contains("W = 0 ticks"));
  CHECK_THAT(why[4].error, Catch::Contains("W = 0 ticks"));

  // What the V needs, each named.
  const ModelSpec& m = r.model;
  Layout l = pp4_v(ScheduleKind::kZeroBubbleV);
  REQUIRE(layout_error(m, l, 8, 64).empty());
  l.vpp = 2;
  CHECK_THAT(layout_error(m, l, 8, 64), Catch::Contains("two model chunks per stage in a V") &&
                                            Catch::Contains("expected VP=1, got VP=2"));
  l.vpp = 1, l.zero_stage = 3;  // ZeRO-3 runs the V's split backward too
  CHECK(layout_error(m, l, 8, 64).empty());
  l.zero_stage = 1, l.pp = 1, l.dp = 8;
  CHECK_THAT(layout_error(m, l, 8, 64), Catch::Contains("expected PP > 1, got PP=1"));
  l.pp = 8, l.dp = 1;  // 24 layers in 16 virtual stages
  CHECK_THAT(layout_error(m, l, 8, 64),
             Catch::Contains("expected the 24 layers divisible by 16, got a remainder of 8"));
  l.pp = 4, l.dp = 2;  // 8 sequences: 4 micro-batches, where the V needs 2 x 4
  CHECK_THAT(layout_error(m, l, 8, 8), Catch::Contains("expected at least 8 micro-batches per step, got 4") &&
                                           Catch::Contains("raise --global-batch-size to 16"));
  CHECK(layout_error(m, l, 8, 16).empty());
  for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1, ScheduleKind::kDualPipeV})
    CHECK(schedule_error(kind, 4, 1).empty());
  CHECK(parse_distributed_backend("gloo") == DistributedBackend::kGloo);
  CHECK_THROWS_WITH(parse_distributed_backend("mpi"), Catch::Contains("'nccl' or 'gloo', got 'mpi'"));
}
