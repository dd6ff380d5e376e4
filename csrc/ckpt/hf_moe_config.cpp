// The HuggingFace mixtures of experts on megatorch's MoE layers: Mixtral (experts in every
// layer) and Qwen3-MoE (Qwen3's attention, dense layers first): what their config.json's
// expert fields become on import, what keeps a configuration from being one, and the
// fields their export writes.
#include <numeric>
#include <string>
#include <vector>

#include "megatorch/check.h"
#include "megatorch/ckpt/hf_convert.h"
#include "hf_internal.h"

namespace megatorch::ckpt {

using namespace hf_detail;

std::vector<std::string> mixtral_obstacles(const TransformerConfig& c) {
  std::vector<std::string> out;
  auto add = [&out](auto&&... parts) { out.push_back(c10::str(parts...)); };
  const auto yes = [](bool b) { return b ? "true" : "false"; };
  if (c.num_experts() == 0) add("num_experts 0 (Mixtral has experts in every layer; a dense model is a Llama or Mistral)");
  if (c.normalization() != Normalization::kRMSNorm) add("normalization ", to_string(c.normalization()), " (Mixtral: RMSNorm)");
  if (c.activation() != Activation::kSwiGLU) add("activation ", to_string(c.activation()), " (Mixtral's experts: swiglu)");
  if (c.position_embedding_type() != Positions::kRope)
    add("position_embedding_type ", to_string(c.position_embedding_type()), " (Mixtral: rope)");
  if (c.rotary_percent() != 1.0) add("rotary_percent ", c.rotary_percent(), " (Mixtral rotates the whole head)");
  if (c.add_bias_linear()) add("add_bias_linear true (Mixtral has no linear biases)");
  if (c.add_qkv_bias()) add("add_qkv_bias true (Mixtral has no q/k/v biases)");
  if (c.add_attention_bias()) add("add_attention_bias true (Mixtral has no attention biases)");
  if (c.add_mlp_bias()) add("add_mlp_bias true (Mixtral's experts have no biases)");
  if (c.qk_layernorm()) add("qk_layernorm true (Mixtral has no QK-norm)");
  if (!c.layer_types().empty()) add("layer_types (Mixtral's window covers every layer or none)");
  if (!c.causal_attention()) add("causal_attention false (Mixtral is a causal LM)");
  if (c.num_experts() == 0) return out;
  if (c.moe_layer_freq() != 1) add("moe_layer_freq ", c.moe_layer_freq(), " (Mixtral: 1, experts in every layer)");
  if (c.moe_first_k_dense() != 0) add("moe_first_k_dense ", c.moe_first_k_dense(), " (Mixtral: 0, no dense layers)");
  if (c.moe_shared_expert_intermediate_size() != 0)
    add("moe_shared_expert_intermediate_size ", c.moe_shared_expert_intermediate_size(), " (Mixtral: 0, no shared expert)");
  if (c.moe_router_score_function() != transformer::RouterScore::kSoftmax)
    add("moe_router_score_function ", to_string(c.moe_router_score_function()), " (Mixtral: softmax)");
  // Softmax over all experts then top-k gives weights summing to < 1; Mixtral renormalises
  // them, which the router does only with norm_topk_prob and k > 1 (top-k-then-softmax, the
  // default, sums to 1 by construction).
  if (c.moe_router_score_function() == transformer::RouterScore::kSoftmax && c.moe_router_pre_softmax() &&
      !(c.moe_router_norm_topk_prob() && c.moe_router_topk() > 1))
    add("moe_router_pre_softmax true with moe_router_norm_topk_prob ", yes(c.moe_router_norm_topk_prob()),
        " and moe_router_topk ", c.moe_router_topk(), " (Mixtral's k weights sum to 1: pre_softmax false, or "
        "pre_softmax with norm_topk_prob and topk > 1)");
  if (c.moe_router_topk_scaling_factor() != 1.0)
    add("moe_router_topk_scaling_factor ", c.moe_router_topk_scaling_factor(), " (Mixtral: 1)");
  if (c.moe_router_enable_expert_bias()) add("moe_router_enable_expert_bias true (Mixtral has no expert bias)");
  return out;
}

std::vector<std::string> qwen3_moe_obstacles(const TransformerConfig& c) {
  std::vector<std::string> out;
  auto add = [&out](auto&&... parts) { out.push_back(c10::str(parts...)); };
  if (c.num_experts() == 0) add("num_experts 0 (Qwen3-MoE has experts; a dense model is a Qwen3)");
  if (!llama_shaped(c)) add("not Llama-shaped (Qwen3-MoE: RMSNorm, swiglu, rope over the whole head, no add_bias_linear)");
  if (!c.qk_layernorm()) add("qk_layernorm false (Qwen3-MoE normalises q and k)");
  if (c.qkv_bias() != c.proj_bias()) add("add_qkv_bias true (Qwen3-MoE's attention_bias covers q, k, v and o)");
  if (c.add_mlp_bias()) add("add_mlp_bias true (Qwen3-MoE's MLPs have no biases)");
  if (!c.layer_types().empty()) add("layer_types (Qwen3-MoE's window covers every layer or none)");
  if (!c.causal_attention()) add("causal_attention false (Qwen3-MoE is a causal LM)");
  if (c.num_experts() == 0) return out;
  if (c.moe_layer_freq() != 1) add("moe_layer_freq ", c.moe_layer_freq(), " (Qwen3-MoE: decoder_sparse_step 1)");
  if (c.moe_shared_expert_intermediate_size() != 0) add("a shared expert (Qwen3-MoE has none)");
  if (c.moe_router_score_function() != transformer::RouterScore::kSoftmax) add("a sigmoid router (Qwen3-MoE: softmax)");
  // Top-k of the softmax over all experts, renormalised (norm_topk_prob) or not: megatorch's
  // top-k-then-softmax router is the renormalised one; pre_softmax without norm the other.
  if (c.moe_router_pre_softmax() && c.moe_router_norm_topk_prob() && c.moe_router_topk() == 1)
    add("moe_router_pre_softmax with moe_router_norm_topk_prob and moe_router_topk 1 (megatorch keeps the probability, "
        "Qwen3-MoE's norm_topk_prob makes it 1)");
  if (c.moe_router_topk_scaling_factor() != 1.0)
    add("moe_router_topk_scaling_factor ", c.moe_router_topk_scaling_factor(), " (Qwen3-MoE: 1)");
  if (c.moe_router_enable_expert_bias()) add("moe_router_enable_expert_bias true (Qwen3-MoE has no expert bias)");
  return out;
}

namespace hf_detail {

void mixtral_experts(const json& h, TransformerConfig& c) {
  // Every layer's MLP is num_local_experts SwiGLU experts of intermediate_size, k of them
  // per token. Mixtral's router (softmax over all experts, top-k, renormalised to sum to
  // 1) equals the default one (top-k of the logits, softmax over those k). Not refused,
  // as they do not change what the model computes: router_jitter_noise (noise on the
  // router's input in HF training only), router_aux_loss_coef and output_router_logits
  // (HF's training loss and outputs); import_hf records the first two for the export.
  // Absent, the expert counts are transformers' defaults (8 and 2), as from_pretrained reads them.
  const int64_t experts = size_field_or(h, "num_local_experts", 1, 8);
  const int64_t topk = size_field_or(h, "num_experts_per_tok", 1, 2);
  MEGATORCH_CHECK(topk <= experts, "Mixtral import: expected num_experts_per_tok (", topk,
                  ") <= num_local_experts (", experts, "): each token goes to that many distinct experts; fix the "
                  "fields in config.json");
  c.num_experts(experts).moe_router_topk(topk).moe_ffn_hidden_size(c.ffn()).moe_layer_freq(1).moe_first_k_dense(0);
}

// Qwen3-MoE's experts: num_experts of moe_intermediate_size on the layers that are sparse
// ((i + 1) % decoder_sparse_step == 0, not in mlp_only_layers; megatorch: every layer after
// moe_first_k_dense dense ones of intermediate_size), routed by the softmax over all experts
// and top-k, renormalised with norm_topk_prob (megatorch's default router: softmax over the
// top-k logits) or not (moe_router_pre_softmax).
void qwen3_moe_experts(const json& h, int64_t layers, TransformerConfig& c) {
  const int64_t experts = h.contains("num_experts") ? size_field(h, "num_experts", 1)
                                                    : size_field_or(h, "num_local_experts", 1, 128);
  const int64_t topk = size_field_or(h, "num_experts_per_tok", 1, 8);
  MEGATORCH_CHECK(topk <= experts, "Qwen3-MoE import: expected num_experts_per_tok (", topk, ") <= num_experts (",
                  experts, "); fix the fields in config.json");
  const int64_t step = size_field_or(h, "decoder_sparse_step", 1, 1);
  MEGATORCH_CHECK(step == 1, "Qwen3-MoE import: decoder_sparse_step ", step, " is not supported: megatorch's MoE "
                  "layers are every layer after the first dense ones (decoder_sparse_step 1)");
  int64_t dense = 0;
  if (h.contains("mlp_only_layers") && !h.at("mlp_only_layers").is_null()) {
    const json& only = h.at("mlp_only_layers");
    MEGATORCH_CHECK(only.is_array(), "config.json: expected 'mlp_only_layers' to be a list, got ", only.dump());
    for (const auto& v : only) {
      MEGATORCH_CHECK(v.is_number_integer() && v.get<int64_t>() == dense, "Qwen3-MoE import: mlp_only_layers ",
                      only.dump(), " is not supported: megatorch's dense layers are the first ones, [0, 1, ..., k-1]");
      ++dense;
    }
  }
  MEGATORCH_CHECK(dense < layers, "Qwen3-MoE import: mlp_only_layers makes every layer dense; import it as a Qwen3");
  const bool norm = get_or<bool>(h, "norm_topk_prob", false);
  c.num_experts(experts)
      .moe_router_topk(topk)
      .moe_ffn_hidden_size(size_field_or(h, "moe_intermediate_size", 1, 768))
      .moe_layer_freq(1)
      .moe_first_k_dense(dense)
      .moe_router_pre_softmax(!norm)
      .moe_router_norm_topk_prob(false);
}

void add_moe_fields(const TransformerConfig& c, HFArch arch, const json& import_state, json& j) {
  j["sliding_window"] = c.sliding_window() > 0 ? json(c.sliding_window()) : json(nullptr);
  j["num_experts_per_tok"] = c.moe_router_topk();
  j["output_router_logits"] = false;
  // HF's training-only fields: what an import recorded, else 0. A checkpoint does not
  // record the run's --moe-aux-loss-coeff, and HF's default (0.001) would be invented.
  const json& st = import_state.is_object() ? import_state : json::object();
  j["router_aux_loss_coef"] = get_or<double>(st, "hf_router_aux_loss_coef", 0.0);
  if (arch == HFArch::kMixtral) {
    j["num_local_experts"] = c.num_experts();
    j["router_jitter_noise"] = get_or<double>(st, "hf_router_jitter_noise", 0.0);
    return;
  }
  // Qwen3-MoE: sparse from layer moe_first_k_dense on; the router renormalises its top-k
  // weights unless megatorch's takes them from the softmax over all experts (pre_softmax).
  j["attention_bias"] = c.add_attention_bias();
  j["use_sliding_window"] = c.sliding_window() > 0;
  j["num_experts"] = c.num_experts();
  j["moe_intermediate_size"] = c.moe_ffn();
  j["decoder_sparse_step"] = 1;
  std::vector<int64_t> dense(static_cast<size_t>(c.moe_first_k_dense()));
  std::iota(dense.begin(), dense.end(), int64_t{0});
  j["mlp_only_layers"] = dense;
  j["norm_topk_prob"] = !c.moe_router_pre_softmax() || c.moe_router_norm_topk_prob();
}

}  // namespace hf_detail
}  // namespace megatorch::ckpt
