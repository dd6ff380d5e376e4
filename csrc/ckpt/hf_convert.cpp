#include "megatorch/ckpt/hf_convert.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "megatorch/check.h"
#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/gpt_checkpoint.h"
#include "megatorch/ckpt/safetensors.h"

namespace megatorch::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;
using transformer::Activation;
using transformer::Normalization;
using transformer::Positions;
using transformer::TransformerConfig;

namespace {

json read_json(const fs::path& path) {
  std::ifstream in(path);
  MEGATORCH_CHECK(in.good(), "cannot open '", path.string(), "'");
  try {
    return json::parse(in);
  } catch (const std::exception& e) {
    MEGATORCH_FAIL("'", path.string(), "' is not valid JSON (", e.what(), ")");
  }
}

template <class T>
T get_or(const json& j, const char* key, T fallback) {
  return j.contains(key) && !j.at(key).is_null() ? j.at(key).get<T>() : fallback;
}

const at::Tensor& take(const std::map<std::string, at::Tensor>& m, const std::string& name) {
  auto it = m.find(name);
  MEGATORCH_CHECK(it != m.end(), "HuggingFace checkpoint: expected tensor '", name, "', found none");
  return it->second;
}

std::string layer(int64_t i) { return "layers." + std::to_string(i) + "."; }

}  // namespace

const char* to_string(HFArch a) { return a == HFArch::kGPT2 ? "gpt2" : "llama"; }

HFArch parse_hf_arch(const std::string& s) {
  if (s == "gpt2") return HFArch::kGPT2;
  if (s == "llama") return HFArch::kLlama;
  MEGATORCH_FAIL("expected a HuggingFace model_type 'gpt2' or 'llama', got '", s, "'");
}

HFArch hf_arch_of(const TransformerConfig& c) {
  if (c.normalization() == Normalization::kLayerNorm && c.activation() == Activation::kGeluTanh &&
      c.position_embedding_type() == Positions::kLearned && c.add_bias_linear() &&
      c.query_groups() == c.num_attention_heads()) {
    return HFArch::kGPT2;
  }
  if (c.normalization() == Normalization::kRMSNorm && c.activation() == Activation::kSwiGLU &&
      c.position_embedding_type() == Positions::kRope && !c.add_bias_linear()) {
    return HFArch::kLlama;
  }
  MEGATORCH_FAIL("HuggingFace export: the model (", to_string(c.normalization()), ", ", to_string(c.activation()), ", ",
                 to_string(c.position_embedding_type()), ", bias ", c.add_bias_linear(), ", ", c.query_groups(),
                 " query groups) is neither GPT-2 (LayerNorm, gelu_tanh, learned positions, biases, MHA) nor Llama "
                 "(RMSNorm, swiglu, rope, no biases)");
}

TransformerConfig config_from_hf(const json& h) {
  const std::string type = get_or<std::string>(h, "model_type", "");
  TransformerConfig c;
  c.hidden_dropout(0).attention_dropout(0);
  if (parse_hf_arch(type) == HFArch::kGPT2) {
    const std::string act = get_or<std::string>(h, "activation_function", "gelu_new");
    MEGATORCH_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", "GPT-2 import: activation_function '", act,
                    "' is not supported; megatorch's GPT-2 uses the tanh GeLU (gelu_new)");
    MEGATORCH_CHECK(!get_or<bool>(h, "scale_attn_by_inverse_layer_idx", false) &&
                        !get_or<bool>(h, "reorder_and_upcast_attn", false) && get_or<bool>(h, "scale_attn_weights", true),
                    "GPT-2 import: only the standard 1/sqrt(head_dim) attention scaling is supported");
    const int64_t hidden = h.at("n_embd").get<int64_t>();
    const int64_t positions = h.at("n_positions").get<int64_t>();
    c.hidden_size(hidden)
        .num_attention_heads(h.at("n_head").get<int64_t>())
        .num_layers(h.at("n_layer").get<int64_t>())
        .vocab_size(h.at("vocab_size").get<int64_t>())
        .max_position_embeddings(positions)
        .seq_length(positions)
        .ffn_hidden_size(get_or<int64_t>(h, "n_inner", 4 * hidden))
        .norm_epsilon(get_or<double>(h, "layer_norm_epsilon", 1e-5))
        .init_std(get_or<double>(h, "initializer_range", 0.02))
        .normalization(Normalization::kLayerNorm)
        .activation(Activation::kGeluTanh)
        .position_embedding_type(Positions::kLearned)
        .add_bias_linear(true)
        .tie_embeddings(get_or<bool>(h, "tie_word_embeddings", true));
    return c;
  }
  const std::string act = get_or<std::string>(h, "hidden_act", "silu");
  MEGATORCH_CHECK(act == "silu", "Llama import: hidden_act '", act, "' is not supported (megatorch's SwiGLU uses silu)");
  MEGATORCH_CHECK(!get_or<bool>(h, "attention_bias", false) && !get_or<bool>(h, "mlp_bias", false),
                  "Llama import: attention_bias / mlp_bias are not supported");
  // transformers 5 keeps rope_theta under rope_parameters; 4.x at the top level.
  double theta = get_or<double>(h, "rope_theta", 10000.0);
  std::string rope_type = "default";
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (h.contains(key) && h.at(key).is_object()) {
      theta = get_or<double>(h.at(key), "rope_theta", theta);
      rope_type = get_or<std::string>(h.at(key), "rope_type", get_or<std::string>(h.at(key), "type", "default"));
    }
  }
  MEGATORCH_CHECK(rope_type == "default", "Llama import: rope type '", rope_type,
                  "' is not supported; megatorch implements the default (unscaled) RoPE");
  const int64_t hidden = h.at("hidden_size").get<int64_t>(), heads = h.at("num_attention_heads").get<int64_t>();
  MEGATORCH_CHECK(get_or<int64_t>(h, "head_dim", hidden / heads) == hidden / heads,
                  "Llama import: head_dim must be hidden_size / num_attention_heads = ", hidden / heads);
  const int64_t positions = h.at("max_position_embeddings").get<int64_t>();
  c.hidden_size(hidden)
      .num_attention_heads(heads)
      .num_query_groups(get_or<int64_t>(h, "num_key_value_heads", heads))
      .num_layers(h.at("num_hidden_layers").get<int64_t>())
      .vocab_size(h.at("vocab_size").get<int64_t>())
      .ffn_hidden_size(h.at("intermediate_size").get<int64_t>())
      .seq_length(positions)
      .norm_epsilon(get_or<double>(h, "rms_norm_eps", 1e-6))
      .rotary_base(theta)
      .init_std(get_or<double>(h, "initializer_range", 0.02))
      .normalization(Normalization::kRMSNorm)
      .activation(Activation::kSwiGLU)
      .position_embedding_type(Positions::kRope)
      .add_bias_linear(false)
      .tie_embeddings(get_or<bool>(h, "tie_word_embeddings", false));
  return c;
}

json hf_config_from(const TransformerConfig& c) {
  if (hf_arch_of(c) == HFArch::kGPT2) {
    return {{"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"},
            {"vocab_size", c.vocab_size()},         {"n_positions", c.max_positions()},
            {"n_embd", c.hidden_size()},            {"n_layer", c.num_layers()},
            {"n_head", c.num_attention_heads()},    {"n_inner", c.ffn()},
            {"activation_function", "gelu_new"},    {"layer_norm_epsilon", c.norm_epsilon()},
            {"resid_pdrop", 0.0},                   {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},                    {"initializer_range", c.init_std()},
            {"tie_word_embeddings", c.tie_embeddings()}, {"torch_dtype", "float32"}};
  }
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", c.vocab_size()},
          {"hidden_size", c.hidden_size()},
          {"intermediate_size", c.ffn()},
          {"num_hidden_layers", c.num_layers()},
          {"num_attention_heads", c.num_attention_heads()},
          {"num_key_value_heads", c.query_groups()},
          {"head_dim", c.head_dim()},
          {"max_position_embeddings", c.seq_length()},
          {"rms_norm_eps", c.norm_epsilon()},
          {"rope_theta", c.rotary_base()},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", c.rotary_base()}}},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"mlp_bias", false},
          {"initializer_range", c.init_std()},
          {"tie_word_embeddings", c.tie_embeddings()},
          {"torch_dtype", "float32"}};
}

std::map<std::string, at::Tensor> from_hf_tensors(const std::map<std::string, at::Tensor>& hf_in,
                                                  const TransformerConfig& c) {
  std::map<std::string, at::Tensor> out;
  const int64_t h = c.hidden_size(), heads = c.num_attention_heads(), groups = c.query_groups(), d = c.head_dim();
  if (hf_arch_of(c) == HFArch::kGPT2) {
    std::map<std::string, at::Tensor> hf;  // "transformer." is there for GPT2LMHeadModel, not for GPT2Model
    for (const auto& [k, v] : hf_in) hf[k.rfind("transformer.", 0) == 0 ? k.substr(12) : k] = v;
    out["embedding.weight"] = take(hf, "wte.weight");
    out["position_embedding"] = take(hf, "wpe.weight");
    for (int64_t i = 0; i < c.num_layers(); ++i) {
      const std::string p = "h." + std::to_string(i) + ".", l = layer(i);
      for (const char* s : {"weight", "bias"}) {
        out[l + "input_norm." + s] = take(hf, p + "ln_1." + s);
        out[l + "post_attention_norm." + s] = take(hf, p + "ln_2." + s);
      }
      // Conv1D [in, out] -> Linear [out, in]; c_attn's [q; k; v] rows -> per head [q_i; k_i; v_i].
      out[l + "attention.qkv.weight"] =
          take(hf, p + "attn.c_attn.weight").t().reshape({3, heads, d, h}).transpose(0, 1).reshape({3 * h, h});
      out[l + "attention.qkv.bias"] = take(hf, p + "attn.c_attn.bias").reshape({3, heads, d}).transpose(0, 1).reshape({3 * h});
      out[l + "attention.proj.weight"] = take(hf, p + "attn.c_proj.weight").t();
      out[l + "attention.proj.bias"] = take(hf, p + "attn.c_proj.bias");
      out[l + "mlp.fc1.weight"] = take(hf, p + "mlp.c_fc.weight").t();
      out[l + "mlp.fc1.bias"] = take(hf, p + "mlp.c_fc.bias");
      out[l + "mlp.fc2.weight"] = take(hf, p + "mlp.c_proj.weight").t();
      out[l + "mlp.fc2.bias"] = take(hf, p + "mlp.c_proj.bias");
    }
    out["final_norm.weight"] = take(hf, "ln_f.weight");
    out["final_norm.bias"] = take(hf, "ln_f.bias");
    if (!c.tie_embeddings()) out["output_layer"] = take(hf, "lm_head.weight");
  } else {
    const auto& hf = hf_in;
    out["embedding.weight"] = take(hf, "model.embed_tokens.weight");
    for (int64_t i = 0; i < c.num_layers(); ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".", l = layer(i);
      out[l + "input_norm.weight"] = take(hf, p + "input_layernorm.weight");
      out[l + "post_attention_norm.weight"] = take(hf, p + "post_attention_layernorm.weight");
      // Group g's rows: its heads/groups queries, then its key, then its value.
      const at::Tensor q = take(hf, p + "self_attn.q_proj.weight").reshape({groups, heads / groups * d, h});
      const at::Tensor k = take(hf, p + "self_attn.k_proj.weight").reshape({groups, d, h});
      const at::Tensor v = take(hf, p + "self_attn.v_proj.weight").reshape({groups, d, h});
      out[l + "attention.qkv.weight"] = at::cat({q, k, v}, 1).reshape({(heads + 2 * groups) * d, h});
      out[l + "attention.proj.weight"] = take(hf, p + "self_attn.o_proj.weight");
      out[l + "mlp.fc1.weight"] = at::cat({take(hf, p + "mlp.gate_proj.weight"), take(hf, p + "mlp.up_proj.weight")}, 0);
      out[l + "mlp.fc2.weight"] = take(hf, p + "mlp.down_proj.weight");
    }
    out["final_norm.weight"] = take(hf, "model.norm.weight");
    if (!c.tie_embeddings()) out["output_layer"] = take(hf, "lm_head.weight");
  }
  for (auto& [k, v] : out) v = v.contiguous();
  return out;
}

std::map<std::string, at::Tensor> to_hf_tensors(const std::map<std::string, at::Tensor>& mt,
                                                const TransformerConfig& c) {
  std::map<std::string, at::Tensor> out;
  const int64_t h = c.hidden_size(), heads = c.num_attention_heads(), groups = c.query_groups(), d = c.head_dim();
  if (hf_arch_of(c) == HFArch::kGPT2) {
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

TransformerConfig import_hf(const std::string& hf_dir, const std::string& ckpt_dir, int64_t iteration) {
  const fs::path dir(hf_dir);
  const TransformerConfig c = config_from_hf(read_json(dir / "config.json"));
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
    e.key = "model/" + name;
    e.spec.full_shape = t.sizes().vec();
    e.tensor = t;
    entries.push_back(std::move(e));
  }
  CheckpointState state;
  state.model_config = gpt_config_json(c);
  state.state = {{"imported_from", hf_dir}, {"hf_model_type", to_string(hf_arch_of(c))}};
  save_checkpoint(ckpt_dir, iteration, entries, state);
  return c;
}

TransformerConfig export_hf(const std::string& ckpt_dir, const std::string& hf_dir, int64_t iteration) {
  const json meta = read_metadata(ckpt_dir, iteration);
  const TransformerConfig c = gpt_config_from_json(meta.at("model_config"));
  hf_arch_of(c);  // refuse a model neither GPT-2 nor Llama before reading tensors
  std::vector<ShardedEntry> entries;
  for (const auto& [key, t] : meta.at("tensors").items()) {
    if (key.rfind("model/", 0) != 0) continue;  // optimizer state stays behind
    ShardedEntry e;
    e.key = key;
    e.spec.full_shape = t.at("shape").get<std::vector<int64_t>>();
    e.tensor = at::empty(e.spec.full_shape, at::TensorOptions().dtype(scalar_type_from_safetensors(
                                                  t.at("pieces").at(0).at("dtype").get<std::string>())));
    entries.push_back(std::move(e));
  }
  load_checkpoint(ckpt_dir, entries, LoadOptions().iteration(meta.at("iteration").get<int64_t>()));
  std::map<std::string, at::Tensor> tensors;
  for (const auto& e : entries) tensors[e.key.substr(6)] = e.tensor;
  std::vector<std::pair<std::string, at::Tensor>> hf;
  for (auto& [k, v] : to_hf_tensors(tensors, c)) hf.emplace_back(k, v);
  fs::create_directories(hf_dir);
  write_safetensors((fs::path(hf_dir) / "model.safetensors").string(), hf, {{"format", "pt"}});
  std::ofstream(fs::path(hf_dir) / "config.json") << hf_config_from(c).dump(2) << "\n";
  return c;
}

}  // namespace megatorch::ckpt
