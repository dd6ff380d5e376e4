#include "megatorch/ckpt/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <tuple>

#include "megatorch/check.h"
#include "megatorch/ckpt/crc32.h"

namespace megatorch::ckpt {

namespace {

// The format's own limit on the JSON header (the reference implementation's
// MAX_HEADER_SIZE); checked before the header is allocated.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Root object -> tensor entry -> shape / data_offsets array.
constexpr int kMaxHeaderDepth = 3;

// Thrown by the JSON parser callback to stop parsing a hostile header.
struct HeaderRejected {
  std::string what;
};

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

void read_at(int fd, void* data, size_t n, int64_t offset, const std::string& path, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, offset);
    if (r < 0 && errno == EINTR) continue;
    MEGATORCH_CHECK(r > 0, "reading ", what, " of '", path, "' at byte ", offset, " failed: ",
                    r == 0 ? "unexpected end of file (truncated? re-copy or re-save it)" : std::strerror(errno));
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

namespace {

// The file's bytes in order through `put` (a descriptor or an AtomicFile), so both writers
// share one layout.
WrittenFile write_safetensors_to(const std::function<void(const void*, size_t)>& put, const std::string& path,
                                 const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
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

  WrittenFile out;
  put(len_bytes, 8);
  out.crc32 = crc32(len_bytes, 8);
  put(text.data(), text.size());
  out.crc32 = crc32(text.data(), text.size(), out.crc32);
  // One tensor at a time through host memory: saving device (or non-contiguous) tensors
  // holds at most one staged copy, never a second copy of the whole shard.
  for (const auto& [name, tensor] : tensors) {
    const at::Tensor t = tensor.detach().to(at::kCPU).contiguous();
    const size_t n = t.numel() * t.element_size();
    put(t.data_ptr(), n);
    out.crc32 = crc32(t.data_ptr(), n, out.crc32);
  }
  out.bytes = 8 + static_cast<int64_t>(len) + offset;
  return out;
}

}  // namespace

WrittenFile write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata, bool durable) {
  Fd f{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  MEGATORCH_CHECK(f.fd >= 0, "cannot create '", path, "': ", std::strerror(errno));
  const WrittenFile out = write_safetensors_to([&](const void* p, size_t n) { write_all(f.fd, p, n, path); }, path,
                                               tensors, metadata);
  if (durable) MEGATORCH_CHECK(::fsync(f.fd) == 0, "fsync of '", path, "' failed: ", std::strerror(errno));
  return out;
}

WrittenFile write_safetensors(io::AtomicFile& file, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  return write_safetensors_to([&](const void* p, size_t n) { file.write(p, n); }, file.path(), tensors, metadata);
}

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  Fd f{::open(path_.c_str(), O_RDONLY | O_CLOEXEC)};
  MEGATORCH_CHECK(f.fd >= 0, "cannot open '", path_, "': ", std::strerror(errno));
  struct stat st {};
  MEGATORCH_CHECK(::fstat(f.fd, &st) == 0, "cannot stat '", path_, "': ", std::strerror(errno));
  const int64_t size = st.st_size;
  MEGATORCH_CHECK(size >= 8, "'", path_, "' is not a safetensors file: ", size,
                  " bytes, expected at least 8 (the header length); is the file truncated or empty?");
  unsigned char len_bytes[8];
  read_at(f.fd, len_bytes, 8, 0, path_, "the header length");
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  // Both checks come before the header is allocated: a corrupt length must not become a
  // multi-gigabyte allocation.
  MEGATORCH_CHECK(len <= kMaxHeaderBytes, "'", path_, "' is not a safetensors file or is corrupt: its header length is ",
                  len, " bytes, expected at most ", kMaxHeaderBytes, " (the format's limit)");
  MEGATORCH_CHECK(len <= static_cast<uint64_t>(size - 8), "'", path_,
                  "' is not a safetensors file or is truncated: header of ", len, " bytes in a file of ", size,
                  " bytes; re-copy or re-save the file");
  std::string text(len, '\0');
  read_at(f.fd, text.data(), len, 8, path_, "the header");
  nlohmann::json header;
  try {
    // A header is at most three levels deep ({name: {shape: [...]}}); the depth limit keeps
    // a hostile "[[[[..." from building millions of nested values. Duplicate tensor names
    // would otherwise silently keep the last entry.
    std::set<std::string> top_keys;
    header = nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (depth > kMaxHeaderDepth) throw HeaderRejected{"nested deeper than " + std::to_string(kMaxHeaderDepth) + " levels"};
      if (event == nlohmann::json::parse_event_t::key && depth == 1 && !top_keys.insert(parsed.get<std::string>()).second) {
        throw HeaderRejected{"tensor '" + parsed.get<std::string>() + "' appears twice"};
      }
      return true;
    });
  } catch (const HeaderRejected& e) {
    MEGATORCH_FAIL("'", path_, "': bad safetensors header: ", e.what, "; re-save the file");
  } catch (const std::exception& e) {
    MEGATORCH_FAIL("'", path_, "': the safetensors header is not valid JSON (", e.what(), "); re-save the file");
  }
  MEGATORCH_CHECK(header.is_object(), "'", path_, "': expected a JSON object as the safetensors header, got ",
                  header.type_name(), "; re-save the file");
  const int64_t data_start = 8 + static_cast<int64_t>(len);
  const int64_t data_size = size - data_start;
  struct Range {
    int64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  for (const auto& item : header.items()) {
    // Named copies, not structured bindings: the lambdas below capture them (C++17).
    const std::string name = item.key();
    const nlohmann::json& v = item.value();
    if (name == "__metadata__") {
      MEGATORCH_CHECK(v.is_object(), "'", path_, "': expected \"__metadata__\" to be an object of strings, got ",
                      v.type_name());
      for (const auto& [k, s] : v.items()) {
        MEGATORCH_CHECK(s.is_string(), "'", path_, "': expected \"__metadata__\" value '", k, "' to be a string, got ",
                        s.type_name());
        metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    // Every message below names the file and the tensor.
    const auto bad = [&](const auto&... parts) {
      MEGATORCH_FAIL("'", path_, "': tensor '", name, "': ", parts..., "; the file is corrupt or not written by a "
                     "safetensors writer, re-save it");
    };
    if (!v.is_object()) bad("expected an object {dtype, shape, data_offsets}, got ", v.type_name());
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!v.contains(field)) bad("the header entry has no \"", field, "\"");
    }
    const auto& dtype = v.at("dtype");
    if (!dtype.is_string()) bad("expected \"dtype\" to be a string, got ", dtype.type_name());
    const auto dtype_it = std::find_if(dtype_names().begin(), dtype_names().end(),
                                       [&](const auto& p) { return dtype.get<std::string>() == p.second; });
    if (dtype_it == dtype_names().end()) {
      bad("unsupported dtype '", dtype.get<std::string>(), "'; expected one of F32, F64, F16, BF16, I64, I32, I16, I8, U8, BOOL");
    }
    TensorInfo info;
    info.dtype = dtype_it->first;
    // A non-negative integer that fits int64 (nlohmann stores large ones as unsigned and
    // would silently convert 2.5 to 2).
    const auto as_index = [&](const nlohmann::json& j, const char* what) -> int64_t {
      if (!j.is_number_integer()) bad("expected ", what, " to be integers, got ", j.dump());
      if (j.is_number_unsigned()) {
        if (j.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          bad("expected ", what, " to fit in 64 bits, got ", j.dump());
        }
        return static_cast<int64_t>(j.get<uint64_t>());
      }
      if (j.get<int64_t>() < 0) bad("expected ", what, " to be non-negative, got ", j.get<int64_t>());
      return j.get<int64_t>();
    };
    const auto& shape = v.at("shape");
    if (!shape.is_array()) bad("expected \"shape\" to be an array, got ", shape.type_name());
    // The product of the non-zero dimensions must fit: at::empty computes strides from them
    // even when another dimension is 0.
    int64_t numel = 1, extent = 1;
    for (const auto& d : shape) {
      const int64_t n = as_index(d, "\"shape\" dimensions");
      info.shape.push_back(n);
      if (n != 0 && __builtin_mul_overflow(extent, n, &extent)) bad("shape ", shape.dump(), " overflows 64 bits");
      numel *= n;  // <= extent, so it cannot overflow
    }
    int64_t expected_bytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<int64_t>(c10::elementSize(info.dtype)), &expected_bytes)) {
      bad("shape ", shape.dump(), " of ", dtype.get<std::string>(), " overflows 64 bits of bytes");
    }
    const auto& offsets = v.at("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2) bad("expected \"data_offsets\" to be [begin, end], got ", offsets.dump());
    const int64_t begin = as_index(offsets[0], "\"data_offsets\"");
    const int64_t end = as_index(offsets[1], "\"data_offsets\"");
    if (begin > end) bad("data_offsets [", begin, ", ", end, "] end before they begin");
    if (end > data_size) {
      bad("data_offsets [", begin, ", ", end, "] extend past the data section of ", data_size, " bytes (file of ", size,
          " bytes, header of ", len, "); the file is truncated");
    }
    if (end - begin != expected_bytes) {
      bad("data_offsets [", begin, ", ", end, "] hold ", end - begin, " bytes, but shape ", shape.dump(), " of ",
          dtype.get<std::string>(), " needs ", expected_bytes);
    }
    info.offset = data_start + begin;
    info.nbytes = end - begin;
    ranges.push_back({begin, end, name});
    infos_[name] = std::move(info);
  }
  // The tensors must tile the data section exactly, as the format requires: an overlap
  // means two tensors share bytes, a gap (or trailing bytes) means a corrupt header.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return std::tie(a.begin, a.end) < std::tie(b.begin, b.end); });
  int64_t at = 0;
  const std::string* prev = nullptr;
  for (const auto& r : ranges) {
    MEGATORCH_CHECK(r.begin >= at, "'", path_, "': tensor '", r.name, "' (bytes [", r.begin, ", ", r.end,
                    ")) overlaps tensor '", prev ? *prev : std::string(), "' (ending at ", at,
                    "); the header is corrupt, re-save the file");
    MEGATORCH_CHECK(r.begin == at, "'", path_, "': tensor '", r.name, "' begins at data byte ", r.begin, " but ",
                    prev ? "tensor '" + *prev + "' ends" : std::string("the data section begins"), " at ", at,
                    ": a gap of ", r.begin - at, " bytes; the header is corrupt, re-save the file");
    at = r.end;
    prev = &r.name;
    order_.push_back(r.name);
  }
  MEGATORCH_CHECK(at == data_size, "'", path_, "': the data section has ", data_size, " bytes but the tensors cover ", at,
                  prev ? " (the last is '" + *prev + "')" : std::string(" (no tensors)"),
                  "; trailing bytes mean a corrupt header or a file appended to, re-save it");
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
  MEGATORCH_CHECK(f.fd >= 0, "cannot open '", path_, "' to read tensor '", name, "': ", std::strerror(errno));
  // The file may have shrunk since the header was checked: read_at fails on a short read.
  read_at(f.fd, out.data_ptr(), i.nbytes, i.offset, path_, "tensor '" + name + "'");
  return out;
}

}  // namespace megatorch::ckpt
