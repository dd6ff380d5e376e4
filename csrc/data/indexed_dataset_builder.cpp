#include "megatorch/data/indexed_dataset_builder.h"

#include <cerrno>
#include <cstring>
#include <limits>
#include <type_traits>

#include "megatorch/check.h"

namespace megatorch::data {

namespace {

template <typename T>
void append_as(std::vector<uint8_t>& buf, const int64_t* tokens, int64_t count, const std::string& path) {
  const size_t start = buf.size();
  buf.resize(start + static_cast<size_t>(count) * sizeof(T));
  uint8_t* dst = buf.data() + start;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t v = tokens[k];
    if constexpr (std::is_integral_v<T>) {
      MEGATORCH_CHECK(v >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                          v <= static_cast<int64_t>(std::numeric_limits<T>::max()),
                      path, ": token ", v, " does not fit the dataset dtype (range [",
                      static_cast<int64_t>(std::numeric_limits<T>::min()), ", ",
                      static_cast<int64_t>(std::numeric_limits<T>::max()), "]); choose a wider dtype");
    }
    const T t = static_cast<T>(v);
    std::memcpy(dst + k * sizeof(T), &t, sizeof(T));
  }
}

at::Tensor as_long_1d(const at::Tensor& tokens) {
  MEGATORCH_CHECK(tokens.dim() <= 1, "expected a 1-D tensor of token ids, got shape ", tokens.sizes());
  return tokens.to(at::kCPU).to(at::kLong).contiguous().reshape({-1});
}

}  // namespace

IndexedDatasetBuilder::IndexedDatasetBuilder(std::string bin_path, DType dtype) : bin_path_(std::move(bin_path)), dtype_(dtype) {
  MEGATORCH_CHECK(is_valid_dtype_code(static_cast<int>(dtype)), "unknown dtype code ", static_cast<int>(dtype));
  bin_ = std::make_unique<io::AtomicFile>(bin_path_);
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() = default;

void IndexedDatasetBuilder::check_open() const {
  MEGATORCH_CHECK(bin_ != nullptr, bin_path_, ": the builder was finalized; create a new one to write more");
}

void IndexedDatasetBuilder::write_tokens(const int64_t* tokens, int64_t count) {
  check_open();
  buffer_.clear();
  switch (dtype_) {
    case DType::kUInt8: append_as<uint8_t>(buffer_, tokens, count, bin_path_); break;
    case DType::kInt8: append_as<int8_t>(buffer_, tokens, count, bin_path_); break;
    case DType::kInt16: append_as<int16_t>(buffer_, tokens, count, bin_path_); break;
    case DType::kUInt16: append_as<uint16_t>(buffer_, tokens, count, bin_path_); break;
    case DType::kInt32: append_as<int32_t>(buffer_, tokens, count, bin_path_); break;
    case DType::kInt64: append_as<int64_t>(buffer_, tokens, count, bin_path_); break;
    case DType::kFloat32: append_as<float>(buffer_, tokens, count, bin_path_); break;
    case DType::kFloat64: append_as<double>(buffer_, tokens, count, bin_path_); break;
  }
  bin_->write(buffer_.data(), buffer_.size());
}

void IndexedDatasetBuilder::add_item(const int64_t* tokens, int64_t count) {
  MEGATORCH_CHECK(count >= 0 && count <= std::numeric_limits<int32_t>::max(), bin_path_, ": a sequence of ", count,
                  " tokens does not fit the format's int32 length");
  write_tokens(tokens, count);
  lengths_.push_back(static_cast<int32_t>(count));
}

void IndexedDatasetBuilder::add_item(const at::Tensor& tokens) {
  const at::Tensor t = as_long_1d(tokens);
  add_item(t.data_ptr<int64_t>(), t.numel());
}

void IndexedDatasetBuilder::end_document() {
  check_open();
  doc_index_.push_back(num_sequences());
}

void IndexedDatasetBuilder::add_document(const int64_t* tokens, const std::vector<int64_t>& lengths) {
  int64_t offset = 0;
  for (int64_t len : lengths) {
    add_item(tokens + offset, len);
    offset += len;
  }
  end_document();
}

void IndexedDatasetBuilder::add_document(const at::Tensor& tokens, const std::vector<int64_t>& lengths) {
  const at::Tensor t = as_long_1d(tokens);
  int64_t total = 0;
  for (int64_t len : lengths) total += len;
  MEGATORCH_CHECK(total == t.numel(), bin_path_, ": add_document got ", t.numel(), " tokens but lengths summing to ", total);
  add_document(t.data_ptr<int64_t>(), lengths);
}

void IndexedDatasetBuilder::add_index(const std::string& path_prefix) {
  check_open();
  const IndexedDataset other(path_prefix);
  MEGATORCH_CHECK(other.dtype() == dtype_, "cannot append ", path_prefix, " (", dtype_name(other.dtype()), ") to ", bin_path_,
                  " (", dtype_name(dtype_), "): the dtypes must match");
  const int64_t base = num_sequences();
  for (int64_t i = 0; i < other.num_sequences(); ++i) lengths_.push_back(static_cast<int32_t>(other.sequence_length(i)));
  for (int64_t j = 1; j <= other.num_documents(); ++j) doc_index_.push_back(base + other.document_index(j));
  // Copy the .bin verbatim: the tokens are already in this dtype.
  const MappedFile src(bin_path(path_prefix));
  bin_->write(src.data(), static_cast<size_t>(src.size()));
}

void IndexedDatasetBuilder::finalize(const std::string& idx_path) {
  check_open();
  // Taken out first: whatever happens below, the builder is finalized (and on an error the
  // temporary files are removed when these go out of scope).
  const std::unique_ptr<io::AtomicFile> bin = std::move(bin_);
  io::AtomicFile idx(idx_path);
  std::vector<uint8_t> out;
  auto put = [&out](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  };
  const char magic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
  const uint64_t version = 1, n = lengths_.size(), d = doc_index_.size();
  const uint8_t code = static_cast<uint8_t>(dtype_);
  put(magic, 9);
  put(&version, 8);
  put(&code, 1);
  put(&n, 8);
  put(&d, 8);
  put(lengths_.data(), 4 * n);
  // Pointers are the running byte offsets, as Megatron's _IndexWriter computes them.
  const int64_t item = dtype_size(dtype_);
  int64_t ptr = 0;
  for (int32_t len : lengths_) {
    put(&ptr, 8);
    ptr += static_cast<int64_t>(len) * item;
  }
  put(doc_index_.data(), 8 * d);
  idx.write(out.data(), out.size());
  // Both complete and fsync'd before either replaces an old file. Between the two renames
  // (microseconds) a reader could pair the new .bin with the old .idx; the .idx goes last
  // so that its appearance means the pair is whole, and only a crash in that window leaves
  // the mismatch (rerun the build).
  bin->finish();
  idx.finish();
  bin->publish();
  idx.publish();
}

}  // namespace megatorch::data
