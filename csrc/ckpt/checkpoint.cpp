#include "megatorch/ckpt/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "megatorch/check.h"
#include "megatorch/ckpt/crc32.h"
#include "megatorch/ckpt/safetensors.h"
#include "megatorch/comm/gather_strings.h"
#include "megatorch/comm/group.h"
#include "megatorch/io/atomic_file.h"
#include "checkpoint_dir.h"
#include "checkpoint_metadata.h"

namespace megatorch::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace checkpoint_dir;
using namespace checkpoint_metadata;

namespace {

constexpr const char* kLatest = "latest_checkpointed_iteration.txt";
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
  if (error) MEGATORCH_FAIL(without_error_prefix(*error));
  MEGATORCH_CHECK(failed == 0, what, " failed on another rank (its error says why); nothing was changed here");
}

std::vector<std::string> all_gather_strings(Ranks& r, const std::string& s) {
  return r.group ? comm::all_gather_strings(*r.group, s) : std::vector<std::string>{s};
}

std::string rank_filename(int64_t rank) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "rank_%05lld.safetensors", static_cast<long long>(rank));
  return buf;
}

int64_t latest_iteration_noting(const std::string& dir, std::string* note);

// `note`: set when `latest` named an iteration that is not there and another was chosen.
fs::path resolve_iteration_dir(const fs::path& dir, int64_t& iteration, std::string* note = nullptr) {
  if (iteration < 0) {
    iteration = latest_iteration_noting(dir.string(), note);
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
  // Fields added after checkpoints were first written whose old behaviour is not off / 0.
  static const json kLaterDefaults = {{"rotary_percent", 1.0}, {"rope_scaling", {{"rope_type", "default"}}},
                                      {"layer_types", json::array()}};
  std::string out;
  for (const auto& [k, v] : want.items()) {
    const bool saved = have.is_object() && have.contains(k);
    // A field added after the checkpoint was written: its absence means the old default
    // (off / 0, or kLaterDefaults'), so older checkpoints keep loading into models that leave it so.
    if (!saved && (v == false || v == 0 || (kLaterDefaults.contains(k) && kLaterDefaults.at(k) == v))) continue;
    const json h = saved ? have.at(k) : json();
    if (h != v) out += (out.empty() ? "" : "; ") + k + ": checkpoint " + h.dump() + ", model " + v.dump();
  }
  return out;
}

// What load will do for one entry: for each file, the pieces to read and their copies.
struct Source {
  std::string name;  // the tensor in the file
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;  // elements metadata.json says it has (checked against the file)
  std::vector<Copy> copies;
};
struct Plan {
  std::map<std::string, std::vector<Source>> by_file;
};

}  // namespace

std::string iteration_dirname(int64_t iteration) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "iter_%07lld", static_cast<long long>(iteration));
  return buf;
}

int64_t latest_iteration(const std::string& dir) { return latest_iteration_noting(dir, nullptr); }

namespace {

int64_t latest_iteration_noting(const std::string& dir, std::string* note) {
  const fs::path path = fs::path(dir) / kLatest;
  if (!fs::exists(path)) return -1;
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  // Digits only (no sign, at most 18 so stoll cannot overflow): what save_checkpoint writes.
  const bool number = !text.empty() && text.size() <= 18 &&
                      std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
  MEGATORCH_CHECK(number, "'", path.string(), "' should hold the iteration number of the last complete save (",
                  "digits, as save_checkpoint writes them), holds ", json(text.substr(0, 64)).dump(-1, ' ', false, json::error_handler_t::replace),
                  text.size() > 64 ? "..." : "", "; write the right iteration into it, or load an iteration ",
                  "explicitly");
  const int64_t named = std::stoll(text);
  // A save that crashed between replacing an iteration and writing `latest`, or a
  // directory deleted by hand, leaves `latest` naming nothing loadable: fall back to the
  // newest complete iteration rather than fail a resumable run.
  const fs::path named_dir = fs::path(dir) / iteration_dirname(named);
  if (complete_iteration(named_dir)) return named;
  const char* what = fs::is_directory(named_dir) ? " has no metadata.json (an unfinished save)" : " does not exist";
  const int64_t found = newest_complete_iteration(dir, named);
  MEGATORCH_CHECK(found >= 0, "'", path.string(), "' names iteration ", named, ", but '", named_dir.string(), "'",
                  what, " and '", dir, "' holds no other complete iteration directory; restore that directory, ",
                  "or write the iteration of one that exists into '", path.string(), "'");
  if (note != nullptr) {
    *note = "'" + path.string() + "' names iteration " + std::to_string(named) + ", but '" + named_dir.string() + "'" +
            what + "; using " + iteration_dirname(found) + ", the newest complete one";
  }
  return found;
}

}  // namespace

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
  const bool ours = meta.is_object() && meta.contains("format") && meta["format"] == "megatorch-checkpoint" &&
                    meta.contains("version") && meta["version"] == kFormatVersion;
  MEGATORCH_CHECK(ours, "'", path.string(), "' is not a megatorch checkpoint of format version ", kFormatVersion,
                  " (expected an object with \"format\": \"megatorch-checkpoint\" and \"version\": ", kFormatVersion,
                  ")");
  return meta;
}

std::map<std::string, at::Tensor> read_tensors(const std::string& dir, const std::string& prefix, int64_t iteration) {
  const json meta = read_metadata(dir, iteration);
  std::vector<ShardedEntry> entries;
  for (const auto& [key, t] : meta.at("tensors").items()) {
    if (key.rfind(prefix, 0) != 0) continue;
    ShardedEntry e;
    e.key = key;
    e.spec.full_shape = t.at("shape").get<std::vector<int64_t>>();
    e.tensor = at::empty(e.spec.full_shape, at::TensorOptions().dtype(scalar_type_from_safetensors(
                                                  t.at("pieces").at(0).at("dtype").get<std::string>())));
    entries.push_back(std::move(e));
  }
  load_checkpoint(dir, entries, LoadOptions().iteration(meta.at("iteration").get<int64_t>()));
  std::map<std::string, at::Tensor> out;
  for (auto& e : entries) out.emplace(e.key, std::move(e.tensor));
  return out;
}

namespace {

// A save's three steps. 1. Check the entries; rank 0, which coordinates the save, takes
// the directory's lock (held until the save is published or abandoned) and clears what
// failed saves left behind. Failing to take the lock fails every rank through agree().
std::unique_ptr<SaveLock> begin_save(Ranks& r, const fs::path& root, int64_t iteration,
                                     const std::vector<ShardedEntry>& entries) {
  std::unique_ptr<SaveLock> lock;
  const auto error = capture([&] {
    MEGATORCH_CHECK(iteration >= 0, "save_checkpoint: expected an iteration >= 0, got ", iteration);
    // A rank writes at most one piece of a tensor. It may hold more copies without writing
    // them: a tie whose copies share a rank (the V layout's embedding and head on rank 0).
    std::set<std::string> keys;
    for (const auto& e : entries) {
      validate_entry(e);
      MEGATORCH_CHECK(!e.write || keys.insert(e.key).second, "save_checkpoint: key '", e.key,
                      "' is written twice on rank ", r.rank, "; each rank writes at most one piece of a tensor "
                      "(set write = false on the other copies)");
    }
    if (r.rank == 0) {
      fs::create_directories(root);
      lock = std::make_unique<SaveLock>(root, iteration);
      clear_failed_saves(root);
      fs::create_directories(root / (iteration_dirname(iteration) + ".tmp"));
    }
  });
  agree(r, error, "save_checkpoint (checking entries)");
  return lock;
}

// 2. This rank writes its pieces into the temporary directory and describes them (no
// collective: the asynchronous save runs it on a writer thread).
json write_rank_pieces(int64_t rank, const fs::path& tmp_dir, const std::vector<ShardedEntry>& entries,
                       const json& rank_state) {
  json desc = {{"rank", rank}, {"file", nullptr}, {"pieces", json::array()}, {"held", json::array()},
               {"rank_state", rank_state}};
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
    const std::string file = rank_filename(rank);
    const WrittenFile w = write_safetensors((tmp_dir / file).string(), tensors, {{"format", "megatorch-shard"}});
    desc["file"] = file;
    desc["bytes"] = w.bytes;
    desc["crc32"] = w.crc32;
  }
  return desc;
}

// 3. Every rank learns whether any write failed; rank 0 writes the metadata and
// publishes: rename, then `latest`. Every rank checks the assembled table, so a bad
// layout fails everywhere with the same message.
void publish_save(Ranks& r, const fs::path& root, int64_t iteration, const CheckpointState& state,
                  const std::optional<std::string>& write_error, const json& desc) {
  agree(r, write_error, "save_checkpoint (writing shards)");
  const fs::path final_dir = root / iteration_dirname(iteration);
  const fs::path tmp_dir = root / (iteration_dirname(iteration) + ".tmp");
  std::vector<json> ranks;
  for (const auto& s : all_gather_strings(r, desc.dump())) ranks.push_back(json::parse(s));
  const auto error = capture([&] {
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
    io::write_file_atomically((tmp_dir / kMetadata).string(), meta.dump(1));
    fsync_dir(tmp_dir);
    const fs::path old_dir = root / (iteration_dirname(iteration) + ".old");
    if (!fs::exists(final_dir)) {
      fs::rename(tmp_dir, final_dir);
      fsync_dir(root);
    } else if (::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      // Saving the same iteration again: one atomic swap, so the iteration `latest` may
      // name is never missing; tmp_dir now holds the old one.
      fsync_dir(root);
      remove_tree(tmp_dir);
    } else {
      // A filesystem without the swap (NFS): two renames. A crash between them leaves
      // only iter_N.old, which the next save puts back (clear_failed_saves) and a load
      // meanwhile replaces by the newest complete iteration.
      MEGATORCH_CHECK(errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP, "cannot replace '",
                      final_dir.string(), "' by '", tmp_dir.string(), "': ", std::strerror(errno));
      remove_tree(old_dir);
      fs::rename(final_dir, old_dir);
      fs::rename(tmp_dir, final_dir);
      fsync_dir(root);
      remove_tree(old_dir);
    }
    io::write_file_atomically((root / kLatest).string(), std::to_string(iteration) + "\n");
  });
  agree(r, error, "save_checkpoint (publishing)");
}

// A copy the training step cannot change: host memory (pinned from a GPU, so the copy
// is a DMA), contiguous.
at::Tensor host_copy(const at::Tensor& t) {
  const auto options = at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU).pinned_memory(t.is_cuda());
  at::Tensor out = at::empty(t.sizes(), options);
  out.copy_(t.detach());
  return out;
}

}  // namespace

void save_checkpoint(const std::string& dir, int64_t iteration, const std::vector<ShardedEntry>& entries,
                     const CheckpointState& state, const std::string& group) {
  Ranks r(group);
  const fs::path root(dir);
  const auto lock = begin_save(r, root, iteration, entries);
  json desc;
  const auto error = capture([&] {
    desc = write_rank_pieces(r.rank, root / (iteration_dirname(iteration) + ".tmp"), entries, state.rank_state);
  });
  publish_save(r, root, iteration, state, error, desc);
}

struct AsyncSave::Impl {
  Ranks ranks;
  fs::path root;
  int64_t iteration = 0;
  CheckpointState state;
  std::unique_ptr<SaveLock> lock;
  std::vector<ShardedEntry> entries;  // their tensors: host copies
  json desc;
  std::optional<std::string> error;
  std::atomic<bool> written{false};
  std::thread writer;
  bool finished = false;
  explicit Impl(const std::string& group) : ranks(group) {}
};

AsyncSave::AsyncSave(const std::string& dir, int64_t iteration, const std::vector<ShardedEntry>& entries,
                     const CheckpointState& state, const std::string& group, const AsyncSaveOptions& options)
    : impl_(std::make_unique<Impl>(group)) {
  Impl& s = *impl_;
  s.root = dir;
  s.iteration = iteration;
  s.state = state;
  s.lock = begin_save(s.ranks, s.root, iteration, entries);
  // A failed copy (host memory exhausted) is reported at finish(), on every rank, as a
  // writer's error is: the ranks stay in step.
  s.error = capture([&] {
    for (const auto& e : entries) {
      ShardedEntry copy = e;
      // What is not written here is only named in the description.
      copy.tensor = e.write ? host_copy(e.tensor) : at::Tensor();
      s.entries.push_back(std::move(copy));
    }
  });
  if (s.error) {
    s.entries.clear();
    s.written = true;
    return;
  }
  const auto delay = options.write_delay();
  s.writer = std::thread([&s, delay] {
    s.error = capture([&] {
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      s.desc = write_rank_pieces(s.ranks.rank, s.root / (iteration_dirname(s.iteration) + ".tmp"), s.entries,
                                 s.state.rank_state);
    });
    s.entries.clear();  // the host copies go as soon as they are on disk
    s.written = true;
  });
}

AsyncSave::~AsyncSave() {
  // Unpublished (an error elsewhere): the writer is joined; its iter_N.tmp is cleared by
  // the next save, and `latest` still names the previous checkpoint.
  if (impl_ && impl_->writer.joinable()) impl_->writer.join();
}

int64_t AsyncSave::iteration() const { return impl_->iteration; }

bool AsyncSave::written_here() const { return impl_->written; }

bool AsyncSave::written_everywhere() {
  Impl& s = *impl_;
  MEGATORCH_CHECK(!s.finished, "AsyncSave: iteration ", s.iteration, " was already published");
  int64_t pending = s.written ? 0 : 1;
  if (s.ranks.group) {
    at::Tensor flag = at::full({1}, pending, at::kLong);
    s.ranks.group->all_reduce(flag, comm::ReduceOp::kMax);
    pending = flag.item<int64_t>();
  }
  return pending == 0;
}

void AsyncSave::finish() {
  Impl& s = *impl_;
  MEGATORCH_CHECK(!s.finished, "AsyncSave: iteration ", s.iteration, " was already published");
  s.finished = true;
  if (s.writer.joinable()) s.writer.join();
  publish_save(s.ranks, s.root, s.iteration, s.state, s.error, s.desc);
  s.lock.reset();
}

LoadedCheckpoint load_checkpoint(const std::string& dir, std::vector<ShardedEntry>& entries,
                                 const LoadOptions& options) {
  Ranks r(options.group());
  LoadedCheckpoint out;
  std::vector<Plan> plans(entries.size());
  fs::path path;
  std::string note;  // `latest` named a missing iteration and another was chosen
  // 1. Validate everything: metadata, model configuration, keys, shapes, every field of
  // every piece used, coverage, files and their headers. Nothing below step 2 can fail on
  // what metadata.json or a shard says, so a refused load leaves the weights unchanged.
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers;
  auto error = capture([&] {
    int64_t iteration = options.iteration();
    path = resolve_iteration_dir(dir, iteration, &note);
    const json meta = read_metadata(dir, iteration);
    const MetaFile m{(path / kMetadata).string()};
    out.iteration = iteration;
    out.path = path.string();
    out.world_size = m.integer(meta, "world_size", "top level");
    out.state.model_config = m.member(meta, "model_config", "top level");
    out.state.state = m.member(meta, "state", "top level");
    for (const auto& s : m.array(meta, "rank_states", "top level")) out.rank_states.push_back(s);
    if (out.world_size == r.size && r.rank < static_cast<int64_t>(out.rank_states.size())) {
      out.state.rank_state = out.rank_states[r.rank];
    }
    if (!options.model_config().is_null()) {
      const std::string diff = config_differences(meta.at("model_config"), options.model_config());
      MEGATORCH_CHECK(diff.empty(), "checkpoint '", path.string(), "' is of another model (", diff,
                      "); load it into a model built with the checkpoint's configuration");
    }
    const json& tensors = m.object(meta, "tensors", "top level");
    std::set<std::string> files_needed;
    for (size_t i = 0; i < entries.size(); ++i) {
      const ShardedEntry& e = entries[i];
      validate_entry(e);
      MEGATORCH_CHECK(tensors.contains(e.key), "checkpoint '", path.string(), "' has no tensor '", e.key,
                      "'; was it saved from another kind of model?");
      const std::string where = "tensors[" + json(e.key).dump() + "]";
      const json& t = m.object(tensors, e.key, "tensors");
      const auto saved_shape = m.shape(t, "shape", where);
      MEGATORCH_CHECK(saved_shape == logical_shape(e), "checkpoint '", path.string(), "': '", e.key, "' has shape ",
                      c10::IntArrayRef(saved_shape), ", the model's is ", c10::IntArrayRef(logical_shape(e)),
                      "; the checkpoint is of another model shape");
      const std::vector<Run> want = entry_runs(e);
      int64_t wanted = 0;
      for (const Run& run : want) wanted += run.length;
      std::vector<std::pair<int64_t, int64_t>> filled;  // (destination, length) of every copy
      const json& pieces = m.array(t, "pieces", where);
      for (size_t j = 0; j < pieces.size(); ++j) {
        const SavedPiece piece = read_piece(m, e.key, saved_shape, pieces[j], where + ".pieces[" + std::to_string(j) + "]");
        std::vector<Copy> copies = overlap(want, entry_runs(piece.entry));
        if (copies.empty()) continue;
        for (const Copy& c : copies) filled.emplace_back(c.dst, c.length);
        plans[i].by_file[piece.file].push_back(
            {piece.name, piece.dtype, piece.entry.end - piece.entry.begin, std::move(copies)});
        files_needed.insert(piece.file);
      }
      // Every element this rank needs exactly once: two pieces claiming the same elements
      // could otherwise hide a gap from a plain count.
      std::sort(filled.begin(), filled.end());
      int64_t covered = 0, next = 0;
      for (const auto& [dst, length] : filled) {
        MEGATORCH_CHECK(dst >= next, "checkpoint '", path.string(), "': pieces of '", e.key, "' in ", kMetadata,
                        " overlap (element ", dst, " of this rank's part is in two); its metadata is damaged");
        next = dst + length;
        covered += length;
      }
      MEGATORCH_CHECK(covered == wanted, "checkpoint '", path.string(), "': only ", covered, " of the ", wanted,
                      " elements of '", e.key, "' this rank needs are in the checkpoint; its metadata is damaged");
    }
    const json& files = m.object(meta, "files", "top level");
    for (const auto& f : files_needed) {
      const fs::path fp = path / f;
      MEGATORCH_CHECK(files.contains(f), "checkpoint '", path.string(), "': ", f, " is not listed in ", kMetadata);
      MEGATORCH_CHECK(fs::is_regular_file(fp), "checkpoint '", path.string(), "' is missing shard ", f,
                      " (written by the saving run's rank of that number); copy the whole checkpoint directory");
      const std::string where = "files[" + json(f).dump() + "]";
      const int64_t bytes = m.integer(files.at(f), "bytes", where);
      const int64_t want_crc = m.integer(files.at(f), "crc32", where);
      if (want_crc < 0 || want_crc > 0xFFFFFFFFLL) m.fail(where + ".crc32", "expected a CRC-32 (0..4294967295), got " + std::to_string(want_crc));
      MEGATORCH_CHECK(static_cast<int64_t>(fs::file_size(fp)) == bytes, "checkpoint shard '", fp.string(), "' has ",
                      fs::file_size(fp), " bytes, ", kMetadata, " says ", bytes, "; the file is truncated or damaged");
      const uint32_t crc = file_crc32(fp.string());
      MEGATORCH_CHECK(crc == static_cast<uint32_t>(want_crc), "checkpoint shard '", fp.string(),
                      "' fails its checksum (CRC-32 ", crc, ", expected ", want_crc, "); the file is damaged");
      // The header now, so the copy below finds every tensor where metadata.json says.
      auto& reader = readers[f];
      reader = std::make_unique<SafetensorsReader>(fp.string());
      for (const Plan& plan : plans) {
        const auto it = plan.by_file.find(f);
        if (it == plan.by_file.end()) continue;
        for (const Source& src : it->second) {
          MEGATORCH_CHECK(reader->contains(src.name), "checkpoint shard '", fp.string(), "' has no tensor '", src.name,
                          "', which ", kMetadata, " places there; the checkpoint is damaged");
          const TensorInfo& info = reader->info(src.name);
          MEGATORCH_CHECK(info.dtype == src.dtype && numel_of(info.shape) == src.numel, "checkpoint shard '",
                          fp.string(), "': tensor '", src.name, "' is ", safetensors_dtype(info.dtype), " ",
                          c10::IntArrayRef(info.shape), ", ", kMetadata, " says ", safetensors_dtype(src.dtype), " of ",
                          src.numel, " elements; the checkpoint is damaged");
        }
      }
    }
  });
  agree(r, error, "load_checkpoint (validating '" + dir + "')");
  // The library has no logger: say it once, on stderr, so the operator sees the fallback.
  if (!note.empty() && r.rank == 0) std::fprintf(stderr, "megatorch: warning: %s\n", note.c_str());

  // 2. Copy: each entry assembled in a CPU staging tensor of its dtype (padding zero).
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < entries.size(); ++i) {
    ShardedEntry& e = entries[i];
    at::Tensor stage = at::zeros({e.tensor.numel()}, at::TensorOptions().dtype(e.tensor.scalar_type()));
    const size_t elem = stage.element_size();
    for (const auto& [file, pieces] : plans[i].by_file) {
      const auto& reader = readers.at(file);
      for (const auto& [name, dtype, numel, copies] : pieces) {
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
