#include "megatorch/ckpt/gpt_checkpoint.h"

#include <regex>

#include "megatorch/check.h"
#include "megatorch/ckpt/module_checkpoint.h"
#include "rope_json.h"

namespace megatorch::ckpt {

using transformer::Positions;
using transformer::TransformerConfig;

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
  // With tied embeddings an output_layer is only ever the last stage's copy of the
  // embedding: stored under the embedding's name, written by the first stage.
  const bool tied = c.tie_embeddings();
  const int64_t layer_begin = model.options.layer_begin();
  return module_entries(model,
                        ModuleEntriesOptions()
                            .prefix(options.prefix())
                            .writer(options.writer())
                            .tp_rank(model.tp.rank)
                            .sequence_parallel(c.sequence_parallel())
                            .rename([tied, layer_begin](const std::string& name) {
                              return gpt_global_name(name, layer_begin, tied && name == "output_layer");
                            })
                            .writes([tied](const std::string& name) { return !(tied && name == "output_layer"); }));
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
  if (c.position_embedding_type() == Positions::kRope) {
    j["rotary_percent"] = c.rotary_percent();
    j["rope_scaling"] = detail::rope_scaling_json(c.rope_scaling());
  }
  j["make_vocab_size_divisible_by"] = c.make_vocab_size_divisible_by();
  j["init_std"] = c.init_std();
  j["sliding_window"] = c.sliding_window();
  if (!c.layer_types().empty()) j["layer_types"] = c.layer_types();
  j["causal_attention"] = c.causal_attention();
  // With RoPE no parameter has the max positions' size (so the shape JSON says 0), but
  // they are the model's own (an imported one's) and go back into an exported HF config.
  j["max_positions"] = c.max_positions();
  if (c.num_experts() > 0) {  // how tokens are routed: not a shape, but the model's behaviour
    j["moe_router_score_function"] = transformer::to_string(c.moe_router_score_function());
    j["moe_router_pre_softmax"] = c.moe_router_pre_softmax();
    j["moe_router_norm_topk_prob"] = c.moe_router_norm_topk_prob();
    j["moe_router_topk_scaling_factor"] = c.moe_router_topk_scaling_factor();
    j["moe_router_enable_expert_bias"] = c.moe_router_enable_expert_bias();
  }
  return j;
}

nlohmann::json gpt_shape_json(const TransformerConfig& c) {
  nlohmann::json j{{"hidden_size", c.hidden_size()},
          {"num_attention_heads", c.num_attention_heads()},
          {"num_query_groups", c.query_groups()},
          {"kv_channels", c.kv_channels()},
          {"ffn_hidden_size", c.ffn()},
          {"num_layers", c.num_layers()},
          {"vocab_size", c.vocab_size()},
          {"max_position_embeddings", c.position_embedding_type() == Positions::kLearned ? c.max_positions() : 0},
          {"normalization", transformer::to_string(c.normalization())},
          {"activation", transformer::to_string(c.activation())},
          {"position_embedding_type", transformer::to_string(c.position_embedding_type())},
          {"add_bias_linear", c.add_bias_linear()},
          {"add_qkv_bias", c.add_qkv_bias()},
          {"add_attention_bias", c.add_attention_bias()},
          {"add_mlp_bias", c.add_mlp_bias()},
          {"qk_layernorm", c.qk_layernorm()},
          {"tie_embeddings", c.tie_embeddings()}};
  // Only MoE models carry these, so dense checkpoints compare as they always did.
  if (c.num_experts() > 0) {
    j["num_experts"] = c.num_experts();
    j["moe_router_topk"] = c.moe_router_topk();
    j["moe_ffn_hidden_size"] = c.moe_ffn();
    j["moe_layer_freq"] = c.moe_layer_freq();
    j["moe_first_k_dense"] = c.moe_first_k_dense();
    j["moe_shared_expert_intermediate_size"] = c.moe_shared_expert_intermediate_size();
  }
  return j;
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
    // Absent in checkpoints written before RoPE scaling: the whole head, unscaled.
    c.rotary_percent(j.value("rotary_percent", 1.0));
    c.rope_scaling(j.contains("rope_scaling")
                       ? detail::rope_scaling_from_json(j.at("rope_scaling"), "checkpoint rope_scaling", c.max_positions())
                       : transformer::RopeScaling());
    if (j.contains("make_vocab_size_divisible_by")) {
      c.make_vocab_size_divisible_by(integer("make_vocab_size_divisible_by"));
    }
    if (j.contains("init_std")) c.init_std(j.at("init_std").get<double>());
    // Absent in checkpoints written before these fields existed: no QKV bias of its own, no window.
    c.kv_channels(j.contains("kv_channels") ? integer("kv_channels") : 0);
    c.add_qkv_bias(j.value("add_qkv_bias", false))
        .add_attention_bias(j.value("add_attention_bias", false))
        .add_mlp_bias(j.value("add_mlp_bias", false))
        .qk_layernorm(j.value("qk_layernorm", false));
    c.sliding_window(j.contains("sliding_window") ? integer("sliding_window") : 0);
    c.layer_types(j.value("layer_types", std::vector<std::string>{}));
    c.causal_attention(j.value("causal_attention", true));  // absent: written when every model was causal
    if (j.contains("num_experts")) {
      c.num_experts(integer("num_experts"))
          .moe_router_topk(integer("moe_router_topk"))
          .moe_ffn_hidden_size(integer("moe_ffn_hidden_size"))
          .moe_layer_freq(integer("moe_layer_freq"))
          .moe_first_k_dense(integer("moe_first_k_dense"))
          .moe_shared_expert_intermediate_size(integer("moe_shared_expert_intermediate_size"));
      c.moe_router_score_function(transformer::parse_router_score(j.value("moe_router_score_function", "softmax")))
          .moe_router_pre_softmax(j.value("moe_router_pre_softmax", false))
          .moe_router_norm_topk_prob(j.value("moe_router_norm_topk_prob", false))
          .moe_router_topk_scaling_factor(j.value("moe_router_topk_scaling_factor", 1.0))
          .moe_router_enable_expert_bias(j.value("moe_router_enable_expert_bias", false));
    }
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
