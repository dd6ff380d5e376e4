#pragma once
// Which device a rank trains on and which c10d backend carries its tensors, decided from
// the request and the machine alone, before anything connects: every rank of a node sees
// the same GPU count and LOCAL_WORLD_SIZE, so a launch that cannot work fails on all of
// them with the same message instead of hanging the ranks that could start.
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace megatorch::parallel {

struct DeviceChoice {
  c10::Device device{c10::kCPU};
  // Backend for tensors on `device`: "gloo" or "nccl". CPU tensors always go through Gloo.
  std::string backend = "gloo";
};

// `device`: "auto" (cuda:LOCAL_RANK when CUDA is available, else CPU), "cpu", "cuda"
// (cuda:LOCAL_RANK) or "cuda:N" (every rank of the node on GPU N; only with Gloo, since
// NCCL refuses two ranks on one device). `backend`: "auto" (NCCL on CUDA, Gloo on CPU),
// "nccl" or "gloo" (Gloo with CUDA tensors, staged through host where Gloo needs it).
// `visible_gpus`: the node's CUDA device count (0 without CUDA or in a CPU-only build).
DeviceChoice choose_device(const std::string& device, const std::string& backend, int64_t local_rank,
                           int64_t local_world_size, int64_t visible_gpus);

// CUDA devices this process can use: 0 in a CPU-only build or without a GPU.
int64_t visible_cuda_devices();

}  // namespace megatorch::parallel
