#include "megatorch/fp8/recipe.h"

#include "megatorch/check.h"
#include "megatorch/util/enum_names.h"

namespace megatorch::fp8 {

void Fp8Options::validate(const std::string& where) const {
  MEGATORCH_CHECK(amax_history_len_ >= 1, where, ": expected an FP8 amax history of at least 1 step, got ",
                  amax_history_len_, "; set --fp8-amax-history-len >= 1");
  MEGATORCH_CHECK(margin_ >= 0, where, ": expected an FP8 margin >= 0 (scale = fp8_max / amax / 2^margin), got ",
                  margin_, "; set --fp8-margin >= 0");
}

c10::ScalarType dtype_of(Format format, Role role) {
  MEGATORCH_CHECK(format != Format::kNone, "fp8: expected an FP8 format (e4m3 or hybrid), got none");
  return format == Format::kHybrid && role == Role::kGradOutput ? at::kFloat8_e5m2 : at::kFloat8_e4m3fn;
}

double max_of(c10::ScalarType t) {
  if (t == at::kFloat8_e4m3fn) return 448.0;
  if (t == at::kFloat8_e5m2) return 57344.0;
  MEGATORCH_FAIL("fp8: expected Float8_e4m3fn or Float8_e5m2, got ", t);
}

const char* to_string(Format f) {
  switch (f) {
    case Format::kNone: return "none";
    case Format::kE4M3: return "e4m3";
    case Format::kHybrid: return "hybrid";
  }
  return "?";
}
const char* to_string(Recipe r) { return r == Recipe::kTensorwise ? "tensorwise" : "delayed"; }
const char* to_string(AmaxAlgo a) { return a == AmaxAlgo::kMostRecent ? "most_recent" : "max"; }
const char* to_string(Role r) {
  switch (r) {
    case Role::kInput: return "input";
    case Role::kWeight: return "weight";
    case Role::kGradOutput: return "grad_output";
  }
  return "?";
}

Format parse_format(const std::string& s) {
  return util::parse_enum(s, {Format::kE4M3, Format::kHybrid}, "fp8 format");
}
Recipe parse_recipe(const std::string& s) {
  return util::parse_enum(s, {Recipe::kTensorwise, Recipe::kDelayed}, "fp8 recipe");
}
AmaxAlgo parse_amax_algo(const std::string& s) {
  return util::parse_enum(s, {AmaxAlgo::kMostRecent, AmaxAlgo::kMax}, "fp8 amax compute algorithm");
}

std::string describe(const Fp8Options& o) {
  if (!o.enabled()) return "none";
  std::string s = std::string(to_string(o.format())) + "/" + to_string(o.recipe());
  if (o.recipe() == Recipe::kDelayed) {
    s += "/len=" + std::to_string(o.amax_history_len()) + "/" + to_string(o.amax_compute_algo()) +
         "/margin=" + std::to_string(o.margin());
  }
  return s;
}

}  // namespace megatorch::fp8
