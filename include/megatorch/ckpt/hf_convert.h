#pragma once
// HuggingFace interchange: a single unsharded safetensors checkpoint with HuggingFace's
// names and config.json, for GPT-2 (GPT2LMHeadModel) and Llama (LlamaForCausalLM).
// import_hf writes a megatorch checkpoint (loadable at any TP x PP), export_hf reads one
// (saved at any layout) and writes a directory transformers' from_pretrained loads.
// The layouts differ where the models do: GPT-2's Conv1D weights are [in, out] and its
// c_attn rows are [all q; all k; all v]; Llama keeps q/k/v and gate/up apart; megatorch
// fuses QKV group by group ([q heads of a group; k; v]) and SwiGLU as [gate; up].
#include <ATen/Tensor.h>
#include <nlohmann/json.hpp>

#include <map>
#include <string>

#include "megatorch/transformer/config.h"

namespace megatorch::ckpt {

enum class HFArch { kGPT2, kLlama };
const char* to_string(HFArch a);  // "gpt2" | "llama"
HFArch parse_hf_arch(const std::string& s);

// The architecture a megatorch configuration corresponds to (an error for none).
HFArch hf_arch_of(const transformer::TransformerConfig& config);
// config.json <-> TransformerConfig (unsupported options are errors that name them).
transformer::TransformerConfig config_from_hf(const nlohmann::json& hf_config);
nlohmann::json hf_config_from(const transformer::TransformerConfig& config);

// Whole tensors: megatorch's single-model names ("embedding.weight" [V, h] without
// padding, "layers.0.attention.qkv.weight", ...) <-> HuggingFace's.
std::map<std::string, at::Tensor> from_hf_tensors(const std::map<std::string, at::Tensor>& hf,
                                                  const transformer::TransformerConfig& config);
std::map<std::string, at::Tensor> to_hf_tensors(const std::map<std::string, at::Tensor>& tensors,
                                                const transformer::TransformerConfig& config);

// A HuggingFace directory (config.json, model.safetensors or an index of several files)
// -> a megatorch checkpoint `iteration` under ckpt_dir. Returns the configuration.
transformer::TransformerConfig import_hf(const std::string& hf_dir, const std::string& ckpt_dir,
                                         int64_t iteration = 0);
// A megatorch checkpoint (-1: the latest) -> hf_dir/config.json + model.safetensors.
transformer::TransformerConfig export_hf(const std::string& ckpt_dir, const std::string& hf_dir,
                                         int64_t iteration = -1);

}  // namespace megatorch::ckpt
