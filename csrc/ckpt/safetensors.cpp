#include "megatorch/ckpt/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "megatorch/check.h"
#include "megatorch/ckpt/crc32.h"

namespace megatorch::ckpt {

namespace {

const std::vector<std::pair<at::ScalarType, const char*>>& dtype_names() {
  static const std::vector<std::pair<at::ScalarType, const char*>> names = {
      {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kHalf, "F16"},  {at::kBFloat16, "BF16"},
      {at::kLong, "I64"},  {at::kInt, "I32"},    {at::kShort, "I16"}, {at::kChar, "I8"},
      {at::kByte, "U8"},   {at::kBool, "BOOL"},
  };
  return names;
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    MEGATORCH_CHECK(w > 0, "writing '", path, "' failed: ", std::strerror(errno), "; is the disk full?");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void read_at(int fd, void* data, size_t n, int64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, offset);
    if (r < 0 && errno == EINTR) continue;
    MEGATORCH_CHECK(r > 0, "reading '", path, "' at byte ", offset, " failed: ",
                    r == 0 ? "unexpected end of file (truncated?)" : std::strerror(errno));
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
}

struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::string safetensors_dtype(at::ScalarType t) {
  for (const auto& [type, name] : dtype_names()) {
    if (type == t) return name;
  }
  MEGATORCH_FAIL("safetensors: no file dtype for ", t, "; convert the tensor to a floating or integer type first");
}

at::ScalarType scalar_type_from_safetensors(const std::string& s) {
  for (const auto& [type, name] : dtype_names()) {
    if (s == name) return type;
  }
  MEGATORCH_FAIL("safetensors: unsupported dtype '", s, "'; expected one of F32, F64, F16, BF16, I64, I32, I16, I8, U8, BOOL");
}

WrittenFile write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata, bool durable) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    MEGATORCH_CHECK(name != "__metadata__" && !header.contains(name), "safetensors: tensor name '", name,
                    "' is reserved or repeated in '", path, "'");
    const int64_t n = tensor.numel() * static_cast<int64_t>(tensor.element_size());
    header[name] = {{"dtype", safetensors_dtype(tensor.scalar_type())}, {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned, as the format's writers do
  const uint64_t len = text.size();
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>((len >> (8 * i)) & 0xff);

  Fd f{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  MEGATORCH_CHECK(f.fd >= 0, "cannot create '", path, "': ", std::strerror(errno));
  WrittenFile out;
  write_all(f.fd, len_bytes, 8, path);
  out.crc32 = crc32(len_bytes, 8);
  write_all(f.fd, text.data(), text.size(), path);
  out.crc32 = crc32(text.data(), text.size(), out.crc32);
  // One tensor at a time through host memory: saving device (or non-contiguous) tensors
  // holds at most one staged copy, never a second copy of the whole shard.
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    const size_t n = t.numel() * t.element_size();
    write_all(f.fd, t.data_ptr(), n, path);
    out.crc32 = crc32(t.data_ptr(), n, out.crc32);
  }
  out.bytes = 8 + static_cast<int64_t>(len) + offset;
  if (durable) MEGATORCH_CHECK(::fsync(f.fd) == 0, "fsync of '", path, "' failed: ", std::strerror(errno));
  return out;
}

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  Fd f{::open(path_.c_str(), O_RDONLY | O_CLOEXEC)};
  MEGATORCH_CHECK(f.fd >= 0, "cannot open '", path_, "': ", std::strerror(errno));
  struct stat st {};
  MEGATORCH_CHECK(::fstat(f.fd, &st) == 0, "cannot stat '", path_, "': ", std::strerror(errno));
  const int64_t size = st.st_size;
  MEGATORCH_CHECK(size >= 8, "'", path_, "' is not a safetensors file: ", size, " bytes, expected at least 8");
  unsigned char len_bytes[8];
  read_at(f.fd, len_bytes, 8, 0, path_);
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  MEGATORCH_CHECK(len <= static_cast<uint64_t>(size - 8), "'", path_, "' is not a safetensors file or is truncated: header of ",
                  len, " bytes in a file of ", size);
  std::string text(len, '\0');
  read_at(f.fd, text.data(), len, 8, path_);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    MEGATORCH_FAIL("'", path_, "': the safetensors header is not valid JSON (", e.what(), ")");
  }
  MEGATORCH_CHECK(header.is_object(), "'", path_, "': expected a JSON object as the safetensors header");
  const int64_t data_start = 8 + static_cast<int64_t>(len);
  std::vector<std::pair<int64_t, std::string>> by_offset;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      for (const auto& [k, s] : v.items()) metadata_[k] = s.get<std::string>();
      continue;
    }
    TensorInfo info;
    try {
      info.dtype = scalar_type_from_safetensors(v.at("dtype").get<std::string>());
      info.shape = v.at("shape").get<std::vector<int64_t>>();
      const auto offsets = v.at("data_offsets").get<std::vector<int64_t>>();
      MEGATORCH_CHECK(offsets.size() == 2, "data_offsets must have 2 entries");
      info.offset = data_start + offsets[0];
      info.nbytes = offsets[1] - offsets[0];
    } catch (const nlohmann::json::exception& e) {
      MEGATORCH_FAIL("'", path_, "': bad header entry for tensor '", name, "' (", e.what(), ")");
    }
    int64_t numel = 1;
    for (int64_t d : info.shape) numel *= d;
    MEGATORCH_CHECK(info.nbytes == numel * static_cast<int64_t>(c10::elementSize(info.dtype)) && info.offset >= data_start &&
                        info.offset + info.nbytes <= size,
                    "'", path_, "': tensor '", name, "' of shape ", c10::IntArrayRef(info.shape), " has ", info.nbytes,
                    " bytes at offset ", info.offset, ", which does not fit its shape or the file of ", size,
                    " bytes (truncated?)");
    by_offset.emplace_back(info.offset, name);
    infos_[name] = std::move(info);
  }
  std::sort(by_offset.begin(), by_offset.end());
  for (auto& [o, name] : by_offset) order_.push_back(name);
}

std::vector<std::string> SafetensorsReader::names() const { return order_; }

const TensorInfo& SafetensorsReader::info(const std::string& name) const {
  auto it = infos_.find(name);
  MEGATORCH_CHECK(it != infos_.end(), "'", path_, "' has no tensor '", name, "'");
  return it->second;
}

at::Tensor SafetensorsReader::read(const std::string& name) const {
  const TensorInfo& i = info(name);
  at::Tensor out = at::empty(i.shape, at::TensorOptions().dtype(i.dtype));
  Fd f{::open(path_.c_str(), O_RDONLY | O_CLOEXEC)};
  MEGATORCH_CHECK(f.fd >= 0, "cannot open '", path_, "': ", std::strerror(errno));
  read_at(f.fd, out.data_ptr(), i.nbytes, i.offset, path_);
  return out;
}

}  // namespace megatorch::ckpt
