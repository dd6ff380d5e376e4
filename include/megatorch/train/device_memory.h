#pragma once
// The GPU caching allocator's counters, as Megatron reports them after the first
// iterations: allocated, max allocated, reserved, max reserved (bytes).
#include <c10/core/Device.h>

#include <cstdint>
#include <map>
#include <string>

namespace megatorch::train {

// {"cuda_allocated_bytes", "cuda_max_allocated_bytes", "cuda_reserved_bytes",
// "cuda_max_reserved_bytes"} of a CUDA device; empty for the CPU.
std::map<std::string, int64_t> device_memory_stats(c10::Device device);

// "memory (MB) | allocated: 1.2 | max allocated: 3.4 | reserved: 5.6 | max reserved: 7.8",
// or "" for empty stats.
std::string device_memory_line(const std::map<std::string, int64_t>& stats);

}  // namespace megatorch::train
