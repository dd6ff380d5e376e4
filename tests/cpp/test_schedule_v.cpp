// The V schedules: ZB-V and DualPipeV hold two chunks per rank in a V (rank r: virtual
// stages r and 2p-1-r). Their placement, their orders, and the simulator's bubbles next
// to the published formulas, with the conditions those formulas need.
#include <catch2/catch.hpp>
#include <megatorch/pipeline/nccl_order_model.h>
#include <megatorch/comm/nccl_semantics.h>
#include <megatorch/pipeline/p2p_batches.h>
#include <megatorch/pipeline/p2p_channels.h>
#include <megatorch/pipeline/schedule.h>
#include <megatorch/pipeline/simulator.h>

#include <tuple>

namespace mp = megatorch::pipeline;
using mp::Action;
using mp::ActionKind;
using mp::ChunkLayout;
using mp::Ratio;
using mp::ScheduleKind;

namespace {

// "F0.1 B3.0 W3.0 BB2.1": F forward, B input gradient, W weight gradient, BB a whole backward.
std::string compute_order(const std::vector<Action>& list) {
  std::string s;
  for (const Action& a : list) {
    if (!mp::is_compute(a.kind)) continue;
    if (!s.empty()) s += ' ';
    const char* letter = a.kind == ActionKind::kForward          ? "F"
                         : a.kind == ActionKind::kBackwardInput  ? "B"
                         : a.kind == ActionKind::kBackwardWeight ? "W"
                                                                 : "BB";
    s += letter + std::to_string(a.microbatch) + "." + std::to_string(a.chunk);
  }
  return s;
}

mp::SimulatorOptions split_costs(int64_t f, int64_t b, int64_t w) {
  mp::SimulatorOptions o;
  o.forward_cost = f;
  o.backward_input_cost = b;
  o.backward_weight_cost = w;
  o.backward_cost = b + w;
  o.record_timeline = false;
  return o;
}

}  // namespace

TEST_CASE("V layout: rank r holds virtual stages r and 2p-1-r; the turn and the loss stay local", "[pipeline][schedule]") {
  CHECK(mp::chunk_layout(ScheduleKind::kZeroBubbleV) == ChunkLayout::kV);
  CHECK(mp::chunk_layout(ScheduleKind::kDualPipeV) == ChunkLayout::kV);
  CHECK(mp::chunk_layout(ScheduleKind::kZeroBubbleH1) == ChunkLayout::kLooped);
  CHECK(mp::chunks_per_rank(ScheduleKind::kDualPipeV, 1) == 2);
  CHECK(mp::chunks_per_rank(ScheduleKind::kInterleaved, 3) == 3);
  for (int64_t p : {1, 2, 3, 4, 8}) {
    for (int64_t s = 0; s < 2 * p; ++s) {
      const int64_t r = mp::rank_of_virtual_stage(s, p, ChunkLayout::kV);
      const int64_t c = mp::chunk_of_virtual_stage(s, p, ChunkLayout::kV);
      REQUIRE(mp::virtual_stage(c, r, p, ChunkLayout::kV) == s);
      REQUIRE(r == (s < p ? s : 2 * p - 1 - s));
    }
  }
  // p = 4: rank 3 turns the micro-batch around (stages 3 and 4), rank 0 holds the loss (7).
  CHECK(mp::virtual_stage(1, 3, 4, ChunkLayout::kV) == 4);
  CHECK(mp::virtual_stage(1, 0, 4, ChunkLayout::kV) == 7);
  // The turn needs no transfer: rank p-1's chunk-1 forward takes its chunk 0's output.
  for (const Action& a : mp::build_schedule(ScheduleKind::kZeroBubbleV, 4, 8, 2, 3)) {
    if (a.kind == ActionKind::kRecvActivation) REQUIRE(a.chunk == 0);
    if (a.kind == ActionKind::kSendActivation) REQUIRE(a.chunk == 1);
    if (mp::is_send(a.kind) || mp::is_recv(a.kind)) REQUIRE(a.peer == 2);
  }
  CHECK(mp::parse_schedule_kind("ZBV") == ScheduleKind::kZeroBubbleV);
  CHECK(mp::parse_schedule_kind("dual_pipe_v") == ScheduleKind::kDualPipeV);
  CHECK(std::string(mp::schedule_kind_name(ScheduleKind::kDualPipeV)) == "dualpipev");
  CHECK(mp::splits_backward(ScheduleKind::kZeroBubbleV));
  CHECK(mp::splits_backward(ScheduleKind::kDualPipeV));
}

TEST_CASE("ZB-V and DualPipeV orders for p=2, m=4", "[pipeline][schedule]") {
  // ZB-V: warm-up 2(p-r)-1 chunk-0 forwards, r (F1, F0) pairs, p-r rounds of F1 B1 W1;
  // one F, B, W per chunk in steady state; the last rank holds r W's back for the tail.
  CHECK(compute_order(mp::build_schedule(ScheduleKind::kZeroBubbleV, 2, 4, 2, 0)) ==
        "F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3.0 B0.0 W0.0 F2.1 B2.1 W2.1 B1.0 W1.0 F3.1 B3.1 W3.1 "
        "B2.0 W2.0 B3.0 W3.0");
  CHECK(compute_order(mp::build_schedule(ScheduleKind::kZeroBubbleV, 2, 4, 2, 1)) ==
        "F0.0 F0.1 F1.0 F1.1 B0.1 W0.1 F2.0 B0.0 W0.0 F2.1 B1.1 W1.1 F3.0 B1.0 W1.0 F3.1 B2.1 W2.1 B2.0 B3.1 "
        "B3.0 W2.0 W3.1 W3.0");
  // DualPipeV: a forward of one chunk next to a whole backward of the other in steady
  // state; split backwards only where their W's fill the warm-up and the tail.
  CHECK(compute_order(mp::build_schedule(ScheduleKind::kDualPipeV, 2, 4, 2, 0)) ==
        "F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 F3.0 BB1.1 F2.1 BB0.0 BB2.1 F3.1 BB1.0 BB3.1 B2.0 W2.0 B3.0 W3.0");
  CHECK(compute_order(mp::build_schedule(ScheduleKind::kDualPipeV, 2, 4, 2, 1)) ==
        "F0.0 F0.1 F1.0 F1.1 F2.0 BB0.1 F2.1 BB0.0 F3.0 BB1.1 F3.1 BB1.0 BB2.1 BB2.0 B3.1 B3.0 W3.1 W3.0");
  for (const Action& a : mp::build_schedule(ScheduleKind::kZeroBubbleV, 4, 8, 2, 1)) {
    REQUIRE(a.kind != ActionKind::kBackward);  // ZB-V splits every backward
  }
}

TEST_CASE("ZB-V idles (p-1)F per rank at F = B = W and holds 1F1B's p micro-batches", "[pipeline][simulator]") {
  // Qi et al. give ZB-V a bubble of about zero at equal costs. The simulator's exact
  // figure: each rank idles (p-1)F, the first micro-batch's walk down the V (costs per
  // chunk, half a stage), whatever m >= 2p, against 1F1B's (p-1)(F+B+W) per whole stage.
  // It holds 2p chunk activations: 1F1B's p micro-batches of a whole stage.
  for (int64_t p : {2, 3, 4, 5, 8, 16, 32}) {
    for (int64_t m : {2 * p, 2 * p + 1, 3 * p + 1, 8 * p}) {
      for (int64_t c : {1, 2, 3}) {
        INFO("p " << p << " m " << m << " F = B = W = " << c);
        const auto o = split_costs(c, c, c);
        const auto sim = mp::simulate_schedule(ScheduleKind::kZeroBubbleV, p, m, 2, o);
        for (const auto& rank : sim.ranks) {
          REQUIRE(rank.idle == (p - 1) * c);
          REQUIRE(rank.peak_inflight == 2 * p);
        }
        REQUIRE(sim.bubble_fraction == mp::formula_bubble_fraction(ScheduleKind::kZeroBubbleV, p, m, 2, o));
        REQUIRE(sim.bubble_fraction == Ratio::of(p - 1, 6 * m));
      }
    }
  }
  CHECK_THROWS_WITH(mp::formula_bubble_fraction(ScheduleKind::kZeroBubbleV, 4, 8, 2, split_costs(2, 2, 1)),
                    Catch::Contains("F = B = W"));
}

TEST_CASE("DualPipeV idles DualPipe's (PP/2-1)(F&B+B-3W) with PP = 2p where B = 2W and B <= F <= B+W",
          "[pipeline][simulator]") {
  // DualPipe's README gives (PP/2-1)(F&B+B-3W) for DualPipe on PP ranks; DualPipeV is
  // DualPipe on 2p ranks folded onto p, so (p-1)(F&B+B-3W), here with F&B = F + B (the
  // executor runs the pair one after the other). The simulator gives exactly that when
  // B = 2W and B <= F <= B + W (DeepSeek's F = B = 2W among them); other costs run, but
  // idle otherwise. It holds 2p + 1 chunk activations (DualPipe's PP + 1 halved, plus one).
  const std::vector<std::tuple<int64_t, int64_t, int64_t>> fbw{{2, 2, 1}, {3, 2, 1}, {4, 4, 2}, {6, 4, 2},
                                                               {6, 6, 3}, {9, 6, 3}};
  for (int64_t p : {2, 3, 4, 5, 8, 16, 32}) {
    for (int64_t m : {2 * p, 2 * p + 1, 3 * p + 1, 8 * p}) {
      for (const auto& [f, b, w] : fbw) {
        INFO("p " << p << " m " << m << " F " << f << " B " << b << " W " << w);
        const auto o = split_costs(f, b, w);
        const auto sim = mp::simulate_schedule(ScheduleKind::kDualPipeV, p, m, 2, o);
        for (const auto& rank : sim.ranks) {
          REQUIRE(rank.idle == (p - 1) * ((f + b) + b - 3 * w));
          REQUIRE(rank.peak_inflight == 2 * p + 1);
        }
        REQUIRE(sim.bubble_fraction == mp::formula_bubble_fraction(ScheduleKind::kDualPipeV, p, m, 2, o));
      }
    }
  }
  CHECK_THROWS_WITH(mp::formula_bubble_fraction(ScheduleKind::kDualPipeV, 4, 8, 2, split_costs(1, 1, 1)),
                    Catch::Contains("B = 2W and B <= F <= B + W"));
}

TEST_CASE("V schedules: any costs complete; forward-only runs; bad arguments say what to pass", "[pipeline][schedule]") {
  for (ScheduleKind kind : {ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV}) {
    for (int64_t p : {1, 2, 3, 4, 7}) {
      for (int64_t m : {2 * p, 2 * p + 3, 5 * p}) {
        for (const auto& [f, b, w] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{{1, 3, 2}, {4, 1, 1}, {2, 5, 3}}) {
          INFO(mp::schedule_kind_name(kind) << " p " << p << " m " << m);
          const auto sim = mp::simulate_schedule(kind, p, m, 2, split_costs(f, b, w));
          for (const auto& rank : sim.ranks) REQUIRE(rank.busy == 2 * m * (f + b + w));
          // Evaluation keeps the forwards in the schedule's order: every chunk of every micro-batch.
          for (int64_t r = 0; r < p; ++r) {
            int64_t forwards = 0;
            for (const Action& a : mp::build_forward_only_schedule(kind, p, m, 2, r)) {
              REQUIRE(a.kind != ActionKind::kBackward);
              REQUIRE(a.kind != ActionKind::kBackwardInput);
              forwards += a.kind == ActionKind::kForward;
            }
            REQUIRE(forwards == 2 * m);
          }
        }
      }
    }
    CHECK_THROWS_WITH(mp::build_schedule(kind, 4, 7, 2, 0), Catch::Contains("at least 8 micro-batches"));
    CHECK_THROWS_WITH(mp::build_schedule(kind, 4, 8, 1, 0), Catch::Contains("two model chunks per rank in a V"));
  }
}

TEST_CASE("V schedules on NCCL: their transfers cross, so one communicator cannot carry them; channels can",
          "[pipeline][nccl]") {
  // Between ranks r and r+1, chunk 0's activations and chunk 1's gradients both go down;
  // the receiver takes them in another order than the sender makes them. NCCL pairs by
  // issue order, so on one communicator the order model finds the mismatch; on the
  // executor's channels (one per chunk and direction) each stream keeps its order.
  for (ScheduleKind kind : {ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV}) {
    CHECK_THROWS_WITH(mp::verify_schedule_nccl_order(kind, 4, 8, 2), Catch::Contains("mismatch"));
    CHECK_NOTHROW(megatorch::comm::check_nccl_semantics(mp::channel_traces(kind, 4, 8, 2)));
  }
  // The same message on both ends under the V placement (p = 4): rank 1's chunk 1 is
  // virtual stage 6, whose input gradient goes to stage 5, rank 2's chunk 1.
  const Action send{ActionKind::kSendGrad, 3, 1, 2};
  const Action recv{ActionKind::kRecvGrad, 3, 1, 1};
  CHECK(mp::p2p_message(send, 1, 4, ChunkLayout::kV) == mp::p2p_message(recv, 2, 4, ChunkLayout::kV));
  CHECK(mp::p2p_message(send, 1, 4, ChunkLayout::kV).to_stage == 5);
}
