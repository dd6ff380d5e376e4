// GPT's optimizer grouping and checkpoint entries, now derived from the layers' own
// layouts (tp::parameter_layouts), against the name-based rules they replaced:
// parameter by parameter, for tied/untied, SP on/off, learned/RoPE, GeLU/SwiGLU, whole
// models and pipeline chunks, at TP 1 and as either rank of a TP group of 2.
#include <catch2/catch.hpp>
#include <megatorch/ckpt/module_checkpoint.h>
#include <megatorch/megatorch.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "fake_tp_group.h"
#include "gpt_test_util.h"

namespace mt = megatorch;
using mt::models::GPTModel;
using mt::models::GPTModelOptions;
using mt::transformer::Activation;
using mt::transformer::TransformerConfig;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The table csrc/ckpt/gpt_checkpoint.cpp kept by parameter name: (dim, parts, vocabulary).
struct OldSplit {
  int64_t dim = -1, parts = 1;
  bool vocab = false;
};

OldSplit old_split(const std::string& name, const TransformerConfig& c) {
  if (name == "embedding.weight" || name == "output_layer") return {0, 1, true};
  if (name == "position_embedding" || ends_with(name, "norm.weight") || ends_with(name, "norm.bias") ||
      ends_with(name, "proj.bias") || ends_with(name, "fc2.bias")) {
    return {-1, 1, false};
  }
  if (ends_with(name, "qkv.weight") || ends_with(name, "qkv.bias")) return {0, 1, false};
  if (ends_with(name, "fc1.weight") || ends_with(name, "fc1.bias")) {
    return {0, c.activation() == Activation::kSwiGLU ? 2 : 1, false};
  }
  if (ends_with(name, "proj.weight") || ends_with(name, "fc2.weight")) return {1, 1, false};
  FAIL("no old rule for " << name);
  return {};
}

std::vector<mt::ckpt::ShardedEntry> old_entries(mt::models::GPTModelImpl& model, bool writer) {
  const TransformerConfig& c = model.options.config();
  const auto tp = model.tp;
  std::vector<mt::ckpt::ShardedEntry> out;
  for (const auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    const at::Tensor& p = item.value();
    const OldSplit split = old_split(name, c);
    const bool tied_copy = name == "output_layer" && c.tie_embeddings();
    mt::ckpt::ShardedEntry e;
    e.key = "model/" + mt::ckpt::gpt_global_name(name, model.options.layer_begin(), tied_copy);
    std::vector<int64_t> full = p.sizes().vec();
    if (split.dim >= 0) full[split.dim] *= tp.size;
    if (split.vocab) e.valid_rows = c.vocab_size();
    e.spec =
        mt::tp::ShardSpec{full, split.dim, split.dim >= 0 ? tp.rank : 0, split.dim >= 0 ? tp.size : 1, split.parts};
    e.tensor = p;
    e.write = writer && !tied_copy && (split.dim >= 0 || tp.rank == 0);
    out.push_back(std::move(e));
  }
  return out;
}

mt::train::ModelParameters old_parameters(const std::vector<GPTModel>& chunks) {
  mt::train::ModelParameters out;
  for (const auto& chunk : chunks) {
    const auto replicated = chunk->sequence_parallel_parameters();
    // QK-norm weights: replicated too, their gradient complete on every rank (summed in autograd).
    std::vector<at::Tensor> qk_norms;
    for (const auto& layer : *chunk->layers) {
      const auto& attention = layer->as<mt::transformer::TransformerLayer>()->attention;
      if (attention->q_norm) qk_norms.insert(qk_norms.end(), {attention->q_norm->weight, attention->k_norm->weight});
    }
    const auto& c = chunk->options.config();
    const bool tied_copy = c.tie_embeddings() && !chunk->options.pre_process() && chunk->output_layer.defined();
    for (auto& unit : chunk->parameter_units()) {
      for (const auto& p : unit) {
        mt::optim::ParamInfo info;
        const bool is_replicated = std::any_of(replicated.begin(), replicated.end(),
                                               [&](const at::Tensor& r) { return r.is_same(p); });
        const bool is_qk_norm =
            std::any_of(qk_norms.begin(), qk_norms.end(), [&](const at::Tensor& r) { return r.is_same(p); });
        if (((is_replicated || is_qk_norm) && chunk->tp.rank != 0) || (tied_copy && p.is_same(chunk->output_layer))) {
          info.counted_in_norm = false;
        }
        info.weight_decay = p.dim() > 1;
        if (is_replicated && c.sequence_parallel() && chunk->tp.size > 1) info.grad_sum_group = chunk->options.group();
        out.info.push_back(info);
      }
      out.units.push_back(std::move(unit));
    }
  }
  return out;
}

struct Chunk {
  const char* name;
  bool pre, post;
  int64_t begin, end;
};
// The whole model and each kind of pipeline chunk (the last one holds the tied copy).
const std::vector<Chunk> kChunks = {{"whole", true, true, 0, -1},
                                    {"first", true, false, 0, 1},
                                    {"middle", false, false, 1, 1},
                                    {"last", false, true, 1, 2}};

GPTModel build(const TransformerConfig& c, const std::string& group, const Chunk& k) {
  return GPTModel(
      GPTModelOptions(c).group(group).pre_process(k.pre).post_process(k.post).layer_begin(k.begin).layer_end(k.end));
}

std::vector<gpt_test::Variant> configs() {
  std::vector<gpt_test::Variant> out;
  for (const auto& v : gpt_test::variants()) {
    out.push_back(v);
    out.push_back({v.name + "-sp", TransformerConfig(v.config).sequence_parallel(true)});
  }
  // SwiGLU's fused fc1 (parts = 2) with biases, untied.
  out.push_back({"swiglu-bias-untied", gpt_test::base_config().activation(Activation::kSwiGLU).tie_embeddings(false)});
  return out;
}

// Runs `check` on every configuration and chunk at TP 1 and as rank 0 and 1 of a TP 2.
template <typename Check>
void for_every_model(Check check) {
  for (int64_t rank = -1; rank < 2; ++rank) {
    std::unique_ptr<fake_tp::Group> group;
    if (rank >= 0) group = std::make_unique<fake_tp::Group>("layouts_tp2_rank" + std::to_string(rank), rank, 2);
    for (const auto& v : configs()) {
      for (const auto& k : kChunks) {
        INFO(v.name << ", chunk " << k.name << ", tp rank " << rank);
        check(v.config, group ? group->name() : std::string(), k);
      }
    }
  }
}

void check_same_entries(const std::vector<mt::ckpt::ShardedEntry>& got,
                        const std::vector<mt::ckpt::ShardedEntry>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(want[i].key);
    CHECK(got[i].key == want[i].key);
    CHECK(got[i].spec.full_shape == want[i].spec.full_shape);
    CHECK(got[i].spec.partition_dim == want[i].spec.partition_dim);
    CHECK(got[i].spec.rank == want[i].spec.rank);
    CHECK(got[i].spec.world == want[i].spec.world);
    CHECK(got[i].spec.parts == want[i].spec.parts);
    CHECK(got[i].valid_rows == want[i].valid_rows);
    CHECK(got[i].begin == want[i].begin);
    CHECK(got[i].end == want[i].end);
    CHECK(got[i].tensor.is_same(want[i].tensor));
    CHECK(got[i].write == want[i].write);
  }
}

void check_same_parameters(const mt::train::ModelParameters& got, const mt::train::ModelParameters& want) {
  REQUIRE(got.units.size() == want.units.size());
  for (size_t u = 0; u < got.units.size(); ++u) {
    REQUIRE(got.units[u].size() == want.units[u].size());
    for (size_t i = 0; i < got.units[u].size(); ++i) CHECK(got.units[u][i].is_same(want.units[u][i]));
  }
  REQUIRE(got.info.size() == want.info.size());
  REQUIRE(got.names.size() == got.info.size());
  for (size_t i = 0; i < got.info.size(); ++i) {
    INFO(got.names[i]);
    CHECK(got.info[i].counted_in_norm == want.info[i].counted_in_norm);
    CHECK(got.info[i].weight_decay == want.info[i].weight_decay);
    CHECK(got.info[i].grad_sum_group == want.info[i].grad_sum_group);
    CHECK(got.info[i].grad_sum_ranks == want.info[i].grad_sum_ranks);
    CHECK(got.info[i].own_bucket == want.info[i].own_bucket);
  }
}

}  // namespace

TEST_CASE("GPT checkpoint entries from the layers' layouts equal the old name table", "[layouts]") {
  for_every_model([](const TransformerConfig& c, const std::string& group, const Chunk& k) {
    GPTModel model = build(c, group, k);
    for (bool writer : {true, false}) {
      check_same_entries(mt::ckpt::gpt_model_entries(*model, mt::ckpt::GPTEntriesOptions().writer(writer)),
                         old_entries(*model, writer));
    }
  });
}

TEST_CASE("GPT parameter grouping from the layers' layouts equals the old rule", "[layouts]") {
  for_every_model([](const TransformerConfig& c, const std::string& group, const Chunk& k) {
    GPTModel model = build(c, group, k);
    const auto got = mt::train::gpt_model_parameters({model});
    check_same_parameters(got, old_parameters({model}));
    // Units as GPTModel numbers them for its hooks: everything outside `layers`, then each layer.
    const auto units = model->parameter_units();
    REQUIRE(got.units.size() == units.size());
    CHECK(got.chunk_units == std::vector<std::pair<int64_t, int64_t>>{{0, static_cast<int64_t>(units.size()) - 1}});
    std::vector<std::string> names;  // outside the layers first, then the layers'
    for (bool in_layers : {false, true}) {
      for (const auto& item : model->named_parameters()) {
        if ((item.key().rfind("layers.", 0) == 0) == in_layers) names.push_back(item.key());
      }
    }
    CHECK(got.names == names);
  });
}

TEST_CASE("GPT grouping over several chunks numbers their units in order", "[layouts]") {
  for (const auto& v : configs()) {
    INFO(v.name);
    GPTModel first = build(v.config, "", kChunks[1]), last = build(v.config, "", kChunks[3]);
    const auto got = mt::train::gpt_model_parameters({first, last});
    check_same_parameters(got, old_parameters({first, last}));
    CHECK(got.chunk_units == std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {2, 3}});
  }
}

TEST_CASE("pipeline_stage_parameters of interleaved chunks on one rank", "[layouts]") {
  for (const auto& v : gpt_test::variants()) {
    INFO(v.name);
    mt::pipeline::PipelineStage stage(mt::pipeline::PipelineStageOptions(v.config).virtual_chunks(2));
    const auto got = mt::train::pipeline_stage_parameters(stage);
    check_same_parameters(got, old_parameters({stage->chunk(0), stage->chunk(1)}));
    CHECK(got.chunk_units == std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {2, 3}});
    CHECK(!mt::train::optimizer_sums_tied_embedding(stage));
  }
}

TEST_CASE("A shard split twice (experts over EP, columns over expert-TP) maps onto exactly its elements", "[layouts]") {
  // The runs of every shard, whole and as ZeRO ranges, hold the elements slice_for_rank
  // gives it, and the shards of all ranks tile the full tensor once.
  struct Case {
    std::vector<int64_t> shape;
    int64_t dim, parts;
  };
  const std::vector<Case> cases{{{4, 3, 12}, 2, 2}, {{4, 6, 5}, 1, 1}, {{4, 12}, 1, 2}, {{6, 5}, -1, 1}};
  for (const auto& c : cases) {
    for (int64_t outer : {1, 2}) {
      for (int64_t world : {1, 2, 3}) {
        const int64_t split = c.dim < 0 ? 1 : world;
        if ((c.dim >= 0 && c.shape[c.dim] % (world * c.parts) != 0) || c.shape[0] % outer != 0) continue;
        INFO("shape " << at::IntArrayRef(c.shape) << " dim " << c.dim << " outer " << outer << " world " << split);
        int64_t total = 1;
        for (int64_t d : c.shape) total *= d;
        const at::Tensor full = at::arange(total, at::kLong).view(c.shape);
        at::Tensor seen = at::zeros({total}, at::kLong);
        for (int64_t o = 0; o < outer; ++o) {
          for (int64_t r = 0; r < split; ++r) {
            mt::ckpt::ShardedEntry e;
            e.key = "t";
            e.spec = mt::tp::ShardSpec{c.shape, c.dim, r, split, c.parts};
            e.spec.outer_rank = o;
            e.spec.outer_world = outer;
            const at::Tensor shard = mt::tp::slice_for_rank(full, e.spec).reshape({-1});
            REQUIRE(shard.numel() == mt::ckpt::shard_numel(e));
            mt::ckpt::validate_layout(e);
            for (const auto& [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, -1}, {3, shard.numel() - 2}}) {
              e.begin = begin;
              e.end = end;
              int64_t covered = 0;
              for (const auto& run : mt::ckpt::entry_runs(e)) {
                CHECK(torch::equal(shard.narrow(0, begin + run.local, run.length),
                                   at::arange(run.global, run.global + run.length, at::kLong)));
                if (begin == 0) seen.narrow(0, run.global, run.length).add_(1);
                covered += run.length;
              }
              CHECK(covered == mt::ckpt::entry_numel(e));
            }
          }
        }
        CHECK(torch::equal(seen, at::ones({total}, at::kLong)));
      }
    }
  }
  mt::ckpt::ShardedEntry bad;
  bad.key = "t";
  bad.spec = mt::tp::ShardSpec{{4, 6}, 0, 0, 2, 1};
  bad.spec.outer_world = 2;
  CHECK_THROWS_WITH(mt::ckpt::validate_layout(bad), Catch::Contains("with the partition dim elsewhere"));
}
