// Sharded checkpoints. Saved at TP2 x PP(world/2) with two virtual chunks per stage, loaded
// at TP1, at TP=world and as ZeRO-style element ranges over DP (and the reverse): every
// parameter equals the matching slice of the saving model exactly (a checkpoint moves
// bytes, no arithmetic) and the loss equals the reference's to 1e-6 (fp32). A killed save
// leaves the previous checkpoint loadable; a bad checksum, a missing shard or another
// model shape fails on every rank before any weight changes.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <ftw.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "gpt_test_util.h"
#include "megatorch/util/strings.h"
#include "mp_util.h"

namespace ckpt = megatorch::ckpt;
namespace fs = std::filesystem;
using megatorch::comm::Group;
using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using megatorch::parallel::GroupKind;
namespace pipeline = megatorch::pipeline;

namespace {

// rm -rf (std::filesystem::remove_all resolves to libtorch's copy, which crashes).
void remove_tree(const fs::path& path) {
  if (!fs::exists(fs::symlink_status(path))) return;
  ::nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return std::remove(p); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

// One directory per test case, the same on every rank of this torchrun job.
std::string test_dir(Group& world, const std::string& name) {
  const char* run = std::getenv("TORCHELASTIC_RUN_ID");
  const char* port = std::getenv("MASTER_PORT");
  const fs::path dir = fs::temp_directory_path() /
                       ("megatorch_ckpt_" + std::string(run ? run : "") + "_" + (port ? port : "0") + "_" + name);
  if (world.rank() == 0) remove_tree(dir);
  world.barrier();
  return dir.string();
}

void scramble(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.fill_(3.0);
}

std::pair<torch::Tensor, torch::Tensor> batch(const gpt_test::TransformerConfig& c) {
  const auto d = gpt_test::batch_ids(2, c.seq_length(), c.vocab_size(), 42);
  return {d.narrow(1, 0, c.seq_length()), d.narrow(1, 1, c.seq_length())};
}

double loss_of(GPTModel& m, const gpt_test::TransformerConfig& c) {
  torch::NoGradGuard no_grad;
  const auto [ids, labels] = batch(c);
  return m->loss(ids, labels).item<double>();
}

// Every parameter of a (chunk of a) TP-sharded model equals the slice of the reference.
void check_equals_reference(GPTModel& part, GPTModel& ref, int64_t tp_rank, int64_t tp_size,
                            const gpt_test::TransformerConfig& c, const std::string& what) {
  auto ref_params = ref->named_parameters();
  for (const auto& p : part->named_parameters()) {
    const bool tied_copy = p.key() == "output_layer" && c.tie_embeddings();
    const std::string name = ckpt::gpt_global_name(p.key(), part->options.layer_begin(), tied_copy);
    REQUIRE(ref_params.contains(name));
    const auto want = gpt_test::expected_shard(name, ref_params[name], p.value(), tp_rank, tp_size, c);
    INFO(what << ": " << p.key() << " (" << name << ")");
    CHECK(torch::equal(p.value(), want));
  }
}

ckpt::CheckpointState state_for(const gpt_test::TransformerConfig& c, int64_t rank) {
  ckpt::CheckpointState s;
  s.model_config = ckpt::gpt_config_json(c);
  s.state = {{"consumed_samples", 1234}, {"loss_scale", 65536.0}};
  s.rank_state = {{"rank", rank}};
  return s;
}

// A DP rank's share of a flat tensor of n elements: [r*n/d, (r+1)*n/d).
std::pair<int64_t, int64_t> zero_range(int64_t n, int64_t r, int64_t d) { return {r * n / d, (r + 1) * n / d}; }

// ZeRO-style entries: each rank holds a range of every flattened parameter of a TP1 model.
std::vector<ckpt::ShardedEntry> zero_entries(GPTModel& model, int64_t r, int64_t d, const std::string& prefix,
                                             bool with_data) {
  std::vector<ckpt::ShardedEntry> out;
  for (auto& e : ckpt::gpt_model_entries(*model, ckpt::GPTEntriesOptions().prefix(prefix))) {
    const auto [b, en] = zero_range(e.tensor.numel(), r, d);
    e.begin = b;
    e.end = en;
    e.tensor = with_data ? e.tensor.detach().reshape({-1}).narrow(0, b, en - b).clone() : torch::zeros({en - b});
    e.write = true;
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace

TEST_CASE("checkpoint saved at TP2 x PP loads at TP1, TP=world and as ZeRO ranges", "[mp][ckpt]") {
  const int64_t world = mp::world_size();
  REQUIRE(world % 2 == 0);
  auto save_st = mp::state(2, world / 2, "ckpt_save");
  Group world_g(*save_st, GroupKind::kWorld), tpg(*save_st, GroupKind::kTensor), ppg(*save_st, GroupKind::kPipeline);
  auto tp1 = mp::state(1, 1, "ckpt_tp1");
  auto tpw = mp::state(world, 1, "ckpt_tpw");
  Group tpw_g(*tpw, GroupKind::kTensor);
  for (const auto& variant : gpt_test::variants()) {
    auto config = gpt_test::with_layers(variant.config, 4);
    INFO(variant.name);
    const std::string dir = test_dir(world_g, "reshard_" + variant.name);
    GPTModel ref{GPTModelOptions(config)};  // the saved weights, whole, on every rank
    const double ref_loss = loss_of(ref, config);

    // Save: TP2 x PP(world/2), 2 virtual chunks per stage when pipelined (a chunk per layer).
    const int64_t v = ppg.size() > 1 ? 2 : 1;
    pipeline::PipelineStage stage(
        pipeline::PipelineStageOptions(config).tp_group(tpg.name()).pp_group(ppg.name()).virtual_chunks(v));
    auto entries = ckpt::pipeline_stage_entries(*stage);
    ckpt::save_checkpoint(dir, 5, entries, state_for(config, world_g.rank()), world_g.name());
    CHECK(ckpt::latest_iteration(dir) == 5);
    const auto meta = ckpt::read_metadata(dir);
    CHECK(meta["tensors"]["model/embedding.weight"]["shape"] == nlohmann::json({config.vocab_size(), config.hidden_size()}));
    CHECK(meta["files"].size() == static_cast<size_t>(world));  // every rank holds a TP shard to write

    const auto load_opts = ckpt::LoadOptions().group(world_g.name()).model_config(ckpt::gpt_shape_json(config));
    {  // TP1 on every rank (DP = world): all replicas load, none writes
      GPTModel m(GPTModelOptions(gpt_test::TransformerConfig(config).seed(99)));
      scramble(*m);
      auto es = ckpt::gpt_model_entries(*m, ckpt::GPTEntriesOptions().writer(false));
      const auto loaded = ckpt::load_checkpoint(dir, es, load_opts);
      CHECK(loaded.iteration == 5);
      CHECK(loaded.state.state["consumed_samples"] == 1234);
      CHECK(loaded.state.rank_state == nlohmann::json({{"rank", world_g.rank()}}));  // same world size
      check_equals_reference(m, ref, 0, 1, config, "TP1");
      CHECK(loss_of(m, config) == ref_loss);
    }
    {  // TP = world
      GPTModel m(GPTModelOptions(gpt_test::TransformerConfig(config).seed(99)).group(tpw_g.name()));
      scramble(*m);
      auto es = ckpt::gpt_model_entries(*m);
      ckpt::load_checkpoint(dir, es, load_opts);
      check_equals_reference(m, ref, tpw_g.rank(), tpw_g.size(), config, "TP=world");
      const double loss = loss_of(m, config);
      INFO("TP=" << world << " loss " << loss << " reference " << ref_loss);
      CHECK(std::abs(loss - ref_loss) <= 1e-6 * std::abs(ref_loss));
    }
    {  // ZeRO-3 style: each DP rank holds 1/world of every flattened parameter
      GPTModel m(GPTModelOptions(gpt_test::TransformerConfig(config).seed(99)));
      auto es = zero_entries(m, world_g.rank(), world, "model/", false);
      ckpt::load_checkpoint(dir, es, load_opts);
      torch::NoGradGuard no_grad;
      auto params = m->named_parameters();
      for (size_t i = 0; i < es.size(); ++i) {  // gather the ranges back into whole parameters
        const std::string name(*megatorch::util::strip_prefix(es[i].key, "model/"));
        auto& p = params[name];
        const int64_t n = p.numel(), longest = (n + world - 1) / world + 1;
        auto padded = torch::zeros({longest});
        padded.narrow(0, 0, es[i].tensor.numel()).copy_(es[i].tensor);
        auto all = world_g.all_gather(padded).view({world, longest});
        std::vector<torch::Tensor> parts;
        for (int64_t r = 0; r < world; ++r) {
          const auto [b, e] = zero_range(n, r, world);
          parts.push_back(all[r].narrow(0, 0, e - b));
        }
        p.copy_(torch::cat(parts).view_as(p));
      }
      check_equals_reference(m, ref, 0, 1, config, "ZeRO ranges");
      CHECK(loss_of(m, config) == ref_loss);
    }
    world_g.barrier();
    if (world_g.rank() == 0) remove_tree(dir);
  }
}

TEST_CASE("checkpoint saved as ZeRO ranges (model and optimizer state) loads at TP2 x PP", "[mp][ckpt]") {
  const int64_t world = mp::world_size();
  auto zero_st = mp::state(1, 1, "ckpt_zero");
  Group world_g(*zero_st, GroupKind::kWorld);
  auto load_st = mp::state(2, world / 2, "ckpt_zero_load");
  Group tpg(*load_st, GroupKind::kTensor), ppg(*load_st, GroupKind::kPipeline);
  // GQA, SwiGLU (fused parts), RoPE, RMSNorm, untied output layer.
  const auto config = gpt_test::variants()[1].config.num_layers(4).tie_embeddings(false);
  const std::string dir = test_dir(world_g, "zero");
  GPTModel ref{GPTModelOptions(config)};
  auto entries = zero_entries(ref, world_g.rank(), world, "model/", true);
  for (auto e : zero_entries(ref, world_g.rank(), world, "optim/exp_avg/", true)) {
    e.tensor = e.tensor * 2;  // a stand-in optimizer state: twice the parameter
    entries.push_back(e);
  }
  ckpt::save_checkpoint(dir, 7, entries, state_for(config, world_g.rank()), world_g.name());

  pipeline::PipelineStage stage(pipeline::PipelineStageOptions(gpt_test::TransformerConfig(config).seed(99))
                                    .tp_group(tpg.name())
                                    .pp_group(ppg.name())
                                    .virtual_chunks(ppg.size() > 1 ? 2 : 1));
  auto es = ckpt::pipeline_stage_entries(*stage);
  std::vector<ckpt::ShardedEntry> optim;
  for (const auto& e : es) {
    ckpt::ShardedEntry o = e;
    o.key = "optim/exp_avg/" + std::string(*megatorch::util::strip_prefix(e.key, "model/"));
    o.tensor = torch::zeros_like(e.tensor);
    optim.push_back(o);
  }
  es.insert(es.end(), optim.begin(), optim.end());
  ckpt::load_checkpoint(dir, es, ckpt::LoadOptions().group(world_g.name()));
  for (int64_t c = 0; c < stage->num_chunks(); ++c) {
    auto chunk = stage->chunk(c);
    check_equals_reference(chunk, ref, tpg.rank(), tpg.size(), config, "TP2 x PP from ZeRO ranges");
  }
  const size_t n = es.size() / 2;
  for (size_t i = 0; i < n; ++i) {
    INFO(optim[i].key);
    CHECK(torch::equal(es[n + i].tensor, es[i].tensor * 2));
  }
  world_g.barrier();
  if (world_g.rank() == 0) remove_tree(dir);
}

TEST_CASE("a killed save leaves the previous checkpoint loadable", "[mp][ckpt]") {
  const int64_t world = mp::world_size();
  auto st = mp::state(world, 1, "ckpt_killed");
  Group world_g(*st, GroupKind::kWorld), tpg(*st, GroupKind::kTensor);
  const auto config = gpt_test::base_config();
  const std::string dir = test_dir(world_g, "killed");
  GPTModel saved(GPTModelOptions(config).group(tpg.name()));
  auto entries = ckpt::gpt_model_entries(*saved);
  ckpt::save_checkpoint(dir, 1, entries, state_for(config, world_g.rank()), world_g.name());

  // What a save of iteration 2 killed mid-way leaves: its temporary directory with a
  // truncated shard and no metadata, and a half-written `latest` replacement.
  if (world_g.rank() == 0) {
    fs::create_directories(fs::path(dir) / "iter_0000002.tmp");
    std::ofstream(fs::path(dir) / "iter_0000002.tmp" / "rank_00000.safetensors") << "\x10\x00\x00";
    std::ofstream(fs::path(dir) / "latest_checkpointed_iteration.txt.tmp") << "2";
  }
  world_g.barrier();
  GPTModel m(GPTModelOptions(gpt_test::TransformerConfig(config).seed(99)).group(tpg.name()));
  scramble(*m);
  auto es = ckpt::gpt_model_entries(*m);
  CHECK(ckpt::load_checkpoint(dir, es, ckpt::LoadOptions().group(world_g.name())).iteration == 1);
  for (size_t i = 0; i < es.size(); ++i) CHECK(torch::equal(es[i].tensor, entries[i].tensor));

  // The next save of iteration 2 goes through over the leftovers and becomes the latest.
  {
    torch::NoGradGuard no_grad;
    for (auto& p : saved->parameters()) p.mul_(-1);
  }
  ckpt::save_checkpoint(dir, 2, entries, state_for(config, world_g.rank()), world_g.name());
  CHECK(ckpt::latest_iteration(dir) == 2);
  CHECK_FALSE(fs::exists(fs::path(dir) / "iter_0000002.tmp"));
  CHECK(ckpt::load_checkpoint(dir, es, ckpt::LoadOptions().group(world_g.name())).iteration == 2);
  for (size_t i = 0; i < es.size(); ++i) CHECK(torch::equal(es[i].tensor, entries[i].tensor));
  // An older iteration stays loadable by number.
  CHECK(ckpt::load_checkpoint(dir, es, ckpt::LoadOptions().iteration(1).group(world_g.name())).iteration == 1);
  for (size_t i = 0; i < es.size(); ++i) CHECK(torch::equal(es[i].tensor, -entries[i].tensor));
  world_g.barrier();
  if (world_g.rank() == 0) remove_tree(dir);
}

TEST_CASE("bad checksum, missing shard, other model shape: errors on every rank, weights untouched", "[mp][ckpt]") {
  const int64_t world = mp::world_size();
  auto st = mp::state(world, 1, "ckpt_errors");
  Group world_g(*st, GroupKind::kWorld), tpg(*st, GroupKind::kTensor);
  const auto config = gpt_test::base_config();
  const std::string dir = test_dir(world_g, "errors");
  const auto opts = ckpt::LoadOptions().group(world_g.name()).model_config(ckpt::gpt_shape_json(config));
  std::vector<ckpt::ShardedEntry> none;
  CHECK_THROWS_WITH(ckpt::load_checkpoint(dir, none, opts), Catch::Contains("no checkpoint in"));
  {
    GPTModel saved(GPTModelOptions(config).group(tpg.name()));
    auto entries = ckpt::gpt_model_entries(*saved);
    ckpt::save_checkpoint(dir, 3, entries, state_for(config, world_g.rank()), world_g.name());
  }
  GPTModel m(GPTModelOptions(gpt_test::TransformerConfig(config).seed(99)).group(tpg.name()));
  auto es = ckpt::gpt_model_entries(*m);
  std::vector<torch::Tensor> before;
  for (const auto& e : es) before.push_back(e.tensor.clone());
  auto untouched = [&] {
    for (size_t i = 0; i < es.size(); ++i) CHECK(torch::equal(es[i].tensor, before[i]));
  };
  const fs::path shard1 = fs::path(dir) / "iter_0000003" / "rank_00001.safetensors";

  SECTION("bad checksum") {
    if (world_g.rank() == 0) {  // flip one byte of rank 1's data
      std::fstream f(shard1, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(-5, std::ios::end);
      char c = 0;
      f.read(&c, 1);
      f.seekp(-5, std::ios::end);
      c = static_cast<char>(c ^ 0x40);
      f.write(&c, 1);
    }
    world_g.barrier();
    // Rank 1 reads that shard and names it; the others learn that a rank failed.
    CHECK_THROWS_WITH(ckpt::load_checkpoint(dir, es, opts),
                      Catch::Contains(world_g.rank() == 1 ? "fails its checksum" : "failed on another rank"));
    untouched();
  }
  SECTION("missing shard") {
    if (world_g.rank() == 0) fs::remove(shard1);
    world_g.barrier();
    CHECK_THROWS_WITH(ckpt::load_checkpoint(dir, es, opts),
                      Catch::Contains(world_g.rank() == 1 ? "missing shard rank_00001.safetensors"
                                                          : "failed on another rank"));
    untouched();
  }
  SECTION("other model shape") {
    const auto other = gpt_test::TransformerConfig(config).hidden_size(64).seed(99);
    GPTModel big(GPTModelOptions(other).group(tpg.name()));
    auto big_es = ckpt::gpt_model_entries(*big);
    const auto w = big_es[0].tensor.clone();
    CHECK_THROWS_WITH(ckpt::load_checkpoint(dir, big_es, ckpt::LoadOptions().group(world_g.name()).model_config(
                                                             ckpt::gpt_shape_json(other))),
                      Catch::Contains("is of another model (") && Catch::Contains("hidden_size: checkpoint 32, model 64"));
    // Without the configuration check, the first tensor's shape gives it away.
    CHECK_THROWS_WITH(ckpt::load_checkpoint(dir, big_es, ckpt::LoadOptions().group(world_g.name())),
                      Catch::Contains("the checkpoint is of another model shape"));
    CHECK(torch::equal(big_es[0].tensor, w));
    untouched();
  }
  SECTION("replicas that all write are refused at save") {
    GPTModel rep{GPTModelOptions(config)};  // TP1 on every rank, all claiming to write
    auto rep_es = ckpt::gpt_model_entries(*rep);
    CHECK_THROWS_WITH(ckpt::save_checkpoint(dir, 4, rep_es, state_for(config, world_g.rank()), world_g.name()),
                      Catch::Contains("are written twice"));
    CHECK(ckpt::latest_iteration(dir) == 3);
  }
  world_g.barrier();
  if (world_g.rank() == 0) remove_tree(dir);
}
