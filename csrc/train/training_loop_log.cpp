// TrainingLoop's reporting (training_loop.h): the Megatron-style log line, the JSON log,
// the validation line, and the straggler summary of log_straggler.
#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "megatorch/check.h"
#include "megatorch/train/device_memory.h"
#include "megatorch/train/training_loop.h"

namespace megatorch::train {
namespace {

int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, rss = 0;
  f >> pages >> rss;
  return rss * 4096;
}

// log_straggler's summary of every rank's compute seconds.
struct Straggler {
  double min = 0, median = 0, max = 0;
  int64_t slowest = 0;
};
Straggler straggler_of(const std::vector<double>& seconds) {
  std::vector<double> sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double median = n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  const auto slowest = std::max_element(seconds.begin(), seconds.end()) - seconds.begin();
  return {sorted.front(), median, sorted.back(), static_cast<int64_t>(slowest)};
}
nlohmann::json straggler_json(const std::vector<double>& seconds) {
  const Straggler s = straggler_of(seconds);
  std::vector<double> ms;
  for (const double v : seconds) ms.push_back(v * 1e3);
  return {{"min_ms", s.min * 1e3}, {"median_ms", s.median * 1e3}, {"max_ms", s.max * 1e3},
          {"slowest_rank", s.slowest}, {"rank_ms", ms}};
}
std::string straggler_line(const std::vector<double>& seconds) {
  if (seconds.empty()) return "";
  const Straggler s = straggler_of(seconds);
  char buf[160];
  std::snprintf(buf, sizeof(buf), " | compute ms min/median/max: %.1f/%.1f/%.1f (slowest rank %ld)", s.min * 1e3,
                s.median * 1e3, s.max * 1e3, static_cast<long>(s.slowest));
  return buf;
}

std::string human(double bytes) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(1);
  if (bytes >= 1 << 30) {
    o << bytes / (1 << 30) << " GiB";
  } else {
    o << bytes / (1 << 20) << " MiB";
  }
  return o.str();
}

}  // namespace

void TrainingLoop::write_log_json(const nlohmann::json& record) {
  if (!json_.is_open()) return;
  json_ << record.dump() << "\n";
  json_.flush();
  // An append-only log is not renamed into place, but a lost line (a full disk) must
  // stop the run rather than leave a silently truncated log.
  MEGATORCH_CHECK(json_.good(), "writing the --log-json file '", options_.log_json(), "' failed: ", std::strerror(errno),
                  "; free space (or raise the file size limit) and resume from the last checkpoint");
}

void TrainingLoop::log(const IterationStats& s, const std::map<std::string, int64_t>& comm_bytes) {
  if (!is_logging_rank()) return;
  const int64_t gbs = global_batch_size();
  const double tokens_per_s = static_cast<double>(gbs * options_.tokens_per_sample()) / s.seconds;
  const double flops_per_token = options_.flops_per_token() ? options_.flops_per_token()(num_parameters_) : 0.0;
  const double tflops = tokens_per_s * flops_per_token / static_cast<double>(state_->world_size()) / 1e12;
  auto mem = optimizer_->memory_stats();
  if (expert_optimizer_) {
    for (const auto& [k, v] : expert_optimizer_->memory_stats()) mem[k] += v;
  }
  const int64_t rss = resident_bytes();
  const auto device_mem = device_memory_stats(state_->device());
  // The host's resident set on CPU; the allocator's peak on a GPU.
  const double shown = device_mem.empty() ? rss : device_mem.at("cuda_max_allocated_bytes");
  if (json_.is_open()) {
    nlohmann::json j{{"iteration", s.iteration},   {"loss", s.loss},
                     {"lr", s.lr},                 {"grad_norm", s.grad_norm},
                     {"loss_scale", s.loss_scale}, {"skipped", s.skipped},
                     {"tokens_per_s", tokens_per_s}, {"tflops_per_rank", tflops},
                     {"ms_per_iteration", s.seconds * 1e3}, {"host_ms_per_iteration", s.host_seconds * 1e3},
                     {"consumed_samples", s.iteration * gbs},
                     {"comm_bytes", comm_bytes}};
    nlohmann::json memory(mem);
    memory["rss_bytes"] = rss;
    for (const auto& [k, v] : device_mem) memory[k] = v;
    j["memory_bytes"] = memory;
    if (last_val_loss_ >= 0) j["val_loss"] = last_val_loss_;
    if (!s.rank_compute_seconds.empty()) j["straggler"] = straggler_json(s.rank_compute_seconds);
    if (!s.rerun.empty()) j["rerun"] = s.rerun;
    if (!s.moe.empty()) j["moe"] = s.moe.to_json();
    write_log_json(j);
  }
  const int64_t iters = options_.train_iters();
  if (s.iteration % options_.log_interval() == 0 || s.iteration == iters) {
    std::printf("\r [%s] iteration %6ld/%6ld | consumed samples: %9ld | elapsed time per iteration (ms): %.1f | "
                "learning rate: %.3E | %s: %.6E | loss scale: %.1f | grad norm: %.3f | skipped: %d | "
                "tokens/s: %.0f | TFLOP/s per rank: %.4f | memory: %s (optimizer %s)%s%s\n",
                "megatorch", s.iteration, iters, s.iteration * gbs, s.seconds * 1e3, s.lr,
                options_.loss_name().c_str(), s.loss, s.loss_scale, s.grad_norm, s.skipped ? 1 : 0, tokens_per_s,
                tflops, human(shown).c_str(), human(mem.at("total_bytes")).c_str(), s.moe.line().c_str(),
                straggler_line(s.rank_compute_seconds).c_str());
  } else {
    std::printf("\r  iteration %ld/%ld  loss %.4f  %.0f ms ", s.iteration, iters, s.loss, s.seconds * 1e3);
  }
  std::fflush(stdout);
}

void TrainingLoop::log_validation() {
  const std::string& name = options_.loss_name();
  std::printf(" validation loss at iteration %ld | %s value: %.6E", iteration_, name.c_str(), last_val_loss_);
  if (options_.log_perplexity()) std::printf(" | %s PPL: %.3f", name.c_str(), std::exp(last_val_loss_));
  std::printf("\n");
  std::fflush(stdout);
}

}  // namespace megatorch::train
