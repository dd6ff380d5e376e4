#include "megatorch/data/token_stats.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <limits>
#include <type_traits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "megatorch/check.h"
#include "megatorch/data/indexed_dataset.h"

namespace megatorch::data {

namespace {

using nlohmann::json;

constexpr int kCacheVersion = 1;

// A float "id" outside int64 (or NaN) is clamped, so it still fails the vocabulary check.
template <typename T>
int64_t to_id(T v) {
  if constexpr (std::is_floating_point_v<T>) {
    if (std::isnan(v) || v >= 9.2e18) return std::numeric_limits<int64_t>::max();
    if (v <= -9.2e18) return std::numeric_limits<int64_t>::min();
  }
  return static_cast<int64_t>(v);
}

// Min and max of n values of T at p (unaligned-safe: memcpy per block). Plain loops over a
// local buffer, which the compiler vectorises.
template <typename T>
void scan(const uint8_t* p, int64_t n, int64_t& lo, int64_t& hi) {
  constexpr int64_t kBlock = 4096;
  T buf[kBlock];
  T mn = std::numeric_limits<T>::max(), mx = std::numeric_limits<T>::lowest();
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    std::memcpy(buf, p + i * static_cast<int64_t>(sizeof(T)), static_cast<size_t>(m) * sizeof(T));
    for (int64_t j = 0; j < m; ++j) {
      mn = buf[j] < mn ? buf[j] : mn;
      mx = buf[j] > mx ? buf[j] : mx;
    }
  }
  if (n > 0) {
    lo = to_id(mn);
    hi = to_id(mx);
  }
}

TokenIdRange scan_bin(const MappedFile& bin, DType dtype) {
  TokenIdRange r;
  r.num_tokens = bin.size() / dtype_size(dtype);
  const uint8_t* p = bin.data();
  const int64_t n = r.num_tokens;
  switch (dtype) {
    case DType::kUInt8: scan<uint8_t>(p, n, r.min_id, r.max_id); break;
    case DType::kInt8: scan<int8_t>(p, n, r.min_id, r.max_id); break;
    case DType::kInt16: scan<int16_t>(p, n, r.min_id, r.max_id); break;
    case DType::kInt32: scan<int32_t>(p, n, r.min_id, r.max_id); break;
    case DType::kInt64: scan<int64_t>(p, n, r.min_id, r.max_id); break;
    case DType::kFloat64: scan<double>(p, n, r.min_id, r.max_id); break;
    case DType::kFloat32: scan<float>(p, n, r.min_id, r.max_id); break;
    case DType::kUInt16: scan<uint16_t>(p, n, r.min_id, r.max_id); break;
  }
  return r;
}

// What identifies the scanned .bin: a different size, mtime or dtype means a rescan.
json cache_key(const std::string& bin, DType dtype) {
  struct stat st {};
  MEGATORCH_CHECK(::stat(bin.c_str(), &st) == 0, "cannot stat ", bin, ": ", std::strerror(errno));
  const int64_t mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec;
  return json{{"version", kCacheVersion}, {"bin_bytes", static_cast<int64_t>(st.st_size)},
              {"bin_mtime_ns", mtime_ns}, {"dtype", dtype_name(dtype)}};
}

// The cached range when the cache matches key; anything unreadable is a miss.
bool read_cache(const std::string& path, const json& key, TokenIdRange& out) {
  std::ifstream in(path);
  if (!in.good()) return false;
  try {
    const json j = json::parse(in);
    for (const auto& [k, v] : key.items()) {
      if (!j.contains(k) || j.at(k) != v) return false;
    }
    out.min_id = j.at("min_id").get<int64_t>();
    out.max_id = j.at("max_id").get<int64_t>();
    out.num_tokens = j.at("num_tokens").get<int64_t>();
    out.from_cache = true;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Atomic: readers (other ranks) see the old file or the whole new one, never a part.
// Failure to write (a read-only directory) only means no cache.
void write_cache(const std::string& path, json j) {
  static std::atomic<int> counter{0};
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out.good()) return;
    out << j.dump() << "\n";
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      return;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) std::remove(tmp.c_str());
}

}  // namespace

std::string token_stats_cache_path(const std::string& prefix) { return prefix + ".max_id.json"; }

TokenIdRange token_id_range(const std::string& prefix) {
  const IndexedDataset dataset(prefix);  // validates the pair and gives the dtype
  const std::string bin = bin_path(prefix);
  const std::string cache = token_stats_cache_path(prefix);
  const json key = cache_key(bin, dataset.dtype());
  TokenIdRange r;
  if (read_cache(cache, key, r)) return r;
  r = scan_bin(MappedFile(bin), dataset.dtype());
  json j = key;
  j["min_id"] = r.min_id;
  j["max_id"] = r.max_id;
  j["num_tokens"] = r.num_tokens;
  write_cache(cache, j);
  return r;
}

int64_t max_token_id(const std::string& prefix) { return token_id_range(prefix).max_id; }

}  // namespace megatorch::data
