#include "megatorch/train/device_memory.h"

#include <cstdio>

#ifdef MEGATORCH_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace megatorch::train {

std::map<std::string, int64_t> device_memory_stats(c10::Device device) {
  std::map<std::string, int64_t> out;
#ifdef MEGATORCH_WITH_CUDA
  if (!device.is_cuda()) return out;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  out["cuda_allocated_bytes"] = stats.allocated_bytes[all].current;
  out["cuda_max_allocated_bytes"] = stats.allocated_bytes[all].peak;
  out["cuda_reserved_bytes"] = stats.reserved_bytes[all].current;
  out["cuda_max_reserved_bytes"] = stats.reserved_bytes[all].peak;
#endif
  return out;
}

std::string device_memory_line(const std::map<std::string, int64_t>& stats) {
  if (stats.empty()) return "";
  const auto mb = [&](const char* key) { return static_cast<double>(stats.at(key)) / (1 << 20); };
  char buf[256];
  std::snprintf(buf, sizeof(buf), "memory (MB) | allocated: %.1f | max allocated: %.1f | reserved: %.1f | max reserved: %.1f",
                mb("cuda_allocated_bytes"), mb("cuda_max_allocated_bytes"), mb("cuda_reserved_bytes"),
                mb("cuda_max_reserved_bytes"));
  return buf;
}

}  // namespace megatorch::train
