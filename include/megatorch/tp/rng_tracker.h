#pragma once
// Tensor-parallel RNG tracker (Megatron's CudaRNGStatesTracker, for CPU and CUDA).
//
// Two streams: the default generator, seeded identically on every TP rank, draws the
// masks of replicated regions (same mask on every TP rank); the tracker's
// "model-parallel" stream, seeded with seed + 2718 + tp_rank, draws masks inside TP
// regions (each rank holds different heads / columns, so masks must differ).
// `fork()` swaps the tracker's state into the default generator for a scope, which is
// how ops that draw from "the current generator" (dropout, SDPA, bias_dropout_add) are
// governed. `snapshot()`/`restore()` let recomputation replay the exact same masks.
#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <map>
#include <string>

namespace megatorch::tp {

inline constexpr const char* kModelParallelRng = "model-parallel-rng";

class RngTracker {
 public:
  // Seeds the default generator of `device` with `seed` and the model-parallel stream
  // with seed + 2718 + tp_rank (Megatron's offsets).
  void seed(int64_t seed, int64_t tp_rank, c10::Device device = c10::kCPU);
  // Adds a named stream (an error if the name exists).
  void add(const std::string& name, int64_t seed);
  bool has(const std::string& name) const { return states_.count(name) > 0; }

  // Within the returned guard's lifetime the default generator draws from `name`'s
  // stream; on exit the stream's advanced state is kept and the default restored.
  class Fork {
   public:
    Fork(RngTracker& tracker, const std::string& name);
    ~Fork();
    Fork(const Fork&) = delete;
    Fork& operator=(const Fork&) = delete;

   private:
    RngTracker& tracker_;
    std::string name_;
    at::Tensor saved_default_;
  };
  Fork fork(const std::string& name = kModelParallelRng) { return Fork(*this, name); }

  // Every stream plus the default generator, for recomputation.
  struct Snapshot {
    at::Tensor default_state;
    std::map<std::string, at::Tensor> states;
  };
  Snapshot snapshot() const;
  void restore(const Snapshot& s);

  c10::Device device() const { return device_; }

 private:
  std::map<std::string, at::Tensor> states_;
  c10::Device device_{c10::kCPU};
};

// Current state of the default generator of `device`, and setting it.
at::Tensor default_generator_state(c10::Device device);
void set_default_generator_state(c10::Device device, const at::Tensor& state);

}  // namespace megatorch::tp
