#include "megatorch/ckpt/hf_convert.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <type_traits>
#include <vector>

#include "megatorch/check.h"
#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/gpt_checkpoint.h"
#include "megatorch/ckpt/safetensors.h"
#include "megatorch/io/atomic_file.h"
#include "megatorch/util/enum_names.h"
#include "megatorch/util/strings.h"

namespace megatorch::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;
using transformer::Activation;
using transformer::Normalization;
using transformer::Positions;
using transformer::TransformerConfig;

namespace {

// The model's keys in a checkpoint (the others are optimizer state): gpt_model_entries'.
const std::string kModelPrefix = GPTEntriesOptions().prefix();

json read_json(const fs::path& path) {
  std::ifstream in(path);
  MEGATORCH_CHECK(in.good(), "cannot open '", path.string(), "'");
  try {
    return json::parse(in);
  } catch (const std::exception& e) {
    MEGATORCH_FAIL("'", path.string(), "' is not valid JSON (", e.what(), ")");
  }
}

// config.json's fields, type-checked by name: nlohmann's get<int64_t>() would truncate 4.5,
// and its type errors do not say which field they are about.
template <class T>
T field(const json& j, const char* key) {
  MEGATORCH_CHECK(j.contains(key), "config.json: expected field '", key, "', found none");
  const json& v = j.at(key);
  const char* expected = nullptr;
  if constexpr (std::is_same_v<T, int64_t>) {
    if (!v.is_number_integer()) expected = "an integer";
  } else if constexpr (std::is_same_v<T, double>) {
    if (!v.is_number()) expected = "a number";
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!v.is_boolean()) expected = "true or false";
  } else {
    static_assert(std::is_same_v<T, std::string>);
    if (!v.is_string()) expected = "a string";
  }
  MEGATORCH_CHECK(expected == nullptr, "config.json: expected '", key, "' to be ", expected, ", got ", v.dump(),
                  "; fix the field in config.json");
  return v.get<T>();
}

template <class T>
T get_or(const json& j, const char* key, T fallback) {
  return j.contains(key) && !j.at(key).is_null() ? field<T>(j, key) : fallback;
}

// Sizes above this are no real model's and could overflow the products computed from them.
constexpr int64_t kMaxSize = int64_t{1} << 40;

// An integer field of config.json within [min, 2^40], named when it is not.
int64_t size_field(const json& j, const char* key, int64_t min) {
  const int64_t v = field<int64_t>(j, key);
  MEGATORCH_CHECK(v >= min, "config.json: expected '", key, "' to be an integer >= ", min, ", got ", v,
                  "; fix the field in config.json");
  MEGATORCH_CHECK(v <= kMaxSize, "config.json: expected '", key, "' <= 2^40 (no model is larger), got ", v,
                  "; fix the field in config.json");
  return v;
}

int64_t size_field_or(const json& j, const char* key, int64_t min, int64_t fallback) {
  return j.contains(key) && !j.at(key).is_null() ? size_field(j, key, min) : fallback;
}

// A set of named tensors that remembers which were taken, so that what is left over (a
// tensor the model has no place for) is an error rather than silently dropped.
class Tensors {
 public:
  // `original`: the file's name of each key where it differs (GPT-2's "transformer." prefix).
  explicit Tensors(std::map<std::string, at::Tensor> m, std::map<std::string, std::string> original = {})
      : m_(std::move(m)), original_(std::move(original)) {}
  // The tensor `name`, which must be floating-point and of exactly the shape the config
  // implies: checked before any reshape, so a wrong config.json (vocab_size, heads) or
  // file is refused by name instead of regrouped into a wrong model or an ATen error.
  const at::Tensor& take(const std::string& name, const std::vector<int64_t>& shape) {
    auto it = m_.find(name);
    MEGATORCH_CHECK(it != m_.end(), "HuggingFace checkpoint: expected tensor '", name, "', found none");
    check(name, it->second, shape);
    taken_.insert(name);
    return it->second;
  }
  // A tensor that may be present (a tied lm_head.weight): checked like take() when it is.
  void check_if_present(const std::string& name, const std::vector<int64_t>& shape) const {
    auto it = m_.find(name);
    if (it != m_.end()) check(name, it->second, shape);
  }
  // Names neither taken nor `ignorable`.
  std::vector<std::string> left(const std::function<bool(const std::string&)>& ignorable) const {
    std::vector<std::string> out;
    for (const auto& [k, v] : m_)
      if (!taken_.count(k) && !ignorable(k)) out.push_back(k);
    return out;
  }

 private:
  void check(const std::string& name, const at::Tensor& t, const std::vector<int64_t>& shape) const {
    auto o = original_.find(name);
    const std::string& file_name = o == original_.end() ? name : o->second;
    MEGATORCH_CHECK(at::isFloatingType(t.scalar_type()), "HuggingFace checkpoint: expected tensor '", file_name,
                    "' to be floating-point (float32, bfloat16, float16), got ", t.scalar_type(),
                    "; import the unquantized model");
    MEGATORCH_CHECK(t.sizes().vec() == shape, "HuggingFace checkpoint: expected tensor '", file_name, "' of shape ",
                    at::IntArrayRef(shape), " (from config.json), got ", t.sizes(),
                    "; config.json does not describe these weights (vocab_size, hidden size, heads, "
                    "key/value heads, intermediate size, layers or positions differ)");
  }

  std::map<std::string, at::Tensor> m_;
  std::map<std::string, std::string> original_;
  std::set<std::string> taken_;
};

const at::Tensor& take(const std::map<std::string, at::Tensor>& m, const std::string& name) {
  auto it = m.find(name);
  MEGATORCH_CHECK(it != m.end(), "megatorch checkpoint: expected tensor '", name, "', found none");
  return it->second;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string layer(int64_t i) { return "layers." + std::to_string(i) + "."; }

bool llama_shaped(const TransformerConfig& c) {
  return c.normalization() == Normalization::kRMSNorm && c.activation() == Activation::kSwiGLU &&
         c.position_embedding_type() == Positions::kRope && !c.add_bias_linear();
}

bool gpt2_shaped(const TransformerConfig& c) {
  return c.normalization() == Normalization::kLayerNorm && c.activation() == Activation::kGeluTanh &&
         c.position_embedding_type() == Positions::kLearned && c.add_bias_linear() &&
         c.query_groups() == c.num_attention_heads();
}

// The RoPE of a Llama-family config.json: transformers 5 writes rope_parameters (possibly one
// dict per layer type), 4.x rope_theta at the top and rope_scaling for the scaled kinds.
// megatorch implements the default, unscaled RoPE over the whole head: returns its base.
double rope_base(const json& h, const std::string& arch) {
  double theta = get_or<double>(h, "rope_theta", 10000.0);
  MEGATORCH_CHECK(get_or<double>(h, "partial_rotary_factor", 1.0) == 1.0, arch, " import: partial_rotary_factor ",
                  h.at("partial_rotary_factor").dump(), " is not supported; megatorch rotates the whole head (1.0)");
  std::vector<std::pair<std::string, json>> dicts;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
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
    const std::string type = get_or<std::string>(r, "rope_type", get_or<std::string>(r, "type", "default"));
    MEGATORCH_CHECK(type == "default", arch, " import: ", where, ".rope_type '", type,
                    "' is not supported; megatorch implements the default (unscaled) RoPE only");
    MEGATORCH_CHECK(get_or<double>(r, "partial_rotary_factor", 1.0) == 1.0, arch, " import: ", where,
                    ".partial_rotary_factor ", r.value("partial_rotary_factor", json()).dump(),
                    " is not supported; megatorch rotates the whole head (1.0)");
    const double t = get_or<double>(r, "rope_theta", theta);
    MEGATORCH_CHECK(first || t == theta, arch, " import: ", where, ".rope_theta ", t, " differs from ", theta,
                    "; megatorch uses one RoPE base for every layer");
    theta = t, first = false;
  }
  return theta;
}

// Qwen2's window: layer i slides when use_sliding_window and i >= max_window_layers
// (transformers writes this out as layer_types). megatorch has one attention kind for every
// layer: all sliding is a window, none sliding is none, a mix is refused.
int64_t qwen2_window(const json& h, int64_t layers) {
  if (!get_or<bool>(h, "use_sliding_window", false)) return 0;
  const int64_t window = size_field_or(h, "sliding_window", 0, 0);
  if (window <= 0) return 0;
  int64_t sliding = 0;
  if (h.contains("layer_types") && h.at("layer_types").is_array()) {
    for (const auto& t : h.at("layer_types")) {
      MEGATORCH_CHECK(t.is_string(), "config.json: expected 'layer_types' to hold strings, got ", t.dump());
      sliding += t.get<std::string>() == "sliding_attention";
    }
  } else {
    sliding = std::max<int64_t>(0, layers - size_field_or(h, "max_window_layers", 0, 28));
  }
  MEGATORCH_CHECK(sliding == 0 || sliding == layers, "Qwen2 import: use_sliding_window with max_window_layers ",
                  get_or<int64_t>(h, "max_window_layers", 28), " (layer_types) gives ", sliding, " sliding-window and ",
                  layers - sliding, " full-attention layers; megatorch gives every layer the same attention, so "
                  "max_window_layers must be 0 (all layers slide) or >= num_hidden_layers (", layers, ", none do)");
  return sliding == layers ? window : 0;
}

}  // namespace

const char* to_string(HFArch a) {
  switch (a) {
    case HFArch::kGPT2: return "gpt2";
    case HFArch::kLlama: return "llama";
    case HFArch::kMistral: return "mistral";
    case HFArch::kQwen2: return "qwen2";
  }
  return "?";
}

HFArch parse_hf_arch(const std::string& s) {
  return util::parse_enum(s, {HFArch::kGPT2, HFArch::kLlama, HFArch::kMistral, HFArch::kQwen2},
                          "a HuggingFace model_type");
}

bool hf_arch_holds(HFArch a, const TransformerConfig& c) {
  switch (a) {
    case HFArch::kGPT2: return gpt2_shaped(c) && c.sliding_window() == 0;
    case HFArch::kLlama: return llama_shaped(c) && !c.add_qkv_bias() && c.sliding_window() == 0;
    case HFArch::kMistral: return llama_shaped(c) && !c.add_qkv_bias();
    case HFArch::kQwen2: return llama_shaped(c) && c.add_qkv_bias();
  }
  return false;
}

HFArch hf_arch_of(const TransformerConfig& c, const std::string& preferred) {
  if (!preferred.empty()) {
    const HFArch p = parse_hf_arch(preferred);
    if (hf_arch_holds(p, c)) return p;
  }
  for (HFArch a : {HFArch::kGPT2, HFArch::kLlama, HFArch::kQwen2, HFArch::kMistral})
    if (hf_arch_holds(a, c)) return a;
  MEGATORCH_FAIL("HuggingFace export: the model (", to_string(c.normalization()), ", ", to_string(c.activation()), ", ",
                 to_string(c.position_embedding_type()), ", add_bias_linear ", c.add_bias_linear(), ", add_qkv_bias ",
                 c.add_qkv_bias(), ", sliding_window ", c.sliding_window(), ", ", c.query_groups(),
                 " query groups) is neither GPT-2 (LayerNorm, gelu_tanh, learned positions, biases, MHA, no window) "
                 "nor Llama/Mistral/Qwen2 (RMSNorm, swiglu, rope, no linear biases; Qwen2: add_qkv_bias; "
                 "Mistral: sliding_window)");
}

namespace {

// hidden / heads and heads / key-value heads, named with config.json's own fields before
// anything divides by them (validate() says the same in megatorch's names).
void check_heads(const json& h, const char* hidden_key, const char* heads_key, const char* groups_key) {
  const int64_t hidden = h.at(hidden_key).get<int64_t>(), heads = h.at(heads_key).get<int64_t>();
  MEGATORCH_CHECK(hidden % heads == 0, "config.json: expected ", hidden_key, " (", hidden, ") to be divisible by ",
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
  // Llama, Mistral and Qwen2: one layout; Qwen2 adds q/k/v biases, Mistral (and Qwen2 with
  // use_sliding_window) a sliding window. pretraining_tp > 1 (Llama) only split the matmuls
  // in transformers 4.x (numerically the same sums; 5.x ignores it), so it is not refused;
  // pad_token_id only keeps HF's embedding row from training (padding_idx), not the forward.
  const std::string name = arch == HFArch::kLlama ? "Llama" : arch == HFArch::kMistral ? "Mistral" : "Qwen2";
  const std::string act = get_or<std::string>(h, "hidden_act", "silu");
  MEGATORCH_CHECK(act == "silu" || act == "swish", name, " import: hidden_act '", act,
                  "' is not supported (megatorch's SwiGLU uses silu)");
  if (arch == HFArch::kLlama) {  // Mistral's and Qwen2's modeling code does not read these
    MEGATORCH_CHECK(!get_or<bool>(h, "attention_bias", false), "Llama import: attention_bias true is not "
                    "supported (it also puts a bias on o_proj, which megatorch's bias-free Llama has not)");
    MEGATORCH_CHECK(!get_or<bool>(h, "mlp_bias", false), "Llama import: mlp_bias true is not supported");
  }
  const double theta = rope_base(h, name);
  const int64_t hidden = size_field(h, "hidden_size", 1), heads = size_field(h, "num_attention_heads", 1);
  const int64_t groups = size_field_or(h, "num_key_value_heads", 1, heads);
  check_heads(h, "hidden_size", "num_attention_heads", "num_key_value_heads");
  const int64_t head_dim = size_field_or(h, "head_dim", 1, hidden / heads);
  MEGATORCH_CHECK(head_dim * heads == hidden, name, " import: head_dim ", head_dim,
                  " is not supported; megatorch's head dim is hidden_size / num_attention_heads = ", hidden, " / ",
                  heads);
  const int64_t layers = size_field(h, "num_hidden_layers", 1);
  int64_t window = 0;
  if (arch == HFArch::kMistral) window = size_field_or(h, "sliding_window", 0, 0);  // null: none
  if (arch == HFArch::kQwen2) window = qwen2_window(h, layers);
  const int64_t positions = size_field(h, "max_position_embeddings", 1);
  c.hidden_size(hidden)
      .num_attention_heads(heads)
      .num_query_groups(groups)
      .num_layers(layers)
      .vocab_size(size_field(h, "vocab_size", 1))
      .ffn_hidden_size(size_field(h, "intermediate_size", 1))
      // The window is kept; sequences stay within it (validate() refuses longer ones).
      .seq_length(window > 0 ? std::min(positions, window) : positions)
      .max_position_embeddings(positions)
      .sliding_window(window)
      .norm_epsilon(get_or<double>(h, "rms_norm_eps", 1e-6))
      .rotary_base(theta)
      .init_std(get_or<double>(h, "initializer_range", 0.02))
      .normalization(Normalization::kRMSNorm)
      .activation(Activation::kSwiGLU)
      .position_embedding_type(Positions::kRope)
      .add_bias_linear(false)
      .add_qkv_bias(arch == HFArch::kQwen2)
      .tie_embeddings(get_or<bool>(h, "tie_word_embeddings", false));
  validate_imported(c, name);
  return c;
}

json hf_config_from(const TransformerConfig& c, HFArch arch) {
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
  const char* cls = arch == HFArch::kLlama ? "LlamaForCausalLM"
                    : arch == HFArch::kMistral ? "MistralForCausalLM" : "Qwen2ForCausalLM";
  json j = {{"architectures", {cls}},
            {"model_type", to_string(arch)},
            {"vocab_size", c.vocab_size()},
            {"hidden_size", c.hidden_size()},
            {"intermediate_size", c.ffn()},
            {"num_hidden_layers", c.num_layers()},
            {"num_attention_heads", c.num_attention_heads()},
            {"num_key_value_heads", c.query_groups()},
            {"head_dim", c.head_dim()},
            {"max_position_embeddings", c.max_positions()},
            {"rms_norm_eps", c.norm_epsilon()},
            {"rope_theta", c.rotary_base()},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rotary_base()}}},
            {"hidden_act", "silu"},
            {"attention_dropout", 0.0},
            {"initializer_range", c.init_std()},
            {"tie_word_embeddings", c.tie_embeddings()},
            {"torch_dtype", "float32"}};
  const json window = c.sliding_window() > 0 ? json(c.sliding_window()) : json(nullptr);
  if (arch == HFArch::kLlama) {
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
  } else if (arch == HFArch::kMistral) {
    j["sliding_window"] = window;
  } else {
    // Qwen2: every layer slides (max_window_layers 0) or none does; layer_types says so
    // explicitly, as transformers 5 writes it.
    const bool slides = c.sliding_window() > 0;
    j["use_sliding_window"] = slides;
    j["sliding_window"] = window;
    j["max_window_layers"] = slides ? 0 : c.num_layers();
    j["layer_types"] = std::vector<std::string>(c.num_layers(), slides ? "sliding_attention" : "full_attention");
  }
  return j;
}

std::map<std::string, at::Tensor> from_hf_tensors(const std::map<std::string, at::Tensor>& hf_in,
                                                  const TransformerConfig& c) {
  std::map<std::string, at::Tensor> out;
  const int64_t h = c.hidden_size(), heads = c.num_attention_heads(), groups = c.query_groups(), d = c.head_dim();
  const int64_t V = c.vocab_size(), F = c.ffn();
  std::function<bool(const std::string&)> ignorable;
  std::string family;
  std::map<std::string, at::Tensor> renamed;
  if (gpt2_shaped(c)) {
    family = "GPT-2";
    std::map<std::string, std::string> original;
    for (const auto& [k, v] : hf_in) {
      const std::string key(util::strip_prefix(k, "transformer.").value_or(k));
      renamed[key] = v;
      original[key] = k;
    }
    Tensors hf(renamed, original);  // "transformer." is there for GPT2LMHeadModel, not for GPT2Model
    out["embedding.weight"] = hf.take("wte.weight", {V, h});
    out["position_embedding"] = hf.take("wpe.weight", {c.max_positions(), h});
    for (int64_t i = 0; i < c.num_layers(); ++i) {
      const std::string p = "h." + std::to_string(i) + ".", l = layer(i);
      for (const char* s : {"weight", "bias"}) {
        out[l + "input_norm." + s] = hf.take(p + "ln_1." + s, {h});
        out[l + "post_attention_norm." + s] = hf.take(p + "ln_2." + s, {h});
      }
      // Conv1D [in, out] -> Linear [out, in]; c_attn's [q; k; v] rows -> per head [q_i; k_i; v_i].
      out[l + "attention.qkv.weight"] = hf.take(p + "attn.c_attn.weight", {h, 3 * h})
                                            .t()
                                            .reshape({3, heads, d, h})
                                            .transpose(0, 1)
                                            .reshape({3 * h, h});
      out[l + "attention.qkv.bias"] =
          hf.take(p + "attn.c_attn.bias", {3 * h}).reshape({3, heads, d}).transpose(0, 1).reshape({3 * h});
      out[l + "attention.proj.weight"] = hf.take(p + "attn.c_proj.weight", {h, h}).t();
      out[l + "attention.proj.bias"] = hf.take(p + "attn.c_proj.bias", {h});
      out[l + "mlp.fc1.weight"] = hf.take(p + "mlp.c_fc.weight", {h, F}).t();
      out[l + "mlp.fc1.bias"] = hf.take(p + "mlp.c_fc.bias", {F});
      out[l + "mlp.fc2.weight"] = hf.take(p + "mlp.c_proj.weight", {F, h}).t();
      out[l + "mlp.fc2.bias"] = hf.take(p + "mlp.c_proj.bias", {h});
    }
    out["final_norm.weight"] = hf.take("ln_f.weight", {h});
    out["final_norm.bias"] = hf.take("ln_f.bias", {h});
    if (!c.tie_embeddings()) out["output_layer"] = hf.take("lm_head.weight", {V, h});
    else hf.check_if_present("lm_head.weight", {V, h});
    // Older GPT-2 files carry the causal-mask buffers (attn.bias, attn.masked_bias); a tied
    // head may be saved as well, and transformers ties it to wte on load.
    ignorable = [&c](const std::string& k) {
      return ends_with(k, ".attn.bias") || ends_with(k, ".attn.masked_bias") ||
             (c.tie_embeddings() && k == "lm_head.weight");
    };
    const auto left = hf.left(ignorable);
    MEGATORCH_CHECK(left.empty(), "HuggingFace checkpoint: tensor '", left.empty() ? "" : left.front(), "' (",
                    left.size(), " in all) has no place in megatorch's ", family,
                    " model; is config.json of another architecture than the weights?");
  } else {
    MEGATORCH_CHECK(llama_shaped(c), "HuggingFace import: the configuration is neither GPT-2 nor Llama-shaped");
    family = "Llama-family";
    Tensors hf(hf_in);
    const int64_t per = heads / groups;
    out["embedding.weight"] = hf.take("model.embed_tokens.weight", {V, h});
    for (int64_t i = 0; i < c.num_layers(); ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".", l = layer(i);
      out[l + "input_norm.weight"] = hf.take(p + "input_layernorm.weight", {h});
      out[l + "post_attention_norm.weight"] = hf.take(p + "post_attention_layernorm.weight", {h});
      // Group g's rows: its heads/groups queries, then its key, then its value; the biases alike.
      const at::Tensor q = hf.take(p + "self_attn.q_proj.weight", {heads * d, h}).reshape({groups, per * d, h});
      const at::Tensor k = hf.take(p + "self_attn.k_proj.weight", {groups * d, h}).reshape({groups, d, h});
      const at::Tensor v = hf.take(p + "self_attn.v_proj.weight", {groups * d, h}).reshape({groups, d, h});
      out[l + "attention.qkv.weight"] = at::cat({q, k, v}, 1).reshape({(heads + 2 * groups) * d, h});
      if (c.add_qkv_bias()) {
        const at::Tensor qb = hf.take(p + "self_attn.q_proj.bias", {heads * d}).reshape({groups, per * d});
        const at::Tensor kb = hf.take(p + "self_attn.k_proj.bias", {groups * d}).reshape({groups, d});
        const at::Tensor vb = hf.take(p + "self_attn.v_proj.bias", {groups * d}).reshape({groups, d});
        out[l + "attention.qkv.bias"] = at::cat({qb, kb, vb}, 1).reshape({(heads + 2 * groups) * d});
      }
      out[l + "attention.proj.weight"] = hf.take(p + "self_attn.o_proj.weight", {h, heads * d});
      out[l + "mlp.fc1.weight"] = at::cat(
          {hf.take(p + "mlp.gate_proj.weight", {F, h}), hf.take(p + "mlp.up_proj.weight", {F, h})}, 0);
      out[l + "mlp.fc2.weight"] = hf.take(p + "mlp.down_proj.weight", {h, F});
    }
    out["final_norm.weight"] = hf.take("model.norm.weight", {h});
    if (!c.tie_embeddings()) out["output_layer"] = hf.take("lm_head.weight", {V, h});
    else hf.check_if_present("lm_head.weight", {V, h});
    // rotary_emb.inv_freq: a buffer older files carry, recomputed from rope_theta.
    ignorable = [&c](const std::string& k) {
      return ends_with(k, "rotary_emb.inv_freq") || (c.tie_embeddings() && k == "lm_head.weight");
    };
    const auto left = hf.left(ignorable);
    MEGATORCH_CHECK(left.empty(), "HuggingFace checkpoint: tensor '", left.empty() ? "" : left.front(), "' (",
                    left.size(), " in all) has no place in megatorch's ", family,
                    " model; is config.json of another architecture than the weights (e.g. biases config.json "
                    "does not declare)?");
  }
  for (auto& [k, v] : out) v = v.contiguous();
  return out;
}

std::map<std::string, at::Tensor> to_hf_tensors(const std::map<std::string, at::Tensor>& mt,
                                                const TransformerConfig& c) {
  std::map<std::string, at::Tensor> out;
  const int64_t h = c.hidden_size(), heads = c.num_attention_heads(), groups = c.query_groups(), d = c.head_dim();
  if (gpt2_shaped(c)) {
    out["transformer.wte.weight"] = take(mt, "embedding.weight");
    out["transformer.wpe.weight"] = take(mt, "position_embedding");
    for (int64_t i = 0; i < c.num_layers(); ++i) {
      const std::string p = "transformer.h." + std::to_string(i) + ".", l = layer(i);
      for (const char* s : {"weight", "bias"}) {
        out[p + "ln_1." + s] = take(mt, l + "input_norm." + s);
        out[p + "ln_2." + s] = take(mt, l + "post_attention_norm." + s);
      }
      out[p + "attn.c_attn.weight"] =
          take(mt, l + "attention.qkv.weight").reshape({heads, 3, d, h}).transpose(0, 1).reshape({3 * h, h}).t();
      out[p + "attn.c_attn.bias"] = take(mt, l + "attention.qkv.bias").reshape({heads, 3, d}).transpose(0, 1).reshape({3 * h});
      out[p + "attn.c_proj.weight"] = take(mt, l + "attention.proj.weight").t();
      out[p + "attn.c_proj.bias"] = take(mt, l + "attention.proj.bias");
      out[p + "mlp.c_fc.weight"] = take(mt, l + "mlp.fc1.weight").t();
      out[p + "mlp.c_fc.bias"] = take(mt, l + "mlp.fc1.bias");
      out[p + "mlp.c_proj.weight"] = take(mt, l + "mlp.fc2.weight").t();
      out[p + "mlp.c_proj.bias"] = take(mt, l + "mlp.fc2.bias");
    }
    out["transformer.ln_f.weight"] = take(mt, "final_norm.weight");
    out["transformer.ln_f.bias"] = take(mt, "final_norm.bias");
    if (!c.tie_embeddings()) out["lm_head.weight"] = take(mt, "output_layer");
  } else {
    MEGATORCH_CHECK(llama_shaped(c), "HuggingFace export: the configuration is neither GPT-2 nor Llama-shaped");
    out["model.embed_tokens.weight"] = take(mt, "embedding.weight");
    const int64_t per = heads / groups;
    for (int64_t i = 0; i < c.num_layers(); ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".", l = layer(i);
      out[p + "input_layernorm.weight"] = take(mt, l + "input_norm.weight");
      out[p + "post_attention_layernorm.weight"] = take(mt, l + "post_attention_norm.weight");
      const at::Tensor qkv = take(mt, l + "attention.qkv.weight").reshape({groups, per + 2, d, h});
      out[p + "self_attn.q_proj.weight"] = qkv.narrow(1, 0, per).reshape({heads * d, h});
      out[p + "self_attn.k_proj.weight"] = qkv.select(1, per).reshape({groups * d, h});
      out[p + "self_attn.v_proj.weight"] = qkv.select(1, per + 1).reshape({groups * d, h});
      if (c.add_qkv_bias()) {
        const at::Tensor b = take(mt, l + "attention.qkv.bias").reshape({groups, per + 2, d});
        out[p + "self_attn.q_proj.bias"] = b.narrow(1, 0, per).reshape({heads * d});
        out[p + "self_attn.k_proj.bias"] = b.select(1, per).reshape({groups * d});
        out[p + "self_attn.v_proj.bias"] = b.select(1, per + 1).reshape({groups * d});
      }
      out[p + "self_attn.o_proj.weight"] = take(mt, l + "attention.proj.weight");
      const auto gate_up = take(mt, l + "mlp.fc1.weight").chunk(2, 0);
      out[p + "mlp.gate_proj.weight"] = gate_up[0];
      out[p + "mlp.up_proj.weight"] = gate_up[1];
      out[p + "mlp.down_proj.weight"] = take(mt, l + "mlp.fc2.weight");
    }
    out["model.norm.weight"] = take(mt, "final_norm.weight");
    if (!c.tie_embeddings()) out["lm_head.weight"] = take(mt, "output_layer");
  }
  for (auto& [k, v] : out) v = v.contiguous();
  return out;
}

HFConversion import_hf(const std::string& hf_dir, const std::string& ckpt_dir, int64_t iteration) {
  const fs::path dir(hf_dir);
  const json hf_config = read_json(dir / "config.json");
  const TransformerConfig c = config_from_hf(hf_config);
  const HFArch arch = parse_hf_arch(hf_config.at("model_type").get<std::string>());
  std::vector<fs::path> files;
  if (fs::exists(dir / "model.safetensors")) {
    files.push_back(dir / "model.safetensors");
  } else {
    MEGATORCH_CHECK(fs::exists(dir / "model.safetensors.index.json"), "'", hf_dir,
                    "' has neither model.safetensors nor model.safetensors.index.json; save the model with "
                    "save_pretrained(..., safe_serialization=True)");
    std::set<std::string> names;
    for (const auto& [k, v] : read_json(dir / "model.safetensors.index.json").at("weight_map").items()) names.insert(v);
    for (const auto& n : names) files.push_back(dir / n);
  }
  std::map<std::string, at::Tensor> hf;
  for (const auto& f : files) {
    SafetensorsReader reader(f.string());
    for (const auto& name : reader.names()) hf[name] = reader.read(name);
  }
  const auto tensors = from_hf_tensors(hf, c);
  std::vector<ShardedEntry> entries;
  for (const auto& [name, t] : tensors) {
    ShardedEntry e;
    e.key = kModelPrefix + name;
    e.spec.full_shape = t.sizes().vec();
    e.tensor = t;
    entries.push_back(std::move(e));
  }
  CheckpointState state;
  state.model_config = gpt_config_json(c);
  // The model_type, so that an export writes the same architecture back (a Mistral without a
  // window is a Llama in shape, and would otherwise be exported as one).
  state.state = {{"imported_from", hf_dir}, {"hf_model_type", to_string(arch)}};
  save_checkpoint(ckpt_dir, iteration, entries, state);
  return {c, arch};
}

HFConversion export_hf(const std::string& ckpt_dir, const std::string& hf_dir, int64_t iteration) {
  const json meta = read_metadata(ckpt_dir, iteration);
  const TransformerConfig c = gpt_config_from_json(meta.at("model_config"));
  std::string recorded;
  if (meta.contains("state") && meta.at("state").is_object())
    recorded = get_or<std::string>(meta.at("state"), "hf_model_type", "");
  const HFArch arch = hf_arch_of(c, recorded);  // refuse a model no architecture holds before reading tensors
  std::vector<ShardedEntry> entries;
  for (const auto& [key, t] : meta.at("tensors").items()) {
    if (!util::starts_with(key, kModelPrefix)) continue;  // optimizer state stays behind
    ShardedEntry e;
    e.key = key;
    e.spec.full_shape = t.at("shape").get<std::vector<int64_t>>();
    e.tensor = at::empty(e.spec.full_shape, at::TensorOptions().dtype(scalar_type_from_safetensors(
                                                  t.at("pieces").at(0).at("dtype").get<std::string>())));
    entries.push_back(std::move(e));
  }
  load_checkpoint(ckpt_dir, entries, LoadOptions().iteration(meta.at("iteration").get<int64_t>()));
  std::map<std::string, at::Tensor> tensors;
  for (const auto& e : entries) tensors[std::string(*util::strip_prefix(e.key, kModelPrefix))] = e.tensor;
  std::vector<std::pair<std::string, at::Tensor>> hf;
  for (auto& [k, v] : to_hf_tensors(tensors, c)) hf.emplace_back(k, v);
  fs::create_directories(hf_dir);
  // Both written whole under temporary names before either replaces an earlier export: a
  // failed export (a full disk) leaves the directory as it was.
  io::AtomicFile weights((fs::path(hf_dir) / "model.safetensors").string());
  write_safetensors(weights, hf, {{"format", "pt"}});
  io::AtomicFile config((fs::path(hf_dir) / "config.json").string());
  config.write(hf_config_from(c, arch).dump(2) + "\n");
  weights.finish();
  config.finish();
  weights.publish();
  config.publish();
  return {c, arch};
}

}  // namespace megatorch::ckpt
