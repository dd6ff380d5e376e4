// HuggingFace tensors <-> megatorch checkpoint tensors (names, the fused QKV and gate/up
// layouts), and importing/exporting whole directories. config.json itself is hf_config.cpp's.
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
#include "hf_internal.h"

namespace megatorch::ckpt {

// json, fs and the TransformerConfig names come with hf_detail.
using namespace hf_detail;

namespace {

// The model's keys in a checkpoint (the others are optimizer state): gpt_model_entries'.
const std::string kModelPrefix = GPTEntriesOptions().prefix();

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
  bool has(const std::string& name) const { return m_.count(name) > 0; }
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
                    "key/value heads, intermediate size, experts, layers or positions differ)");
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

// Where an architecture keeps its experts, per expert (the published layout, and what
// save_pretrained writes): Mixtral's block_sparse_moe.experts.e.w1 (gate) / w3 (up) / w2
// (down); Qwen3-MoE's mlp.experts.e.gate_proj / up_proj / down_proj; the router is the
// block's gate. Qwen3-MoE carries QK-norm, Mixtral cannot: the config tells them apart.
struct ExpertNames {
  std::string block, gate, up, down;
};
ExpertNames expert_names(const TransformerConfig& c) {
  if (c.qk_layernorm()) return {"mlp.", "gate_proj", "up_proj", "down_proj"};
  return {"block_sparse_moe.", "w1", "w3", "w2"};
}

// The experts of HF layer prefix `p` ("model.layers.3.") -> megatorch's MoE layer `l`: the
// per-expert layout (gate, up [F, h]; down [h, F]), or transformers 5's in-memory one under
// mlp (gate_up_proj [E, 2F, h] = [gate; up] rows, down_proj [E, h, F]). megatorch's are
// input-major: fc1 [E, h, 2F] with [gate | up] columns, fc2 [E, F, h].
void take_experts(Tensors& hf, const std::string& p, const std::string& l, const TransformerConfig& c,
                  std::map<std::string, at::Tensor>& out) {
  const int64_t E = c.num_experts(), h = c.hidden_size(), F = c.moe_ffn();
  const ExpertNames n = expert_names(c);
  const std::string fused = p + "mlp.experts.gate_up_proj";
  const std::string moe = hf.has(fused) || hf.has(p + "mlp.gate.weight") ? p + "mlp." : p + n.block;
  out[l + "mlp.router.weight"] = hf.take(moe + "gate.weight", {E, h});
  if (hf.has(fused)) {
    out[l + "mlp.experts.fc1_weight"] = hf.take(fused, {E, 2 * F, h}).transpose(1, 2);
    out[l + "mlp.experts.fc2_weight"] = hf.take(p + "mlp.experts.down_proj", {E, h, F}).transpose(1, 2);
    return;
  }
  std::vector<at::Tensor> fc1, fc2;
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = moe + "experts." + std::to_string(e) + ".";
    fc1.push_back(at::cat({hf.take(x + n.gate + ".weight", {F, h}), hf.take(x + n.up + ".weight", {F, h})}, 0).t());
    fc2.push_back(hf.take(x + n.down + ".weight", {h, F}).t());
  }
  out[l + "mlp.experts.fc1_weight"] = at::stack(fc1);
  out[l + "mlp.experts.fc2_weight"] = at::stack(fc2);
}

}  // namespace

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
      if (c.qkv_bias()) {
        const at::Tensor qb = hf.take(p + "self_attn.q_proj.bias", {heads * d}).reshape({groups, per * d});
        const at::Tensor kb = hf.take(p + "self_attn.k_proj.bias", {groups * d}).reshape({groups, d});
        const at::Tensor vb = hf.take(p + "self_attn.v_proj.bias", {groups * d}).reshape({groups, d});
        out[l + "attention.qkv.bias"] = at::cat({qb, kb, vb}, 1).reshape({(heads + 2 * groups) * d});
      }
      out[l + "attention.proj.weight"] = hf.take(p + "self_attn.o_proj.weight", {h, heads * d});
      if (c.proj_bias()) out[l + "attention.proj.bias"] = hf.take(p + "self_attn.o_proj.bias", {h});
      if (c.qk_layernorm()) {
        out[l + "attention.q_norm.weight"] = hf.take(p + "self_attn.q_norm.weight", {d});
        out[l + "attention.k_norm.weight"] = hf.take(p + "self_attn.k_norm.weight", {d});
      }
      if (c.is_moe_layer(i)) {
        take_experts(hf, p, l, c, out);
        continue;
      }
      out[l + "mlp.fc1.weight"] = at::cat(
          {hf.take(p + "mlp.gate_proj.weight", {F, h}), hf.take(p + "mlp.up_proj.weight", {F, h})}, 0);
      out[l + "mlp.fc2.weight"] = hf.take(p + "mlp.down_proj.weight", {h, F});
      if (c.mlp_bias()) {
        out[l + "mlp.fc1.bias"] = at::cat({hf.take(p + "mlp.gate_proj.bias", {F}), hf.take(p + "mlp.up_proj.bias", {F})});
        out[l + "mlp.fc2.bias"] = hf.take(p + "mlp.down_proj.bias", {h});
      }
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
      if (c.qkv_bias()) {
        const at::Tensor b = take(mt, l + "attention.qkv.bias").reshape({groups, per + 2, d});
        out[p + "self_attn.q_proj.bias"] = b.narrow(1, 0, per).reshape({heads * d});
        out[p + "self_attn.k_proj.bias"] = b.select(1, per).reshape({groups * d});
        out[p + "self_attn.v_proj.bias"] = b.select(1, per + 1).reshape({groups * d});
      }
      out[p + "self_attn.o_proj.weight"] = take(mt, l + "attention.proj.weight");
      if (c.proj_bias()) out[p + "self_attn.o_proj.bias"] = take(mt, l + "attention.proj.bias");
      if (c.qk_layernorm()) {
        out[p + "self_attn.q_norm.weight"] = take(mt, l + "attention.q_norm.weight");
        out[p + "self_attn.k_norm.weight"] = take(mt, l + "attention.k_norm.weight");
      }
      if (c.is_moe_layer(i)) {
        // The published per-expert layout: transformers 4.x's module names, which 5.x fuses
        // on load and splits again in save_pretrained.
        const ExpertNames n = expert_names(c);
        const std::string moe = p + n.block;
        const int64_t F = c.moe_ffn();
        out[moe + "gate.weight"] = take(mt, l + "mlp.router.weight");
        const at::Tensor fc1 = take(mt, l + "mlp.experts.fc1_weight"), fc2 = take(mt, l + "mlp.experts.fc2_weight");
        for (int64_t e = 0; e < c.num_experts(); ++e) {
          const std::string x = moe + "experts." + std::to_string(e) + ".";
          out[x + n.gate + ".weight"] = fc1[e].narrow(1, 0, F).t();
          out[x + n.up + ".weight"] = fc1[e].narrow(1, F, F).t();
          out[x + n.down + ".weight"] = fc2[e].t();
        }
        continue;
      }
      const auto gate_up = take(mt, l + "mlp.fc1.weight").chunk(2, 0);
      out[p + "mlp.gate_proj.weight"] = gate_up[0];
      out[p + "mlp.up_proj.weight"] = gate_up[1];
      out[p + "mlp.down_proj.weight"] = take(mt, l + "mlp.fc2.weight");
      if (c.mlp_bias()) {
        const auto bias = take(mt, l + "mlp.fc1.bias").chunk(2, 0);
        out[p + "mlp.gate_proj.bias"] = bias[0];
        out[p + "mlp.up_proj.bias"] = bias[1];
        out[p + "mlp.down_proj.bias"] = take(mt, l + "mlp.fc2.bias");
      }
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
  if (arch == HFArch::kMixtral || arch == HFArch::kQwen3Moe) {  // HF training settings megatorch does not use
    state.state["hf_router_aux_loss_coef"] = get_or<double>(hf_config, "router_aux_loss_coef", 0.001);
    state.state["hf_router_jitter_noise"] = get_or<double>(hf_config, "router_jitter_noise", 0.0);
  }
  save_checkpoint(ckpt_dir, iteration, entries, state);
  return {c, arch};
}

HFConversion export_hf(const std::string& ckpt_dir, const std::string& hf_dir, int64_t iteration) {
  const json meta = read_metadata(ckpt_dir, iteration);
  const TransformerConfig c = gpt_config_from_json(meta.at("model_config"));
  std::string recorded;
  json import_state = json::object();
  if (meta.contains("state") && meta.at("state").is_object()) {
    import_state = meta.at("state");
    recorded = get_or<std::string>(import_state, "hf_model_type", "");
  }
  const HFArch arch = hf_arch_of(c, recorded);  // refuse a model no architecture holds before reading tensors
  // The model's tensors (optimizer state stays behind), but FP8 scaling state: no HF weight.
  std::map<std::string, at::Tensor> tensors;
  for (auto& [key, t] : read_tensors(ckpt_dir, kModelPrefix, meta.at("iteration").get<int64_t>()))
    if (key.find(".fp8.") == std::string::npos) tensors[std::string(*util::strip_prefix(key, kModelPrefix))] = t;
  std::vector<std::pair<std::string, at::Tensor>> hf;
  for (auto& [k, v] : to_hf_tensors(tensors, c)) hf.emplace_back(k, v);
  fs::create_directories(hf_dir);
  // Both written whole under temporary names before either replaces an earlier export: a
  // failed export (a full disk) leaves the directory as it was.
  io::AtomicFile weights((fs::path(hf_dir) / "model.safetensors").string());
  write_safetensors(weights, hf, {{"format", "pt"}});
  io::AtomicFile config((fs::path(hf_dir) / "config.json").string());
  config.write(hf_config_from(c, arch, import_state).dump(2) + "\n");
  weights.finish();
  config.finish();
  weights.publish();
  config.publish();
  return {c, arch};
}

}  // namespace megatorch::ckpt
