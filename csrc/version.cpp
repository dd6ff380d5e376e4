#include "megatorch/version.h"

namespace megatorch {

// Compiled into the library, so it reports the library's version, not the caller's headers'.
std::string version() { return MEGATORCH_VERSION_STRING; }

}  // namespace megatorch
