#include "megatorch/io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "megatorch/check.h"

namespace megatorch::io {

namespace {

constexpr size_t kBufferBytes = 1 << 20;

// Makes the rename itself durable: a crash after commit() must not bring back the old file.
void fsync_directory_of(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MEGATORCH_CHECK(fd >= 0, "cannot open the directory '", dir, "' of '", path, "' to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some filesystems cannot fsync a directory (EINVAL); the rename is done, which is all
  // they offer.
  MEGATORCH_CHECK(rc == 0 || err == EINVAL, "fsync of the directory '", dir, "' after writing '", path,
                  "' failed: ", std::strerror(err));
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  MEGATORCH_CHECK(!path_.empty(), "AtomicFile: expected a file path, got an empty one");
  temp_ = path_ + ".tmp." + std::to_string(::getpid());
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  MEGATORCH_CHECK(fd_ >= 0, "cannot create '", temp_, "' (to write '", path_, "'): ", std::strerror(errno),
                  "; check that the directory exists and is writable");
  buffer_.reserve(kBufferBytes);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!published_) ::unlink(temp_.c_str());  // an abandoned write leaves nothing behind
}

void AtomicFile::flush_buffer() {
  const char* p = buffer_.data();
  size_t left = buffer_.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    MEGATORCH_CHECK(n > 0, "writing '", path_, "' failed: ", n < 0 ? std::strerror(errno) : "no bytes written",
                    " (via '", temp_, "'; '", path_, "' is unchanged); free space or raise the file size limit");
    p += n;
    left -= static_cast<size_t>(n);
  }
  buffer_.clear();
}

void AtomicFile::write(const void* data, size_t bytes) {
  MEGATORCH_CHECK(fd_ >= 0 && !finished_, "AtomicFile: '", path_, "' was finished; nothing can be written after finish()");
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const size_t n = std::min(bytes, kBufferBytes - buffer_.size());
    buffer_.insert(buffer_.end(), p, p + n);
    p += n;
    bytes -= n;
    if (buffer_.size() == kBufferBytes) flush_buffer();
  }
}

void AtomicFile::finish() {
  if (finished_) return;
  flush_buffer();
  MEGATORCH_CHECK(::fsync(fd_) == 0, "fsync of '", temp_, "' (to write '", path_, "') failed: ", std::strerror(errno));
  const int rc = ::close(fd_);
  fd_ = -1;
  MEGATORCH_CHECK(rc == 0, "closing '", temp_, "' (to write '", path_, "') failed: ", std::strerror(errno));
  finished_ = true;
}

void AtomicFile::publish() {
  MEGATORCH_CHECK(finished_, "AtomicFile: '", path_, "' must be finish()ed before publish()");
  if (published_) return;
  MEGATORCH_CHECK(std::rename(temp_.c_str(), path_.c_str()) == 0, "renaming '", temp_, "' to '", path_,
                  "' failed: ", std::strerror(errno));
  published_ = true;
  fsync_directory_of(path_);
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  AtomicFile f(path);
  f.write(contents);
  f.commit();
}

}  // namespace megatorch::io
