#include "megatorch/ckpt/gpt_checkpoint.h"

#include <regex>

#include "megatorch/check.h"

namespace megatorch::ckpt {

using transformer::Activation;
using transformer::Normalization;
using transformer::Positions;
using transformer::TransformerConfig;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// How a GPT parameter is split over TP, by its (local) name: (partition dim, parts,
// vocabulary table). Mirrors how each layer builds its ShardSpec.
struct Split {
  int64_t dim = -1, parts = 1;
  bool vocab = false;
};

Split split_of(const std::string& name, const TransformerConfig& c) {
  if (name == "embedding.weight" || name == "output_layer") return {0, 1, true};
  if (name == "position_embedding" || ends_with(name, "norm.weight") || ends_with(name, "norm.bias") ||
      ends_with(name, "proj.bias") || ends_with(name, "fc2.bias")) {
    return {-1, 1, false};  // replicated (row-parallel biases are added after the reduction)
  }
  // The grouped QKV layout keeps whole key/value groups in contiguous rows: one part.
  if (ends_with(name, "qkv.weight") || ends_with(name, "qkv.bias")) return {0, 1, false};
  if (ends_with(name, "fc1.weight") || ends_with(name, "fc1.bias")) {
    return {0, c.activation() == Activation::kSwiGLU ? 2 : 1, false};  // SwiGLU: [gate; up]
  }
  if (ends_with(name, "proj.weight") || ends_with(name, "fc2.weight")) return {1, 1, false};
  MEGATORCH_FAIL("checkpoint: no sharding rule for GPT parameter '", name,
                 "'; add one to csrc/ckpt/gpt_checkpoint.cpp (split_of)");
}

}  // namespace

std::string gpt_global_name(const std::string& name, int64_t layer_begin, bool tied_copy) {
  static const std::regex layer(R"(^layers\.(\d+)\.)");
  std::smatch m;
  if (std::regex_search(name, m, layer)) {
    return "layers." + std::to_string(layer_begin + std::stoll(m[1])) + "." + m.suffix().str();
  }
  return name == "output_layer" && tied_copy ? "embedding.weight" : name;
}

std::vector<ShardedEntry> gpt_model_entries(models::GPTModelImpl& model, const GPTEntriesOptions& options) {
  const TransformerConfig& c = model.options.config();
  const auto tp = model.tp;
  const int64_t padded = tp::padded_vocab_size(c.vocab_size(), tp.size, c.make_vocab_size_divisible_by());
  std::vector<ShardedEntry> out;
  for (const auto& item : model.named_parameters()) {
    const std::string& name = item.key();
    const at::Tensor& p = item.value();
    const Split split = split_of(name, c);
    const bool tied_copy = name == "output_layer" && c.tie_embeddings();
    ShardedEntry e;
    e.key = options.prefix() + gpt_global_name(name, model.options.layer_begin(), tied_copy);
    std::vector<int64_t> full = p.sizes().vec();
    if (split.dim >= 0) full[split.dim] *= tp.size;
    if (split.vocab) {
      MEGATORCH_CHECK(full[0] == padded, "checkpoint: '", name, "' has ", full[0], " vocabulary rows over the TP group, expected the padded ", padded);
      e.valid_rows = c.vocab_size();
    }
    e.spec = tp::ShardSpec{full, split.dim, split.dim >= 0 ? tp.rank : 0, split.dim >= 0 ? tp.size : 1, split.parts};
    e.tensor = p;
    e.write = options.writer() && !tied_copy && (split.dim >= 0 || tp.rank == 0);
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<ShardedEntry> pipeline_stage_entries(pipeline::PipelineStageImpl& stage, const GPTEntriesOptions& options) {
  std::vector<ShardedEntry> out;
  for (int64_t i = 0; i < stage.num_chunks(); ++i) {
    auto chunk = stage.chunk(i);
    for (auto& e : gpt_model_entries(*chunk, options)) out.push_back(std::move(e));
  }
  return out;
}

nlohmann::json gpt_config_json(const TransformerConfig& c) {
  nlohmann::json j = gpt_shape_json(c);
  j["seq_length"] = c.seq_length();
  j["norm_epsilon"] = c.norm_epsilon();
  j["rotary_base"] = c.rotary_base();
  j["make_vocab_size_divisible_by"] = c.make_vocab_size_divisible_by();
  j["init_std"] = c.init_std();
  j["sliding_window"] = c.sliding_window();
  // With RoPE no parameter has the max positions' size (so the shape JSON says 0), but
  // they are the model's own (an imported one's) and go back into an exported HF config.
  j["max_positions"] = c.max_positions();
  return j;
}

nlohmann::json gpt_shape_json(const TransformerConfig& c) {
  return {{"hidden_size", c.hidden_size()},
          {"num_attention_heads", c.num_attention_heads()},
          {"num_query_groups", c.query_groups()},
          {"ffn_hidden_size", c.ffn()},
          {"num_layers", c.num_layers()},
          {"vocab_size", c.vocab_size()},
          {"max_position_embeddings", c.position_embedding_type() == Positions::kLearned ? c.max_positions() : 0},
          {"normalization", transformer::to_string(c.normalization())},
          {"activation", transformer::to_string(c.activation())},
          {"position_embedding_type", transformer::to_string(c.position_embedding_type())},
          {"add_bias_linear", c.add_bias_linear()},
          {"add_qkv_bias", c.add_qkv_bias()},
          {"tie_embeddings", c.tie_embeddings()}};
}

TransformerConfig gpt_config_from_json(const nlohmann::json& j, TransformerConfig c) {
  // get<int64_t>() would truncate 4.5 and read 1e9 silently: integers must be JSON integers.
  const auto integer = [&j](const char* key) {
    const nlohmann::json& v = j.at(key);
    MEGATORCH_CHECK(v.is_number_integer(), "checkpoint model_config: expected ", key, " to be an integer, got ",
                    v.dump(), "; the checkpoint's metadata.json was not written by megatorch or was edited");
    return v.get<int64_t>();
  };
  try {
    c.hidden_size(integer("hidden_size"))
        .num_attention_heads(integer("num_attention_heads"))
        .num_query_groups(integer("num_query_groups"))
        .ffn_hidden_size(integer("ffn_hidden_size"))
        .num_layers(integer("num_layers"))
        .vocab_size(integer("vocab_size"))
        .add_bias_linear(j.at("add_bias_linear").get<bool>())
        .tie_embeddings(j.at("tie_embeddings").get<bool>());
    c.normalization(transformer::parse_normalization(j.at("normalization")))
        .activation(transformer::parse_activation(j.at("activation")))
        .position_embedding_type(transformer::parse_positions(j.at("position_embedding_type")));
    // 0 (RoPE: no parameter has the size) keeps the base's; a negative is left for validate() below.
    if (j.contains("max_position_embeddings") && integer("max_position_embeddings") != 0) {
      c.max_position_embeddings(integer("max_position_embeddings"));
    }
    if (j.contains("seq_length")) c.seq_length(integer("seq_length"));
    if (j.contains("max_positions") && c.position_embedding_type() == Positions::kRope) {
      c.max_position_embeddings(integer("max_positions"));
    }
    if (j.contains("norm_epsilon")) c.norm_epsilon(j.at("norm_epsilon").get<double>());
    if (j.contains("rotary_base")) c.rotary_base(j.at("rotary_base").get<double>());
    if (j.contains("make_vocab_size_divisible_by")) {
      c.make_vocab_size_divisible_by(integer("make_vocab_size_divisible_by"));
    }
    if (j.contains("init_std")) c.init_std(j.at("init_std").get<double>());
    // Absent in checkpoints written before these fields existed: no QKV bias of its own, no window.
    c.add_qkv_bias(j.value("add_qkv_bias", false));
    c.sliding_window(j.contains("sliding_window") ? integer("sliding_window") : 0);
  } catch (const nlohmann::json::exception& e) {
    MEGATORCH_FAIL("checkpoint model_config ", j.dump(), " is not a GPT configuration (", e.what(), ")");
  }
  // What every model built from it would refuse, refused on reading (a layout's TP size is
  // checked later, against the run's): zero heads, negative sizes, indivisible shapes.
  try {
    c.validate(1);
  } catch (const c10::Error& e) {
    MEGATORCH_FAIL("checkpoint model_config does not describe a valid model: ",
                   without_error_prefix(e.what_without_backtrace()),
                   "; the checkpoint's metadata.json was not written by megatorch or was edited");
  }
  return c;
}

}  // namespace megatorch::ckpt
