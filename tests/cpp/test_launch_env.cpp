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
    CHECK_THROWS_WITH(megatorch::parallel::default_comm_timeout(), Catch::Contains("positive number"));
  }
}
