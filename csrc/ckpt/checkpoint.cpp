#include "megatorch/ckpt/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fcntl.h>
#include <ftw.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "megatorch/check.h"
#include "megatorch/ckpt/crc32.h"
#include "megatorch/ckpt/safetensors.h"
#include "megatorch/comm/group.h"

namespace megatorch::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kLatest = "latest_checkpointed_iteration.txt";
constexpr const char* kMetadata = "metadata.json";
constexpr int kFormatVersion = 1;

// ---- the group ("" = one process)

struct Ranks {
  std::optional<comm::Group> group;
  int64_t rank = 0, size = 1;
  explicit Ranks(const std::string& name) {
    if (name.empty()) return;
    group.emplace(name);
    rank = group->rank();
    size = group->size();
  }
};

// Every rank learns whether any rank failed, so all fail together instead of some
// waiting forever in the next collective; the failing rank reports its own error.
void agree(Ranks& r, const std::optional<std::string>& error, const std::string& what) {
  int64_t failed = error ? 1 : 0;
  if (r.group) {
    at::Tensor flag = at::full({1}, failed, at::kLong);
    r.group->all_reduce(flag, comm::ReduceOp::kMax);
    failed = flag.item<int64_t>();
  }
  if (error) MEGATORCH_FAIL(*error);
  MEGATORCH_CHECK(failed == 0, what, " failed on another rank (its error says why); nothing was changed here");
}

template <class F>
std::optional<std::string> capture(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return std::string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

std::vector<std::string> all_gather_strings(Ranks& r, const std::string& s) {
  if (!r.group) return {s};
  at::Tensor len = at::full({1}, static_cast<int64_t>(s.size()), at::kLong);
  const at::Tensor lens = r.group->all_gather(len);
  const int64_t longest = lens.max().item<int64_t>();
  at::Tensor buf = at::zeros({longest}, at::kByte);
  std::memcpy(buf.data_ptr(), s.data(), s.size());
  const at::Tensor all = r.group->all_gather(buf).view({r.size, longest});
  std::vector<std::string> out;
  for (int64_t i = 0; i < r.size; ++i) {
    out.emplace_back(reinterpret_cast<const char*>(all[i].data_ptr()), lens[i].item<int64_t>());
  }
  return out;
}

// ---- durable files

void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MEGATORCH_CHECK(fd >= 0, "cannot open directory '", dir.string(), "' to fsync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  MEGATORCH_CHECK(rc == 0, "fsync of directory '", dir.string(), "' failed: ", std::strerror(errno));
}

// Writes `text` to `path` atomically: a temporary sibling, fsync, rename, fsync the dir.
void write_file_atomic(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    MEGATORCH_CHECK(fd >= 0, "cannot create '", tmp.string(), "': ", std::strerror(errno));
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        ::close(fd);
        MEGATORCH_FAIL("writing '", tmp.string(), "' failed: ", std::strerror(errno));
      }
      done += static_cast<size_t>(w);
    }
    const int rc = ::fsync(fd);
    ::close(fd);
    MEGATORCH_CHECK(rc == 0, "fsync of '", tmp.string(), "' failed: ", std::strerror(errno));
  }
  fs::rename(tmp, path);
  fsync_dir(path.parent_path());
}

// rm -rf: std::filesystem::remove_all resolves to libtorch's own copy of the symbol,
// which crashes on non-empty directories (seen with torch 2.11); nftw does not.
void remove_tree(const fs::path& path) {
  if (!fs::exists(fs::symlink_status(path))) return;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); };
  MEGATORCH_CHECK(::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) == 0, "cannot remove '", path.string(),
                  "': ", std::strerror(errno));
}

std::string rank_filename(int64_t rank) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "rank_%05lld.safetensors", static_cast<long long>(rank));
  return buf;
}

// ---- metadata

json spec_json(const ShardedEntry& e) {
  return {{"full_shape", e.spec.full_shape}, {"partition_dim", e.spec.partition_dim}, {"rank", e.spec.rank},
          {"world", e.spec.world},           {"parts", e.spec.parts},                 {"begin", e.begin},
          {"end", e.end < 0 ? shard_numel(e) : e.end}, {"valid_rows", e.valid_rows}};
}

// A saved piece as an entry without data (for its runs).
ShardedEntry piece_entry(const std::string& key, const json& p) {
  ShardedEntry e;
  e.key = key;
  e.spec.full_shape = p.at("full_shape").get<std::vector<int64_t>>();
  e.spec.partition_dim = p.at("partition_dim").get<int64_t>();
  e.spec.rank = p.at("rank").get<int64_t>();
  e.spec.world = p.at("world").get<int64_t>();
  e.spec.parts = p.at("parts").get<int64_t>();
  e.begin = p.at("begin").get<int64_t>();
  e.end = p.at("end").get<int64_t>();
  e.valid_rows = p.at("valid_rows").get<int64_t>();
  return e;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Every rank's description -> the tensors' table, checking that the written pieces of
// each tensor cover it exactly once.
json assemble_tensors(const std::vector<json>& ranks) {
  json tensors = json::object();
  std::map<std::string, int64_t> held_by;  // keys some rank holds without writing
  for (const auto& r : ranks) {
    for (const auto& p : r.at("pieces")) {
      const std::string key = p.at("key");
      json piece = p;
      piece.erase("key");
      piece["file"] = r.at("file");
      auto& t = tensors[key];
      if (t.is_null()) t = {{"shape", p.at("shape")}, {"pieces", json::array()}};
      MEGATORCH_CHECK(t.at("shape") == p.at("shape"), "checkpoint save: '", key, "' has shape ", t.at("shape").dump(),
                      " on one rank and ", p.at("shape").dump(), " on rank ", r.at("rank").get<int64_t>(),
                      "; every rank must describe the same global tensor");
      piece.erase("shape");
      t["pieces"].push_back(piece);
    }
    for (const auto& k : r.at("held")) held_by.emplace(k.get<std::string>(), r.at("rank").get<int64_t>());
  }
  for (const auto& [key, rank] : held_by) {
    MEGATORCH_CHECK(tensors.contains(key), "checkpoint save: rank ", rank, " holds '", key,
                    "' with write = false and no rank writes it; exactly one copy of each piece needs write = true");
  }
  for (auto& [key, t] : tensors.items()) {
    std::vector<std::pair<Run, std::string>> runs;
    for (const auto& p : t.at("pieces")) {
      for (const Run& run : entry_runs(piece_entry(key, p))) runs.emplace_back(run, p.at("file").get<std::string>());
    }
    std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.first.global < b.first.global; });
    int64_t next = 0;
    for (const auto& [run, file] : runs) {
      MEGATORCH_CHECK(run.global >= next, "checkpoint save: elements of '", key, "' from element ", run.global,
                      " are written twice (again by ", file, "); set write = false on replicas (DP copies, "
                      "TP-replicated tensors on tp rank > 0)");
      MEGATORCH_CHECK(run.global == next, "checkpoint save: elements [", next, ", ", run.global, ") of '", key,
                      "' are written by no rank; every element needs one piece with write = true");
      next = run.global + run.length;
    }
    const int64_t total = numel_of(t.at("shape").get<std::vector<int64_t>>());
    MEGATORCH_CHECK(next == total, "checkpoint save: elements [", next, ", ", total, ") of '", key,
                    "' are written by no rank; every element needs one piece with write = true");
  }
  return tensors;
}

fs::path resolve_iteration_dir(const fs::path& dir, int64_t& iteration) {
  if (iteration < 0) {
    iteration = latest_iteration(dir.string());
    MEGATORCH_CHECK(iteration >= 0, "no checkpoint in '", dir.string(), "': expected ", kLatest,
                    " naming the last complete save; pass the directory given to save_checkpoint (--save)");
  }
  const fs::path path = dir / iteration_dirname(iteration);
  MEGATORCH_CHECK(fs::is_directory(path), "checkpoint iteration ", iteration, " not found: expected directory '",
                  path.string(), "'");
  return path;
}

// The fields of `want` that differ from `have`, as "field: checkpoint X, model Y".
std::string config_differences(const json& have, const json& want) {
  std::string out;
  for (const auto& [k, v] : want.items()) {
    const bool saved = have.is_object() && have.contains(k);
    // A field added after the checkpoint was written: its absence means the old default
    // (off / 0), so older checkpoints keep loading into models that leave it so.
    if (!saved && (v == false || v == 0)) continue;
    const json h = saved ? have.at(k) : json();
    if (h != v) out += (out.empty() ? "" : "; ") + k + ": checkpoint " + h.dump() + ", model " + v.dump();
  }
  return out;
}

// What load will do for one entry: for each file, (piece name, copies).
struct Plan {
  std::map<std::string, std::vector<std::pair<std::string, std::vector<Copy>>>> by_file;
};

}  // namespace

std::string iteration_dirname(int64_t iteration) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "iter_%07lld", static_cast<long long>(iteration));
  return buf;
}

int64_t latest_iteration(const std::string& dir) {
  const fs::path path = fs::path(dir) / kLatest;
  if (!fs::exists(path)) return -1;
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  MEGATORCH_CHECK(!text.empty() && std::all_of(text.begin(), text.end(), ::isdigit), "'", path.string(),
                  "' should hold an iteration number, holds '", text, "'");
  return std::stoll(text);
}

json read_metadata(const std::string& dir, int64_t iteration) {
  const fs::path path = resolve_iteration_dir(dir, iteration) / kMetadata;
  MEGATORCH_CHECK(fs::exists(path), "checkpoint '", path.parent_path().string(), "' has no ", kMetadata,
                  "; it is incomplete (a save that did not finish?)");
  std::ifstream in(path);
  json meta;
  try {
    meta = json::parse(in);
  } catch (const std::exception& e) {
    MEGATORCH_FAIL("'", path.string(), "' is not valid JSON (", e.what(), "); the checkpoint is damaged");
  }
  MEGATORCH_CHECK(meta.value("format", "") == "megatorch-checkpoint" && meta.value("version", 0) == kFormatVersion,
                  "'", path.string(), "' is not a megatorch checkpoint of format version ", kFormatVersion);
  return meta;
}

void save_checkpoint(const std::string& dir, int64_t iteration, const std::vector<ShardedEntry>& entries,
                     const CheckpointState& state, const std::string& group) {
  Ranks r(group);
  const fs::path root(dir);
  const fs::path final_dir = root / iteration_dirname(iteration);
  const fs::path tmp_dir = root / (iteration_dirname(iteration) + ".tmp");
  const std::string file = rank_filename(r.rank);

  // 1. Check the entries; rank 0 clears what a killed save may have left behind.
  auto error = capture([&] {
    MEGATORCH_CHECK(iteration >= 0, "save_checkpoint: expected an iteration >= 0, got ", iteration);
    std::set<std::string> keys;
    for (const auto& e : entries) {
      validate_entry(e);
      MEGATORCH_CHECK(keys.insert(e.key).second, "save_checkpoint: key '", e.key,
                      "' appears twice on rank ", r.rank, "; each rank holds at most one piece of a tensor");
    }
    if (r.rank == 0) {
      fs::create_directories(root);
      remove_tree(tmp_dir);
      fs::create_directories(tmp_dir);
    }
  });
  agree(r, error, "save_checkpoint (checking entries)");

  // 2. Every rank writes its pieces and describes them.
  json desc = {{"rank", r.rank}, {"file", nullptr}, {"pieces", json::array()}, {"held", json::array()},
               {"rank_state", state.rank_state}};
  error = capture([&] {
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    for (const auto& e : entries) {
      if (!e.write) {
        desc["held"].push_back(e.key);
        continue;
      }
      json p = spec_json(e);
      p["key"] = e.key;
      p["shape"] = logical_shape(e);
      p["name"] = e.key;
      p["dtype"] = safetensors_dtype(e.tensor.scalar_type());
      desc["pieces"].push_back(p);
      tensors.emplace_back(e.key, e.tensor.reshape({-1}));
    }
    if (!tensors.empty()) {
      const WrittenFile w = write_safetensors((tmp_dir / file).string(), tensors, {{"format", "megatorch-shard"}});
      desc["file"] = file;
      desc["bytes"] = w.bytes;
      desc["crc32"] = w.crc32;
    }
  });
  agree(r, error, "save_checkpoint (writing shards)");

  // 3. Rank 0 writes the metadata and publishes: rename, then `latest`. Every rank checks
  // the assembled table, so a bad layout fails everywhere with the same message.
  std::vector<json> ranks;
  for (const auto& s : all_gather_strings(r, desc.dump())) ranks.push_back(json::parse(s));
  error = capture([&] {
    json meta = {{"format", "megatorch-checkpoint"}, {"version", kFormatVersion}, {"iteration", iteration},
                 {"world_size", r.size}, {"model_config", state.model_config}, {"state", state.state}};
    meta["tensors"] = assemble_tensors(ranks);
    if (r.rank != 0) return;
    json files = json::object(), rank_states = json::array();
    for (const auto& d : ranks) {
      if (!d.at("file").is_null()) files[d.at("file").get<std::string>()] = {{"bytes", d.at("bytes")}, {"crc32", d.at("crc32")}};
      rank_states.push_back(d.at("rank_state"));
    }
    meta["files"] = files;
    meta["rank_states"] = rank_states;
    write_file_atomic(tmp_dir / kMetadata, meta.dump(1));
    fsync_dir(tmp_dir);
    const fs::path old_dir = root / (iteration_dirname(iteration) + ".old");
    if (fs::exists(final_dir)) {  // saving the same iteration again: swap, then drop
      remove_tree(old_dir);
      fs::rename(final_dir, old_dir);
    }
    fs::rename(tmp_dir, final_dir);
    fsync_dir(root);
    remove_tree(old_dir);
    write_file_atomic(root / kLatest, std::to_string(iteration) + "\n");
  });
  agree(r, error, "save_checkpoint (publishing)");
}

LoadedCheckpoint load_checkpoint(const std::string& dir, std::vector<ShardedEntry>& entries,
                                 const LoadOptions& options) {
  Ranks r(options.group());
  LoadedCheckpoint out;
  std::vector<Plan> plans(entries.size());
  fs::path path;
  // 1. Validate everything: metadata, model configuration, keys, shapes, coverage, files.
  auto error = capture([&] {
    int64_t iteration = options.iteration();
    path = resolve_iteration_dir(dir, iteration);
    const json meta = read_metadata(dir, iteration);
    out.iteration = iteration;
    out.path = path.string();
    out.world_size = meta.at("world_size").get<int64_t>();
    out.state.model_config = meta.at("model_config");
    out.state.state = meta.at("state");
    for (const auto& s : meta.at("rank_states")) out.rank_states.push_back(s);
    if (out.world_size == r.size && r.rank < static_cast<int64_t>(out.rank_states.size())) {
      out.state.rank_state = out.rank_states[r.rank];
    }
    if (!options.model_config().is_null()) {
      const std::string diff = config_differences(meta.at("model_config"), options.model_config());
      MEGATORCH_CHECK(diff.empty(), "checkpoint '", path.string(), "' is of another model (", diff,
                      "); load it into a model built with the checkpoint's configuration");
    }
    const json& tensors = meta.at("tensors");
    std::set<std::string> files_needed;
    for (size_t i = 0; i < entries.size(); ++i) {
      const ShardedEntry& e = entries[i];
      validate_entry(e);
      MEGATORCH_CHECK(tensors.contains(e.key), "checkpoint '", path.string(), "' has no tensor '", e.key,
                      "'; was it saved from another kind of model?");
      const json& t = tensors.at(e.key);
      const auto saved_shape = t.at("shape").get<std::vector<int64_t>>();
      MEGATORCH_CHECK(saved_shape == logical_shape(e), "checkpoint '", path.string(), "': '", e.key, "' has shape ",
                      c10::IntArrayRef(saved_shape), ", the model's is ", c10::IntArrayRef(logical_shape(e)),
                      "; the checkpoint is of another model shape");
      const std::vector<Run> want = entry_runs(e);
      int64_t wanted = 0, covered = 0;
      for (const Run& run : want) wanted += run.length;
      for (const auto& p : t.at("pieces")) {
        std::vector<Copy> copies = overlap(want, entry_runs(piece_entry(e.key, p)));
        if (copies.empty()) continue;
        for (const Copy& c : copies) covered += c.length;
        const std::string file = p.at("file");
        plans[i].by_file[file].emplace_back(p.at("name").get<std::string>(), std::move(copies));
        files_needed.insert(file);
      }
      MEGATORCH_CHECK(covered == wanted, "checkpoint '", path.string(), "': only ", covered, " of the ", wanted,
                      " elements of '", e.key, "' this rank needs are in the checkpoint; its metadata is damaged");
    }
    const json& files = meta.at("files");
    for (const auto& f : files_needed) {
      const fs::path fp = path / f;
      MEGATORCH_CHECK(files.contains(f), "checkpoint '", path.string(), "': ", f, " is not listed in ", kMetadata);
      MEGATORCH_CHECK(fs::exists(fp), "checkpoint '", path.string(), "' is missing shard ", f,
                      " (written by the saving run's rank of that number); copy the whole checkpoint directory");
      const int64_t bytes = files.at(f).at("bytes").get<int64_t>();
      MEGATORCH_CHECK(static_cast<int64_t>(fs::file_size(fp)) == bytes, "checkpoint shard '", fp.string(), "' has ",
                      fs::file_size(fp), " bytes, ", kMetadata, " says ", bytes, "; the file is truncated or damaged");
      const uint32_t crc = file_crc32(fp.string());
      const uint32_t want_crc = files.at(f).at("crc32").get<uint32_t>();
      MEGATORCH_CHECK(crc == want_crc, "checkpoint shard '", fp.string(), "' fails its checksum (CRC-32 ", crc,
                      ", expected ", want_crc, "); the file is damaged");
    }
  });
  agree(r, error, "load_checkpoint (validating '" + dir + "')");

  // 2. Copy: each entry assembled in a CPU staging tensor of its dtype (padding zero).
  at::NoGradGuard no_grad;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
  for (size_t i = 0; i < entries.size(); ++i) {
    ShardedEntry& e = entries[i];
    at::Tensor stage = at::zeros({e.tensor.numel()}, at::TensorOptions().dtype(e.tensor.scalar_type()));
    const size_t elem = stage.element_size();
    for (const auto& [file, pieces] : plans[i].by_file) {
      auto& reader = readers[file];
      if (!reader) reader = std::make_unique<SafetensorsReader>((path / file).string());
      for (const auto& [name, copies] : pieces) {
        const at::Tensor src = reader->read(name).reshape({-1}).to(stage.scalar_type()).contiguous();
        auto* dst_bytes = static_cast<char*>(stage.data_ptr());
        const auto* src_bytes = static_cast<const char*>(src.data_ptr());
        for (const Copy& c : copies) {
          MEGATORCH_CHECK(c.src + c.length <= src.numel(), "checkpoint shard '", file, "': tensor '", name,
                          "' is shorter than ", kMetadata, " says");
          std::memcpy(dst_bytes + c.dst * elem, src_bytes + c.src * elem, c.length * elem);
        }
      }
    }
    e.tensor.copy_(stage.view(e.tensor.sizes()));
  }
  return out;
}

}  // namespace megatorch::ckpt
