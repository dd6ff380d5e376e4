#include "megatorch/plan/calibrate.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/parallel/launch_env.h"
#include "megatorch/parallel/parallel_state.h"

#ifdef MEGATORCH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace megatorch::plan {

namespace {

// Passes over a layer's saved activations that the memory-bound kernels make at full
// bandwidth; the calibrated coefficient is this divided by the measured bandwidth fraction.
constexpr double kMemoryBoundPasses = 0.4;

void sync(const at::Device& d) {
#ifdef MEGATORCH_WITH_CUDA
  if (d.is_cuda()) at::cuda::device_synchronize();
#endif
  (void)d;
}

template <typename F>
double best_seconds(const at::Device& d, int repeats, F&& f) {
  f();  // warm-up
  sync(d);
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    sync(d);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

void fit_matmul_efficiency(const std::vector<double>& w, const std::vector<double>& e, Calibration& out) {
  MEGATORCH_CHECK(!w.empty() && w.size() == e.size(), "fit_matmul_efficiency: expected as many widths as efficiencies, got ",
                  w.size(), " and ", e.size());
  // 1/eff = 1/e_max + (w_half/e_max) * (1/w): a line in 1/w.
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  const double n = static_cast<double>(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    MEGATORCH_CHECK(w[i] > 0 && e[i] > 0, "fit_matmul_efficiency: expected positive points, got (", w[i], ", ", e[i], ")");
    const double x = 1 / w[i], y = 1 / e[i];
    sx += x, sy += y, sxx += x * x, sxy += x * y;
  }
  const double den = n * sxx - sx * sx;
  double slope = den > 0 ? (n * sxy - sx * sy) / den : 0, icept = (sy - slope * sx) / n;
  if (slope < 0 || icept <= 0) {  // efficiency does not fall with width: flat at the best point
    out.matmul_efficiency = *std::max_element(e.begin(), e.end());
    out.matmul_half_width = 0;
    return;
  }
  out.matmul_efficiency = 1 / icept;
  out.matmul_half_width = slope / icept;
}

CalibrationReport calibrate(const Cluster& cluster, const CalibrateOptions& o) {
  bool cuda = false;
#ifdef MEGATORCH_WITH_CUDA
  cuda = o.use_cuda && at::cuda::is_available();
#endif
  // One process unless torchrun set the environment.
  const parallel::LaunchEnv env = std::getenv("WORLD_SIZE") ? parallel::LaunchEnv::from_environment() : parallel::LaunchEnv{};
  const at::Device device = cuda ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank)) : at::Device(at::kCPU);
  const auto dtype = cuda ? at::kBFloat16 : at::kFloat;
  const auto opts = at::TensorOptions().device(device).dtype(dtype);
  std::vector<int64_t> widths = o.widths;
  if (widths.empty()) widths = cuda ? std::vector<int64_t>{512, 1024, 2048, 4096, 8192} : std::vector<int64_t>{128, 256, 512};
  const int64_t tokens = o.tokens > 0 ? o.tokens : (cuda ? 8192 : 512);
  const double peak = cluster.peak_tflops * 1e12;

  CalibrationReport rep;
  Calibration& cal = rep.calibration;
  nlohmann::json& m = rep.measurements;
  m["device"] = cuda ? "cuda" : "cpu";
  m["dtype"] = cuda ? "bf16" : "fp32";
  m["peak_tflops"] = cluster.peak_tflops;

  // GEMMs shaped like a layer's: [tokens, w] x [w, 4w] (the MLP's fc1 at hidden w).
  std::vector<double> ws, effs;
  nlohmann::json gemms = nlohmann::json::array();
  for (int64_t w : widths) {
    const at::Tensor a = at::randn({tokens, w}, opts), b = at::randn({w, 4 * w}, opts);
    const double s = best_seconds(device, o.repeats, [&] { (void)at::matmul(a, b); });
    const double tflops = 2.0 * tokens * w * 4 * w / s / 1e12;
    gemms.push_back({{"width", w}, {"tokens", tokens}, {"seconds", s}, {"tflops", tflops}});
    ws.push_back(static_cast<double>(w));
    effs.push_back(tflops * 1e12 / peak);
  }
  m["matmul"] = gemms;
  fit_matmul_efficiency(ws, effs, cal);

  // A memory-bound pass: GeLU then a residual add over [tokens, 4 * max width].
  {
    const at::Tensor x = at::randn({tokens, 4 * widths.back()}, opts), r = at::randn_like(x);
    const double s = best_seconds(device, o.repeats, [&] { (void)at::add(at::gelu(x, "tanh"), r); });
    const double bytes = 5.0 * x.numel() * x.element_size();  // read x; write, read gelu; read r; write out
    const double gbps = bytes / s / 1e9;
    m["memory_bound_gbps"] = gbps;
    cal.memory_bound_passes = kMemoryBoundPasses * cluster.memory_bandwidth_gbps / gbps;
  }

  // Collectives over the world group, when launched by torchrun.
  if (env.world_size > 1) {
    parallel::ParallelState state{parallel::ParallelStateOptions(1, 1)};
    comm::Group world(state, parallel::GroupKind::kWorld);
    const int64_t n = world.size();
    const int64_t elems = (cuda ? 64 : 4) << 20;
    at::Tensor buf = at::ones({elems}, at::TensorOptions().device(state.device()).dtype(dtype));
    const double s_ar = best_seconds(device, o.repeats, [&] { world.all_reduce(buf); });
    const double bytes = static_cast<double>(elems) * buf.element_size();
    const double bus_ar = 2.0 * (n - 1) / n * bytes / s_ar / 1e9;
    const at::Tensor piece = at::ones({elems / n}, buf.options());
    const double s_ag = best_seconds(device, o.repeats, [&] { (void)world.all_gather(piece); });
    const double bus_ag = static_cast<double>(n - 1) / n * bytes / s_ag / 1e9;
    m["world_size"] = n;
    m["all_reduce_bus_gbps"] = bus_ar;
    m["all_gather_bus_gbps"] = bus_ag;
    // All ranks on one node (torchrun --standalone): they measure the intra-node link; with
    // several nodes the ring is bounded by the inter-node link.
    const bool multi_node = env.local_world_size < env.world_size;
    const double bus = std::min(bus_ar, bus_ag);
    if (multi_node)
      cal.inter_node_efficiency = bus / (cluster.inter_node_gbps / cluster.gpus_per_node);
    else
      cal.intra_node_efficiency = bus / (cluster.intra_node_gbps / 2);
    // Everyone reports rank 0's numbers.
    at::Tensor vals = at::tensor({cal.matmul_efficiency, cal.matmul_half_width, cal.memory_bound_passes,
                                  cal.intra_node_efficiency, cal.inter_node_efficiency},
                                 at::TensorOptions().dtype(at::kDouble));
    if (env.rank != 0) vals.zero_();
    at::Tensor shared = vals.to(state.device());
    world.all_reduce(shared);
    const at::Tensor back = shared.cpu();
    const double* v = back.data_ptr<double>();
    cal.matmul_efficiency = v[0], cal.matmul_half_width = v[1], cal.memory_bound_passes = v[2];
    cal.intra_node_efficiency = v[3], cal.inter_node_efficiency = v[4];
    cal.source = std::string("measured: ") + (cuda ? "cuda" : "cpu") + ", " + std::to_string(n) +
                 " ranks (" + (multi_node ? "inter" : "intra") + "-node link measured)";
  } else {
    m["world_size"] = 1;
    cal.source = std::string("measured: ") + (cuda ? "cuda" : "cpu") +
                 ", 1 process (communication efficiencies are the defaults; run under torchrun to measure them)";
  }
  return rep;
}

}  // namespace megatorch::plan
