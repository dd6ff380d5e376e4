#pragma once
// Builds one c10d ProcessGroup over a store: Gloo serves CPU tensors, NCCL serves CUDA
// tensors when asked for (the default backend is then NCCL). The group is not
// registered; ParallelState does that.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>


namespace megatorch::parallel {

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                          int64_t rank, int64_t size, const std::string& name,
                                                          bool with_cuda, std::chrono::milliseconds timeout);

// True when megatorch was built against a CUDA torch and a GPU is visible.
bool cuda_available();
// Sets the current CUDA device (no-op in a CPU-only build; an error if asked for CUDA there).
void set_cuda_device(int64_t index);

}  // namespace megatorch::parallel
