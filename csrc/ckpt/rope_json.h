#pragma once
// RoPE scaling as JSON, in HuggingFace's field names (rope_type, factor,
// original_max_position_embeddings, low/high_freq_factor, beta_fast/slow,
// attention_factor, mscale, mscale_all_dim, truncate): what megatorch's checkpoints record
// and what config.json's rope_parameters / rope_scaling hold. Private to the library.
#include <nlohmann/json.hpp>

#include <string>

#include "megatorch/transformer/rope.h"

namespace megatorch::ckpt::detail {

// The fields `s`'s type reads, with its rope_type.
nlohmann::json rope_scaling_json(const transformer::RopeScaling& s);

// The scaling a JSON object describes ("rope_type", or 4.x's "type"; absent: default).
// `what` names it in errors; `max_positions` stands for original_max_position_embeddings
// where the object gives none.
transformer::RopeScaling rope_scaling_from_json(const nlohmann::json& j, const std::string& what,
                                                int64_t max_positions);

}  // namespace megatorch::ckpt::detail
