#pragma once
// numpy.random.RandomState(seed).shuffle, reproduced exactly: Megatron's GPTDataset
// shuffles its document and sample orders with it, and we must produce the same orders to
// read the same samples as Megatron for the same seed. RandomState seeds MT19937 with
// init_genrand (the std::mt19937 seeding) and shuffles with Fisher-Yates from the end,
// drawing j in [0, i] by masked rejection sampling (numpy's random_interval).
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace megatorch::data {

class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : mt_(seed) {}

  uint32_t next_uint32() { return static_cast<uint32_t>(mt_()); }
  uint64_t next_uint64() {
    const uint64_t hi = next_uint32();
    return (hi << 32) | next_uint32();
  }

  // Uniform in [0, max], as numpy's random_interval.
  uint64_t interval(uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    uint64_t value;
    if (max <= 0xffffffffULL) {
      while ((value = (next_uint32() & mask)) > max) {
      }
    } else {
      while ((value = (next_uint64() & mask)) > max) {
      }
    }
    return value;
  }

  template <typename T>
  void shuffle(std::vector<T>& x) {
    for (int64_t i = static_cast<int64_t>(x.size()) - 1; i >= 1; --i) {
      const auto j = static_cast<int64_t>(interval(static_cast<uint64_t>(i)));
      std::swap(x[static_cast<size_t>(i)], x[static_cast<size_t>(j)]);
    }
  }

 private:
  std::mt19937 mt_;
};

}  // namespace megatorch::data
