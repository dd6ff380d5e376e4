#pragma once
// An enum's names are what its to_string returns (found by argument-dependent lookup);
// parse_enum is the inverse, so each enum spells its names in one place.
#include <initializer_list>
#include <string>
#include <string_view>

#include "megatorch/check.h"

namespace megatorch::util {

// The value of `values` named `name`; otherwise fails with every valid name, e.g.
// "expected recompute granularity 'none', 'selective' or 'full', got 'half'".
template <typename E>
E parse_enum(std::string_view name, std::initializer_list<E> values, std::string_view what) {
  std::string valid;
  size_t i = 0;
  for (E v : values) {
    const std::string_view n = to_string(v);
    if (name == n) return v;
    if (i > 0) valid += i + 1 == values.size() ? " or " : ", ";
    valid += "'" + std::string(n) + "'";
    ++i;
  }
  MEGATORCH_FAIL("expected ", what, " ", valid, ", got '", name, "'");
}

}  // namespace megatorch::util
