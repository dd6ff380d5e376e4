// The NCCL-semantics check (comm/nccl_semantics.h) on hand-made traces: each rule it
// enforces fails when broken, with the communicator, ranks, sequence numbers and both ops;
// and the executor's channel posting (pipeline/p2p_channels.h) passes it for every
// schedule, while a deliberately mis-ordered one fails.
#include <catch2/catch.hpp>
#include <megatorch/comm/nccl_semantics.h>
#include <megatorch/pipeline/p2p_channels.h>

#include <algorithm>

namespace comm = megatorch::comm;
namespace mp = megatorch::pipeline;
using comm::CommOp;
using comm::RankTrace;
using comm::TracedOp;
using mp::ScheduleKind;

namespace {

TracedOp collective(const std::string& c, int64_t grank, int64_t size, CommOp op, const std::string& sig) {
  TracedOp o;
  o.comm = c;
  o.group = c;
  o.group_rank = grank;
  o.group_size = size;
  o.op = op;
  o.signature = sig;
  return o;
}

TracedOp p2p(const std::string& c, int64_t grank, int64_t size, std::vector<comm::TracedTransfer> transfers,
             bool batch = false) {
  TracedOp o = collective(c, grank, size, transfers.front().send ? CommOp::kSend : CommOp::kRecv, "");
  o.transfers = std::move(transfers);
  o.batch = batch;
  return o;
}

comm::TracedTransfer send(int64_t peer, int64_t tag) { return {true, peer, tag, 64}; }
comm::TracedTransfer recv(int64_t peer, int64_t tag) { return {false, peer, tag, 64}; }

// Appends `op` to `t`, posted after the waits made so far; returns its index.
int64_t post(RankTrace& t, TracedOp op) {
  op.waits_before = static_cast<int64_t>(t.waits.size());
  t.ops.push_back(std::move(op));
  return static_cast<int64_t>(t.ops.size()) - 1;
}

std::vector<RankTrace> two_ranks() {
  std::vector<RankTrace> t(2);
  t[0].rank = 0;
  t[1].rank = 1;
  return t;
}

}  // namespace

TEST_CASE("NCCL check: collectives must come in the same order with the same shape", "[nccl]") {
  auto t = two_ranks();
  for (int64_t r = 0; r < 2; ++r) {
    post(t[r], collective("tp", r, 2, CommOp::kAllReduce, "Floatx8,sum"));
    post(t[r], collective("dp", r, 2, CommOp::kAllGather, "Floatx4"));
  }
  const auto ok = comm::check_nccl_semantics(t);
  CHECK(ok.collectives == 4);
  CHECK(ok.communicators == 2);
  // Swapped on one rank: each communicator still sees its own op first, so NCCL runs it;
  // but one rank waiting on the first before posting the second deadlocks the other.
  auto swapped = two_ranks();
  post(swapped[0], collective("tp", 0, 2, CommOp::kAllReduce, "Floatx8,sum"));
  swapped[0].waits.push_back(0);
  post(swapped[0], collective("dp", 0, 2, CommOp::kAllGather, "Floatx4"));
  post(swapped[1], collective("dp", 1, 2, CommOp::kAllGather, "Floatx4"));
  swapped[1].waits.push_back(0);
  post(swapped[1], collective("tp", 1, 2, CommOp::kAllReduce, "Floatx8,sum"));
  CHECK_THROWS_WITH(comm::check_nccl_semantics(swapped),
                    Catch::Contains("deadlock") && Catch::Contains("all_reduce #0") &&
                        Catch::Contains("waited for"));
  // Different shapes for the same collective: named with both ops.
  auto shapes = two_ranks();
  post(shapes[0], collective("tp", 0, 2, CommOp::kAllReduce, "Floatx8,sum"));
  post(shapes[1], collective("tp", 1, 2, CommOp::kAllReduce, "Floatx16,sum"));
  CHECK_THROWS_WITH(comm::check_nccl_semantics(shapes),
                    Catch::Contains("group 'tp': collective #0 differs") && Catch::Contains("Floatx8,sum") &&
                        Catch::Contains("Floatx16,sum") && Catch::Contains("rank 1 (group rank 1)"));
  // One rank skips a collective.
  auto skipped = two_ranks();
  post(skipped[0], collective("tp", 0, 2, CommOp::kAllReduce, "Floatx8,sum"));
  post(skipped[0], collective("tp", 0, 2, CommOp::kBarrier, "Floatx0"));
  post(skipped[1], collective("tp", 1, 2, CommOp::kAllReduce, "Floatx8,sum"));
  CHECK_THROWS_WITH(comm::check_nccl_semantics(skipped),
                    Catch::Contains("barrier #1") && Catch::Contains("issued only 1 collectives"));
}

TEST_CASE("NCCL check: sends pair with receives by issue order, not by tag", "[nccl]") {
  // Rank 0 sends tags 1 then 2; rank 1 receives 2 then 1: Gloo pairs them by tag, NCCL
  // would hand tag 1's tensor to the receive meant for tag 2.
  auto t = two_ranks();
  post(t[0], p2p("pp", 0, 2, {send(1, 1)}));
  post(t[0], p2p("pp", 0, 2, {send(1, 2)}));
  post(t[1], p2p("pp", 1, 2, {recv(0, 2)}));
  post(t[1], p2p("pp", 1, 2, {recv(0, 1)}));
  CHECK_THROWS_WITH(comm::check_nccl_semantics(t), Catch::Contains("send #0 and receive #0") &&
                                                       Catch::Contains("carry different tags") &&
                                                       Catch::Contains("group 'pp'"));
  std::swap(t[1].ops[0], t[1].ops[1]);
  CHECK(comm::check_nccl_semantics(t).transfers == 4);
  // A receive nobody sends.
  post(t[1], p2p("pp", 1, 2, {recv(0, 3)}));
  CHECK_THROWS_WITH(comm::check_nccl_semantics(t), Catch::Contains("has no matching send"));
  // A batch on one end and lone ops on the other never pair on NCCL.
  auto mixed = two_ranks();
  post(mixed[0], p2p("pp", 0, 2, {send(1, 1)}, /*batch=*/true));
  post(mixed[1], p2p("pp", 1, 2, {recv(0, 1)}));
  CHECK_THROWS_WITH(comm::check_nccl_semantics(mixed), Catch::Contains("different communicators"));
}

TEST_CASE("NCCL check: crossing sends deadlock alone and complete in one batch", "[nccl]") {
  // Each rank sends to the other, then receives: on one pair's stream each send waits for
  // a receive queued behind the other's send.
  auto alone = two_ranks();
  for (int64_t r = 0; r < 2; ++r) {
    post(alone[r], p2p("pp", r, 2, {send(1 - r, 7)}));
    post(alone[r], p2p("pp", r, 2, {recv(1 - r, 7)}));
  }
  CHECK_THROWS_WITH(comm::check_nccl_semantics(alone),
                    Catch::Contains("deadlock") && Catch::Contains("2 of 2 ranks") &&
                        Catch::Contains("queued behind"));
  auto batched = two_ranks();
  for (int64_t r = 0; r < 2; ++r) post(batched[r], p2p("pp", r, 2, {send(1 - r, 7), recv(1 - r, 7)}, true));
  CHECK(comm::check_nccl_semantics(batched).batches == 2);
  // On two communicators (two channels) the same lone ops complete.
  auto channels = two_ranks();
  for (int64_t r = 0; r < 2; ++r) {
    post(channels[r], p2p(r == 0 ? "down" : "up", r, 2, {send(1 - r, 7)}));
    post(channels[r], p2p(r == 0 ? "up" : "down", r, 2, {recv(1 - r, 7)}));
  }
  CHECK(comm::check_nccl_semantics(channels).transfers == 4);
}

TEST_CASE("NCCL check: a rank's waits order its later ops across communicators", "[nccl]") {
  // Each rank waits for its receive on one channel before sending on the other: the
  // receives need the sends that come after the waits, a cycle through both ranks.
  auto t = two_ranks();
  for (int64_t r = 0; r < 2; ++r) {
    const std::string in = r == 0 ? "a" : "b", out = r == 0 ? "b" : "a";
    post(t[r], p2p(in, r, 2, {recv(1 - r, 1)}));
    t[r].waits.push_back(0);
    post(t[r], p2p(out, r, 2, {send(1 - r, 1)}));
  }
  CHECK_THROWS_WITH(comm::check_nccl_semantics(t), Catch::Contains("deadlock"));
  // Without the waits both sends go out and both receives complete.
  for (auto& r : t) r.waits.clear(), r.ops[1].waits_before = 0;
  CHECK_NOTHROW(comm::check_nccl_semantics(t));
}

TEST_CASE("NCCL check: traces survive their text form", "[nccl]") {
  auto t = two_ranks();
  post(t[0], collective("x.tp@megatorch/0/tp/0/", 0, 2, CommOp::kAllReduce, "Floatx8,sum"));
  post(t[0], p2p("pp", 0, 2, {send(1, 5), recv(1, 6)}, true));
  t[0].waits = {1, 0};
  const RankTrace back = comm::parse_trace(comm::serialize_trace(t[0]));
  REQUIRE(back.ops.size() == 2);
  CHECK(back.ops[0].comm == t[0].ops[0].comm);
  CHECK(back.ops[0].signature == "Floatx8,sum");
  CHECK(back.ops[1].batch);
  REQUIRE(back.ops[1].transfers.size() == 2);
  CHECK(back.ops[1].transfers[1].tag == 6);
  CHECK_FALSE(back.ops[1].transfers[1].send);
  CHECK(back.ops[1].waits_before == 0);
  CHECK(back.waits == std::vector<int64_t>{1, 0});
  CHECK_THROWS_WITH(comm::parse_trace("X 1\n"), Catch::Contains("line 1 is garbled"));
}

TEST_CASE("The executor's channels pass NCCL's rules for every schedule; a mis-ordered one fails", "[nccl][pipeline]") {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved,
                            ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV}) {
    const int64_t v = kind == ScheduleKind::kInterleaved ? 2 : mp::chunks_per_rank(kind, 1);
    for (int64_t p : {2, 3, 4}) {
      for (int64_t m : {2 * p, 3 * p, 4 * p + (kind == ScheduleKind::kInterleaved ? 0 : 1)}) {
        for (int64_t lookahead : {1, 2}) {
          INFO(mp::schedule_kind_name(kind) << " p=" << p << " m=" << m << " lookahead=" << lookahead);
          const auto report = comm::check_nccl_semantics(mp::channel_traces(kind, p, m, v, lookahead));
          CHECK(report.communicators == mp::num_p2p_channels(v, mp::chunk_layout(kind)));
          CHECK_NOTHROW(comm::check_nccl_semantics(mp::channel_traces(kind, p, m, v, lookahead, true)));
        }
      }
    }
  }
  // Rank 1 posts two of its activation sends in the wrong order: rank 2 would get the
  // wrong micro-batch, and the check names the pair, the sequence numbers and both tags.
  auto traces = mp::channel_traces(ScheduleKind::kZeroBubbleV, 4, 8, 2);
  auto& ops = traces[1].ops;
  std::vector<size_t> sends;
  for (size_t i = 0; i < ops.size(); ++i)
    if (ops[i].comm == "ch0" && ops[i].transfers[0].send) sends.push_back(i);
  REQUIRE(sends.size() >= 2);
  std::swap(ops[sends[0]].transfers, ops[sends[1]].transfers);
  CHECK_THROWS_WITH(comm::check_nccl_semantics(traces),
                    Catch::Contains("group 'ch0': send #0 and receive #0 between group ranks 1 and 2") &&
                        Catch::Contains("carry different tags"));
  CHECK_THROWS_WITH(mp::channel_traces(ScheduleKind::kOneFOneB, 2, 4, 1, 0), Catch::Contains("lookahead >= 1"));
}
