#pragma once
// Sharded checkpoints: every rank writes its own pieces (ShardedEntry) to one safetensors
// file, rank 0 writes metadata.json describing every global tensor (logical shape, and
// for each piece its TP split, element range and file), the model configuration and the
// caller's states. Load reassembles each entry of ANY layout from whichever saved pieces
// overlap it, so TP, PP, DP and ZeRO sharding may all differ from the saving run.
//
//   <dir>/latest_checkpointed_iteration.txt   the iteration of the last complete save
//   <dir>/iter_0000100/metadata.json           written last inside the directory
//   <dir>/iter_0000100/rank_00003.safetensors  one per rank that holds pieces to write
//
// Atomic: a save is written under iter_XXXXXXX.tmp, every file and the directory are
// fsync'd, the directory is renamed into place, and only then is the `latest` file
// replaced (by rename); saving an iteration again swaps the directories atomically
// (renameat2 RENAME_EXCHANGE; two renames where the filesystem lacks it). A save killed at
// any point leaves the previous checkpoint loadable, and the next save clears its
// leftovers (iter_*.tmp*, iter_*.old). While saving, the coordinating rank (0) holds
// <dir>/.megatorch_save.lock (O_EXCL, {"host", "pid"}): a second saver into the same
// directory is refused naming the owner; a lock whose pid is gone on this host is taken
// over; one from another host must be removed by hand. Load validates everything (keys, shapes, model configuration, files, CRC-32
// checksums, coverage) on every rank and agrees over the group before any tensor changes.
#include <torch/arg.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/ckpt/sharded_entry.h"

namespace megatorch::ckpt {

// What a checkpoint carries besides tensors; all opaque JSON from the caller.
struct CheckpointState {
  // The model's architecture (e.g. gpt_config_json); LoadOptions::model_config is
  // compared with it before anything loads.
  nlohmann::json model_config;
  // Run-wide (iteration counters, loss scaler, data-iterator position): rank 0's is kept.
  nlohmann::json state;
  // This rank's own (RNG states); every rank's is kept, by global rank.
  nlohmann::json rank_state;
};

// Writes `entries` (those with write = true) as checkpoint `iteration` under `dir`.
// `group` names the group of every rank taking part (usually the world), "" for a single
// process. Collective over the group; it returns once the checkpoint is published.
void save_checkpoint(const std::string& dir, int64_t iteration, const std::vector<ShardedEntry>& entries,
                     const CheckpointState& state, const std::string& group = "");

struct AsyncSaveOptions {
  // Fault injection for tests: the writer sleeps this long before writing (a slow disk),
  // so a kill can land while it writes.
  TORCH_ARG(std::chrono::milliseconds, write_delay) = std::chrono::milliseconds(0);
};

// save_checkpoint with the writing in the background (Megatron's --async-save, DCP's
// async_save). The constructor checks the entries and takes the directory's lock
// (collective, as save_checkpoint's first step), copies this rank's pieces to host
// memory (pinned from a GPU) and starts a writer thread: the caller may change the
// tensors as soon as it returns. finish() waits for this rank's writer, then publishes
// exactly as save_checkpoint does (metadata.json, rename, `latest`; collective), so
// `latest` moves only once every rank's file is complete; a writer's error fails every
// rank there. Destroyed unfinished (an exception elsewhere), the save is abandoned:
// `latest` keeps naming the previous checkpoint and the next save clears the leftovers.
// The writer thread does file I/O only; every collective runs on the calling thread.
class AsyncSave {
 public:
  AsyncSave(const std::string& dir, int64_t iteration, const std::vector<ShardedEntry>& entries,
            const CheckpointState& state, const std::string& group = "", const AsyncSaveOptions& options = {});
  ~AsyncSave();
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;

  int64_t iteration() const;
  // This rank's writer is done (no collective).
  bool written_here() const;
  // Every rank's writer is done: one small all-reduce over the group, so every rank gets
  // the same answer and may call finish() together without waiting.
  bool written_everywhere();
  void finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct LoadOptions {
  TORCH_ARG(int64_t, iteration) = -1;  // -1: the one `latest` names
  // Fields that must equal the checkpoint's model_config (e.g. gpt_shape_json); null: none.
  TORCH_ARG(nlohmann::json, model_config) = nullptr;
  TORCH_ARG(std::string, group) = "";  // as for save_checkpoint
};

struct LoadedCheckpoint {
  int64_t iteration = -1;
  std::string path;     // the iteration's directory
  int64_t world_size = 1;  // of the saving run
  // state and model_config as saved; rank_state is this rank's when the saving run had
  // the same world size, else null (its RNG states mean nothing in another layout).
  CheckpointState state;
  std::vector<nlohmann::json> rank_states;  // every saving rank's
};

// Fills every entry's tensor from checkpoint `dir`. Collective over options.group.
LoadedCheckpoint load_checkpoint(const std::string& dir, std::vector<ShardedEntry>& entries,
                                 const LoadOptions& options = {});

// "iter_0000100", Megatron's directory name.
std::string iteration_dirname(int64_t iteration);
// The iteration `latest` names; -1 when `dir` holds no checkpoint. When that iteration's
// directory is missing or has no metadata.json (a crashed save, a deletion), the newest
// complete iteration directory instead (load_checkpoint warns on stderr); none: an error
// naming both `latest` and the missing directory.
int64_t latest_iteration(const std::string& dir);
// The parsed metadata.json of an iteration (-1: the latest).
nlohmann::json read_metadata(const std::string& dir, int64_t iteration = -1);
// Every tensor of an iteration (-1: the latest) whose key starts with `prefix`, assembled
// whole in this process in the saved dtype, by key ("model/layers.0.mlp.fc1.weight", "optim/grad/..."):
// for tools that compare or inspect checkpoints, whatever layout saved them.
std::map<std::string, at::Tensor> read_tensors(const std::string& dir, const std::string& prefix = "",
                                               int64_t iteration = -1);

}  // namespace megatorch::ckpt
