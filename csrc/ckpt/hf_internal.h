#pragma once
// What hf_config.cpp (config.json <-> TransformerConfig) and hf_convert.cpp (tensor names
// and layouts, import/export of directories) share. Private to csrc/ckpt.
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <type_traits>

#include "megatorch/check.h"
#include "megatorch/ckpt/hf_convert.h"
#include "megatorch/transformer/config.h"

namespace megatorch::ckpt::hf_detail {

using nlohmann::json;
namespace fs = std::filesystem;
using transformer::Activation;
using transformer::Normalization;
using transformer::Positions;
using transformer::TransformerConfig;

inline json read_json(const fs::path& path) {
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
inline constexpr int64_t kMaxSize = int64_t{1} << 40;

// An integer field of config.json within [min, 2^40], named when it is not.
inline int64_t size_field(const json& j, const char* key, int64_t min) {
  const int64_t v = field<int64_t>(j, key);
  MEGATORCH_CHECK(v >= min, "config.json: expected '", key, "' to be an integer >= ", min, ", got ", v,
                  "; fix the field in config.json");
  MEGATORCH_CHECK(v <= kMaxSize, "config.json: expected '", key, "' <= 2^40 (no model is larger), got ", v,
                  "; fix the field in config.json");
  return v;
}

inline int64_t size_field_or(const json& j, const char* key, int64_t min, int64_t fallback) {
  return j.contains(key) && !j.at(key).is_null() ? size_field(j, key, min) : fallback;
}

// The mixtures of experts (hf_moe_config.cpp): what config.json's expert fields make of `c`
// on import, and the fields an export of `arch` (Mixtral or Qwen3-MoE) adds to `j`.
void mixtral_experts(const json& h, TransformerConfig& c);
void qwen3_moe_experts(const json& h, int64_t layers, TransformerConfig& c);
void add_moe_fields(const TransformerConfig& c, HFArch arch, const json& import_state, json& j);

// The two model families the tensor layouts follow (GPT-2: LayerNorm, GELU, learned
// positions, biases; Llama and its kin: RMSNorm, SwiGLU, RoPE, no linear biases).
bool llama_shaped(const transformer::TransformerConfig& c);
bool gpt2_shaped(const transformer::TransformerConfig& c);

}  // namespace megatorch::ckpt::hf_detail
