#include "megatorch/parallel/launch_env.h"

#include <cerrno>
#include <cstdlib>
#include <string>

#include "megatorch/check.h"

namespace megatorch::parallel {
namespace {

constexpr const char* kHowToLaunch =
    "; launch with `torchrun --nproc-per-node=N ...`, or set RANK, WORLD_SIZE, MASTER_ADDR and "
    "MASTER_PORT yourself";

const char* getenv_or_null(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

int64_t parse_int(const char* name, const char* value) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value, &end, 10);
  MEGATORCH_CHECK(errno == 0 && end != value && *end == '\0', "expected environment variable ", name,
                  " to be an integer, got '", value, "'", kHowToLaunch);
  return static_cast<int64_t>(v);
}

int64_t required_int(const char* name) {
  const char* v = getenv_or_null(name);
  MEGATORCH_CHECK(v != nullptr, "expected environment variable ", name, " (set by torchrun), but it is not set",
                  kHowToLaunch);
  return parse_int(name, v);
}

int64_t optional_int(const char* name, int64_t fallback) {
  const char* v = getenv_or_null(name);
  return v ? parse_int(name, v) : fallback;
}

}  // namespace

LaunchEnv LaunchEnv::from_environment() {
  LaunchEnv env;
  env.world_size = required_int("WORLD_SIZE");
  env.rank = required_int("RANK");
  MEGATORCH_CHECK(env.world_size >= 1, "expected WORLD_SIZE >= 1, got ", env.world_size, kHowToLaunch);
  MEGATORCH_CHECK(env.rank >= 0 && env.rank < env.world_size, "expected RANK in [0, WORLD_SIZE) = [0, ",
                  env.world_size, "), got ", env.rank, kHowToLaunch);
  env.local_rank = optional_int("LOCAL_RANK", env.rank);
  env.local_world_size = optional_int("LOCAL_WORLD_SIZE", env.world_size);
  MEGATORCH_CHECK(env.local_world_size >= 1 && env.local_rank >= 0 && env.local_rank < env.local_world_size,
                  "expected LOCAL_RANK in [0, LOCAL_WORLD_SIZE) = [0, ", env.local_world_size, "), got ",
                  env.local_rank, kHowToLaunch);
  const char* addr = getenv_or_null("MASTER_ADDR");
  MEGATORCH_CHECK(addr != nullptr, "expected environment variable MASTER_ADDR (set by torchrun), but it is not set",
                  kHowToLaunch);
  env.master_addr = addr;
  env.master_port = required_int("MASTER_PORT");
  MEGATORCH_CHECK(env.master_port >= 1 && env.master_port <= 65535, "expected MASTER_PORT in [1, 65535], got ",
                  env.master_port, kHowToLaunch);
  const char* agent = getenv_or_null("TORCHELASTIC_USE_AGENT_STORE");
  env.use_agent_store = agent && std::string(agent) == "True";
  env.restart_count = optional_int("TORCHELASTIC_RESTART_COUNT", 0);
  return env;
}

std::chrono::milliseconds default_comm_timeout() {
  const char* v = getenv_or_null("MEGATORCH_COMM_TIMEOUT_S");
  if (!v) return std::chrono::minutes(10);
  // At least 1 ms (a smaller one truncates to 0, which the backends read as no timeout),
  // at most ~2 years (6e7 s) so the nanoseconds NCCL's watchdog counts in fit int64; strtod
  // alone would take "inf" and "nan".
  constexpr double kMaxSeconds = 6e7;
  char* end = nullptr;
  errno = 0;
  const double s = std::strtod(v, &end);
  MEGATORCH_CHECK(end != v && *end == '\0' && errno == 0 && s >= 1e-3 && s <= kMaxSeconds,
                  "expected MEGATORCH_COMM_TIMEOUT_S to be a number of seconds in [0.001, ", kMaxSeconds, "], got '", v,
                  "'; unset it for the default (10 minutes, or --distributed-timeout-minutes)");
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

}  // namespace megatorch::parallel
