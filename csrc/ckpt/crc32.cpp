#include "megatorch/ckpt/crc32.h"

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "megatorch/check.h"

namespace megatorch::ckpt {

namespace {

// Byte-at-a-time table for the reflected polynomial 0xEDB88320.
const std::array<uint32_t, 256>& table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> out{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      out[i] = c;
    }
    return out;
  }();
  return t;
}

}  // namespace

uint32_t crc32(const void* data, size_t size, uint32_t crc) {
  const auto& t = table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t file_crc32(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  MEGATORCH_CHECK(f != nullptr, "cannot open '", path, "' to verify its checksum: ", std::strerror(errno));
  std::vector<char> block(1 << 20);
  uint32_t crc = 0;
  size_t n = 0;
  while ((n = std::fread(block.data(), 1, block.size(), f)) > 0) crc = crc32(block.data(), n, crc);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  MEGATORCH_CHECK(!failed, "error reading '", path, "' to verify its checksum");
  return crc;
}

}  // namespace megatorch::ckpt
