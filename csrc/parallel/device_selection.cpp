#include "megatorch/parallel/device_selection.h"

#include <cstdlib>

#include "megatorch/check.h"
#include "megatorch/parallel/process_group_factory.h"

namespace megatorch::parallel {

DeviceChoice choose_device(const std::string& device, const std::string& backend, int64_t local_rank,
                           int64_t local_world_size, int64_t visible_gpus) {
  const bool pinned = device.rfind("cuda:", 0) == 0;
  MEGATORCH_CHECK(device == "auto" || device == "cpu" || device == "cuda" || pinned,
                  "expected --device auto, cpu, cuda or cuda:N, got '", device, "'");
  MEGATORCH_CHECK(backend == "auto" || backend == "nccl" || backend == "gloo",
                  "expected --distributed-backend auto, nccl or gloo, got '", backend, "'");
  const bool cuda = device == "cuda" || pinned || (device == "auto" && visible_gpus > 0);
  DeviceChoice out;
  if (!cuda) {
    MEGATORCH_CHECK(backend != "nccl", "--distributed-backend nccl needs CUDA tensors, but this rank trains on the CPU (",
                    visible_gpus == 0 ? "no CUDA device is visible" : "--device cpu",
                    "); use --distributed-backend gloo (or auto) on CPU, or --device cuda on a GPU machine");
    return out;
  }
  MEGATORCH_CHECK(visible_gpus > 0, "--device ", device,
                  " asks for a GPU, but no CUDA device is visible on this machine (or megatorch was built against a "
                  "CPU-only torch); use --device cpu (Gloo), or run on a GPU machine with a CUDA build");
  int64_t index = local_rank;
  if (pinned) {
    char* end = nullptr;
    const long long n = std::strtoll(device.c_str() + 5, &end, 10);
    MEGATORCH_CHECK(end && *end == '\0' && end != device.c_str() + 5 && n >= 0,
                    "expected --device cuda:N with N a GPU index, got '", device, "'");
    index = n;
    MEGATORCH_CHECK(index < visible_gpus, "--device ", device, " names GPU ", index, ", but this machine has ",
                    visible_gpus, " visible GPU(s) (indices 0..", visible_gpus - 1, "); check CUDA_VISIBLE_DEVICES");
  } else {
    // Checked against the node's size, not just this rank's index: every rank of the node
    // then fails alike, rather than only those whose LOCAL_RANK has no GPU.
    MEGATORCH_CHECK(local_world_size <= visible_gpus, "--device ", device, " puts each of the ", local_world_size,
                    " ranks of this node on its own GPU (cuda:LOCAL_RANK), but only ", visible_gpus,
                    " GPU(s) are visible, so LOCAL_RANK ", visible_gpus, "..", local_world_size - 1,
                    " would have none; launch at most ", visible_gpus,
                    " processes per node (torchrun --nproc-per-node), or share one GPU with "
                    "--device cuda:0 --distributed-backend gloo");
  }
  out.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  out.backend = backend == "gloo" ? "gloo" : "nccl";
  MEGATORCH_CHECK(!(pinned && out.backend == "nccl" && local_world_size > 1), "--device ", device, " puts all ",
                  local_world_size, " ranks of this node on GPU ", index,
                  ", but NCCL refuses two ranks on one device; add --distributed-backend gloo to share it, or use "
                  "--device cuda (one GPU per rank)");
  return out;
}

int64_t visible_cuda_devices() { return cuda_device_count(); }

}  // namespace megatorch::parallel
