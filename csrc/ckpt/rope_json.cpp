#include "rope_json.h"

#include "megatorch/check.h"

namespace megatorch::ckpt::detail {

using transformer::RopeScaling;
using transformer::RopeType;

nlohmann::json rope_scaling_json(const RopeScaling& s) {
  nlohmann::json j = {{"rope_type", transformer::to_string(s.type())}};
  if (s.type() == RopeType::kDefault) return j;
  j["factor"] = s.factor();
  if (s.type() == RopeType::kLinear) return j;
  j["original_max_position_embeddings"] = s.original_max_position_embeddings();
  if (s.type() == RopeType::kLlama3) {
    j["low_freq_factor"] = s.low_freq_factor();
    j["high_freq_factor"] = s.high_freq_factor();
  } else if (s.type() == RopeType::kYarn) {
    j["beta_fast"] = s.beta_fast();
    j["beta_slow"] = s.beta_slow();
    j["truncate"] = s.truncate();
    if (s.attention_factor() > 0) j["attention_factor"] = s.attention_factor();
    if (s.mscale() > 0) j["mscale"] = s.mscale();
    if (s.mscale_all_dim() > 0) j["mscale_all_dim"] = s.mscale_all_dim();
  }
  return j;
}

RopeScaling rope_scaling_from_json(const nlohmann::json& j, const std::string& what, int64_t max_positions) {
  MEGATORCH_CHECK(j.is_object(), what, ": expected an object, got ", j.dump());
  auto number = [&](const char* key, double fallback) {
    if (!j.contains(key) || j.at(key).is_null()) return fallback;
    MEGATORCH_CHECK(j.at(key).is_number(), what, ".", key, ": expected a number, got ", j.at(key).dump());
    return j.at(key).get<double>();
  };
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (j.contains(key) && j.at(key).is_string()) {
      type = j.at(key).get<std::string>();
      break;
    }
  }
  RopeScaling s;
  try {
    s.type(transformer::parse_rope_type(type));
  } catch (const c10::Error& e) {
    MEGATORCH_FAIL(what, ".rope_type: ", without_error_prefix(e.what_without_backtrace()),
                   " (megatorch implements these; longrope and others are refused)");
  }
  if (s.type() == RopeType::kDefault) return s;
  s.factor(number("factor", 1.0));
  const double original = number("original_max_position_embeddings", static_cast<double>(max_positions));
  s.original_max_position_embeddings(static_cast<int64_t>(original));
  s.low_freq_factor(number("low_freq_factor", s.low_freq_factor()))
      .high_freq_factor(number("high_freq_factor", s.high_freq_factor()))
      // null or 0 take YaRN's defaults, as transformers' "or 32" does.
      .beta_fast(number("beta_fast", 0) > 0 ? number("beta_fast", 0) : 32.0)
      .beta_slow(number("beta_slow", 0) > 0 ? number("beta_slow", 0) : 1.0)
      .attention_factor(number("attention_factor", 0))
      .mscale(number("mscale", 0))
      .mscale_all_dim(number("mscale_all_dim", 0))
      .truncate(j.contains("truncate") && j.at("truncate").is_boolean() ? j.at("truncate").get<bool>() : true);
  try {
    s.validate();
  } catch (const c10::Error& e) {
    MEGATORCH_FAIL(what, ": ", without_error_prefix(e.what_without_backtrace()));
  }
  return s;
}

}  // namespace megatorch::ckpt::detail
