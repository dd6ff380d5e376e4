#pragma once
// The environment torchrun gives each worker, read and validated in one place.
#include <chrono>
#include <cstdint>
#include <string>

namespace megatorch::parallel {

struct LaunchEnv {
  int64_t rank = 0;              // RANK
  int64_t world_size = 1;        // WORLD_SIZE
  int64_t local_rank = 0;        // LOCAL_RANK (defaults to RANK)
  int64_t local_world_size = 1;  // LOCAL_WORLD_SIZE (defaults to WORLD_SIZE)
  std::string master_addr;       // MASTER_ADDR
  int64_t master_port = 0;       // MASTER_PORT
  // TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent hosts the store, every worker
  // (rank 0 included) connects as a client under /worker/attempt_<TORCHELASTIC_RESTART_COUNT>,
  // exactly as torch.distributed does, so a restarted worker never sees stale keys.
  bool use_agent_store = false;
  int64_t restart_count = 0;

  // Throws (with what was expected, what was found and how to launch) when a variable is
  // missing or garbled. Reads nothing else and connects to nothing.
  static LaunchEnv from_environment();
};

// MEGATORCH_COMM_TIMEOUT_S (seconds, > 0) if set, else 10 minutes.
std::chrono::milliseconds default_comm_timeout();

}  // namespace megatorch::parallel
