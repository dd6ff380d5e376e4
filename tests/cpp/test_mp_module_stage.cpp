// Generic pipeline stages: a model that is not a GPT (2-D activations, a plain LibTorch
// LayerNorm, a tie between the first and the last stage) split into the user's own chunks
// gives the single-rank loss and gradients under every schedule and TP inside stages;
// checkpoints of its stage reshard; the TrainingLoop trains it with ZeRO like one rank.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <ftw.h>

#include <cstdio>
#include <filesystem>

#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/module_checkpoint.h"
#include "megatorch/pipeline/module_stage.h"
#include "megatorch/tp/parameter_layout.h"
#include "megatorch/train/training_loop.h"
#include "mp_util.h"
#include "tolerance.h"

using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
namespace pipeline = megatorch::pipeline;
namespace tp = megatorch::tp;
namespace ckpt = megatorch::ckpt;
namespace train = megatorch::train;

namespace {

// rm -rf (std::filesystem::remove_all resolves to libtorch's copy, which crashes).
void remove_tree(const std::string& path) {
  ::nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return std::remove(p); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

constexpr int64_t kHidden = 16, kIn = 8, kLayers = 8;

// x + fc2(gelu(fc1(x))) with the two parallel linears: the user's own block.
struct ToyBlockImpl : torch::nn::Cloneable<ToyBlockImpl> {
  ToyBlockImpl(std::string group, int64_t index, int64_t seed) : group(std::move(group)), index(index), seed(seed) {
    reset();
  }
  void reset() override {
    const std::string name = "block" + std::to_string(index);
    fc1 = register_module("fc1", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(kHidden, 2 * kHidden)
                                                               .group(group)
                                                               .init(tp::ParamInitOptions().name(name + ".fc1").seed(seed).std(0.2))));
    fc2 = register_module("fc2", tp::RowParallelLinear(tp::RowParallelLinearOptions(2 * kHidden, kHidden)
                                                            .group(group)
                                                            .init(tp::ParamInitOptions().name(name + ".fc2").seed(seed).std(0.2))));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc2->forward(at::gelu(fc1->forward(x))); }
  std::string group;
  int64_t index, seed;
  tp::ColumnParallelLinear fc1{nullptr};
  tp::RowParallelLinear fc2{nullptr};
};
TORCH_MODULE(ToyBlock);

// Layers [begin, end) of the toy model; the first chunk projects the inputs [b, kIn] with
// `proj`, the last normalises and projects back with proj's transpose (tied) to logits.
struct ToyChunkImpl : torch::nn::Cloneable<ToyChunkImpl> {
  ToyChunkImpl(bool first, bool last, int64_t begin, int64_t end, std::string group, int64_t seed = 7)
      : first(first), last(last), begin(begin), end(end), group(std::move(group)), seed(seed) {
    reset();
  }
  void reset() override {
    const tp::ShardSpec whole{{kHidden, kIn}, -1, 0, 1, 1};
    if (first) proj = register_parameter("proj", tp::init_shard(whole, "proj", seed, tp::InitMethod::kNormal, 0.3));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = begin; i < end; ++i) blocks->push_back(ToyBlock(group, i, seed));
    if (last) {
      norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kHidden})));
      // The tied copy starts from the same numbers as proj (drawn from its name).
      if (!first) out = register_parameter("out", tp::init_shard(whole, "proj", seed, tp::InitMethod::kNormal, 0.3));
    }
  }
  at::Tensor forward(const at::Tensor& input) {
    at::Tensor x = first ? at::matmul(input, proj.t()) : input;
    for (const auto& b : *blocks) x = b->as<ToyBlockImpl>()->forward(x);
    if (last) x = at::matmul(norm->forward(x), first ? proj : out);
    return x;
  }
  bool first, last;
  int64_t begin, end;
  std::string group;
  int64_t seed;
  at::Tensor proj, out;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(ToyChunk);

at::Tensor toy_loss(const at::Tensor& logits, const pipeline::MicroBatch& mb) {
  return at::cross_entropy_loss(logits, mb.get("targets"));
}

std::vector<pipeline::MicroBatch> toy_batches(int64_t m, int64_t b, int64_t seed) {
  std::vector<pipeline::MicroBatch> out;
  for (int64_t i = 0; i < m; ++i) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(seed + i);
    pipeline::MicroBatch mb;
    mb.tensors["x"] = at::randn({b, kIn}, g);
    mb.tensors["targets"] = at::randint(kIn, {b}, g, at::kLong);
    out.push_back(std::move(mb));
  }
  return out;
}

// The loops these tests compare with one rank and torch's AdamW: ZeRO-1, constant LR 1e-2,
// no weight decay or clipping, quiet.
train::TrainingLoopOptions adamw_loop(int64_t m, int64_t b, int64_t iters) {
  return train::TrainingLoopOptions()
      .device("cpu")
      .zero_stage(1)
      .num_micro_batches(m)
      .micro_batch_size(b)
      .train_iters(iters)
      .lr(1e-2)
      .lr_decay_style("constant")
      .weight_decay(0)
      .clip_grad(0)
      .log_interval(1000);
}

// This rank's chunks of the toy model: virtual stage s (c·p + rank, or in a V: rank and
// 2p-1-rank) owns kLayers/(p·v) blocks.
pipeline::ModuleStage toy_stage(const std::string& tp_group, const std::string& pp_group, int64_t p, int64_t rank,
                                int64_t v, pipeline::ModuleStageOptions o = pipeline::ModuleStageOptions(),
                                int64_t seed = 7) {
  const auto layout = o.chunk_layout();
  const int64_t per = kLayers / (p * v), stages = p * v;
  std::vector<torch::nn::AnyModule> chunks;
  std::vector<pipeline::TiedParameter> tied;
  for (int64_t c = 0; c < v; ++c) {
    const int64_t s = pipeline::virtual_stage(c, rank, p, layout);
    chunks.emplace_back(ToyChunk(s == 0, s == stages - 1, s * per, (s + 1) * per, tp_group, seed));
    if (stages > 1 && s == 0) tied.push_back({"proj", c, "proj"});
    if (stages > 1 && s == stages - 1) tied.push_back({"proj", c, "out"});
  }
  return pipeline::ModuleStage(chunks, o.pp_group(pp_group).tp_group(tp_group).input("x").loss(toy_loss).tied(tied));
}

}  // namespace

TEST_CASE("a user's model in its own chunks gives the single-rank loss and gradients", "[mp][module_stage]") {
  const int64_t world = mp::world_size();
  std::vector<std::pair<int64_t, int64_t>> layouts{{1, world}};  // (tp, pp)
  if (world == 4) layouts.push_back({2, 2});
  for (auto [tpn, ppn] : layouts) {
    auto st = mp::state(tpn, ppn, "toy_" + std::to_string(tpn) + "_" + std::to_string(ppn));
    Group tpg(*st, GroupKind::kTensor), ppg(*st, GroupKind::kPipeline);
    // zb-h1 splits the user's backward at its own layers (split_backward.h).
    for (auto kind : {pipeline::ScheduleKind::kGPipe, pipeline::ScheduleKind::kOneFOneB,
                      pipeline::ScheduleKind::kInterleaved, pipeline::ScheduleKind::kZeroBubbleH1,
                      pipeline::ScheduleKind::kZeroBubbleV, pipeline::ScheduleKind::kDualPipeV}) {
      for (bool declared : {false, true}) {
        const int64_t v = kind == pipeline::ScheduleKind::kInterleaved ? 2 : pipeline::chunks_per_rank(kind, 1);
        const bool vee = pipeline::chunk_layout(kind) == pipeline::ChunkLayout::kV;
        const int64_t m = vee ? 2 * ppn + 1 : 2 * ppn;
        INFO(pipeline::schedule_kind_name(kind) << " tp=" << tpn << " pp=" << ppn << (declared ? " declared" : " inferred"));
        const auto mbs = toy_batches(m, 3, 40);
        ToyChunk full(true, true, 0, kLayers, "");
        at::Tensor ref_loss = torch::zeros({});
        for (const auto& mb : mbs) {
          auto l = toy_loss(full->forward(mb.get("x")), mb) / static_cast<double>(m);
          l.backward();
          ref_loss += l.detach();
        }
        auto o = pipeline::ModuleStageOptions().chunk_layout(pipeline::chunk_layout(kind));
        if (declared) {
          o.activation([](int64_t, const pipeline::MicroBatch& mb) {
            return pipeline::ActivationSpec{{mb.get("x").size(0), kHidden}, at::kFloat};
          });
        }
        auto stage = toy_stage(tpg.name(), ppg.name(), ppn, ppg.rank(), v, o);
        pipeline::reset_pipeline_p2p_stats(ppg.name());
        const auto result = pipeline::run_pipeline_step(stage, mbs, pipeline::ExecutorOptions().schedule(kind));
        // [b, h] activations: every transfer moves exactly one.
        int64_t sends = 0;
        for (const auto& a : pipeline::build_schedule(kind, ppn, m, v, ppg.rank())) sends += pipeline::is_send(a.kind);
        CHECK(pipeline::pipeline_p2p_stats(ppg.name())[megatorch::comm::CommOp::kSend].bytes == sends * 3 * kHidden * 4);
        stage->allreduce_tied_grads();
        if (stage->is_last_virtual_stage(v - 1)) {  // rank 0 in a V
          REQUIRE(result.loss.defined());
          CHECK(torch::allclose(result.loss, ref_loss, 1e-5, 0));
        }
        const auto full_params = full->named_parameters();
        for (int64_t c = 0; c < stage->num_chunks(); ++c) {
          const auto params = stage->chunk_module(c)->named_parameters();
          for (const auto& [local, layout] : tp::parameter_layouts(*stage->chunk_module(c))) {
            const std::string name = stage->global_name(c, local);
            REQUIRE(full_params.contains(name));
            const at::Tensor want = tp::slice_for_rank(full_params[name].grad(), layout.spec);
            const at::Tensor got = params[local].grad();
            REQUIRE(got.defined());
            INFO(local << " (" << name << ")");
            CHECK_CLOSE(got, want);
          }
        }
      }
    }
  }
}

TEST_CASE("module stage: ranks that declare different activations fail together, before any p2p",
          "[mp][module_stage]") {
  const int64_t world = mp::world_size();
  auto st = mp::state(1, world, "toy_bad_spec");
  Group ppg(*st, GroupKind::kPipeline);
  auto stage = toy_stage("", ppg.name(), world, ppg.rank(), 1,
                         pipeline::ModuleStageOptions().activation([r = ppg.rank()](int64_t, const pipeline::MicroBatch& mb) {
                           return pipeline::ActivationSpec{{mb.get("x").size(0), kHidden + r}, at::kFloat};
                         }));
  CHECK_THROWS_WITH(pipeline::run_pipeline_step(stage, toy_batches(2, 3, 1)),
                    Catch::Contains("declares other activations"));
  // A missing input names what the micro-batch holds (on every rank: the first stage reads it).
  auto ok = toy_stage("", ppg.name(), world, ppg.rank(), 1);
  pipeline::MicroBatch wrong;
  wrong.tensors["pixels"] = at::zeros({3, kIn});
  if (ppg.rank() == 0) {
    CHECK_THROWS_WITH(ok->prepare({wrong}), Catch::Contains("expected a tensor named 'x'") && Catch::Contains("pixels"));
  }
}

TEST_CASE("module stage checkpoints: saved at TP1 x PP, loaded at TP=world", "[mp][module_stage][ckpt]") {
  const int64_t world = mp::world_size();
  auto save_st = mp::state(1, world, "toy_ckpt_save");
  Group world_g(*save_st, GroupKind::kWorld), ppg(*save_st, GroupKind::kPipeline);
  const char* port = std::getenv("MASTER_PORT");
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("megatorch_toy_ckpt_" + std::string(port ? port : "0"))).string();
  if (world_g.rank() == 0) remove_tree(dir);
  world_g.barrier();
  // Two chunks per rank (interleaved layout): list offsets must follow virtual stages.
  auto saved = toy_stage("", ppg.name(), world, ppg.rank(), 2);
  ckpt::CheckpointState state;
  state.model_config = {{"toy", 1}};
  ckpt::save_checkpoint(dir, 3, ckpt::stage_entries(*saved), state, world_g.name());
  const auto meta = ckpt::read_metadata(dir);
  CHECK(meta["tensors"].contains("model/blocks.7.fc2.weight"));
  CHECK(meta["tensors"].contains("model/proj"));
  CHECK_FALSE(meta["tensors"].contains("model/out"));  // the tie is written once, by its first copy

  auto load_st = mp::state(world, 1, "toy_ckpt_load");
  Group tpg(*load_st, GroupKind::kTensor);
  auto loaded = toy_stage(tpg.name(), "", 1, 0, 1, pipeline::ModuleStageOptions(), /*seed=*/99);
  auto entries = ckpt::stage_entries(*loaded);
  ckpt::load_checkpoint(dir, entries, ckpt::LoadOptions().group(world_g.name()));
  ToyChunk full(true, true, 0, kLayers, "");  // seed 7: the saved numbers
  const auto want = full->named_parameters();
  for (const auto& [name, layout] : tp::parameter_layouts(*loaded->chunk_module(0))) {
    INFO(name);
    CHECK(torch::equal(loaded->chunk_module(0)->named_parameters()[name], tp::slice_for_rank(want[name], layout.spec)));
  }
  world_g.barrier();
  if (world_g.rank() == 0) remove_tree(dir);
}

TEST_CASE("TrainingLoop trains a user's model like one rank with AdamW (ZeRO-1, tie across stages), resumes exactly",
          "[mp][module_stage][train]") {
  const int64_t world = mp::world_size();
  const int64_t m = 2, b = 3, iters = 3;
  const char* port = std::getenv("MASTER_PORT");
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("megatorch_toy_loop_" + std::string(port ? port : "0"))).string();
  if (mp::rank() == 0) remove_tree(dir);
  const auto options = adamw_loop(m, b, iters).pipeline_parallel(world).save(dir).save_interval(1);
  train::TrainingLoop loop(train::TrainingLoopOptions(options).name("toy_loop"));
  const auto& ps = loop.parallel_state();
  auto stage = toy_stage(loop.tp_group(), loop.pp_group(), world, ps.pp_rank(), 1);
  loop.set_model(stage.ptr());
  std::vector<double> losses;
  loop.on_iteration = [&](const train::IterationStats& s) { losses.push_back(s.loss); };
  const auto source = [&](int64_t step) { return toy_batches(m, b, 100 * step); };
  loop.train(source);
  {  // Resumed from iteration 2 (not the latest, 3): its third step is the uninterrupted one.
    train::TrainingLoop resumed(train::TrainingLoopOptions(options).name("toy_loop_resumed").save("").load(dir)
                                    .load_iteration(2));
    auto fresh = toy_stage(resumed.tp_group(), resumed.pp_group(), world, ps.pp_rank(), 1, {}, /*seed=*/99);
    resumed.set_model(fresh.ptr());
    CHECK(resumed.iteration() == 2);
    std::vector<double> again;
    resumed.on_iteration = [&](const train::IterationStats& s) { again.push_back(s.loss); };
    resumed.train(source);
    REQUIRE(again.size() == 1);
    CHECK(again[0] == losses.at(2));  // bit for bit: the same layout and arithmetic as the uninterrupted step
  }
  Group(ps, GroupKind::kWorld).barrier();
  if (mp::rank() == 0) remove_tree(dir);
  // One rank, the whole model, torch's AdamW.
  ToyChunk full(true, true, 0, kLayers, "");
  torch::optim::AdamW adam(full->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0));
  REQUIRE(losses.size() == static_cast<size_t>(iters));
  for (int64_t step = 0; step < iters; ++step) {
    adam.zero_grad();
    at::Tensor loss = torch::zeros({});
    for (const auto& mb : source(step)) loss += toy_loss(full->forward(mb.get("x")), mb) / static_cast<double>(m);
    loss.backward();
    adam.step();
    INFO("step " << step);
    CHECK(losses[step] == Approx(loss.item<double>()).margin(1e-5));
  }
}

TEST_CASE("tied parameters: any number of copies, on one rank or many, end equal to their sum", "[mp][module_stage]") {
  const int64_t world = mp::world_size();
  auto st = mp::state(1, world, "ties_many");
  Group ppg(*st, GroupKind::kPipeline);
  const int64_t r = ppg.rank();
  // "w": one copy per rank in chunk 0, and a second one on rank 0 (chunk 1); "pair": ranks 0 and p-1.
  std::vector<pipeline::TiedCopy> copies{{"w", 0, torch::zeros({3})}};
  if (r == 0) copies.push_back({"w", 1, torch::zeros({3})});
  if (r == 0 || r == world - 1) copies.push_back({"pair", 0, torch::zeros({2})});
  for (size_t i = 0; i < copies.size(); ++i) copies[i].tensor.mutable_grad() = torch::full_like(copies[i].tensor, 10 * r + i + 1);
  pipeline::TiedParameters ties(copies, ppg.name(), 2);
  CHECK(ties.holders("w").size() == static_cast<size_t>(world));
  CHECK(ties.holders("pair") == std::vector<int64_t>{0, world - 1});
  CHECK_FALSE(ties.optimizer_can_sum());  // "w" has more than two copies
  CHECK(ties.is_primary(copies[0]) == (r == 0));
  ties.allreduce_grads();
  // "w": rank 0 holds 1 and 2, rank q > 0 holds 10q + 1; "pair": rank 0's third copy (3) and rank p-1's second.
  double w = 3;
  for (int64_t q = 1; q < world; ++q) w += 10 * q + 1;
  const double pair = 3 + 10 * (world - 1) + 2;
  for (const auto& c : copies) {
    INFO(c.name << " in chunk " << c.chunk);
    CHECK(torch::equal(c.tensor.grad(), torch::full_like(c.tensor, c.name == "w" ? w : pair)));
  }
  // A tie named on one stage only is refused on every rank.
  std::vector<pipeline::TiedCopy> lonely;
  if (r == 0) lonely.push_back({"alone", 0, torch::zeros({1})});
  CHECK_THROWS_WITH(pipeline::TiedParameters(lonely, ppg.name(), 1), Catch::Contains("single copy"));
}

namespace {

// A user's sequence model for context parallelism: token and learned position embeddings,
// pre-norm-free blocks of causal self-attention (its own projections, attention through
// transformer::context_parallel_attention on the CP group, SDPA without one) and a GeLU
// MLP, a LayerNorm and an untied head. Activations [b, s, h]; every parameter drawn from
// its name, so any split of the layers starts from the same numbers.
constexpr int64_t kVocab = 11, kSeqHidden = 16, kHeads = 2, kSeq = 16, kSeqLayers = 2;

at::Tensor named_param(const std::string& name, int64_t rows, int64_t cols) {
  return tp::init_shard(tp::ShardSpec{{rows, cols}, -1, 0, 1, 1}, name, 5, tp::InitMethod::kNormal, 0.2);
}

struct SeqChunkImpl : torch::nn::Cloneable<SeqChunkImpl> {
  SeqChunkImpl(bool first, bool last, int64_t begin, int64_t end, std::string cp_group)
      : first(first), last(last), begin(begin), end(end), cp_group(std::move(cp_group)) {
    reset();
  }
  void reset() override {
    if (first) {
      embedding = register_parameter("embedding", named_param("embedding", kVocab, kSeqHidden));
      position = register_parameter("position", named_param("position", kSeq, kSeqHidden));
    }
    for (int64_t i = begin; i < end; ++i) {
      const std::string n = "layers." + std::to_string(i) + ".";
      qkv.push_back(register_parameter("qkv" + std::to_string(i), named_param(n + "qkv", 3 * kSeqHidden, kSeqHidden)));
      out.push_back(register_parameter("out" + std::to_string(i), named_param(n + "out", kSeqHidden, kSeqHidden)));
      fc1.push_back(register_parameter("fc1" + std::to_string(i), named_param(n + "fc1", 2 * kSeqHidden, kSeqHidden)));
      fc2.push_back(register_parameter("fc2" + std::to_string(i), named_param(n + "fc2", kSeqHidden, 2 * kSeqHidden)));
    }
    if (last) {
      norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kSeqHidden})));
      head = register_parameter("head", named_param("head", kVocab, kSeqHidden));
    }
  }
  at::Tensor attention(const at::Tensor& x, size_t i) const {
    const int64_t b = x.size(0), s = x.size(1), d = kSeqHidden / kHeads;
    const auto parts = at::matmul(x, qkv[i].t()).view({b, s, 3, kHeads, d}).permute({2, 0, 3, 1, 4});
    const at::Tensor o = cp_group.empty()
                             ? at::scaled_dot_product_attention(parts[0], parts[1], parts[2], {}, 0.0, true)
                             : megatorch::transformer::context_parallel_attention(
                                   parts[0], parts[1], parts[2],
                                   megatorch::transformer::ContextParallelAttentionOptions(cp_group));
    return at::matmul(o.permute({0, 2, 1, 3}).reshape({b, s, kSeqHidden}), out[i].t());
  }
  at::Tensor forward(const at::Tensor& input) {
    at::Tensor x = input;
    if (first) {
      // This rank's tokens sit at context_parallel_positions in the whole sequence.
      const int64_t c = cp_group.empty() ? 1 : Group(cp_group).size(), r = cp_group.empty() ? 0 : Group(cp_group).rank();
      const at::Tensor positions = megatorch::transformer::context_parallel_positions(input.size(1) * c, c, r);
      x = embedding.index_select(0, input.reshape(-1)).view({input.size(0), input.size(1), kSeqHidden}) +
          position.index_select(0, positions);
    }
    for (size_t i = 0; i < qkv.size(); ++i) {
      x = x + attention(x, i);
      x = x + at::matmul(at::gelu(at::matmul(x, fc1[i].t())), fc2[i].t());
    }
    return last ? at::matmul(norm->forward(x), head.t()) : x;
  }
  bool first, last;
  int64_t begin, end;
  std::string cp_group;
  at::Tensor embedding, position, head;
  std::vector<at::Tensor> qkv, out, fc1, fc2;
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(SeqChunk);

// The mean over the tokens the stage hands it: this CP rank's share.
at::Tensor seq_loss(const at::Tensor& logits, const pipeline::MicroBatch& mb) {
  return at::cross_entropy_loss(logits.reshape({-1, kVocab}), mb.get("targets").reshape(-1));
}

std::vector<pipeline::MicroBatch> seq_batches(int64_t m, int64_t b, int64_t seed) {
  std::vector<pipeline::MicroBatch> out;
  for (int64_t i = 0; i < m; ++i) {
    auto g = at::make_generator<at::CPUGeneratorImpl>(seed + i);
    pipeline::MicroBatch mb;
    mb.tensors["tokens"] = at::randint(kVocab, {b, kSeq}, g, at::kLong);
    mb.tensors["targets"] = at::randint(kVocab, {b, kSeq}, g, at::kLong);
    out.push_back(std::move(mb));
  }
  return out;
}

}  // namespace

TEST_CASE("a user's sequence model in a ModuleStage trains at context-parallel size c like one rank",
          "[mp][module_stage][context_parallel]") {
  const int64_t world = mp::world_size();
  if (world < 2) return;
  const int64_t m = 2, b = 2, iters = 3;
  std::vector<std::pair<int64_t, int64_t>> layouts{{1, world}};  // (pp, cp)
  if (world == 4) layouts.push_back({2, 2});
  // One rank, the whole model, torch's AdamW.
  SeqChunk full(true, true, 0, kSeqLayers, "");
  torch::optim::AdamW adam(full->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0));
  const auto source = [&](int64_t step) { return seq_batches(m, b, 100 * step); };
  std::vector<double> want;
  for (int64_t step = 0; step < iters; ++step) {
    adam.zero_grad();
    at::Tensor loss = torch::zeros({});
    for (const auto& mb : source(step)) {
      loss += seq_loss(full->forward(mb.get("tokens")), mb) / static_cast<double>(m);
    }
    loss.backward();
    adam.step();
    want.push_back(loss.item<double>());
  }
  for (const auto& [p, c] : layouts) {
    INFO("pp " << p << " cp " << c);
    train::TrainingLoop loop(adamw_loop(m, b, iters).pipeline_parallel(p).context_parallel(c).print_summary(false)
                                 .name("seq_cp_" + std::to_string(p)));
    const int64_t rank = loop.parallel_state().pp_rank(), per = kSeqLayers / p;
    std::vector<torch::nn::AnyModule> chunks{
        torch::nn::AnyModule(SeqChunk(rank == 0, rank == p - 1, rank * per, (rank + 1) * per, loop.cp_group()))};
    const auto options = pipeline::ModuleStageOptions()
                             .pp_group(loop.pp_group())
                             .cp_group(loop.cp_group())
                             .sequence_dims({{"tokens", 1}, {"targets", 1}})
                             .input("tokens")
                             .loss(seq_loss);
    pipeline::ModuleStage stage(chunks, options);
    REQUIRE(stage->context_parallel_size() == c);
    loop.set_model(stage.ptr());
    std::vector<double> losses;
    loop.on_iteration = [&](const train::IterationStats& s) { losses.push_back(s.loss); };
    loop.train(source);
    REQUIRE(losses.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      INFO("step " << i);
      CHECK(losses[i] == Approx(want[i]).margin(1e-5));
    }
    // What the chunks see: this rank's share of each named tensor, the rest whole.
    const auto mb = source(0)[0];
    const auto local = stage->local_micro_batch(mb);
    const Group cp(loop.cp_group());
    CHECK(torch::equal(local.get("tokens"),
                       megatorch::transformer::context_parallel_slice(mb.get("tokens"), 1, c, cp.rank())));
    CHECK(local.get("tokens").size(1) == kSeq / c);
  }
  // Loud: a CP stage must name what to split, and what it names must split.
  train::TrainingLoop loop(train::TrainingLoopOptions().context_parallel(world).device("cpu").print_summary(false)
                               .name("seq_cp_bad"));
  std::vector<torch::nn::AnyModule> chunks{torch::nn::AnyModule(SeqChunk(true, true, 0, 1, loop.cp_group()))};
  CHECK_THROWS_WITH(pipeline::ModuleStage(chunks, pipeline::ModuleStageOptions().cp_group(loop.cp_group())
                                                      .input("tokens").loss(seq_loss)),
                    Catch::Contains("no micro-batch tensor is named to split") &&
                        Catch::Contains("sequence_dims({{\"tokens\", 1}"));
  pipeline::ModuleStage odd(chunks, pipeline::ModuleStageOptions()
                                        .cp_group(loop.cp_group())
                                        .sequence_dims({{"tokens", 1}, {"targets", 0}})
                                        .input("tokens")
                                        .loss(seq_loss));
  CHECK_THROWS_WITH(odd->prepare(seq_batches(1, 3, 1)), Catch::Contains("micro-batch tensor 'targets' of shape [3, 16]") &&
                                                            Catch::Contains("along dim 0"));
  // A ModuleStage without a CP group under a CP loop is refused, naming the option.
  pipeline::ModuleStage whole(chunks, pipeline::ModuleStageOptions().input("tokens").loss(seq_loss));
  CHECK_THROWS_WITH(loop.set_model(whole.ptr()), Catch::Contains("ModuleStageOptions().cp_group(loop.cp_group())"));
}
