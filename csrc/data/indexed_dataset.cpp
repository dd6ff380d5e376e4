#include "megatorch/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "megatorch/check.h"

namespace megatorch::data {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

// The .idx arrays start at byte 34 and are not aligned for their types.
template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void convert(const uint8_t* src, int64_t count, int64_t* out) {
  for (int64_t k = 0; k < count; ++k) out[k] = static_cast<int64_t>(load<T>(src + k * sizeof(T)));
}

}  // namespace

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kUInt8: case DType::kInt8: return 1;
    case DType::kInt16: case DType::kUInt16: return 2;
    case DType::kInt32: case DType::kFloat32: return 4;
    case DType::kInt64: case DType::kFloat64: return 8;
  }
  MEGATORCH_FAIL("unknown dtype code ", static_cast<int>(dtype));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kFloat64: return "float64";
    case DType::kFloat32: return "float32";
    case DType::kUInt16: return "uint16";
  }
  MEGATORCH_FAIL("unknown dtype code ", static_cast<int>(dtype));
}

bool is_valid_dtype_code(int code) { return code >= 1 && code <= 8; }

DType dtype_from_name(const std::string& name) {
  for (int code = 1; code <= 8; ++code) {
    if (name == dtype_name(static_cast<DType>(code))) return static_cast<DType>(code);
  }
  MEGATORCH_FAIL("unknown dtype '", name, "'; expected one of uint8, int8, int16, int32, int64, float64, float32, uint16");
}

DType optimal_dtype(int64_t vocab_size) { return vocab_size < 65500 ? DType::kUInt16 : DType::kInt32; }

std::string idx_path(const std::string& prefix) { return prefix + ".idx"; }
std::string bin_path(const std::string& prefix) { return prefix + ".bin"; }

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MEGATORCH_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno),
                  "; pass the dataset prefix without .bin/.idx and check that both files exist");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    MEGATORCH_FAIL("cannot stat ", path, ": ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    MEGATORCH_FAIL(path, " is not a regular file");
  }
  size_ = static_cast<int64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    MEGATORCH_CHECK(p != MAP_FAILED, "cannot mmap ", path, " (", size_, " bytes): ", std::strerror(err));
    data_ = static_cast<const uint8_t*>(p);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
}

IndexedDataset::IndexedDataset(std::string path_prefix)
    : prefix_(std::move(path_prefix)), idx_(idx_path(prefix_)), bin_(bin_path(prefix_)) {
  validate();
}

int64_t IndexedDataset::header_u64(int64_t offset) const {
  const uint64_t v = load<uint64_t>(idx_.data() + offset);
  MEGATORCH_CHECK(v <= static_cast<uint64_t>(INT64_MAX / 32), idx_.path(), ": header field at byte ", offset,
                  " holds ", v, ", which is not a plausible count; the file is corrupt");
  return static_cast<int64_t>(v);
}

void IndexedDataset::validate() {
  const std::string& ip = idx_.path();
  const std::string& bp = bin_.path();
  MEGATORCH_CHECK(idx_.size() >= kHeaderBytes, ip, " is truncated: ", idx_.size(), " bytes, but the MMIDIDX header alone is ",
                  kHeaderBytes, " bytes");
  MEGATORCH_CHECK(std::memcmp(idx_.data(), kMagic, sizeof(kMagic)) == 0, ip,
                  " is not a Megatron MMIDIDX index: its first 9 bytes are not \"MMIDIDX\\0\\0\" "
                  "(is it an old lazy/cached indexed dataset, or not an .idx file?)");
  const uint64_t version = load<uint64_t>(idx_.data() + 9);
  MEGATORCH_CHECK(version == 1, ip, ": unsupported MMIDIDX version ", version, "; expected 1");
  const int code = idx_.data()[17];
  MEGATORCH_CHECK(is_valid_dtype_code(code), ip, ": unknown dtype code ", code,
                  "; expected 1..8 (uint8, int8, int16, int32, int64, float64, float32, uint16)");
  dtype_ = static_cast<DType>(code);
  num_sequences_ = header_u64(18);
  num_doc_entries_ = header_u64(26);
  const int64_t n = num_sequences_, d = num_doc_entries_;
  MEGATORCH_CHECK(d >= 1, ip, ": the document index has ", d, " entries; expected at least 1 (a leading 0)");
  const int64_t expected = kHeaderBytes + 4 * n + 8 * n + 8 * d;
  MEGATORCH_CHECK(idx_.size() == expected || idx_.size() == expected + n, ip, " has ", idx_.size(),
                  " bytes, but a header of ", n, " sequences and ", d, " document-index entries needs ", expected,
                  " (or ", expected + n, " with sequence modes): the file is truncated or corrupt");
  has_modes_ = idx_.size() == expected + n && n > 0;
  lengths_ = idx_.data() + kHeaderBytes;
  pointers_ = lengths_ + 4 * n;
  doc_index_ = pointers_ + 8 * n;

  const int64_t item = dtype_size(dtype_);
  int64_t expected_pointer = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t len = load<int32_t>(lengths_ + 4 * i);
    const int64_t ptr = load<int64_t>(pointers_ + 8 * i);
    MEGATORCH_CHECK(len >= 0, ip, ": sequence ", i, " has negative length ", len);
    MEGATORCH_CHECK(ptr == expected_pointer, ip, ": sequence ", i, " points to byte ", ptr, " of ", bp,
                    ", but the lengths before it put it at byte ", expected_pointer, " (", dtype_name(dtype_),
                    " tokens stored back to back): the index is corrupt");
    expected_pointer += static_cast<int64_t>(len) * item;
    num_tokens_ += len;
  }
  MEGATORCH_CHECK(bin_.size() == expected_pointer, bp, " has ", bin_.size(), " bytes, but ", ip, " describes ", num_tokens_, " ",
                  dtype_name(dtype_), " tokens = ", expected_pointer,
                  " bytes: the .bin is truncated, or the .idx belongs to another dataset");
  int64_t prev = 0;
  for (int64_t j = 0; j < d; ++j) {
    const int64_t v = load<int64_t>(doc_index_ + 8 * j);
    MEGATORCH_CHECK(j > 0 || v == 0, ip, ": the document index starts at ", v, "; expected 0");
    MEGATORCH_CHECK(v >= prev && v <= n, ip, ": document index entry ", j, " is ", v, " after ", prev,
                    "; expected a non-decreasing sequence number in [", prev, ", ", n, "]");
    prev = v;
  }
  MEGATORCH_CHECK(prev == n, ip, ": the document index ends at sequence ", prev, ", but there are ", n,
                  " sequences; expected the last entry to equal the sequence count");
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  MEGATORCH_CHECK(i >= 0 && i < num_sequences_, prefix_, ": sequence ", i, " out of range [0, ", num_sequences_, ")");
  return load<int32_t>(lengths_ + 4 * i);
}

int64_t IndexedDataset::sequence_pointer(int64_t i) const {
  MEGATORCH_CHECK(i >= 0 && i < num_sequences_, prefix_, ": sequence ", i, " out of range [0, ", num_sequences_, ")");
  return load<int64_t>(pointers_ + 8 * i);
}

int64_t IndexedDataset::document_index(int64_t j) const {
  MEGATORCH_CHECK(j >= 0 && j < num_doc_entries_, prefix_, ": document index entry ", j, " out of range [0, ",
                  num_doc_entries_, ")");
  return load<int64_t>(doc_index_ + 8 * j);
}

std::vector<int32_t> IndexedDataset::sequence_lengths() const {
  std::vector<int32_t> out(static_cast<size_t>(num_sequences_));
  if (num_sequences_ > 0) std::memcpy(out.data(), lengths_, 4 * static_cast<size_t>(num_sequences_));
  return out;
}

void IndexedDataset::read(int64_t i, int64_t offset, int64_t length, int64_t* out) const {
  const int64_t seq_len = sequence_length(i);
  if (length < 0) length = seq_len - offset;
  MEGATORCH_CHECK(offset >= 0 && length >= 0 && offset + length <= seq_len, prefix_, ": tokens [", offset, ", ",
                  offset + length, ") of sequence ", i, " are outside its ", seq_len, " tokens");
  const uint8_t* src = bin_.data() + sequence_pointer(i) + offset * dtype_size(dtype_);
  if (length == 0) return;
  switch (dtype_) {
    case DType::kUInt8: convert<uint8_t>(src, length, out); break;
    case DType::kInt8: convert<int8_t>(src, length, out); break;
    case DType::kInt16: convert<int16_t>(src, length, out); break;
    case DType::kUInt16: convert<uint16_t>(src, length, out); break;
    case DType::kInt32: convert<int32_t>(src, length, out); break;
    case DType::kInt64: convert<int64_t>(src, length, out); break;
    case DType::kFloat32: convert<float>(src, length, out); break;
    case DType::kFloat64: convert<double>(src, length, out); break;
  }
}

at::Tensor IndexedDataset::get(int64_t i, int64_t offset, int64_t length) const {
  if (length < 0) length = sequence_length(i) - offset;
  at::Tensor t = at::empty({std::max<int64_t>(length, 0)}, at::kLong);
  read(i, offset, length, t.data_ptr<int64_t>());
  return t;
}

}  // namespace megatorch::data
