#include "megatorch/parallel/process_group_factory.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/cuda.h>

#include <cstdlib>

#ifdef MEGATORCH_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "megatorch/check.h"

namespace megatorch::parallel {

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                          int64_t rank, int64_t size, const std::string& name,
                                                          const c10::Device& device, const std::string& cuda_backend,
                                                          std::chrono::milliseconds timeout,
                                                          const std::string& desc) {
  using BT = c10d::ProcessGroup::BackendType;
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, static_cast<int>(rank), static_cast<int>(size));

  auto gloo_opts = c10d::ProcessGroupGloo::Options::create_default(timeout);
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo/", store),
                                                          static_cast<int>(rank), static_cast<int>(size), gloo_opts);
  pg->setBackend(c10::DeviceType::CPU, BT::GLOO, gloo);
  pg->setDefaultBackend(BT::GLOO);

  if (device.is_cuda()) {
#ifdef MEGATORCH_WITH_CUDA
    if (cuda_backend == "gloo") {
      // Ranks sharing one GPU: Gloo takes the CUDA tensors too (comm::Group stages what
      // Gloo cannot read from device memory through the host).
      pg->setBackend(c10::DeviceType::CUDA, BT::GLOO, gloo);
    } else {
      // A collective that fails or hangs tears the process down with an error naming the
      // group (its description is `name`), the operation and its sequence number, instead
      // of leaving the other ranks blocked; the user's own setting wins.
      ::setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", /*overwrite=*/0);
      auto nccl_opts = c10d::ProcessGroupNCCL::Options::create();
      nccl_opts->timeout = timeout;
      nccl_opts->group_name = name;
      auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("nccl/", store),
                                                              static_cast<int>(rank), static_cast<int>(size), nccl_opts);
      nccl->setBoundDeviceId(device);
      pg->setBackend(c10::DeviceType::CUDA, BT::NCCL, nccl);
      pg->setDefaultBackend(BT::NCCL);
    }
    pg->setBoundDeviceId(device);
#else
    MEGATORCH_FAIL("expected a CUDA build of megatorch for device ", device, ", got a CPU-only build; "
                   "rebuild against a CUDA torch or use --device cpu");
#endif
  }
  pg->setGroupName(name);
  pg->setGroupDesc(desc.empty() ? name : desc);
  return pg;
}

int64_t cuda_device_count() {
#ifdef MEGATORCH_WITH_CUDA
  return torch::cuda::is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
#else
  return 0;
#endif
}

void set_cuda_device(int64_t index) {
#ifdef MEGATORCH_WITH_CUDA
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#else
  MEGATORCH_FAIL("expected a CUDA build of megatorch to select CUDA device ", index, ", got a CPU-only build");
#endif
}

}  // namespace megatorch::parallel
