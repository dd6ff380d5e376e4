#pragma once
// The one error macro of megatorch. Every message says what was expected, what was
// given and how to fix it; it throws c10::Error, which Python sees as RuntimeError.
#include <c10/util/Exception.h>

#define MEGATORCH_CHECK(cond, ...) TORCH_CHECK((cond), "megatorch: ", __VA_ARGS__)

// Raise unconditionally (for paths already known to be wrong, e.g. a caught error
// rethrown with context).
#define MEGATORCH_FAIL(...) TORCH_CHECK(false, "megatorch: ", __VA_ARGS__)
