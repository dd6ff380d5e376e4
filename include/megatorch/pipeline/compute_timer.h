#pragma once
// Start and end times of the compute actions of a pipeline step. On the CPU the host clock
// is the time of the work. On a GPU the host only enqueues kernels, so its clock would time
// the launches: there each mark is a timing event recorded on the current stream, and
// finish() turns the events into seconds on the host's monotonic clock (one
// synchronisation, at the end of the step), so the ranks' timelines still line up.
#include <c10/core/Device.h>
#include <c10/core/Event.h>

#include <chrono>
#include <memory>
#include <utility>
#include <vector>

namespace megatorch::pipeline {

class ComputeTimer {
 public:
  explicit ComputeTimer(c10::Device device);
  // Marks the start / end of an interval on the current stream (or clock); returns its index.
  int64_t start();
  void stop(int64_t interval);
  // (start, end) of every interval in monotonic-clock seconds; waits for the device.
  std::vector<std::pair<double, double>> finish();

 private:
  static double now();
  bool events_;
  c10::Device device_;
  std::vector<std::pair<double, double>> host_;
  // The reference event and the host time at which it completed.
  std::unique_ptr<c10::Event> origin_;
  double origin_s_ = 0;
  std::vector<std::pair<std::unique_ptr<c10::Event>, std::unique_ptr<c10::Event>>> marks_;
};

}  // namespace megatorch::pipeline
