#pragma once
// CRC-32 (IEEE 802.3, the polynomial of zlib and PNG), incremental: a checkpoint shard's
// checksum is computed while it is written and again, streamed, before it is loaded.
#include <cstddef>
#include <cstdint>
#include <string>

namespace megatorch::ckpt {

// crc32(data, n, crc32(prev, ...)) continues a running checksum; start from 0.
uint32_t crc32(const void* data, size_t size, uint32_t crc = 0);

// The checksum of a whole file, read in blocks (errors name the file).
uint32_t file_crc32(const std::string& path);

}  // namespace megatorch::ckpt
