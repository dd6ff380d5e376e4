#pragma once
// The one error macro of megatorch. Every message says what was expected, what was
// given and how to fix it; it throws c10::Error, which Python sees as RuntimeError.
#include <c10/util/Exception.h>

#include <string>
#include <string_view>

#define MEGATORCH_ERROR_PREFIX "megatorch: "

#define MEGATORCH_CHECK(cond, ...) TORCH_CHECK((cond), MEGATORCH_ERROR_PREFIX, __VA_ARGS__)

// Raise unconditionally (for paths already known to be wrong, e.g. a caught error
// rethrown with context).
#define MEGATORCH_FAIL(...) TORCH_CHECK(false, MEGATORCH_ERROR_PREFIX, __VA_ARGS__)

namespace megatorch {

// A caught error's message without the "megatorch: " in front, to quote it inside
// another MEGATORCH_FAIL without saying the prefix twice.
inline std::string without_error_prefix(std::string_view message) {
  constexpr std::string_view prefix = MEGATORCH_ERROR_PREFIX;
  if (message.substr(0, prefix.size()) == prefix) message.remove_prefix(prefix.size());
  return std::string(message);
}

}  // namespace megatorch
