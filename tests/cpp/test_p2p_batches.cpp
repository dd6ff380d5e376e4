// Pipeline p2p under NCCL's rules: the executor's batches (p2p_batches.h) for every
// schedule neither deadlock nor pair the wrong send and receive in the NCCL order model,
// and the model catches lists that would (unbatched transfers, swapped micro-batches, a
// hand-written cycle), naming ranks, steps and actions.
#include <catch2/catch.hpp>
#include <megatorch/pipeline/nccl_order_model.h>
#include <megatorch/pipeline/p2p_batches.h>
#include <megatorch/pipeline/schedule.h>

#include <string>
#include <vector>

#include "schedule_test_util.h"

namespace mp = megatorch::pipeline;
using mp::Action;
using mp::ActionKind;
using mp::P2PStep;
using mp::Ratio;
using mp::RecvPosting;
using mp::ScheduleKind;

namespace {

using namespace schedule_test;

P2PStep C(const Action& a) {
  P2PStep s;
  s.compute = a;
  return s;
}
P2PStep Batch(std::vector<Action> ops) {
  P2PStep s;
  s.batch = std::move(ops);
  return s;
}

std::string render(const std::vector<P2PStep>& steps) {
  std::string out;
  for (const P2PStep& s : steps) out += (out.empty() ? "" : " ") + mp::to_string(s);
  return out;
}

std::vector<std::vector<P2PStep>> steps_of(ScheduleKind kind, int64_t p, int64_t m, int64_t v, RecvPosting posting,
                                           bool batched = true) {
  std::vector<std::vector<P2PStep>> all;
  const auto lists = mp::build_schedules(kind, p, m, v);
  for (int64_t r = 0; r < p; ++r)
    all.push_back(batched ? mp::p2p_steps(lists[r], r, p, posting) : mp::unbatched_p2p_steps(lists[r]));
  return all;
}

// The steps are the list regrouped, nothing else: the computes in list order, every
// transfer exactly once, a send after the compute that produced it, a receive before the
// one that consumes it, and no batch empty. Returns the first problem.
std::string check_regrouping(const std::vector<Action>& list, const std::vector<P2PStep>& steps) {
  std::vector<Action> computes, transfers;
  for (const Action& a : list) (mp::is_compute(a.kind) ? computes : transfers).push_back(a);
  size_t next = 0, seen = 0;
  std::vector<int> used(transfers.size(), 0);
  for (const P2PStep& s : steps) {
    if (!s.is_batch()) {
      if (next >= computes.size() || s.compute != computes[next]) return "compute order at " + mp::to_string(s);
      ++next;
      continue;
    }
    for (const Action& a : s.batch) {
      size_t i = 0;
      while (i < transfers.size() && (transfers[i] != a || used[i])) ++i;
      if (i == transfers.size()) return "unknown or repeated " + mp::to_string(a);
      used[i] = 1;
      ++seen;
      // Position of the transfer in the list, in computes passed before it.
      size_t before = 0;
      for (const Action& x : list) {
        if (x == a) break;
        before += mp::is_compute(x.kind) ? 1 : 0;
      }
      if (mp::is_send(a.kind) && next != before) return "send moved: " + mp::to_string(a);
      if (mp::is_recv(a.kind) && next > before) return "receive after its consumer: " + mp::to_string(a);
    }
  }
  if (next != computes.size() || seen != transfers.size()) return "steps lose actions";
  return "";
}

}  // namespace

TEST_CASE("1F1B batches are Megatron's send_forward_recv_backward pairs", "[pipeline][p2p]") {
  CHECK(render(mp::schedule_p2p_steps(ScheduleKind::kOneFOneB, 2, 3, 1, 0)) ==
        "forward(mb 0, chunk 0) [send_activation(mb 0, chunk 0) to rank 1] forward(mb 1, chunk 0) "
        "[recv_grad(mb 0, chunk 0) from rank 1, send_activation(mb 1, chunk 0) to rank 1] backward(mb 0, chunk 0) "
        "forward(mb 2, chunk 0) [recv_grad(mb 1, chunk 0) from rank 1, send_activation(mb 2, chunk 0) to rank 1] "
        "backward(mb 1, chunk 0) [recv_grad(mb 2, chunk 0) from rank 1] backward(mb 2, chunk 0)");
  CHECK(render(mp::schedule_p2p_steps(ScheduleKind::kOneFOneB, 2, 3, 1, 1)) ==
        "[recv_activation(mb 0, chunk 0) from rank 0] forward(mb 0, chunk 0) backward(mb 0, chunk 0) "
        "[recv_activation(mb 1, chunk 0) from rank 0, send_grad(mb 0, chunk 0) to rank 0] forward(mb 1, chunk 0) "
        "backward(mb 1, chunk 0) [recv_activation(mb 2, chunk 0) from rank 0, send_grad(mb 1, chunk 0) to rank 0] "
        "forward(mb 2, chunk 0) backward(mb 2, chunk 0) [send_grad(mb 2, chunk 0) to rank 0]");
  // Interleaved posts each receive right after the previous compute of its direction:
  // rank 1 (p=2, v=2, m=4; computes F0.0 F1.0 F0.1 B0.1 F1.1 ...) posts the receive of
  // F1.1's input right after F0.1, before B0.1 runs.
  const auto il = mp::schedule_p2p_steps(ScheduleKind::kInterleaved, 2, 4, 2, 1);
  CHECK(render({il.begin(), il.begin() + 8}) ==
        "[recv_activation(mb 0, chunk 0) from rank 0] forward(mb 0, chunk 0) "
        "[recv_activation(mb 1, chunk 0) from rank 0, send_activation(mb 0, chunk 0) to rank 0] "
        "forward(mb 1, chunk 0) [recv_activation(mb 0, chunk 1) from rank 0, send_activation(mb 1, chunk 0) to rank 0] "
        "forward(mb 0, chunk 1) [recv_activation(mb 1, chunk 1) from rank 0] backward(mb 0, chunk 1)");
  CHECK(mp::recv_posting(ScheduleKind::kGPipe) == RecvPosting::kBeforeConsumer);
  CHECK(mp::recv_posting(ScheduleKind::kOneFOneB) == RecvPosting::kBeforeConsumer);
  CHECK(std::string(mp::recv_posting_name(mp::recv_posting(ScheduleKind::kInterleaved))) ==
        "after_previous_same_direction");
  // The message both ends compute alike: rank 1's chunk 1 is virtual stage 3 of p=2.
  CHECK(mp::p2p_message(SG(4, 1, 0), 1, 2) == mp::P2PMessage{true, 4, 2});
  CHECK(mp::p2p_message(RG(4, 1, 1), 0, 2) == mp::P2PMessage{true, 4, 2});
  CHECK(mp::p2p_message(RG(4, 0, 1), 0, 2) != mp::P2PMessage{true, 4, 2});
  CHECK(mp::to_string(mp::p2p_message(SA(3, 0, 1), 0, 2)) == "activation of mb 3 for virtual stage 1");
  CHECK_THROWS_WITH(mp::p2p_message(F(0), 0, 2), Catch::Contains("expected a send or receive action"));
  CHECK_THROWS_WITH(mp::p2p_steps({F(0), SA(0, 0, 0)}, 0, 2, RecvPosting::kBeforeConsumer),
                    Catch::Contains("to name a peer rank in [0, 2) other than itself"));
}

TEST_CASE("every schedule's batches pass the NCCL order model", "[pipeline][p2p]") {
  // p <= 16, m in {p, 2p, 4p}, v in {1, 2, 4} for interleaved: no deadlock, no mismatch,
  // every op matched, and under NCCL's rendezvous timing (free transfers, B = F and
  // B = 2F) the bubble is docs/reference.md's formula exactly, as the simulator's is.
  int64_t configs = 0, ops = 0;
  for (int64_t p = 1; p <= 16; ++p) {
    for (int64_t m : {p, 2 * p, 4 * p}) {
      for (auto [kind, v] : {std::pair{ScheduleKind::kGPipe, 1}, {ScheduleKind::kOneFOneB, 1},
                             {ScheduleKind::kInterleaved, 1}, {ScheduleKind::kInterleaved, 2},
                             {ScheduleKind::kInterleaved, 4}, {ScheduleKind::kZeroBubbleH1, 1}}) {
        INFO(mp::schedule_kind_name(kind) << " p " << p << " m " << m << " v " << v);
        const auto lists = mp::build_schedules(kind, p, m, v);
        std::vector<std::vector<P2PStep>> steps;
        for (int64_t r = 0; r < p; ++r) {
          steps.push_back(mp::schedule_p2p_steps(kind, p, m, v, r));
          REQUIRE(check_regrouping(lists[r], steps.back()) == "");
        }
        for (int64_t b : {1, 2}) {
          mp::SimulatorOptions costs;
          costs.backward_cost = b;
          costs.backward_input_cost = b;  // ZB-H1: B = F or 2F, W = F
          mp::NcclOrderReport report;
          REQUIRE_NOTHROW(report = mp::verify_nccl_order(steps, costs));
          // ZB-H1 posts without deadlock, but under rendezvous its sends, batched with the
          // next receive, wait for the deferred W's: no formula (docs/pipeline.md).
          if (kind != ScheduleKind::kZeroBubbleH1) {
            REQUIRE(report.bubble_fraction == mp::formula_bubble_fraction(kind, p, m, v, costs));
          }
          REQUIRE(report.max_batch <= 3);  // a send and at most one receive per direction
          if (b == 1) ops += report.ops;
        }
        ++configs;
      }
    }
  }
  CHECK(configs == 16 * 3 * 6);
  CHECK(ops > 300000);  // the sweep is not vacuous
}

TEST_CASE("forward-only (evaluation) steps pass the NCCL order model", "[pipeline][p2p]") {
  // The schedule's forwards in its order, each with its transfers, no backward; posted
  // with the schedule's own RecvPosting.
  CHECK(render(mp::forward_only_p2p_steps(ScheduleKind::kOneFOneB, 2, 2, 1, 0)) ==
        "forward(mb 0, chunk 0) [send_activation(mb 0, chunk 0) to rank 1] forward(mb 1, chunk 0) "
        "[send_activation(mb 1, chunk 0) to rank 1]");
  CHECK(render(mp::forward_only_p2p_steps(ScheduleKind::kOneFOneB, 2, 2, 1, 1)) ==
        "[recv_activation(mb 0, chunk 0) from rank 0] forward(mb 0, chunk 0) "
        "[recv_activation(mb 1, chunk 0) from rank 0] forward(mb 1, chunk 0)");
  // Interleaved keeps its groups of p micro-batches: chunk 0 of mb 0 and 1, then chunk 1.
  CHECK(render(mp::forward_only_p2p_steps(ScheduleKind::kInterleaved, 2, 2, 2, 0)) ==
        "forward(mb 0, chunk 0) [send_activation(mb 0, chunk 0) to rank 1] forward(mb 1, chunk 0) "
        "[recv_activation(mb 0, chunk 1) from rank 1, send_activation(mb 1, chunk 0) to rank 1] "
        "forward(mb 0, chunk 1) [recv_activation(mb 1, chunk 1) from rank 1, send_activation(mb 0, chunk 1) to rank 1] "
        "forward(mb 1, chunk 1) [send_activation(mb 1, chunk 1) to rank 1]");
  // p <= 16, every m up to 3p for gpipe and 1f1b (m < p too), m in {p, 2p, 4p} for
  // interleaved with v in {1, 2, 4}: no deadlock, no mismatch, every op matched, and the
  // steps are the forward-only list regrouped.
  int64_t configs = 0, ops = 0;
  for (int64_t p = 1; p <= 16; ++p) {
    std::vector<std::pair<ScheduleKind, std::pair<int64_t, int64_t>>> cases;  // (kind, (m, v))
    for (int64_t m = 1; m <= 3 * p; ++m) {
      cases.push_back({ScheduleKind::kGPipe, {m, 1}});
      cases.push_back({ScheduleKind::kOneFOneB, {m, 1}});
    }
    for (int64_t m : {p, 2 * p, 4 * p})
      for (int64_t v : {1, 2, 4}) cases.push_back({ScheduleKind::kInterleaved, {m, v}});
    for (const auto& [kind, mv] : cases) {
      const auto [m, v] = mv;
      INFO(mp::schedule_kind_name(kind) << " forward only, p " << p << " m " << m << " v " << v);
      std::vector<std::vector<P2PStep>> steps;
      for (int64_t r = 0; r < p; ++r) {
        const auto list = mp::build_forward_only_schedule(kind, p, m, v, r);
        int64_t forwards = 0;
        for (const Action& a : list) {
          REQUIRE((a.kind == ActionKind::kForward || a.kind == ActionKind::kSendActivation ||
                   a.kind == ActionKind::kRecvActivation));
          forwards += a.kind == ActionKind::kForward ? 1 : 0;
        }
        REQUIRE(forwards == m * v);
        steps.push_back(mp::forward_only_p2p_steps(kind, p, m, v, r));
        REQUIRE(check_regrouping(list, steps.back()) == "");
      }
      mp::NcclOrderReport report;
      REQUIRE_NOTHROW(report = mp::verify_nccl_order(steps));
      REQUIRE_NOTHROW(mp::verify_forward_only_nccl_order(kind, p, m, v));
      // Every virtual-stage boundary between two ranks carries each micro-batch once, a send and a receive.
      REQUIRE(report.ops == (p > 1 ? 2 * m * (p * v - 1) : 0));
      ops += report.ops;
      ++configs;
    }
  }
  CHECK(configs == 16 * 17 * 3 + 16 * 9);  // sum over p of 2·3p, and 9 interleaved cases per p
  CHECK(ops > 100000);  // the sweep is not vacuous
}

TEST_CASE("the NCCL order model rejects unbatched and mis-posted transfers", "[pipeline][p2p]") {
  // (a) One op per batch, as the executor posted them before: 1F1B's steady state
  // deadlocks for every p >= 2, m >= 2 (rank p-2 sends activation 1 while rank p-1 sends
  // gradient 0). p = 2, m = 2 worked by hand:
  //   rank 0: F0 [SA0] F1 [SA1] [RG0] B0 ...   rank 1: [RA0] F0 B0 [SG0] [RA1] F1 ...
  CHECK_THROWS_WITH(
      mp::verify_nccl_order(steps_of(ScheduleKind::kOneFOneB, 2, 2, 1, RecvPosting::kBeforeConsumer, false)),
      Catch::Contains("deadlock: 2 of 2 ranks") &&
          Catch::Contains("rank 0 step #3 [send_activation(mb 1, chunk 0) to rank 1]:\n"
                          "    send_activation(mb 1, chunk 0) to rank 1 (send #1) waits for rank 1's receive #1, "
                          "recv_activation(mb 1, chunk 0) from rank 0 at its step #4; rank 1 is at step #3 "
                          "[send_grad(mb 0, chunk 0) to rank 0]") &&
          Catch::Contains("rank 1 step #3 [send_grad(mb 0, chunk 0) to rank 0]"));
  for (int64_t p = 2; p <= 16; ++p) {
    for (int64_t m : {int64_t{2}, p, 2 * p}) {
      INFO("1f1b unbatched p " << p << " m " << m);
      CHECK_THROWS_WITH(
          mp::verify_nccl_order(steps_of(ScheduleKind::kOneFOneB, p, m, 1, RecvPosting::kBeforeConsumer, false)),
          Catch::Contains("rank " + std::to_string(p - 1) + " step #3 [send_grad(mb 0, chunk 0) to rank " +
                          std::to_string(p - 2) + "]"));
    }
  }
  // Why each schedule has its own posting: swapped, both deadlock. Interleaved with
  // receives only before their consumer (v > 1, m > p); 1F1B with receives a round early.
  for (int64_t p = 2; p <= 8; ++p) {
    INFO("p " << p);
    CHECK_THROWS_WITH(
        mp::verify_nccl_order(steps_of(ScheduleKind::kInterleaved, p, 2 * p, 2, RecvPosting::kBeforeConsumer)),
        Catch::Contains("deadlock"));
    CHECK_THROWS_WITH(mp::verify_nccl_order(steps_of(ScheduleKind::kOneFOneB, p, 2 * p, 1,
                                                     RecvPosting::kAfterPreviousSameDirection)),
                      Catch::Contains("deadlock"));
  }
  // GPipe's two postings coincide.
  CHECK(render(steps_of(ScheduleKind::kGPipe, 3, 4, 1, RecvPosting::kBeforeConsumer)[1]) ==
        render(steps_of(ScheduleKind::kGPipe, 3, 4, 1, RecvPosting::kAfterPreviousSameDirection)[1]));
}

TEST_CASE("the NCCL order model reports mismatches, cycles and unmatched ops", "[pipeline][p2p]") {
  // (b) Rank 0 runs its two forwards in swapped order: NCCL would hand micro-batch 1's
  // activation to rank 1's receive of micro-batch 0.
  auto swapped = steps_of(ScheduleKind::kOneFOneB, 2, 2, 1, RecvPosting::kBeforeConsumer);
  swapped[0] = mp::p2p_steps({F(1), SA(1, 0, 1), F(0), SA(0, 0, 1), RG(0, 0, 1), B(0), RG(1, 0, 1), B(1)}, 0, 2,
                             RecvPosting::kBeforeConsumer);
  CHECK_THROWS_WITH(mp::verify_nccl_order(swapped),
                    Catch::Contains("mismatch between rank 0 and rank 1: send #0 from rank 0 to rank 1 is "
                                    "send_activation(mb 1, chunk 0) to rank 1 at step #1 (activation of mb 1 for "
                                    "virtual stage 1), but receive #0 on rank 1 from rank 0 is "
                                    "recv_activation(mb 0, chunk 0) from rank 0 at step #0 (activation of mb 0 for "
                                    "virtual stage 1)") &&
                        Catch::Contains("would deliver the wrong tensor"));
  // (c) Both ranks send first, each send alone: each waits for the other's receive.
  const std::vector<std::vector<P2PStep>> crossed = {
      {C(F(0)), Batch({SA(0, 0, 1)}), Batch({RG(0, 0, 1)}), C(B(0))},
      {Batch({SG(0, 0, 0)}), Batch({RA(0, 0, 0)}), C(F(0)), C(B(0))}};
  CHECK_THROWS_WITH(mp::verify_nccl_order(crossed),
                    Catch::Contains("the steps deadlock: 2 of 2 ranks") &&
                        Catch::Contains("rank 0 step #1 [send_activation(mb 0, chunk 0) to rank 1]:\n"
                                        "    send_activation(mb 0, chunk 0) to rank 1 (send #0) waits for rank 1's "
                                        "receive #0, recv_activation(mb 0, chunk 0) from rank 0 at its step #1; "
                                        "rank 1 is at step #0 [send_grad(mb 0, chunk 0) to rank 0]") &&
                        Catch::Contains("rank 1 step #0 [send_grad(mb 0, chunk 0) to rank 0]:\n"
                                        "    send_grad(mb 0, chunk 0) to rank 0 (send #0) waits for rank 0's "
                                        "receive #0, recv_grad(mb 0, chunk 0) from rank 1 at its step #2"));
  // The same four ops, each rank's pair in one batch, complete.
  const std::vector<std::vector<P2PStep>> paired = {{C(F(0)), Batch({SA(0, 0, 1), RG(0, 0, 1)}), C(B(0))},
                                                    {Batch({SG(0, 0, 0), RA(0, 0, 0)}), C(F(0)), C(B(0))}};
  const auto report = mp::verify_nccl_order(paired);
  CHECK(report.batches == 2);
  CHECK(report.ops == 4);
  CHECK(report.steps == 6);
  // A send nobody receives; malformed steps.
  CHECK_THROWS_WITH(mp::verify_nccl_order({{Batch({SA(0, 0, 1)})}, {}}),
                    Catch::Contains("waits for rank 1's receive #0, which rank 1 never posts"));
  CHECK_THROWS_WITH(mp::verify_nccl_order({{Batch({F(0)})}}), Catch::Contains("batches a compute action"));
  CHECK_THROWS_WITH(mp::verify_nccl_order({{C(SA(0, 0, 1))}, {}}),
                    Catch::Contains("rank 0 step #0 is neither a compute action nor a batch"));
  CHECK_THROWS_WITH(mp::verify_nccl_order({{Batch({SA(0, 0, 5)})}, {}}),
                    Catch::Contains("to name a peer in [0, 2) other than rank 0"));
  CHECK_THROWS_WITH(mp::verify_nccl_order({}), Catch::Contains("one step list per pipeline rank"));
  CHECK_NOTHROW(mp::verify_nccl_order({{C(F(0)), C(B(0))}}));
}
