// GPT with context parallelism: for every layout of 2 and 4 ranks with c > 1 (c alone,
// with TP and SP, with PP, next to DP), MHA and GQA, learned positions and RoPE, both
// comm types and every recompute granularity, the loss and every gradient equal the
// whole model's on whole sequences (1e-5, fp32) — gradients summed over CP and averaged
// as the optimizer's DP x CP reduction does.
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
using megatorch::transformer::CpCommType;
using megatorch::transformer::Recompute;
namespace pipeline = megatorch::pipeline;

namespace {

struct CpLayout {
  int64_t tp, pp, cp;
  bool sp;
};

std::string describe(const CpLayout& l) {
  return "tp " + std::to_string(l.tp) + " pp " + std::to_string(l.pp) + " cp " + std::to_string(l.cp) +
         (l.sp ? " +SP" : "");
}

// Micro-batches of whole sequences; the first has ignored labels in one chunk, so the CP
// ranks hold different numbers of counted tokens.
std::vector<pipeline::MicroBatch> micro_batches(const gpt_test::TransformerConfig& c, int64_t m) {
  std::vector<pipeline::MicroBatch> mbs;
  for (int64_t i = 0; i < m; ++i) {
    auto d = gpt_test::batch_ids(2, c.seq_length(), c.vocab_size(), 300 + i);
    at::Tensor labels = d.narrow(1, 1, c.seq_length()).clone();
    if (i == 0) labels.narrow(1, 1, 3).fill_(megatorch::tp::kIgnoreIndex);
    mbs.push_back({d.narrow(1, 0, c.seq_length()), labels});
  }
  return mbs;
}

// Builds `config`'s stage on `st`, runs one step on `mbs` and checks its loss and every
// gradient against `full` (the whole model, backward already run on the same micro-batches,
// mean loss `ref_loss`).
void check_stage_against(const megatorch::parallel::ParallelState& st, const CpLayout& layout,
                         const gpt_test::TransformerConfig& config, const std::vector<pipeline::MicroBatch>& mbs,
                         GPTModel& full, const at::Tensor& ref_loss) {
  Group tpg(st, GroupKind::kTensor), cpg(st, GroupKind::kContext);
  pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config).tp_group(tpg.name()).pp_group(
      layout.pp > 1 ? st.group_name(GroupKind::kPipeline) : ""));
  REQUIRE(stage->context_parallel_size() == layout.cp);
  REQUIRE(stage->activation_shape(2)[0] == config.seq_length() / layout.cp / (layout.sp ? layout.tp : 1));
  auto result = pipeline::run_pipeline_step(stage, mbs, pipeline::ExecutorOptions());
  stage->allreduce_tied_grads();
  stage->allreduce_sequence_parallel_grads();
  // What the optimizer does over DP x CP (here DP x CP = CP per replica): sum, then
  // divide by its size; every CP rank's loss is c times its share.
  const double c = static_cast<double>(layout.cp);
  if (st.pp_rank() == layout.pp - 1) {
    REQUIRE(result.loss.defined());
    at::Tensor loss = result.loss.to(at::kDouble).reshape({1});
    cpg.all_reduce(loss);
    CHECK(loss.item<double>() / c == Approx(ref_loss.item<double>()).epsilon(1e-5));
  }
  gpt_test::for_each_stage_gradient(
      stage, full, config, tpg.rank(), tpg.size(),
      [&](const std::string& key, const std::string& name, const at::Tensor& p, const at::Tensor& want) {
        at::Tensor grad = p.grad().clone();
        cpg.all_reduce(grad);
        grad.div_(c);
        INFO(key << " (" << name << ")");
        CHECK_CLOSE(grad, want);
      });
}

// The whole model's mean loss over `mbs`, its gradients left in `full`.
at::Tensor reference_step(GPTModel& full, const std::vector<pipeline::MicroBatch>& mbs) {
  at::Tensor ref_loss = torch::zeros({});
  for (const auto& mb : mbs) {
    auto l = full->loss(mb.ids, mb.labels) / static_cast<double>(mbs.size());
    l.backward();
    ref_loss = ref_loss + l.detach();
  }
  return ref_loss;
}

}  // namespace

TEST_CASE("GPT at context-parallel size c gives the whole sequence's loss and gradients", "[mp][context_parallel]") {
  const int64_t world = mp::world_size();
  std::vector<CpLayout> layouts{{1, 1, world, false}};
  if (world == 4) {
    layouts.push_back({1, 1, 2, false});  // two CP pairs side by side (DP 2)
    layouts.push_back({2, 1, 2, false});  // heads split by TP first
    layouts.push_back({2, 1, 2, true});   // SP inside each CP rank's share
    layouts.push_back({1, 2, 2, false});  // CP inside each pipeline stage
  }
  int64_t cases = 0;
  for (const auto& layout : layouts) {
    auto st = mp::state(layout.tp, layout.pp, "cpgpt_" + std::to_string(cases), layout.cp);
    Group tpg(*st, GroupKind::kTensor), cpg(*st, GroupKind::kContext);
    REQUIRE(cpg.size() == layout.cp);
    for (const auto& variant : gpt_test::variants()) {
      if (variant.name == "mha-learned-gelu-untied") continue;  // positions and attention are what CP changes
      for (CpCommType comm : {CpCommType::kP2P, CpCommType::kA2A}) {
        const auto& base = variant.config;
        const int64_t heads = base.num_attention_heads() / layout.tp, groups = base.query_groups() / layout.tp;
        if (comm == CpCommType::kA2A && (heads % layout.cp || groups % layout.cp)) continue;
        for (Recompute recompute : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
          // Recompute replays the split attention; once per layout is enough.
          if (recompute != Recompute::kNone && (comm != CpCommType::kP2P || variant.name != "mha-learned-gelu-layernorm")) {
            continue;
          }
          ++cases;
          INFO(variant.name << " " << describe(layout) << " " << megatorch::transformer::to_string(comm) << " recompute "
                            << megatorch::transformer::to_string(recompute));
          // 16 tokens at c = 2 and 4; two chunks of 2 per rank (x t under SP) at any c.
          const int64_t unit = 4 * layout.cp * layout.tp;
          const int64_t seq = unit * std::max<int64_t>(1, 16 / unit);
          const auto ref_config = gpt_test::with_layers(base, 4).seq_length(seq);
          const auto config = gpt_test::TransformerConfig(ref_config)
                                  .sequence_parallel(layout.sp)
                                  .recompute(recompute)
                                  .context_parallel_group(cpg.name())
                                  .cp_comm_type(comm);
          const int64_t m = 2 * layout.pp;
          const auto mbs = micro_batches(ref_config, m);
          // Reference: the whole model on whole sequences, one rank.
          GPTModel full{GPTModelOptions(ref_config)};
          const at::Tensor ref_loss = reference_step(full, mbs);
          check_stage_against(*st, layout, config, mbs, full, ref_loss);
        }
      }
    }
  }
  CHECK(cases > 0);
}

// Attention dropout under CP draws its mask by position and global head
// (attention_dropout.h): the whole model on whole sequences draws the same mask when its
// attention takes the same path on a CP group of one rank, so every layout matches it.
// Hidden dropout stays 0 (its CPU masks depend on how many tokens a rank holds), and the
// pipeline stays 1 (a stage draws its layers' keys from its own generator).
TEST_CASE("attention dropout under context parallelism drops what one rank drops", "[mp][context_parallel]") {
  const int64_t world = mp::world_size();
  if (world < 2) return;
  std::vector<CpLayout> layouts{{1, 1, world, false}};
  if (world == 4) layouts.push_back({2, 1, 2, true});
  auto alone = mp::state(1, 1, "cpdrop_one", 1);  // every rank its own CP group of one
  const std::string one = alone->group_name(GroupKind::kContext);
  REQUIRE(Group(one).size() == 1);
  int64_t cases = 0;
  for (const auto& layout : layouts) {
    auto st = mp::state(layout.tp, layout.pp, "cpdrop_" + std::to_string(cases), layout.cp);
    for (const auto& variant : gpt_test::variants()) {
      if (variant.name == "mha-learned-gelu-untied") continue;
      for (CpCommType comm : {CpCommType::kP2P, CpCommType::kA2A}) {
        const auto& base = variant.config;
        if (comm == CpCommType::kA2A &&
            (base.num_attention_heads() / layout.tp % layout.cp || base.query_groups() / layout.tp % layout.cp)) {
          continue;
        }
        for (Recompute recompute : {Recompute::kNone, Recompute::kSelective}) {
          ++cases;
          INFO(variant.name << " " << describe(layout) << " " << megatorch::transformer::to_string(comm)
                            << " recompute " << megatorch::transformer::to_string(recompute));
          const auto ref_config = gpt_test::with_layers(base, 2)
                                      .seq_length(16)
                                      .hidden_dropout(0.0)
                                      .attention_dropout(0.25)
                                      .context_parallel_group(one);
          const auto config = gpt_test::TransformerConfig(ref_config)
                                  .sequence_parallel(layout.sp)
                                  .recompute(recompute)
                                  .context_parallel_group(st->group_name(GroupKind::kContext))
                                  .cp_comm_type(comm);
          const auto mbs = micro_batches(ref_config, 2);
          // Each model seeds the default generator as it is built, so both draw the same keys.
          GPTModel full{GPTModelOptions(ref_config)};
          const at::Tensor ref_loss = reference_step(full, mbs);
          check_stage_against(*st, layout, config, mbs, full, ref_loss);
          // The mask matters: without it the loss moves by more than the tolerance above
          // (about 2e-4 relative at initialisation, where attention is nearly uniform).
          GPTModel plain{GPTModelOptions(gpt_test::TransformerConfig(ref_config).attention_dropout(0.0))};
          CHECK(reference_step(plain, mbs).item<double>() != Approx(ref_loss.item<double>()).epsilon(1e-5));
        }
      }
    }
  }
  CHECK(cases > 0);
}

TEST_CASE("context parallelism refuses what it cannot split, by name", "[mp][context_parallel]") {
  const int64_t world = mp::world_size();
  if (world < 2) return;  // c = 1 splits nothing
  auto st = mp::state(1, 1, "cpgpt_bad", world);
  const std::string cp = st->group_name(GroupKind::kContext);
  const auto base = gpt_test::base_config().context_parallel_group(cp);
  const int64_t seq = 4 * world;  // two chunks of 2 tokens per rank
  // An odd length never splits into 2c chunks.
  CHECK_THROWS_WITH(GPTModel(GPTModelOptions(gpt_test::TransformerConfig(base).seq_length(seq + 1))),
                    Catch::Contains("divisible by 2 x the context-parallel size"));
  // Ulysses splits heads: one key/value head does not split over c >= 2.
  CHECK_THROWS_WITH(
      GPTModel(GPTModelOptions(gpt_test::TransformerConfig(base)
                                   .seq_length(seq)
                                   .num_attention_heads(4)
                                   .num_query_groups(1)
                                   .cp_comm_type(CpCommType::kA2A))),
      Catch::Contains("--cp-comm-type a2a") && Catch::Contains("--context-parallel-size " + std::to_string(world)));
}
