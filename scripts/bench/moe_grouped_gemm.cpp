// megatorch::kernels::grouped_gemm timed both ways it runs: `grouped` (one at::_grouped_mm
// call) and the per-expert loop it replaces (`grouped` false: at::mm on input.narrow(...)
// and weight.select(g), then at::cat), the two interleaved call by call on the same inputs.
// Built and driven by scripts/bench/moe.py (--parts kernel); not part of the CMake build.
//
// stdin: one case per line,
//     NAME MODE ITERS BUDGET_MS WARMUP H F c0,c1,...,c{E-1} [grouped_only]
// MODE fwd (inputs without requires_grad) or fwdbwd (forward, then backward of a fixed
// random output gradient; both operands' gradients). Each path is timed at least ITERS
// times, and more (up to 50) while the slower path's calls add up to less than
// BUDGET_MS, as its first (untimed) call predicts. stdout: one JSON object per case
// with each path's median and all times in ms and the largest difference between the
// two paths' outputs (and gradients). With grouped_only the loop is not timed (its
// backward is the slow part: see moe.py) and loop_ms is null.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "megatorch/kernels/grouped_gemm.h"

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string list(const std::vector<double>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
  s << "]";
  return s.str();
}

struct Result {
  at::Tensor out, grad_input, grad_weight;
};

Result run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& grad, const std::vector<int64_t>& counts,
           bool grouped, bool backward, bool keep = false) {
  Result r;
  r.out = megatorch::kernels::grouped_gemm(x, w, counts, grouped);
  if (backward) {
    r.out.backward(grad);
    if (keep) {  // the gradients, for the comparison (timed calls drop them)
      r.grad_input = x.grad().clone();
      r.grad_weight = w.grad().clone();
    }
    x.mutable_grad().reset();
    w.mutable_grad().reset();
  }
  return r;
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() ? (a - b).abs().max().item<double>() : 0.0;
}

}  // namespace

int main() {
  at::set_num_threads(1);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    std::istringstream in(line);
    std::string name, mode, counts_text, only;
    int iters = 0, warmup = 0;
    double budget_ms = 0;
    int64_t h = 0, f = 0;
    in >> name >> mode >> iters >> budget_ms >> warmup >> h >> f >> counts_text >> only;
    const bool with_loop = only != "grouped_only";
    std::vector<int64_t> counts;
    std::istringstream cs(counts_text);
    for (std::string c; std::getline(cs, c, ',');) counts.push_back(std::stoll(c));
    int64_t rows = 0;
    for (int64_t c : counts) rows += c;
    const bool backward = mode == "fwdbwd";
    const auto E = static_cast<int64_t>(counts.size());

    at::manual_seed(0);
    at::Tensor x = at::randn({rows, h});
    at::Tensor w = at::randn({E, h, f}) * 0.02;
    at::Tensor grad = at::randn({rows, f});
    x.requires_grad_(backward);
    w.requires_grad_(backward);

    const double t_first = now_ms();
    const Result a = run(x, w, grad, counts, true, backward, true);
    double first_ms = now_ms() - t_first;
    double diff = 0.0;
    if (with_loop) {
      const double t_loop = now_ms();
      const Result b = run(x, w, grad, counts, false, backward, true);
      first_ms = std::max(first_ms, now_ms() - t_loop);
      diff = std::max({max_diff(a.out, b.out), max_diff(a.grad_input, b.grad_input),
                       max_diff(a.grad_weight, b.grad_weight)});
    }
    // The slower path's first call sets the count.
    iters = std::max(iters, std::min(50, static_cast<int>(budget_ms / std::max(first_ms, 1e-3))));
    for (int i = 1; i < warmup; ++i) {
      run(x, w, grad, counts, true, backward);
      if (with_loop) run(x, w, grad, counts, false, backward);
    }
    std::vector<double> tg, tl;
    for (int i = 0; i < iters; ++i) {
      // Alternate which path goes first, so that neither always follows the other's
      // allocations.
      for (int k = 0; k < 2; ++k) {
        const bool grouped = (k == 0) == (i % 2 == 0);
        if (!grouped && !with_loop) continue;
        const double t0 = now_ms();
        run(x, w, grad, counts, grouped, backward);
        (grouped ? tg : tl).push_back(now_ms() - t0);
      }
    }
    char loop_ms[64] = "null", loop_diff[64] = "null";
    if (with_loop) {
      std::snprintf(loop_ms, sizeof loop_ms, "%.6f", median(tl));
      std::snprintf(loop_diff, sizeof loop_diff, "%.3e", diff);
    }
    std::printf(
        "{\"name\":\"%s\",\"mode\":\"%s\",\"grouped_ms\":%.6f,\"loop_ms\":%s,\"grouped_all_ms\":%s,"
        "\"loop_all_ms\":%s,\"max_abs_diff\":%s,\"iters\":%d,\"threads\":%d}\n",
        name.c_str(), mode.c_str(), median(tg), loop_ms, list(tg).c_str(), list(tl).c_str(),
        loop_diff, iters, at::get_num_threads());
    std::fflush(stdout);
  }
  return 0;
}
