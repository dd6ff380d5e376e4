#pragma once
// Megatron-LM's indexed dataset ("MMIDIDX"), read through mmap. A dataset is two files
// that share a prefix:
//
//   PREFIX.bin  the tokens of every sequence back to back, in the dataset's dtype
//   PREFIX.idx  little-endian header and arrays:
//     9 bytes   magic "MMIDIDX\0\0"
//     u64       version, 1
//     u8        dtype code (DType below)
//     u64       n: number of sequences
//     u64       d: number of document-index entries (documents + 1)
//     i32[n]    sequence lengths in tokens
//     i64[n]    sequence pointers: byte offset of each sequence in .bin
//     i64[d]    document index: sequence number where each document starts, then n
//     i8[n]     (multimodal datasets only) sequence modes; ignored here
//
// Files written by Megatron's preprocess_data.py and by megatorch-preprocess are the same
// bytes for the same documents. Opening validates everything a reader relies on, so a
// corrupt, truncated or mismatched pair fails with a message naming the file and the fault
// instead of reading garbage later.
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace megatorch::data {

// Megatron's dtype codes (megatron/core/datasets/indexed_dataset.py, DType).
enum class DType : uint8_t {
  kUInt8 = 1, kInt8 = 2, kInt16 = 3, kInt32 = 4, kInt64 = 5, kFloat64 = 6, kFloat32 = 7, kUInt16 = 8,
};

int64_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);        // numpy's name: "uint16", ...
DType dtype_from_name(const std::string& name);
bool is_valid_dtype_code(int code);
// Megatron's choice for token ids: uint16 when the vocabulary has fewer than 65500 ids,
// else int32.
DType optimal_dtype(int64_t vocab_size);

std::string idx_path(const std::string& prefix);  // prefix + ".idx"
std::string bin_path(const std::string& prefix);  // prefix + ".bin"

// A read-only memory map of a whole file (empty files map to nothing).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  int64_t size_ = 0;
};

class IndexedDataset {
 public:
  // Maps PREFIX.idx and PREFIX.bin and validates them (see the file comment).
  explicit IndexedDataset(std::string path_prefix);

  const std::string& path_prefix() const { return prefix_; }
  DType dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return num_doc_entries_ - 1; }
  int64_t num_tokens() const { return num_tokens_; }
  bool has_modes() const { return has_modes_; }

  int64_t sequence_length(int64_t i) const;   // tokens in sequence i
  int64_t sequence_pointer(int64_t i) const;  // byte offset of sequence i in .bin
  int64_t document_index(int64_t j) const;    // j in [0, num_documents()]: first sequence of document j
  std::vector<int32_t> sequence_lengths() const;

  // Tokens [offset, offset + length) of sequence i as int64 into out; length -1 reads to the
  // end of the sequence. Ranges are checked.
  void read(int64_t i, int64_t offset, int64_t length, int64_t* out) const;
  at::Tensor get(int64_t i, int64_t offset = 0, int64_t length = -1) const;  // int64 [length]

 private:
  void validate();
  int64_t header_u64(int64_t offset) const;

  std::string prefix_;
  MappedFile idx_;
  MappedFile bin_;
  DType dtype_ = DType::kInt32;
  int64_t num_sequences_ = 0;
  int64_t num_doc_entries_ = 0;
  int64_t num_tokens_ = 0;
  bool has_modes_ = false;
  const uint8_t* lengths_ = nullptr;    // i32[n], unaligned: read through memcpy
  const uint8_t* pointers_ = nullptr;   // i64[n]
  const uint8_t* doc_index_ = nullptr;  // i64[d]
};

}  // namespace megatorch::data
