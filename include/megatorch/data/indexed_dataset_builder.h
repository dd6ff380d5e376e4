#pragma once
// Writes Megatron's indexed dataset (.bin + .idx, see indexed_dataset.h) byte for byte as
// megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder does: tokens are appended to
// the .bin as they come, and finalize() writes the .idx. Unlike Megatron, a token that does
// not fit the dtype is an error rather than silently wrapped. Byte order is the host's, as
// with numpy: little-endian on every machine megatorch targets.
// Both files are written under temporary names (io::AtomicFile) and renamed into place only
// by finalize(), once both are complete: a failed or abandoned build leaves an existing
// dataset of the same name untouched.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/data/indexed_dataset.h"
#include "megatorch/io/atomic_file.h"

namespace megatorch::data {

class IndexedDatasetBuilder {
 public:
  IndexedDatasetBuilder(std::string bin_path, DType dtype = DType::kInt32);
  ~IndexedDatasetBuilder();
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;

  // One sequence (for a document of several sentences, call it per sentence and then
  // end_document()).
  void add_item(const at::Tensor& tokens);
  void add_item(const int64_t* tokens, int64_t count);
  void end_document();
  // A whole document: tokens concatenated, lengths[k] tokens per sequence (may be empty: an
  // empty document, as Megatron writes for empty text).
  void add_document(const at::Tensor& tokens, const std::vector<int64_t>& lengths);
  void add_document(const int64_t* tokens, const std::vector<int64_t>& lengths);
  // Appends a whole existing dataset of the same dtype (Megatron's merge of shards).
  void add_index(const std::string& path_prefix);
  // Completes the .bin, writes the .idx, then renames both into place; the builder takes
  // nothing after this. Destroyed without finalize(), it removes its temporary files.
  void finalize(const std::string& idx_path);

  int64_t num_sequences() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(doc_index_.size()) - 1; }

 private:
  void write_tokens(const int64_t* tokens, int64_t count);
  void check_open() const;

  std::string bin_path_;
  DType dtype_;
  std::unique_ptr<io::AtomicFile> bin_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_index_{0};
  std::vector<uint8_t> buffer_;
};

}  // namespace megatorch::data
