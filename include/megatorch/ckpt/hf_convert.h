#pragma once
// HuggingFace interchange: a single unsharded safetensors checkpoint with HuggingFace's
// names and config.json, for GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM, with
// attention_bias / mlp_bias), Mistral (MistralForCausalLM: Llama + sliding_window), Qwen2
// (Qwen2ForCausalLM: Llama + q/k/v biases, sliding windows per layer), Qwen3
// (Qwen3ForCausalLM: Llama + per-head QK RMSNorm, as Qwen2's windows), Qwen3-MoE
// (Qwen3MoeForCausalLM: Qwen3 with mixtures of SwiGLU experts) and Mixtral (MixtralForCausalLM: Mistral with a mixture of SwiGLU experts in
// every layer). A config.json field the model cannot honour is an error naming the field.
// import_hf writes a megatorch checkpoint (loadable at any TP x PP), export_hf reads one
// (saved at any layout) and writes a directory transformers' from_pretrained loads.
// The layouts differ where the models do: GPT-2's Conv1D weights are [in, out] and its
// c_attn rows are [all q; all k; all v]; Llama keeps q/k/v and gate/up apart; megatorch
// fuses QKV group by group ([q heads of a group; k; v]) and SwiGLU as [gate; up].
// Mixtral's experts are w1 (gate) / w3 (up) [F, h] and w2 (down) [h, F] per expert (or,
// as transformers 5 holds them in memory, gate_up_proj [E, 2F, h] and down_proj [E, h, F]);
// megatorch stacks them input-major: fc1 [E, h, 2F] ([gate | up] columns), fc2 [E, F, h].
#include <ATen/Tensor.h>
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

#include "megatorch/transformer/config.h"

namespace megatorch::ckpt {

enum class HFArch { kGPT2, kLlama, kMistral, kQwen2, kMixtral, kQwen3, kQwen3Moe };
// the HuggingFace model_type: "gpt2" | "llama" | "mistral" | "qwen2" | "mixtral" | "qwen3" | "qwen3_moe"
const char* to_string(HFArch a);
HFArch parse_hf_arch(const std::string& s);

// Whether `arch` can express this configuration exactly (Llama: no window, no QKV bias
// without the output projection's; Mistral: no biases, every layer slides or none; Qwen2:
// QKV bias and no other; Qwen3: QK-norm, attention biases or none; all of them dense;
// Mixtral: experts in every layer, routed as mixtral_obstacles describes; Qwen3-MoE: Qwen3's
// attention, experts after moe_first_k_dense dense layers, as qwen3_moe_obstacles describes).
bool hf_arch_holds(HFArch arch, const transformer::TransformerConfig& config);
// What keeps a mixture-of-experts configuration from being a Mixtral, one entry per
// megatorch field ("moe_router_score_function sigmoid (Mixtral: softmax)"); empty when it is one.
std::vector<std::string> mixtral_obstacles(const transformer::TransformerConfig& config);
std::vector<std::string> qwen3_moe_obstacles(const transformer::TransformerConfig& config);
// The architecture a megatorch configuration is exported as: `preferred` (the model_type an
// import recorded) when it holds the configuration, else the first of GPT-2, Llama, Qwen2,
// Qwen3, Mistral, Mixtral, Qwen3-MoE that does; an error naming what no architecture has (for a mixture of
// experts: each field Mixtral cannot represent).
HFArch hf_arch_of(const transformer::TransformerConfig& config, const std::string& preferred = "");
// config.json -> TransformerConfig (options it cannot honour are errors that name them).
// Sliding windows become sliding_window and, where only some layers slide, layer_types.
transformer::TransformerConfig config_from_hf(const nlohmann::json& hf_config);
// TransformerConfig -> config.json of `arch` (an error when hf_arch_holds(arch, config) is false).
// `import_state`: the checkpoint's state as import_hf wrote it; Mixtral's training-only
// router_aux_loss_coef and router_jitter_noise are written back from it (0.0 when absent:
// megatorch checkpoints do not record --moe-aux-loss-coeff, see docs/checkpoints.md).
nlohmann::json hf_config_from(const transformer::TransformerConfig& config, HFArch arch,
                              const nlohmann::json& import_state = nlohmann::json::object());

// Whole tensors: megatorch's single-model names ("embedding.weight" [V, h] without
// padding, "layers.0.attention.qkv.weight", ...) <-> HuggingFace's.
std::map<std::string, at::Tensor> from_hf_tensors(const std::map<std::string, at::Tensor>& hf,
                                                  const transformer::TransformerConfig& config);
std::map<std::string, at::Tensor> to_hf_tensors(const std::map<std::string, at::Tensor>& tensors,
                                                const transformer::TransformerConfig& config);

// What an import or export converted: the model and the HuggingFace architecture.
struct HFConversion {
  transformer::TransformerConfig config;
  HFArch arch;
};

// A HuggingFace directory (config.json, model.safetensors or an index of several files)
// -> a megatorch checkpoint `iteration` under ckpt_dir (its state records hf_model_type,
// and for Mixtral hf_router_aux_loss_coef and hf_router_jitter_noise, which megatorch's
// model does not use but an export writes back).
// A tensor of the HuggingFace checkpoint that has no place in the model is an error.
HFConversion import_hf(const std::string& hf_dir, const std::string& ckpt_dir, int64_t iteration = 0);
// A megatorch checkpoint (-1: the latest) -> hf_dir/config.json + model.safetensors, as the
// checkpoint's recorded hf_model_type when that holds the model (hf_arch_of).
HFConversion export_hf(const std::string& ckpt_dir, const std::string& hf_dir, int64_t iteration = -1);

}  // namespace megatorch::ckpt
