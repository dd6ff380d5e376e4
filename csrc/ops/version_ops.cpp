// Registers torch.ops.megatorch.version(): the loaded library's version, which
// megatorch.__version__ must equal (tests/python/unit/test_import.py).
#include <torch/library.h>

#include "megatorch/version.h"

namespace megatorch::ops {
namespace {

std::string version_op() { return megatorch::version(); }

}  // namespace
}  // namespace megatorch::ops

TORCH_LIBRARY_FRAGMENT(megatorch, m) { m.def("version() -> str", TORCH_FN(megatorch::ops::version_op)); }
