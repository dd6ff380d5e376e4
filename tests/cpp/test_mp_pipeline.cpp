// The pipeline executor: every schedule (the zero-bubble ones' split backward, ZB-V's and
// DualPipeV's V of two chunks per rank too) at p = 2 and 4 (TP 1
// and 2 inside stages, SP, two pipelines side by side) gives
// the loss and gradients of the single-stage model (1e-5, fp32), and the activations it
// stashes peak exactly where the schedule's simulation says.
#include <algorithm>
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "gpt_test_util.h"
#include "mp_util.h"
#include "tolerance.h"

using megatorch::comm::Group;
using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using megatorch::parallel::GroupKind;
namespace pipeline = megatorch::pipeline;

TEST_CASE("pipeline schedules give the single-stage loss and gradients", "[mp][pipeline]") {
  const int64_t world = mp::world_size();
  std::vector<std::pair<int64_t, int64_t>> layouts{{1, world}};  // (tp, pp)
  if (world == 4) {
    layouts.push_back({2, 2});  // TP inside every stage
    layouts.push_back({1, 2});  // two pipelines side by side (DP 2), each its own PP group
  }
  for (auto [tpn, ppn] : layouts) {
    auto st = mp::state(tpn, ppn, "pipe_" + std::to_string(tpn) + "_" + std::to_string(ppn));
    Group tpg(*st, GroupKind::kTensor), ppg(*st, GroupKind::kPipeline);
    for (auto kind : {pipeline::ScheduleKind::kGPipe, pipeline::ScheduleKind::kOneFOneB,
                      pipeline::ScheduleKind::kInterleaved, pipeline::ScheduleKind::kZeroBubbleH1,
                      pipeline::ScheduleKind::kZeroBubbleV, pipeline::ScheduleKind::kDualPipeV}) {
      for (bool sp : {false, true}) {
        if (sp && tpn == 1) continue;
        const int64_t v = kind == pipeline::ScheduleKind::kInterleaved ? 2 : pipeline::chunks_per_rank(kind, 1);
        const auto layout = pipeline::chunk_layout(kind);
        // The V schedules fill their V with 2p micro-batches; one more shows the steady state.
        const int64_t m = layout == pipeline::ChunkLayout::kV ? 2 * ppn + 1 : 2 * ppn;
        auto config = gpt_test::base_config().num_layers(8).sequence_parallel(sp);
        INFO(pipeline::schedule_kind_name(kind) << " tp=" << tpn << " pp=" << ppn << (sp ? " +SP" : ""));
        std::vector<pipeline::MicroBatch> mbs;
        for (int64_t i = 0; i < m; ++i) {
          auto d = gpt_test::batch_ids(2, config.seq_length(), config.vocab_size(), 100 + i);
          mbs.push_back({d.narrow(1, 0, config.seq_length()), d.narrow(1, 1, config.seq_length())});
        }
        // Reference: the whole model on one rank, micro-batch losses averaged.
        GPTModel full(GPTModelOptions(gpt_test::base_config().num_layers(8)));
        at::Tensor ref_loss = torch::zeros({});
        for (const auto& mb : mbs) {
          auto l = full->loss(mb.ids, mb.labels) / static_cast<double>(m);
          l.backward();
          ref_loss = ref_loss + l.detach();
        }
        pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config)
                                          .tp_group(tpg.name())
                                          .pp_group(ppg.name())
                                          .virtual_chunks(v)
                                          .chunk_layout(layout));
        pipeline::reset_pipeline_p2p_stats(ppg.name());
        auto result = pipeline::run_pipeline_step(stage, mbs, pipeline::ExecutorOptions().schedule(kind));
        // The batches count one send or recv per transfer of the schedule, one activation each.
        int64_t sends = 0, recvs = 0;
        for (const auto& a : pipeline::build_schedule(kind, ppn, m, v, ppg.rank())) {
          sends += pipeline::is_send(a.kind) ? 1 : 0;
          recvs += pipeline::is_recv(a.kind) ? 1 : 0;
        }
        const auto act = stage->activation_shape(2);
        const int64_t act_bytes = act[0] * act[1] * act[2] * 4;
        CHECK(pipeline::pipeline_p2p_stats(ppg.name())[megatorch::comm::CommOp::kSend].calls == sends);
        CHECK(pipeline::pipeline_p2p_stats(ppg.name())[megatorch::comm::CommOp::kSend].bytes == sends * act_bytes);
        CHECK(pipeline::pipeline_p2p_stats(ppg.name())[megatorch::comm::CommOp::kRecv].calls == recvs);
        CHECK(pipeline::pipeline_p2p_stats(ppg.name())[megatorch::comm::CommOp::kRecv].bytes == recvs * act_bytes);
        stage->allreduce_tied_embedding_grads();
        stage->allreduce_sequence_parallel_grads();
        // The loss is the last virtual stage's: the last rank's, or rank 0's in a V.
        if (stage->is_last_virtual_stage(v - 1)) {
          REQUIRE(result.loss.defined());
          CHECK(torch::allclose(result.loss, ref_loss, 1e-5, 0));
        } else {
          CHECK_FALSE(result.loss.defined());
        }
        gpt_test::for_each_stage_gradient(
            stage, full, config, tpg.rank(), tpg.size(),
            [](const std::string& key, const std::string& name, const at::Tensor& p, const at::Tensor& want) {
              INFO(key << " (" << name << ")");
              CHECK_CLOSE(p.grad(), want);
              CHECK_DETECTS_ERROR(p.grad(), want);
            });
        // Peak stashed activations: exactly the simulated schedule's peak in flight.
        const auto sim = pipeline::simulate_schedule(kind, ppn, m, v);
        CHECK(result.peak_stashed == sim.ranks[ppg.rank()].peak_inflight);
        const auto shape = stage->activation_shape(2);
        CHECK(result.peak_stashed_bytes == result.peak_stashed * shape[0] * shape[1] * shape[2] * 4);
        // F and B per micro-batch and chunk, and W where backward is split (DualPipeV
        // splits some of its backwards only).
        int64_t splits = 0;
        for (const auto& a : pipeline::build_schedule(kind, ppn, m, v, ppg.rank()))
          splits += a.kind == pipeline::ActionKind::kBackwardWeight ? 1 : 0;
        CHECK(result.timeline.size() == static_cast<size_t>(2 * m * v + splits));
        if (kind != pipeline::ScheduleKind::kDualPipeV) CHECK(splits == (pipeline::splits_backward(kind) ? m * v : 0));
        // Every rank's timeline on every rank, though DualPipeV's ranks run different numbers
        // of computes: each record where its rank's list has it.
        const auto gathered = pipeline::gather_timeline(result, ppg.name());
        std::vector<std::vector<pipeline::Action>> computes(ppn);
        size_t total = 0;
        for (int64_t r = 0; r < ppn; ++r) {
          for (const auto& a : pipeline::build_schedule(kind, ppn, m, v, r))
            if (pipeline::is_compute(a.kind)) computes[r].push_back(a);
          total += computes[r].size();
        }
        REQUIRE(gathered.size() == total);
        std::vector<size_t> seen(ppn, 0);
        for (const auto& rec : gathered) {
          REQUIRE(rec.rank >= 0);
          REQUIRE(rec.rank < ppn);
          CHECK(rec.action.kind == computes[rec.rank][seen[rec.rank]].kind);
          CHECK(rec.action.microbatch == computes[rec.rank][seen[rec.rank]].microbatch);
          CHECK(rec.action.chunk == computes[rec.rank][seen[rec.rank]].chunk);
          CHECK(rec.start >= 0);
          ++seen[rec.rank];
        }
      }
    }
  }
}

TEST_CASE("forward only: the single-stage loss over non-ignored tokens, no gradients", "[mp][pipeline]") {
  const int64_t world = mp::world_size();
  std::vector<std::pair<int64_t, int64_t>> layouts{{1, world}, {world, 1}};  // (tp, pp)
  if (world == 4) layouts.push_back({2, 2});
  for (auto [tpn, ppn] : layouts) {
    auto st = mp::state(tpn, ppn, "pipe_fwd_" + std::to_string(tpn) + "_" + std::to_string(ppn));
    Group tpg(*st, GroupKind::kTensor), ppg(*st, GroupKind::kPipeline);
    for (auto kind : {pipeline::ScheduleKind::kGPipe, pipeline::ScheduleKind::kOneFOneB,
                      pipeline::ScheduleKind::kInterleaved, pipeline::ScheduleKind::kZeroBubbleV}) {
      const int64_t v = kind == pipeline::ScheduleKind::kInterleaved ? 2 : pipeline::chunks_per_rank(kind, 1);
      const int64_t m = 2 * ppn;
      auto config = gpt_test::base_config().num_layers(8);
      INFO(pipeline::schedule_kind_name(kind) << " tp=" << tpn << " pp=" << ppn);
      // Some labels ignored, a different number in each micro-batch (micro-batch i: every
      // (i+2)-th token), so a plain token mean differs from the mean over the others.
      std::vector<pipeline::MicroBatch> mbs;
      for (int64_t i = 0; i < m; ++i) {
        auto d = gpt_test::batch_ids(2, config.seq_length(), config.vocab_size(), 300 + i);
        at::Tensor labels = d.narrow(1, 1, config.seq_length()).clone();
        labels.view(-1).slice(0, 0, labels.numel(), i + 2).fill_(megatorch::tp::kIgnoreIndex);
        mbs.push_back({d.narrow(1, 0, config.seq_length()), labels});
      }
      // Reference: the whole model, each micro-batch's loss summed over its valid tokens
      // and divided by their count, averaged over micro-batches; and what the trainer's
      // evaluation computed before it ran through the executor (a plain token mean).
      GPTModel full{GPTModelOptions(config)};
      full->eval();
      double ref = 0, plain_mean = 0;
      {
        torch::NoGradGuard no_grad;
        for (const auto& mb : mbs) {
          const auto per_token = full->per_token_loss(full->forward(mb.ids), mb.labels);
          ref += (per_token.sum() / (mb.labels != -100).sum()).item<double>() / static_cast<double>(m);
          plain_mean += per_token.mean().item<double>() / static_cast<double>(m);
        }
      }
      pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config)
                                        .tp_group(tpg.name())
                                        .pp_group(ppn > 1 ? ppg.name() : "")
                                        .virtual_chunks(v)
                                        .chunk_layout(pipeline::chunk_layout(kind)));
      stage->eval();
      pipeline::reset_pipeline_p2p_stats(ppg.name());
      const auto result =
          pipeline::run_pipeline_step(stage, mbs, pipeline::ExecutorOptions().schedule(kind).forward_only(true));
      // Only the forwards' transfers, one activation each.
      int64_t sends = 0, recvs = 0, forwards = 0;
      for (const auto& a : pipeline::build_forward_only_schedule(kind, ppn, m, v, ppg.rank())) {
        sends += pipeline::is_send(a.kind) ? 1 : 0;
        recvs += pipeline::is_recv(a.kind) ? 1 : 0;
        forwards += a.kind == pipeline::ActionKind::kForward ? 1 : 0;
        CHECK(a.kind != pipeline::ActionKind::kBackward);
      }
      CHECK(forwards == m * v);
      const auto act = stage->activation_shape(2);
      CHECK(pipeline::pipeline_p2p_stats(ppg.name())[megatorch::comm::CommOp::kSend].calls == sends);
      CHECK(pipeline::pipeline_p2p_stats(ppg.name())[megatorch::comm::CommOp::kSend].bytes == sends * act[0] * act[1] * act[2] * 4);
      CHECK(pipeline::pipeline_p2p_stats(ppg.name())[megatorch::comm::CommOp::kRecv].calls == recvs);
      if (stage->is_last_virtual_stage(v - 1)) {
        REQUIRE(result.loss.defined());
        CHECK_FALSE(result.loss.requires_grad());
        const double got = result.loss.item<double>();
        CHECK(got == Approx(ref).epsilon(1e-5));
        CHECK(std::abs(got - plain_mean) > 1e-2);  // the ignored tokens' zeros are not averaged in
      } else {
        CHECK_FALSE(result.loss.defined());
      }
      for (int64_t c = 0; c < stage->num_chunks(); ++c) {
        for (const auto& p : stage->chunk(c)->named_parameters()) {
          INFO(p.key());
          CHECK_FALSE(p.value().grad().defined());
        }
      }
      CHECK(result.peak_stashed == 0);
      CHECK(result.timeline.size() == static_cast<size_t>(m * v));
    }
  }
}

TEST_CASE("an untimed step records no timeline and gives the timed step's loss and gradients bit for bit",
          "[mp][pipeline]") {
  const int64_t world = mp::world_size();
  auto st = mp::state(1, world, "pipe_untimed");
  Group ppg(*st, GroupKind::kPipeline);
  const auto config = gpt_test::base_config().num_layers(2 * world).hidden_dropout(0.0).attention_dropout(0.0);
  for (auto kind : {pipeline::ScheduleKind::kOneFOneB, pipeline::ScheduleKind::kZeroBubbleH1}) {
    INFO(pipeline::schedule_kind_name(kind));
    const int64_t m = 2 * world;
    std::vector<pipeline::MicroBatch> mbs;
    for (int64_t i = 0; i < m; ++i) {
      const auto d = gpt_test::batch_ids(2, config.seq_length(), config.vocab_size(), 500 + i);
      mbs.push_back({d.narrow(1, 0, config.seq_length()), d.narrow(1, 1, config.seq_length())});
    }
    pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config).pp_group(ppg.name()));
    std::vector<pipeline::PipelineStepResult> results;
    std::vector<std::vector<at::Tensor>> grads;
    for (bool timed : {true, false}) {
      for (auto& p : stage->parameters()) p.mutable_grad() = at::Tensor();
      results.push_back(
          pipeline::run_pipeline_step(stage, mbs, pipeline::ExecutorOptions().schedule(kind).time_compute(timed)));
      grads.emplace_back();
      for (const auto& p : stage->parameters()) grads.back().push_back(p.grad().clone());
    }
    const auto& timed = results[0];
    const auto& untimed = results[1];
    const auto actions = pipeline::build_schedule(kind, world, m, 1, ppg.rank());
    const auto computes =
        std::count_if(actions.begin(), actions.end(), [](const pipeline::Action& a) { return pipeline::is_compute(a.kind); });
    CHECK(static_cast<int64_t>(timed.timeline.size()) == computes);
    CHECK(timed.busy_s > 0);
    CHECK(untimed.timeline.empty());
    CHECK(untimed.busy_s == 0);
    CHECK(untimed.makespan_s == 0);
    CHECK(untimed.peak_stashed == timed.peak_stashed);
    CHECK(timed.loss.defined() == untimed.loss.defined());
    if (timed.loss.defined()) CHECK(torch::equal(untimed.loss, timed.loss));
    REQUIRE(grads[0].size() == grads[1].size());
    for (size_t i = 0; i < grads[0].size(); ++i) CHECK(torch::equal(grads[1][i], grads[0][i]));
  }
}

TEST_CASE("batch_p2p posts a batch both ways, counts each op, fills non-contiguous buffers", "[mp][pipeline]") {
  using megatorch::comm::CommOp;
  using megatorch::comm::P2POp;
  auto st = mp::state(1, mp::world_size(), "pipe_batch");
  Group g(*st, GroupKind::kPipeline);
  const int64_t n = g.size(), r = g.rank(), next = (r + 1) % n, prev = (r + n - 1) % n;
  g.reset_stats();
  // Both neighbours at once (one peer twice when n = 2: the tags keep Gloo's pairs apart).
  auto from_prev = torch::empty({3, 2}).t();  // non-contiguous: received into a copy, then written back
  auto from_next = torch::empty({4});
  auto work = g.batch_p2p({{P2POp::Kind::kSend, torch::full({2, 3}, static_cast<double>(r)), next, 0},
                           {P2POp::Kind::kSend, torch::full({4}, 100.0 + r), prev, 1},
                           {P2POp::Kind::kRecv, from_prev, prev, 0},
                           {P2POp::Kind::kRecv, from_next, next, 1}});
  work.wait();
  CHECK(work.is_completed());
  CHECK(torch::equal(from_prev, torch::full({2, 3}, static_cast<double>(prev))));
  CHECK(torch::equal(from_next, torch::full({4}, 100.0 + next)));
  CHECK(g.stats()[CommOp::kSend].calls == 2);
  CHECK(g.stats()[CommOp::kSend].bytes == (6 + 4) * 4);
  CHECK(g.stats()[CommOp::kRecv].calls == 2);
  CHECK(g.stats()[CommOp::kRecv].bytes == (6 + 4) * 4);
  CHECK(g.batch_p2p({}).is_completed());
  CHECK_THROWS_WITH(g.batch_p2p({{P2POp::Kind::kSend, torch::ones({1}), r, 0}}),
                    Catch::Contains("other than this rank " + std::to_string(r)));
  CHECK(g.stats()[CommOp::kSend].calls == 2);  // a rejected batch posts and counts nothing
}

TEST_CASE("stages built from different configurations fail on every rank, before any p2p", "[mp][pipeline]") {
  auto st = mp::state(1, mp::world_size(), "pipe_mismatch");
  Group ppg(*st, GroupKind::kPipeline);
  auto config = gpt_test::base_config().num_layers(8).hidden_size(ppg.rank() == 0 ? 32 : 64);
  CHECK_THROWS_WITH(pipeline::PipelineStage(pipeline::PipelineStageOptions(config).pp_group(ppg.name())),
                    Catch::Contains("every stage must be built from the same model configuration"));
  auto good = gpt_test::base_config().num_layers(8);
  pipeline::PipelineStage stage(pipeline::PipelineStageOptions(good).pp_group(ppg.name()));
  std::vector<pipeline::MicroBatch> bad{{torch::zeros({2, 5}, torch::kLong), torch::zeros({2, 5}, torch::kLong)}};
  CHECK_THROWS_WITH(pipeline::run_pipeline_step(stage, bad), Catch::Contains("micro-batch's ids and labels to be [b, 8]"));
  CHECK_THROWS_WITH(pipeline::run_pipeline_step(stage, std::vector<pipeline::MicroBatch>(3, {torch::zeros({2, 8}, torch::kLong), torch::zeros({2, 8}, torch::kLong)}),
                                                pipeline::ExecutorOptions().schedule(pipeline::ScheduleKind::kInterleaved)),
                    Catch::Contains("--num-microbatches to be a multiple of"));
}

TEST_CASE("bad pipeline splits are errors", "[mp][pipeline]") {
  CHECK_THROWS_WITH(pipeline::split_layers(6, 4, 1, {}), Catch::Contains("divisible by pipeline stages"));
  CHECK_THROWS_WITH(pipeline::split_layers(6, 2, 1, {4, 1}), Catch::Contains("sum to num_layers = 6"));
  CHECK_THROWS_WITH(pipeline::split_layers(6, 2, 1, {6, 0}), Catch::Contains("at least one layer"));
  CHECK(pipeline::split_layers(6, 2, 1, {4, 2}) == std::vector<int64_t>{4, 2});
}
