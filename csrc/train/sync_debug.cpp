#include "megatorch/train/sync_debug.h"

#include <cstdio>
#include <exception>

#ifdef MEGATORCH_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace megatorch::train {
namespace {

#ifdef MEGATORCH_WITH_CUDA
// Sets CUDA's sync debug mode and returns the one it replaces (as an int, as the headers keep it).
int swap_sync_debug_mode(c10::cuda::SyncDebugMode mode) {
  auto& state = c10::cuda::warning_state();
  const int previous = static_cast<int>(state.get_sync_debug_mode());
  state.set_sync_debug_mode(mode);
  return previous;
}
#endif

}  // namespace

SyncDebugScope::SyncDebugScope(bool active, c10::Device device, int64_t iteration)
    : iteration_(iteration), uncaught_(std::uncaught_exceptions()) {
  if (!active) return;
#ifdef MEGATORCH_WITH_CUDA
  if (device.is_cuda()) {
    previous_ = swap_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR);
    set_ = true;
    return;
  }
#endif
  static bool said = false;
  if (!said) {
    said = true;
    std::printf("[megatorch] sync debug: the step runs on %s, not CUDA: no device to synchronise with, nothing to check\n",
                device.str().c_str());
    std::fflush(stdout);
  }
}

SyncDebugScope::~SyncDebugScope() {
  if (!set_) return;
#ifdef MEGATORCH_WITH_CUDA
  swap_sync_debug_mode(static_cast<c10::cuda::SyncDebugMode>(previous_));
#endif
  if (std::uncaught_exceptions() > uncaught_) {
    std::fprintf(stderr,
                 "[megatorch] iteration %ld failed under the sync debug mode (--sync-debug-iters): if the error below "
                 "says a synchronizing CUDA operation was called, the step made the host wait for the device there\n",
                 static_cast<long>(iteration_));
  }
}

AllowedSync::AllowedSync(c10::Device device) {
#ifdef MEGATORCH_WITH_CUDA
  if (device.is_cuda()) {
    previous_ = swap_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    set_ = true;
  }
#else
  (void)device;
#endif
}

AllowedSync::~AllowedSync() {
#ifdef MEGATORCH_WITH_CUDA
  if (set_) swap_sync_debug_mode(static_cast<c10::cuda::SyncDebugMode>(previous_));
#endif
}

}  // namespace megatorch::train
