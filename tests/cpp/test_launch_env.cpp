#include <catch2/catch.hpp>
#include <megatorch/parallel/launch_env.h>

#include <cstdlib>
#include <map>

using megatorch::parallel::LaunchEnv;

namespace {
// Sets torchrun's variables for one test and restores a clean slate afterwards.
struct ScopedEnv {
  explicit ScopedEnv(const std::map<std::string, std::string>& vars) {
    for (const char* k : kVars) unsetenv(k);
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const char* k : kVars) unsetenv(k);
  }
  static constexpr const char* kVars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                          "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                                          "TORCHELASTIC_RESTART_COUNT", "MEGATORCH_COMM_TIMEOUT_S"};
};
const std::map<std::string, std::string> kGood{{"RANK", "3"},        {"WORLD_SIZE", "8"},
                                               {"LOCAL_RANK", "1"},  {"LOCAL_WORLD_SIZE", "2"},
                                               {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}};
std::map<std::string, std::string> with(std::map<std::string, std::string> m, const std::string& k,
                                        const std::string& v) {
  if (v.empty()) m.erase(k); else m[k] = v;
  return m;
}
}  // namespace

TEST_CASE("torchrun's environment is read", "[env]") {
  ScopedEnv env(with(with(kGood, "TORCHELASTIC_USE_AGENT_STORE", "True"), "TORCHELASTIC_RESTART_COUNT", "2"));
  const LaunchEnv e = LaunchEnv::from_environment();
  CHECK(e.rank == 3);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 2);
  CHECK(e.master_addr == "h");
  CHECK(e.master_port == 29500);
  CHECK(e.use_agent_store);
  CHECK(e.restart_count == 2);
}

TEST_CASE("missing or garbled launch variables are clear errors", "[env]") {
  {
    ScopedEnv env(with(kGood, "RANK", ""));
    CHECK_THROWS_WITH(LaunchEnv::from_environment(), Catch::Contains("RANK (set by torchrun)") && Catch::Contains("torchrun"));
  }
  {
    ScopedEnv env(with(kGood, "WORLD_SIZE", "four"));
    CHECK_THROWS_WITH(LaunchEnv::from_environment(), Catch::Contains("WORLD_SIZE to be an integer, got 'four'"));
  }
  {
    ScopedEnv env(with(kGood, "RANK", "8"));
    CHECK_THROWS_WITH(LaunchEnv::from_environment(), Catch::Contains("RANK in [0, WORLD_SIZE) = [0, 8), got 8"));
  }
  {
    ScopedEnv env(with(kGood, "MASTER_PORT", "70000"));
    CHECK_THROWS_WITH(LaunchEnv::from_environment(), Catch::Contains("MASTER_PORT in [1, 65535], got 70000"));
  }
  {
    ScopedEnv env(with(kGood, "MASTER_ADDR", ""));
    CHECK_THROWS_WITH(LaunchEnv::from_environment(), Catch::Contains("MASTER_ADDR"));
  }
  {
    ScopedEnv env(with(kGood, "LOCAL_RANK", "5"));
    CHECK_THROWS_WITH(LaunchEnv::from_environment(), Catch::Contains("LOCAL_RANK in [0, LOCAL_WORLD_SIZE)"));
  }
}

TEST_CASE("comm timeout: 10 minutes unless MEGATORCH_COMM_TIMEOUT_S says otherwise", "[env]") {
  {
    ScopedEnv env(std::map<std::string, std::string>{});
    CHECK(megatorch::parallel::default_comm_timeout() == std::chrono::minutes(10));
  }
  {
    ScopedEnv env(std::map<std::string, std::string>{{"MEGATORCH_COMM_TIMEOUT_S", "2.5"}});
    CHECK(megatorch::parallel::default_comm_timeout() == std::chrono::milliseconds(2500));
  }
  {
    ScopedEnv env(std::map<std::string, std::string>{{"MEGATORCH_COMM_TIMEOUT_S", "-1"}});
    CHECK_THROWS_WITH(megatorch::parallel::default_comm_timeout(), Catch::Contains("MEGATORCH_COMM_TIMEOUT_S to be a number of seconds in [0.001,"));
  }
}

// ---- device selection: a pure function of the request, LOCAL_RANK, LOCAL_WORLD_SIZE and
// the GPU count, so every GPU case is checked here without a GPU.
#include <megatorch/parallel/device_selection.h>

using megatorch::parallel::choose_device;

TEST_CASE("device selection: auto, cpu, cuda, cuda:N and the backend", "[env][device]") {
  // auto: the GPU of LOCAL_RANK and NCCL when GPUs are visible, else the CPU and Gloo.
  auto c = choose_device("auto", "auto", 3, 8, 8);
  CHECK(c.device == c10::Device(c10::kCUDA, 3));
  CHECK(c.backend == "nccl");
  c = choose_device("auto", "auto", 3, 8, 0);
  CHECK(c.device.is_cpu());
  CHECK(c.backend == "gloo");
  c = choose_device("cpu", "auto", 0, 8, 8);
  CHECK(c.device.is_cpu());
  c = choose_device("cuda", "gloo", 1, 2, 2);
  CHECK(c.device == c10::Device(c10::kCUDA, 1));
  CHECK(c.backend == "gloo");
  // Four ranks sharing GPU 0 through Gloo (NCCL would refuse them).
  c = choose_device("cuda:0", "gloo", 3, 4, 1);
  CHECK(c.device == c10::Device(c10::kCUDA, 0));
  CHECK(c.backend == "gloo");
  // One rank per node pinned to a GPU may use NCCL.
  c = choose_device("cuda:1", "auto", 0, 1, 2);
  CHECK(c.device == c10::Device(c10::kCUDA, 1));
  CHECK(c.backend == "nccl");
}

TEST_CASE("device selection refuses launches that cannot work, alike on every rank of a node", "[env][device]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(choose_device("cuda", "auto", 0, 1, 0), Contains("no CUDA device is visible"));
  CHECK_THROWS_WITH(choose_device("cuda:0", "gloo", 0, 1, 0), Contains("no CUDA device is visible"));
  // 4 ranks on a 2-GPU node: ranks 0 and 1 would find a GPU, but all four fail together.
  for (int64_t local_rank = 0; local_rank < 4; ++local_rank) {
    CHECK_THROWS_WITH(choose_device("cuda", "auto", local_rank, 4, 2),
                      Contains("each of the 4 ranks of this node on its own GPU") && Contains("only 2 GPU(s)") &&
                          Contains("LOCAL_RANK 2..3"));
  }
  CHECK_THROWS_WITH(choose_device("auto", "auto", 0, 4, 2), Contains("only 2 GPU(s)"));
  CHECK_THROWS_WITH(choose_device("cuda:0", "nccl", 1, 4, 1), Contains("NCCL refuses two ranks on one device"));
  CHECK_THROWS_WITH(choose_device("cuda:0", "auto", 1, 4, 1), Contains("--distributed-backend gloo"));
  CHECK_THROWS_WITH(choose_device("cuda:5", "gloo", 0, 1, 2), Contains("names GPU 5") && Contains("2 visible GPU(s)"));
  CHECK_THROWS_WITH(choose_device("cuda:x", "gloo", 0, 1, 2), Contains("expected --device cuda:N"));
  CHECK_THROWS_WITH(choose_device("tpu", "auto", 0, 1, 2), Contains("expected --device auto, cpu, cuda or cuda:N, got 'tpu'"));
  CHECK_THROWS_WITH(choose_device("cpu", "nccl", 0, 1, 2), Contains("--distributed-backend nccl needs CUDA tensors"));
  CHECK_THROWS_WITH(choose_device("cpu", "mpi", 0, 1, 2), Contains("expected --distributed-backend auto, nccl or gloo"));
}
