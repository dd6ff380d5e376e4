#pragma once
// The safetensors file format (HuggingFace's): an 8-byte little-endian header length, a
// JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the
// raw little-endian bytes. Checkpoint shards and the HuggingFace export use it, so one
// reader and one writer serve both.
#include <ATen/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "megatorch/io/atomic_file.h"

namespace megatorch::ckpt {

// "F32", "BF16", "I64", ... (the safetensors names) and back.
std::string safetensors_dtype(at::ScalarType t);
at::ScalarType scalar_type_from_safetensors(const std::string& name);

struct WrittenFile {
  int64_t bytes = 0;
  uint32_t crc32 = 0;  // of the whole file
};

// Writes `tensors` (any device or layout: copied to contiguous CPU) to `path`. With
// `durable`, the file is fsync'd before returning, so a later rename publishes it whole.
WrittenFile write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {}, bool durable = true);
// The same bytes into `file` (not committed: the caller commit()s, e.g. after writing the
// files that go with it).
WrittenFile write_safetensors(io::AtomicFile& file, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

struct TensorInfo {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // from the start of the file
  int64_t nbytes = 0;
};

// Reads the header once (validated: sizes, offsets inside the file, known dtypes); each
// tensor is read on demand.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::string path);
  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // in file order
  bool contains(const std::string& name) const { return infos_.count(name) > 0; }
  const TensorInfo& info(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  at::Tensor read(const std::string& name) const;  // a new CPU tensor

 private:
  std::string path_;
  std::map<std::string, TensorInfo> infos_;
  std::vector<std::string> order_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace megatorch::ckpt
