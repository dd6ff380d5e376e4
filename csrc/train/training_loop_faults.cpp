// TrainingLoop's fault tolerance (training_loop.h): stopping every rank together on a
// signal, an interval or a clock; the NaN / Inf check before the optimizer step; the
// straggler report; the fault injection's hooks (fault_injection.h).
#include <ATen/ATen.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

#include "exit_signals.h"
#include "megatorch/check.h"
#include "megatorch/comm/gather_strings.h"
#include "megatorch/comm/group.h"
#include "megatorch/train/training_loop.h"

namespace megatorch::train {

namespace exit_signals {
namespace {

volatile sig_atomic_t g_received = 0;
std::mutex g_mutex;
int g_users = 0;
struct sigaction g_previous_term, g_previous_int;

void on_signal(int signo) { g_received = signo; }

}  // namespace

void install() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_users++ > 0) return;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // a collective's blocking call resumes; the loop looks after the step
  sigaction(SIGTERM, &sa, &g_previous_term);
  sigaction(SIGINT, &sa, &g_previous_int);
}

void uninstall() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_users == 0 || --g_users > 0) return;
  sigaction(SIGTERM, &g_previous_term, nullptr);
  sigaction(SIGINT, &g_previous_int, nullptr);
}

int received() { return g_received; }

}  // namespace exit_signals

namespace {

using parallel::GroupKind;

std::string minutes(double m) {
  std::ostringstream o;
  o << m;
  return o.str();
}

// NaN's sign and spelling vary by platform; the message should not.
std::string non_finite(double v) { return std::isnan(v) ? "NaN" : v > 0 ? "Inf" : "-Inf"; }

}  // namespace

std::string TrainingLoop::exit_requested() {
  const auto& o = options_;
  // Decided alike on every rank: the interval without a collective, the signal and the
  // clock (each rank's own) by one MAX over the world.
  if (o.exit_signal_handler() || o.exit_duration_in_mins() > 0) {
    const double elapsed_min = std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count() / 60;
    at::Tensor flags = at::zeros({2}, at::kLong);
    flags[0] = static_cast<int64_t>(exit_signals::received());
    flags[1] = o.exit_duration_in_mins() > 0 && elapsed_min >= o.exit_duration_in_mins() ? 1 : 0;
    comm::Group(state_->group_name(GroupKind::kWorld)).all_reduce(flags, comm::ReduceOp::kMax);
    const int64_t signo = flags[0].item<int64_t>();
    if (signo != 0) return std::string("signal ") + (signo == SIGTERM ? "SIGTERM" : signo == SIGINT ? "SIGINT" : std::to_string(signo));
    if (flags[1].item<int64_t>() != 0) return "exit duration " + minutes(o.exit_duration_in_mins()) + " min";
  }
  if (o.exit_interval() > 0 && iteration_ % o.exit_interval() == 0 && iteration_ < o.train_iters()) {
    return "exit interval " + std::to_string(o.exit_interval());
  }
  return "";
}

void TrainingLoop::on_nonfinite_step(double loss, bool bad_grads, double sum_of_squares) {
  // Where: every rank's parameters whose reduced gradient (the range it owns) is
  // non-finite, gathered so every rank reports, and fails, alike.
  std::string mine;
  const auto name = [&](const ModelParameters& params, optim::DistributedOptimizer& opt) {
    for (const int64_t i : opt.nonfinite_grad_params()) {
      mine += (mine.empty() ? "" : ", ") + (static_cast<size_t>(i) < params.names.size() ? params.names[i] : "#" + std::to_string(i));
    }
  };
  name(params_, *optimizer_);
  if (expert_optimizer_) name(expert_params_, *expert_optimizer_);
  comm::Group world(state_->group_name(GroupKind::kWorld));
  const auto all = comm::all_gather_strings(world, mine);
  std::string where;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) where += (where.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + all[r]);
  }
  std::ostringstream what;
  what << "iteration " << iteration_ + 1 << ": ";
  if (!std::isfinite(loss)) what << "the loss is " << non_finite(loss);
  if (!std::isfinite(loss) && bad_grads) what << " and ";
  if (bad_grads) {
    what << "the reduced gradients are not finite (norm "
         << (std::isfinite(sum_of_squares) ? std::to_string(std::sqrt(sum_of_squares)) : non_finite(sum_of_squares)) << ")";
  }
  what << (where.empty() ? "" : ", on " + where);
  if (nan_steps_skipped_ < options_.skip_nan_steps()) {
    ++nan_steps_skipped_;
    if (is_logging_rank()) {
      std::printf("\n[megatorch] %s: step skipped, nothing applied (%ld of --skip-nan-steps %ld)\n", what.str().c_str(),
                  nan_steps_skipped_, options_.skip_nan_steps());
      std::fflush(stdout);
    }
    return;
  }
  MEGATORCH_FAIL(what.str(), "; stopped before the optimizer step, so the weights and the last checkpoint are those "
                 "of iteration ", iteration_, ". ", options_.skip_nan_steps() > 0
                     ? "--skip-nan-steps " + std::to_string(options_.skip_nan_steps()) + " steps were already skipped. "
                     : std::string(),
                 "Look for a bad sample or a learning rate that diverges, resume from the last checkpoint with a lower "
                 "--lr, or pass --skip-nan-steps K to skip up to K such steps");
}

void TrainingLoop::attach_fault_hooks() {
  const int64_t rank = state_->rank();
  const bool nan_here = faults_.nan_grad_iteration > 0 && faults_.nan_grad_rank == rank;
  const bool slow_here = faults_.slow_rank == rank;
  if (!nan_here && !slow_here) return;
  // The first 1-D parameter: a norm's weight or a bias, whose gradient autograd
  // accumulates (no fused weight-gradient GEMM writes around the hook).
  for (auto& p : stage_->stage_module().parameters()) {
    if (p.dim() != 1 || !p.requires_grad()) continue;
    const int64_t nan_iteration = nan_here ? faults_.nan_grad_iteration : 0;
    const auto delay = std::chrono::milliseconds(slow_here ? faults_.slow_rank_ms : 0);
    p.register_hook([this, nan_iteration, delay](const at::Tensor& grad) -> at::Tensor {
      if (delay.count() > 0) std::this_thread::sleep_for(delay);
      if (iteration_ + 1 != nan_iteration) return grad;
      at::Tensor g = grad.clone();
      g.view({-1})[0] = std::nan("");
      return g;
    });
    return;
  }
  MEGATORCH_FAIL("MEGATORCH_FAULT_INJECTION: rank ", rank, "'s stage has no 1-D parameter to inject a fault into");
}

bool TrainingLoop::suspicious_loss(double loss) {
  bool mine = !std::isfinite(loss);
  if (!mine && !recent_losses_.empty()) {
    double mean = 0;
    for (const double l : recent_losses_) mean += l;
    mean /= static_cast<double>(recent_losses_.size());
    mine = loss > options_.spike_threshold() * mean;
  }
  // Ranks agree: a fault may reach only some ranks' copy of the reduced loss.
  at::Tensor flag = at::full({1}, mine ? int64_t{1} : int64_t{0}, at::kLong);
  comm::Group(state_->group_name(GroupKind::kWorld)).all_reduce(flag, comm::ReduceOp::kMax);
  return flag.item<int64_t>() != 0;
}

std::string TrainingLoop::judge_rerun(double first, double second, double own_first, double own_second) {
  // Bit for bit: a deterministic step gives the same bits from the same state.
  const auto same = [](double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; };
  at::Tensor differed = at::zeros({2}, at::kLong);
  differed[0] = same(own_first, own_second) ? 0 : 1;
  differed[1] = same(first, second) ? 0 : 1;
  const at::Tensor all = comm::Group(state_->group_name(GroupKind::kWorld)).all_gather(differed).view({-1, 2});
  std::string ranks;
  for (int64_t r = 0; r < all.size(0); ++r) {
    if (all[r][0].item<int64_t>() != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  const bool reproducible = all.sum().item<int64_t>() == 0;
  const int64_t it = iteration_ + 1, gbs = global_batch_size();
  if (is_logging_rank()) {
    if (reproducible) {
      std::printf("\n[megatorch] rerun: iteration %ld's loss %.6E (spike threshold %g x the recent mean) came out the "
                  "same on a rerun from the same state: a data or model fault, not the hardware; the step's samples "
                  "are [%ld, %ld) of the training order\n",
                  it, first, options_.spike_threshold(), (it - 1) * gbs, it * gbs);
    } else {
      std::printf("\n[megatorch] rerun: iteration %ld's loss %.6E became %.6E on a rerun from the same state: a "
                  "transient fault (ranks whose own share of the loss differed: %s); the rerun's step is kept\n",
                  it, first, second, ranks.empty() ? "none; the difference is in the reductions" : ranks.c_str());
    }
    std::fflush(stdout);
  }
  return reproducible ? "reproducible" : "transient";
}

std::vector<double> TrainingLoop::gather_compute_seconds(double busy_seconds) {
  comm::Group world(state_->group_name(GroupKind::kWorld));
  const at::Tensor all = world.all_gather(at::full({1}, busy_seconds, at::kDouble));
  return {all.data_ptr<double>(), all.data_ptr<double>() + all.numel()};
}

}  // namespace megatorch::train
