#pragma once
// Builds one c10d ProcessGroup over a store: Gloo serves CPU tensors; CUDA tensors go to
// NCCL (or to the same Gloo backend when `cuda_backend` is "gloo": ranks sharing a GPU).
// The group is not registered; ParallelState does that. `desc` (default: `name`) is the
// group's description: unique per group instance and equal on its members, it is what
// NCCL's errors and the NCCL check (comm/nccl_trace.h) tell groups apart by.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>


namespace megatorch::parallel {

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                          int64_t rank, int64_t size, const std::string& name,
                                                          const c10::Device& device, const std::string& cuda_backend,
                                                          std::chrono::milliseconds timeout,
                                                          const std::string& desc = "");

// Visible CUDA devices: 0 in a CPU-only build or without a GPU.
int64_t cuda_device_count();
// True when megatorch was built against a CUDA torch and a GPU is visible.
inline bool cuda_available() { return cuda_device_count() > 0; }
// Sets the current CUDA device (no-op in a CPU-only build; an error if asked for CUDA there).
void set_cuda_device(int64_t index);

}  // namespace megatorch::parallel
