#pragma once
// A checkpoint directory's bookkeeping, apart from reading and writing tensors
// (checkpoint.cpp): which iterations it holds and which are complete, what failed saves
// left behind, the save lock, and durable directory operations.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace megatorch::ckpt::checkpoint_dir {

inline constexpr const char* kMetadata = "metadata.json";
// Held by the coordinating rank for a whole save: two savers into one directory would
// clear and replace each other's temporary directories and shards.
inline constexpr const char* kSaveLock = ".megatorch_save.lock";

// fsync of a directory, so a rename in it is durable.
void fsync_dir(const std::filesystem::path& dir);
// rm -rf (nftw: libtorch's copy of std::filesystem::remove_all crashes on non-empty dirs).
void remove_tree(const std::filesystem::path& path);
// "iter_0000100" -> 100; nullopt for any other name (iter_0000100.tmp, .old, ...).
std::optional<int64_t> parse_iteration_dirname(const std::string& name);
// A published iteration: its directory with metadata.json, which is written last.
bool complete_iteration(const std::filesystem::path& dir);
// The names in `dir`, sorted (readdir, for the same libtorch reason).
std::vector<std::string> list_dir(const std::filesystem::path& dir);
// The newest complete iteration in `dir` other than `except`; -1 when none.
int64_t newest_complete_iteration(const std::filesystem::path& dir, int64_t except);
// Removes failed saves' iter_*.tmp* and puts back (or drops) iter_*.old; call under the lock.
void clear_failed_saves(const std::filesystem::path& root);

// <dir>/.megatorch_save.lock, created with O_EXCL and holding {"host", "pid"} of the
// saver; removed when the save ends, however it ends. One left by a crashed saver on
// this host (its pid gone) is taken over; one from another host cannot be checked and
// is refused (the message says how to clear it).
class SaveLock {
 public:
  SaveLock(const std::filesystem::path& root, int64_t iteration);
  ~SaveLock();
  SaveLock(const SaveLock&) = delete;
  SaveLock& operator=(const SaveLock&) = delete;

 private:
  // Removes the existing lock when its saver is gone (the caller tries again); fails
  // naming the owner when it is live or cannot be judged.
  void remove_if_stale();

  std::filesystem::path path_;
  bool held_ = false;
};

}  // namespace megatorch::ckpt::checkpoint_dir
