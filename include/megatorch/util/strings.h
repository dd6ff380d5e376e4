#pragma once
// String helpers C++17 lacks (std::string_view::starts_with is C++20).
#include <optional>
#include <string_view>

namespace megatorch::util {

inline bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// `s` without `prefix`, or nullopt when it does not start with it: no hand-counted
// prefix lengths next to the literal.
inline std::optional<std::string_view> strip_prefix(std::string_view s, std::string_view prefix) {
  if (!starts_with(s, prefix)) return std::nullopt;
  return s.substr(prefix.size());
}

}  // namespace megatorch::util
