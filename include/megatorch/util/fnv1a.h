#pragma once
// 64-bit FNV-1a over a sequence of 64-bit words: a cheap fingerprint that every rank
// computes alike (parameter layouts compared across ranks, seeds derived from names).
// Not for security: collisions are only unlikely.
#include <cstdint>
#include <string_view>

namespace megatorch::util {

class Fnv1a {
 public:
  void mix(uint64_t word) { hash_ = (hash_ ^ word) * kPrime; }
  void mix_bytes(std::string_view bytes) {
    for (unsigned char c : bytes) mix(c);
  }
  uint64_t value() const { return hash_; }

 private:
  static constexpr uint64_t kOffsetBasis = 1469598103934665603ull;
  static constexpr uint64_t kPrime = 1099511628211ull;
  uint64_t hash_ = kOffsetBasis;
};

}  // namespace megatorch::util
