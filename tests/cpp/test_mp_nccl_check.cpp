// The NCCL-semantics check on real process groups (Gloo underneath): calls that Gloo runs
// but NCCL would not fail the check with the group, ranks, sequence numbers and both ops;
// and the pipeline executor, which follows NCCL's rules while the check is on, moves its
// transfers on the channel communicators.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cstdlib>

#include "gpt_test_util.h"
#include "mp_util.h"

using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
namespace comm = megatorch::comm;
namespace pipeline = megatorch::pipeline;

namespace {

// This case's traces checked now, on every rank, instead of when the case ends.
comm::NcclCheckReport check_now(const std::string& key) {
  const auto env = megatorch::parallel::LaunchEnv::from_environment();
  static c10::intrusive_ptr<c10d::Store> store =
      megatorch::parallel::connect_store(env, megatorch::parallel::default_comm_timeout());
  return comm::check_nccl_semantics_across_ranks(store, "test_mp_nccl_check/" + key, env.rank, env.world_size);
}

}  // namespace

TEST_CASE("the NCCL check fails transfers that Gloo pairs by tag but NCCL would pair by order", "[mp][nccl]") {
  if (!comm::nccl_check_enabled()) {
    WARN("skipped: MEGATORCH_NCCL_CHECK=0 turned the check off");
    return;
  }
  auto st = mp::state(1, 1, "nccl_misorder");
  Group g(*st, GroupKind::kWorld);
  const int64_t r = g.rank();
  // Rank 0 sends tags 1 then 2 to rank 1, which receives tag 2 first: fine on Gloo.
  if (r == 0) {
    auto first = g.send_async(torch::full({4}, 1.0), 1, 1);
    auto second = g.send_async(torch::full({4}, 2.0), 1, 2);
    first.wait();
    second.wait();
  } else if (r == 1) {
    auto second = torch::empty({4}), first = torch::empty({4});
    g.recv(second, 0, 2);
    g.recv(first, 0, 1);
    CHECK(torch::equal(first, torch::full({4}, 1.0)));
    CHECK(torch::equal(second, torch::full({4}, 2.0)));
  }
  g.barrier();
  CHECK_THROWS_WITH(check_now("misorder"), Catch::Contains("group 'nccl_misorder.world'") &&
                                               Catch::Contains("send #0 and receive #0 between group ranks 0 and 1") &&
                                               Catch::Contains("carry different tags") &&
                                               Catch::Contains("(tag 1, 16 bytes)") && Catch::Contains("(tag 2, 16 bytes)"));
  // Posted in matching order, the same transfers pass.
  if (r == 0) {
    g.send(torch::full({4}, 1.0), 1, 1);
  } else if (r == 1) {
    auto t = torch::empty({4});
    g.recv(t, 0, 1);
  }
  CHECK(check_now("ordered").transfers == 2);
}

TEST_CASE("under NCCL's rules every schedule moves its transfers on the channel communicators", "[mp][nccl][pipeline]") {
  const int64_t world = mp::world_size();
  auto st = mp::state(1, world, "nccl_channels");
  Group ppg(*st, GroupKind::kPipeline);
  auto config = gpt_test::base_config().num_layers(8);
  for (auto kind : {pipeline::ScheduleKind::kOneFOneB, pipeline::ScheduleKind::kZeroBubbleV}) {
    const int64_t v = pipeline::chunks_per_rank(kind, 1);
    const int64_t m = 2 * world;
    std::vector<pipeline::MicroBatch> mbs;
    for (int64_t i = 0; i < m; ++i) {
      auto d = gpt_test::batch_ids(2, config.seq_length(), config.vocab_size(), 7 + i);
      mbs.push_back({d.narrow(1, 0, config.seq_length()), d.narrow(1, 1, config.seq_length())});
    }
    pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config)
                                      .pp_group(ppg.name())
                                      .virtual_chunks(v)
                                      .chunk_layout(pipeline::chunk_layout(kind)));
    ppg.reset_stats();
    for (int64_t k = 0; k < pipeline::num_p2p_channels(v, pipeline::chunk_layout(kind)); ++k) comm::reset_comm_stats(ppg.name() + ".ch" + std::to_string(k));
    pipeline::run_pipeline_step(stage, mbs, pipeline::ExecutorOptions().schedule(kind).recv_lookahead(2));
    int64_t sends = 0;
    for (const auto& a : pipeline::build_schedule(kind, world, m, v, ppg.rank())) sends += pipeline::is_send(a.kind);
    if (comm::nccl_check_enabled()) {
      // None on the PP group itself; every one on a channel.
      CHECK(ppg.stats()[comm::CommOp::kSend].calls == 0);
      int64_t on_channels = 0;
      for (int64_t k = 0; k < pipeline::num_p2p_channels(v, pipeline::chunk_layout(kind)); ++k)
        on_channels += comm::comm_stats(ppg.name() + ".ch" + std::to_string(k))[comm::CommOp::kSend].calls;
      CHECK(on_channels == sends);
    } else {
      CHECK(ppg.stats()[comm::CommOp::kSend].calls == sends);
    }
    CHECK(pipeline::pipeline_p2p_stats(ppg.name())[comm::CommOp::kSend].calls == sends);
  }
}
