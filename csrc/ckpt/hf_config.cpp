// HuggingFace config.json <-> TransformerConfig: which architectures are understood, what
// their fields mean here, and what an import refuses by name.
#include "megatorch/ckpt/hf_convert.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <type_traits>
#include <vector>

#include "megatorch/check.h"
#include "megatorch/util/enum_names.h"
#include "megatorch/util/strings.h"
#include "hf_internal.h"
#include "rope_json.h"

namespace megatorch::ckpt {

// json, fs and the TransformerConfig names come with hf_detail.
using namespace hf_detail;

bool hf_detail::llama_shaped(const TransformerConfig& c) {
  // transformers' Llama family rotates the whole head.
  return c.normalization() == Normalization::kRMSNorm && c.activation() == Activation::kSwiGLU &&
         c.position_embedding_type() == Positions::kRope && !c.add_bias_linear() && c.rotary_percent() == 1.0;
}

bool hf_detail::gpt2_shaped(const TransformerConfig& c) {
  return c.normalization() == Normalization::kLayerNorm && c.activation() == Activation::kGeluTanh &&
         c.position_embedding_type() == Positions::kLearned && c.add_bias_linear() &&
         c.query_groups() == c.num_attention_heads();
}

namespace {

std::string joined(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : sep) + p;
  return out;
}

// The RoPE of a Llama-family config.json: transformers 5 writes rope_parameters (possibly one
// dict per layer type), 4.x rope_theta at the top and rope_scaling for the scaled kinds.
// Every layer must share one (base, scaling). `fallback`: the base transformers assumes for
// the model type when the config gives none.
struct HFRope {
  double theta = 1e4;
  transformer::RopeScaling scaling;
};
HFRope rope_of(const json& h, const std::string& arch, double fallback) {
  HFRope out;
  out.theta = get_or<double>(h, "rope_theta", fallback);
  // transformers' Llama, Mistral, Qwen2 and Mixtral rotate the whole head whatever this says.
  auto whole_head = [&](const json& j, const std::string& where) {
    MEGATORCH_CHECK(get_or<double>(j, "partial_rotary_factor", 1.0) == 1.0, arch, " import: ", where,
                    "partial_rotary_factor ", j.at("partial_rotary_factor").dump(), " is not supported: transformers' ",
                    arch, " rotates the whole head, so megatorch would compute another model (1.0)");
  };
  whole_head(h, "");
  const int64_t positions = get_or<int64_t>(h, "max_position_embeddings", 0);
  // Phi-3 style: the pretraining length outside the rope dict wins, as transformers does.
  const int64_t original = get_or<int64_t>(h, "original_max_position_embeddings", 0);
  std::vector<std::pair<std::string, json>> dicts;
  // transformers reads rope_scaling when it is set, else rope_parameters.
  const bool scaling_set = h.contains("rope_scaling") && !h.at("rope_scaling").is_null();
  for (const char* key : {scaling_set ? "rope_scaling" : "rope_parameters"}) {
    if (!h.contains(key) || h.at(key).is_null()) continue;
    const json& r = h.at(key);
    MEGATORCH_CHECK(r.is_object(), arch, " import: expected ", key, " to be an object, got ", r.dump());
    bool nested = !r.empty();
    for (const auto& [k, v] : r.items()) nested = nested && v.is_object();
    if (nested) {  // per layer type ({"full_attention": {...}, "sliding_attention": {...}})
      for (const auto& [k, v] : r.items()) dicts.emplace_back(std::string(key) + "." + k, v);
    } else {
      dicts.emplace_back(key, r);
    }
  }
  bool first = true;
  for (const auto& [where, r] : dicts) {
    whole_head(r, where + ".");
    json fields = r;
    if (original > 0) fields["original_max_position_embeddings"] = original;
    // transformers' dynamic NTK scales above max_position_embeddings, whatever the dict says.
    if (get_or<std::string>(r, "rope_type", get_or<std::string>(r, "type", "")) == "dynamic") {
      fields["original_max_position_embeddings"] = positions;
    }
    const auto scaling = detail::rope_scaling_from_json(fields, arch + " import: " + where, positions);
    const double t = get_or<double>(r, "rope_theta", out.theta);
    MEGATORCH_CHECK(first || (t == out.theta && scaling == out.scaling), arch, " import: ", where, " (rope_theta ", t,
                    ", ", detail::rope_scaling_json(scaling).dump(), ") differs from the other layers' (",
                    out.theta, ", ", detail::rope_scaling_json(out.scaling).dump(),
                    "); megatorch uses one RoPE for every layer");
    out.theta = t, out.scaling = scaling, first = false;
  }
  return out;
}

// Qwen2's and Qwen3's windows: with use_sliding_window, layer i slides when layer_types says
// "sliding_attention" or, without layer_types, when i >= max_window_layers (as transformers
// derives layer_types). Every layer sliding is kept as the window alone (no layer_types).
struct HFWindow {
  int64_t window = 0;
  std::vector<std::string> layer_types;
};
HFWindow qwen_window(const json& h, int64_t layers) {
  HFWindow out;
  if (!get_or<bool>(h, "use_sliding_window", false)) return out;
  out.window = size_field_or(h, "sliding_window", 0, 0);
  if (out.window <= 0) return {};
  if (h.contains("layer_types") && !h.at("layer_types").is_null()) {
    const json& t = h.at("layer_types");
    MEGATORCH_CHECK(t.is_array() && static_cast<int64_t>(t.size()) == layers, "config.json: expected 'layer_types' "
                    "to be a list of num_hidden_layers (", layers, ") strings, got ", t.dump());
    for (const auto& v : t) {
      MEGATORCH_CHECK(v.is_string() && (v == "sliding_attention" || v == "full_attention"), "config.json: expected "
                      "each of layer_types to be 'sliding_attention' or 'full_attention', got ", v.dump());
      out.layer_types.push_back(v.get<std::string>());
    }
  } else {
    const int64_t full = size_field_or(h, "max_window_layers", 0, 28);
    for (int64_t i = 0; i < layers; ++i) out.layer_types.push_back(i >= full ? "sliding_attention" : "full_attention");
  }
  const auto sliding = std::count(out.layer_types.begin(), out.layer_types.end(), "sliding_attention");
  if (sliding == 0) return {};
  if (sliding == layers) out.layer_types.clear();
  return out;
}

}  // namespace

const char* to_string(HFArch a) {
  switch (a) {
    case HFArch::kGPT2: return "gpt2";
    case HFArch::kLlama: return "llama";
    case HFArch::kMistral: return "mistral";
    case HFArch::kQwen2: return "qwen2";
    case HFArch::kMixtral: return "mixtral";
    case HFArch::kQwen3: return "qwen3";
    case HFArch::kQwen3Moe: return "qwen3_moe";
  }
  return "?";
}

HFArch parse_hf_arch(const std::string& s) {
  return util::parse_enum(s, {HFArch::kGPT2, HFArch::kLlama, HFArch::kMistral, HFArch::kQwen2, HFArch::kMixtral,
                              HFArch::kQwen3, HFArch::kQwen3Moe},
                          "a HuggingFace model_type");
}

bool hf_arch_holds(HFArch a, const TransformerConfig& c) {
  if (!c.causal_attention()) return false;  // every supported HF model is a causal LM
  const bool dense = c.num_experts() == 0;
  // Llama-shaped, with which biases (q/k/v only: Qwen2; q/k/v/o: attention_bias) and QK-norm.
  const bool llama = dense && llama_shaped(c);
  const bool qkv_only = c.qkv_bias() && !c.proj_bias(), no_bias = !c.qkv_bias() && !c.mlp_bias();
  switch (a) {
    case HFArch::kGPT2:
      return dense && gpt2_shaped(c) && c.sliding_window() == 0 && !c.qk_layernorm() && c.kv_channels() == 0;
    case HFArch::kLlama: return llama && !qkv_only && !c.qk_layernorm() && c.sliding_window() == 0;
    case HFArch::kMistral: return llama && no_bias && !c.qk_layernorm() && c.layer_types().empty();
    case HFArch::kQwen2: return llama && qkv_only && !c.mlp_bias() && !c.qk_layernorm();
    case HFArch::kQwen3: return llama && !qkv_only && !c.mlp_bias() && c.qk_layernorm();
    case HFArch::kMixtral: return mixtral_obstacles(c).empty();
    case HFArch::kQwen3Moe: return qwen3_moe_obstacles(c).empty();
  }
  return false;
}

HFArch hf_arch_of(const TransformerConfig& c, const std::string& preferred) {
  if (!preferred.empty()) {
    const HFArch p = parse_hf_arch(preferred);
    if (hf_arch_holds(p, c)) return p;
  }
  for (HFArch a : {HFArch::kGPT2, HFArch::kLlama, HFArch::kQwen2, HFArch::kQwen3, HFArch::kMistral, HFArch::kMixtral,
                   HFArch::kQwen3Moe})
    if (hf_arch_holds(a, c)) return a;
  if (c.num_experts() > 0) {
    MEGATORCH_FAIL("HuggingFace export: the mixture-of-experts model can be written neither as Mixtral ",
                   "(MixtralForCausalLM: ", joined(mixtral_obstacles(c), "; "), ") nor as Qwen3-MoE ",
                   "(Qwen3MoeForCausalLM: ", joined(qwen3_moe_obstacles(c), "; "), "). These fields describe how ",
                   "the weights compute, so no config.json of either reproduces the model: keep it in megatorch's "
                   "format");
  }
  MEGATORCH_FAIL("HuggingFace export: the model (", to_string(c.normalization()), ", ", to_string(c.activation()), ", ",
                 to_string(c.position_embedding_type()), ", rotary_percent ", c.rotary_percent(),
                 ", add_bias_linear ", c.add_bias_linear(), ", add_qkv_bias ", c.add_qkv_bias(),
                 ", add_attention_bias ", c.add_attention_bias(), ", add_mlp_bias ", c.add_mlp_bias(), ", qk_layernorm ",
                 c.qk_layernorm(), ", sliding_window ", c.sliding_window(), ", ", c.layer_types().size(),
                 " layer_types, ", c.query_groups(), " query groups, causal_attention ", c.causal_attention(),
                 ") is neither GPT-2 (LayerNorm, gelu_tanh, learned positions, biases, MHA, no window, no QK-norm) nor "
                 "Llama/Mistral/Qwen2/Qwen3 (RMSNorm, swiglu, rope over the whole head (rotary_percent 1: transformers' "
                 "Llama family rotates every channel), no add_bias_linear; Llama: attention/MLP biases, no window; "
                 "Mistral: no biases, one window for all layers; Qwen2: add_qkv_bias only; Qwen3: qk_layernorm), all "
                 "of them causal (causal_attention true)");
}

namespace {

// hidden / heads and heads / key-value heads, named with config.json's own fields before
// anything divides by them (validate() says the same in megatorch's names).
void check_heads(const json& h, const char* hidden_key, const char* heads_key, const char* groups_key,
                 bool hidden_divisible = true) {
  const int64_t hidden = h.at(hidden_key).get<int64_t>(), heads = h.at(heads_key).get<int64_t>();
  MEGATORCH_CHECK(!hidden_divisible || hidden % heads == 0, "config.json: expected ", hidden_key, " (", hidden, ") to be divisible by ",
                  heads_key, " (", heads, "); fix the field in config.json");
  if (groups_key == nullptr || !h.contains(groups_key) || h.at(groups_key).is_null()) return;
  const int64_t groups = h.at(groups_key).get<int64_t>();
  MEGATORCH_CHECK(heads % groups == 0, "config.json: expected ", heads_key, " (", heads, ") to be divisible by ",
                  groups_key, " (", groups, "); each key/value head serves a whole group of query heads");
}

// validate() on what config.json made, its message prefixed with where the config came from.
void validate_imported(const TransformerConfig& c, const std::string& arch) {
  try {
    c.validate(1);
  } catch (const c10::Error& e) {
    MEGATORCH_FAIL(arch, " import: config.json does not describe a valid model: ",
                   without_error_prefix(e.what_without_backtrace()));
  }
}

}  // namespace

TransformerConfig config_from_hf(const json& h) {
  MEGATORCH_CHECK(h.is_object(), "config.json: expected a JSON object, got ", h.type_name());
  const std::string type = get_or<std::string>(h, "model_type", "");
  const HFArch arch = parse_hf_arch(type);
  MEGATORCH_CHECK(!h.contains("quantization_config") || h.at("quantization_config").is_null(), type,
                  " import: quantization_config is not supported; import the unquantized (fp32/bf16/fp16) model");
  TransformerConfig c;
  // Dropout probabilities (attn_pdrop, resid_pdrop, embd_pdrop, attention_dropout) act in
  // training only; a run sets its own (--attention-dropout, --hidden-dropout), so they are
  // not carried and do not change what the imported model computes.
  c.hidden_dropout(0).attention_dropout(0);
  if (arch == HFArch::kGPT2) {
    const std::string act = get_or<std::string>(h, "activation_function", "gelu_new");
    MEGATORCH_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", "GPT-2 import: activation_function '", act,
                    "' is not supported; megatorch's GPT-2 uses the tanh GeLU (gelu_new)");
    MEGATORCH_CHECK(!get_or<bool>(h, "scale_attn_by_inverse_layer_idx", false),
                    "GPT-2 import: scale_attn_by_inverse_layer_idx true is not supported; megatorch scales "
                    "attention by 1/sqrt(head_dim) only");
    MEGATORCH_CHECK(get_or<bool>(h, "scale_attn_weights", true),
                    "GPT-2 import: scale_attn_weights false is not supported; megatorch scales attention by "
                    "1/sqrt(head_dim)");
    // reorder_and_upcast_attn computes the same attention in fp32 (a precision choice, and
    // megatorch's SDPA in fp32 is that already for fp32 models).
    MEGATORCH_CHECK(!get_or<bool>(h, "add_cross_attention", false),
                    "GPT-2 import: add_cross_attention true is not supported; megatorch's GPT is decoder-only");
    const int64_t hidden = size_field(h, "n_embd", 1), heads = size_field(h, "n_head", 1);
    const int64_t positions = size_field(h, "n_positions", 1);
    check_heads(h, "n_embd", "n_head", nullptr);
    c.hidden_size(hidden)
        .num_attention_heads(heads)
        .num_layers(size_field(h, "n_layer", 1))
        .vocab_size(size_field(h, "vocab_size", 1))
        .max_position_embeddings(positions)
        .seq_length(positions)
        .ffn_hidden_size(size_field_or(h, "n_inner", 1, 4 * hidden))
        .norm_epsilon(get_or<double>(h, "layer_norm_epsilon", 1e-5))
        .init_std(get_or<double>(h, "initializer_range", 0.02))
        .normalization(Normalization::kLayerNorm)
        .activation(Activation::kGeluTanh)
        .position_embedding_type(Positions::kLearned)
        .add_bias_linear(true)
        .tie_embeddings(get_or<bool>(h, "tie_word_embeddings", true));
    validate_imported(c, "GPT-2");
    return c;
  }
  // Llama, Mistral, Qwen2, Qwen3 and Mixtral: one layout; Qwen2 adds q/k/v biases, Qwen3
  // QK-norm, Mistral and Mixtral (and Qwen2/3 with use_sliding_window, per layer) a sliding
  // window, Mixtral experts for the MLP; Llama and Qwen3 may have attention biases.
  // pretraining_tp > 1 (Llama) only split the matmuls in transformers 4.x (numerically the
  // same sums; 5.x ignores it), so it is not refused; pad_token_id only keeps HF's embedding
  // row from training (padding_idx), not the forward.
  const std::string name = arch == HFArch::kLlama     ? "Llama"
                           : arch == HFArch::kMistral ? "Mistral"
                           : arch == HFArch::kQwen2   ? "Qwen2"
                           : arch == HFArch::kQwen3   ? "Qwen3"
                           : arch == HFArch::kQwen3Moe ? "Qwen3-MoE"
                                                      : "Mixtral";
  const std::string act = get_or<std::string>(h, "hidden_act", "silu");
  MEGATORCH_CHECK(act == "silu" || act == "swish", name, " import: hidden_act '", act,
                  "' is not supported (megatorch's SwiGLU uses silu)");
  // Only Llama's and Qwen3's modeling code reads these (q/k/v/o biases; gate/up/down biases).
  const bool qwen3 = arch == HFArch::kQwen3 || arch == HFArch::kQwen3Moe;
  const bool attention_bias = (arch == HFArch::kLlama || qwen3) && get_or<bool>(h, "attention_bias", false);
  const bool mlp_bias = arch == HFArch::kLlama && get_or<bool>(h, "mlp_bias", false);
  // transformers' default base where config.json has none: 1e6 for Mixtral, 1e4 otherwise.
  const HFRope rope = rope_of(h, name, arch == HFArch::kMixtral ? 1e6 : 1e4);
  const int64_t hidden = size_field(h, "hidden_size", 1), heads = size_field(h, "num_attention_heads", 1);
  const int64_t groups = size_field_or(h, "num_key_value_heads", 1, heads);
  // head_dim given: heads x head_dim may differ from hidden_size (Qwen3), megatorch's kv_channels.
  const bool explicit_head_dim = h.contains("head_dim") && !h.at("head_dim").is_null();
  check_heads(h, "hidden_size", "num_attention_heads", "num_key_value_heads", !explicit_head_dim);
  const int64_t head_dim = explicit_head_dim ? size_field(h, "head_dim", 1) : hidden / heads;
  const int64_t layers = size_field(h, "num_hidden_layers", 1);
  HFWindow window;
  if (arch == HFArch::kMistral || arch == HFArch::kMixtral) window.window = size_field_or(h, "sliding_window", 0, 0);  // null: none
  if (arch == HFArch::kQwen3Moe && get_or<bool>(h, "use_sliding_window", false)) {
    window.window = size_field_or(h, "sliding_window", 0, 0);  // every layer's
  }
  if (arch == HFArch::kQwen2 || arch == HFArch::kQwen3) window = qwen_window(h, layers);
  const int64_t positions = size_field(h, "max_position_embeddings", 1);
  // Dynamic NTK scales above max_position_embeddings, up to factor times it: the model's
  // reach (its seq_length stays the pretraining context).
  const bool dynamic = rope.scaling.type() == transformer::RopeType::kDynamic;
  const int64_t reach = dynamic ? static_cast<int64_t>(positions * rope.scaling.factor()) : positions;
  c.hidden_size(hidden)
      .num_attention_heads(heads)
      .num_query_groups(groups)
      .kv_channels(head_dim * heads == hidden ? 0 : head_dim)
      .num_layers(layers)
      .vocab_size(size_field(h, "vocab_size", 1))
      .ffn_hidden_size(size_field(h, "intermediate_size", 1))
      .seq_length(positions)
      .max_position_embeddings(reach)
      .sliding_window(window.window)
      .layer_types(window.layer_types)
      .norm_epsilon(get_or<double>(h, "rms_norm_eps", 1e-6))
      .rotary_base(rope.theta)
      .rope_scaling(rope.scaling)
      .init_std(get_or<double>(h, "initializer_range", 0.02))
      .normalization(Normalization::kRMSNorm)
      .activation(Activation::kSwiGLU)
      .position_embedding_type(Positions::kRope)
      .add_bias_linear(false)
      .add_qkv_bias(arch == HFArch::kQwen2)
      .add_attention_bias(attention_bias)
      .add_mlp_bias(mlp_bias)
      .qk_layernorm(qwen3)
      .tie_embeddings(get_or<bool>(h, "tie_word_embeddings", false));
  if (arch == HFArch::kMixtral) mixtral_experts(h, c);
  if (arch == HFArch::kQwen3Moe) qwen3_moe_experts(h, layers, c);
  validate_imported(c, name);
  return c;
}

// config.json's rope_parameters (transformers 5's spelling; 4.x reads rope_theta and, for
// the scaled types, rope_scaling, written next to it).
json rope_parameters(const TransformerConfig& c) {
  json r = detail::rope_scaling_json(c.rope_scaling());
  r["rope_theta"] = c.rotary_base();
  return r;
}

json hf_config_from(const TransformerConfig& c, HFArch arch, const json& import_state) {
  MEGATORCH_CHECK(hf_arch_holds(arch, c), "HuggingFace export: the model cannot be written as ", to_string(arch),
                  "; hf_arch_of(config) names the architecture that holds it");
  if (arch == HFArch::kGPT2) {
    return {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"},
            {"vocab_size", c.vocab_size()},         {"n_positions", c.max_positions()},
            {"n_embd", c.hidden_size()},            {"n_layer", c.num_layers()},
            {"n_head", c.num_attention_heads()},    {"n_inner", c.ffn()},
            {"activation_function", "gelu_new"},    {"layer_norm_epsilon", c.norm_epsilon()},
            {"resid_pdrop", 0.0},                   {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},                    {"initializer_range", c.init_std()},
            {"tie_word_embeddings", c.tie_embeddings()}, {"torch_dtype", "float32"}};
  }
  const char* cls = arch == HFArch::kLlama     ? "LlamaForCausalLM"
                    : arch == HFArch::kMistral ? "MistralForCausalLM"
                    : arch == HFArch::kQwen2   ? "Qwen2ForCausalLM"
                    : arch == HFArch::kQwen3   ? "Qwen3ForCausalLM"
                    : arch == HFArch::kQwen3Moe ? "Qwen3MoeForCausalLM"
                                               : "MixtralForCausalLM";
  json j = {{"architectures", {cls}},
            {"model_type", to_string(arch)},
            {"vocab_size", c.vocab_size()},
            {"hidden_size", c.hidden_size()},
            {"intermediate_size", arch == HFArch::kMixtral ? c.moe_ffn() : c.ffn()},  // Qwen3-MoE: the dense layers'
            {"num_hidden_layers", c.num_layers()},
            {"num_attention_heads", c.num_attention_heads()},
            {"num_key_value_heads", c.query_groups()},
            {"head_dim", c.head_dim()},
            {"max_position_embeddings", c.max_positions()},
            {"rms_norm_eps", c.norm_epsilon()},
            {"rope_theta", c.rotary_base()},
            {"rope_parameters", rope_parameters(c)},
            {"hidden_act", "silu"},
            {"attention_dropout", 0.0},
            {"initializer_range", c.init_std()},
            {"tie_word_embeddings", c.tie_embeddings()},
            {"torch_dtype", "float32"}};
  if (c.rope_scaling().type() != transformer::RopeType::kDefault) {
    j["rope_scaling"] = detail::rope_scaling_json(c.rope_scaling());  // for transformers 4.x
  }
  if (c.rope_scaling().type() == transformer::RopeType::kDynamic) {
    // transformers scales dynamic NTK above max_position_embeddings.
    j["max_position_embeddings"] = c.rope_scaling().original_max_position_embeddings();
  }
  const json window = c.sliding_window() > 0 ? json(c.sliding_window()) : json(nullptr);
  if (arch == HFArch::kLlama) {
    j["attention_bias"] = c.add_attention_bias();
    j["mlp_bias"] = c.add_mlp_bias();
  } else if (arch == HFArch::kMistral) {
    j["sliding_window"] = window;
  } else if (arch == HFArch::kMixtral || arch == HFArch::kQwen3Moe) {
    add_moe_fields(c, arch, import_state, j);
  } else {
    // Qwen2 and Qwen3: layer_types explicitly, as transformers 5 writes it; max_window_layers
    // (what 4.x reads) counts the leading full-attention layers.
    if (arch == HFArch::kQwen3) j["attention_bias"] = c.add_attention_bias();
    std::vector<std::string> types;
    for (int64_t i = 0; i < c.num_layers(); ++i) {
      types.push_back(c.attention_window(i) > 0 ? "sliding_attention" : "full_attention");
    }
    const auto full = std::find(types.begin(), types.end(), "sliding_attention") - types.begin();
    j["use_sliding_window"] = c.sliding_window() > 0;
    j["sliding_window"] = window;
    j["max_window_layers"] = full;
    j["layer_types"] = types;
  }
  return j;
}

}  // namespace megatorch::ckpt
