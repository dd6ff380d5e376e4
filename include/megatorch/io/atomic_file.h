#pragma once
// Writing a file so that readers see either the old file or the whole new one, never a
// truncated or half-written one: the bytes go to `<path>.tmp.<pid>` in the same directory
// (so the rename stays within one filesystem), every write is checked, the file is
// fsync'd, and commit() renames it over `path` and fsyncs the directory. A process that
// has the old file memory-mapped keeps the old inode (no SIGBUS). Without commit() (an
// error, an exception) the destructor removes the temporary file and `path` is untouched.
// Every failure names the file and the OS error, so a full disk is an error, not exit 0.
#include <cstddef>
#include <string>
#include <vector>

namespace megatorch::io {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(const std::string& text) { write(text.data(), text.size()); }

  // Both steps of commit(), for publishing several files together (a dataset's .bin and
  // .idx): finish() every file first (all bytes written, fsync'd, closed; still under the
  // temporary name), then publish() each (rename + directory fsync).
  void finish();
  void publish();
  void commit() {
    finish();
    publish();
  }

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_; }
  bool committed() const { return published_; }

 private:
  void flush_buffer();

  std::string path_;
  std::string temp_;
  int fd_ = -1;
  bool finished_ = false;
  bool published_ = false;
  std::vector<char> buffer_;  // small writes are batched: one syscall per ~1 MiB
};

// The whole of `contents` to `path`, atomically (AtomicFile + commit()).
void write_file_atomically(const std::string& path, const std::string& contents);

}  // namespace megatorch::io
