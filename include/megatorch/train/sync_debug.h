#pragma once
// A scope that runs a training step under CUDA's sync debug mode "error" (what
// torch.cuda.set_sync_debug_mode("error") sets from Python): inside it, any operation that
// makes the host wait for the device (an item(), a device-to-host copy, nonzero and other
// size-dependent results, a stream or device synchronize) throws instead. It checks that a
// steady-state step queues its work and returns without waiting, which is what lets the
// host run ahead of the GPU. The previous mode comes back when the scope ends.
#include <c10/core/Device.h>

#include <cstdint>

namespace megatorch::train {

class SyncDebugScope {
 public:
  // Does nothing unless `active`; on a device other than CUDA it says once that there is
  // nothing to check. `iteration` names the step in the line printed when it throws.
  SyncDebugScope(bool active, c10::Device device, int64_t iteration);
  ~SyncDebugScope();
  SyncDebugScope(const SyncDebugScope&) = delete;
  SyncDebugScope& operator=(const SyncDebugScope&) = delete;

 private:
  bool set_ = false;
  int previous_ = 0;  // c10::cuda::SyncDebugMode, kept as an int so this header needs no CUDA
  int64_t iteration_ = 0;
  int uncaught_ = 0;
};

// A deliberate synchronisation inside a checked step (the NaN check reads the loss and the
// gradient norm once): the sync debug mode is off inside the scope, as it was before after.
class AllowedSync {
 public:
  explicit AllowedSync(c10::Device device);
  ~AllowedSync();
  AllowedSync(const AllowedSync&) = delete;
  AllowedSync& operator=(const AllowedSync&) = delete;

 private:
  bool set_ = false;
  int previous_ = 0;
};

}  // namespace megatorch::train
