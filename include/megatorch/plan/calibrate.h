#pragma once
// Calibration: times real ATen GEMMs, a memory-bound layer pass and (under torchrun) the
// megatorch collectives on this machine, and turns them into the Calibration the cost model
// uses instead of its defaults. The nominal numbers it measures against are the cluster's
// (--peak-tflops, --memory-bandwidth-gbps, --intra-node-gbps): give this machine's.
#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "megatorch/plan/cost_model.h"

namespace megatorch::plan {

struct CalibrateOptions {
  std::vector<int64_t> widths;  // GEMM inner widths to time; empty: by device
  int64_t tokens = 0;           // GEMM rows (b*s); 0: by device
  int repeats = 3;
  bool use_cuda = true;         // when a GPU is present
};

struct CalibrationReport {
  Calibration calibration;
  nlohmann::json measurements;  // raw timings: device, TFLOP/s per width, GB/s, bus bandwidths
};

// Under torchrun (WORLD_SIZE > 1) every rank must call it: the collectives are timed on the
// world group and rank 0's numbers are returned on every rank. With one process the
// communication efficiencies stay at their defaults (the report says so).
CalibrationReport calibrate(const Cluster& cluster, const CalibrateOptions& options = {});

// Least-squares fit of eff(w) = e_max * w / (w + w_half) through (width, efficiency) points.
void fit_matmul_efficiency(const std::vector<double>& widths, const std::vector<double>& efficiencies,
                           Calibration& out);

}  // namespace megatorch::plan
