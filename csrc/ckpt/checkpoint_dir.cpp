#include "checkpoint_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <iterator>

#include "megatorch/check.h"
#include "megatorch/util/strings.h"

namespace megatorch::ckpt::checkpoint_dir {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string host_name() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

}  // namespace

// ---- durable files

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MEGATORCH_CHECK(fd >= 0, "cannot open directory '", dir.string(), "' to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  MEGATORCH_CHECK(rc == 0, "fsync of directory '", dir.string(), "' failed: ", std::strerror(errno));
}

// rm -rf: std::filesystem::remove_all resolves to libtorch's own copy of the symbol,
// which crashes on non-empty directories (seen with torch 2.11); nftw does not.
void remove_tree(const fs::path& path) {
  if (!fs::exists(fs::symlink_status(path))) return;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); };
  MEGATORCH_CHECK(::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) == 0, "cannot remove '", path.string(),
                  "': ", std::strerror(errno));
}

// ---- the directory's iterations, leftovers of failed saves, and the save lock

// "iter_0000100" -> 100; nullopt for any other name (iter_0000100.tmp, .old, ...).
std::optional<int64_t> parse_iteration_dirname(const std::string& name) {
  const auto stripped = util::strip_prefix(name, "iter_");
  if (!stripped) return std::nullopt;
  const std::string digits(*stripped);
  if (digits.empty() || digits.size() > 18) return std::nullopt;
  if (!std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c) != 0; })) {
    return std::nullopt;
  }
  return std::stoll(digits);
}

// A published iteration: its directory with metadata.json, which is written last.
bool complete_iteration(const fs::path& dir) {
  return fs::is_directory(dir) && fs::is_regular_file(dir / kMetadata);
}

// The names in `dir` (readdir: libtorch carries its own copies of some std::filesystem
// symbols, see remove_tree).
std::vector<std::string> list_dir(const fs::path& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  while (const struct dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

// The newest complete iteration in `dir` other than `except`; -1 when none.
int64_t newest_complete_iteration(const fs::path& dir, int64_t except) {
  int64_t best = -1;
  for (const auto& name : list_dir(dir)) {
    const auto it = parse_iteration_dirname(name);
    if (it && *it != except && *it > best && complete_iteration(dir / name)) best = *it;
  }
  return best;
}

// What failed saves leave, cleared by the writing rank under the save lock (so no live
// saver owns any of it): iter_*.tmp* directories (a save killed before its rename), and
// iter_*.old (a replaced iteration killed between its two renames; put back in place
// when the new one never arrived, since `latest` may name it).
void clear_failed_saves(const fs::path& root) {
  for (const auto& name : list_dir(root)) {
    if (!util::starts_with(name, "iter_")) continue;
    const fs::path path = root / name;
    if (name.find(".tmp") != std::string::npos) {
      remove_tree(path);
    } else if (path.extension() == ".old" && parse_iteration_dirname(path.stem().string())) {
      const fs::path published = root / path.stem();
      if (!fs::exists(fs::symlink_status(published)) && complete_iteration(path)) {
        fs::rename(path, published);
      } else {
        remove_tree(path);
      }
    }
  }
}

// <dir>/.megatorch_save.lock, created with O_EXCL and holding {"host", "pid"} of the
// saver; removed when the save ends, however it ends. One left by a crashed saver on
// this host (its pid gone) is taken over; one from another host cannot be checked and
// is refused (the message says how to clear it).
SaveLock::SaveLock(const fs::path& root, int64_t iteration) : path_(root / kSaveLock) {
    const std::string mine = json{{"host", host_name()}, {"pid", static_cast<int64_t>(::getpid())},
                                  {"iteration", iteration}}.dump() + "\n";
    for (int attempt = 0; attempt < 3; ++attempt) {
      const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd >= 0) {
        const bool written = ::write(fd, mine.data(), mine.size()) == static_cast<ssize_t>(mine.size());
        const bool synced = written && ::fsync(fd) == 0;
        ::close(fd);
        if (!synced) ::unlink(path_.c_str());
        MEGATORCH_CHECK(synced, "save_checkpoint: cannot write the lock file '", path_.string(), "': ",
                        std::strerror(errno), "; expected a writable checkpoint directory");
        held_ = true;
        return;
      }
      MEGATORCH_CHECK(errno == EEXIST, "save_checkpoint: cannot create the lock file '", path_.string(), "': ",
                      std::strerror(errno), "; expected a writable checkpoint directory");
      remove_if_stale();  // or refuse, naming the owner
    }
    MEGATORCH_FAIL("save_checkpoint: the lock file '", path_.string(), "' keeps coming back after removing a stale ",
                   "one; another saver is starting in this directory. Save into another directory, or stop it");
  }
SaveLock::~SaveLock() {
  if (held_) ::unlink(path_.c_str());
}

void SaveLock::remove_if_stale() {
    std::ifstream in(path_);
    if (!in) return;  // removed by its owner meanwhile
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    json owner;
    try {
      owner = json::parse(text);
    } catch (const std::exception&) {
    }
    const bool valid = owner.is_object() && owner.contains("host") && owner["host"].is_string() &&
                       owner.contains("pid") && owner["pid"].is_number_integer() && owner["pid"].get<int64_t>() > 0;
    // Empty or half-written: a saver that has just created it, or damage; either way not ours to remove.
    MEGATORCH_CHECK(valid, "save_checkpoint: the lock file '", path_.string(), "' exists but holds ",
                    json(text.substr(0, 80)).dump(-1, ' ', false, json::error_handler_t::replace),
                    ", not a saver's host and pid (a saver creating it right now, or damage); if no save into '",
                    path_.parent_path().string(), "' is running, remove the file");
    const std::string host = owner["host"].get<std::string>();
    const int64_t pid = owner["pid"].get<int64_t>();
    const bool same_host = host == host_name();
    const bool dead = same_host && pid <= INT32_MAX && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    if (dead) {
      ::unlink(path_.c_str());
      return;
    }
    MEGATORCH_FAIL("save_checkpoint: another save into '", path_.parent_path().string(), "' holds its lock file '",
                   path_.string(), "' (host ", host, ", pid ", pid,
                   same_host ? ", still running" : ", another host: cannot check whether it runs",
                   "); two savers into one directory would delete each other's shards. Save into another ",
                   "directory or wait for it to finish; if that process is gone, remove the lock file");
  }



}  // namespace megatorch::ckpt::checkpoint_dir
