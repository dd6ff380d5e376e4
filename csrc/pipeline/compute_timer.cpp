#include "megatorch/pipeline/compute_timer.h"

#include <c10/core/impl/VirtualGuardImpl.h>

namespace megatorch::pipeline {
namespace {

std::unique_ptr<c10::Event> record(c10::Device device) {
  auto e = std::make_unique<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
  e->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  return e;
}

}  // namespace

double ComputeTimer::now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

ComputeTimer::ComputeTimer(c10::Device device) : events_(!device.is_cpu()), device_(device) {
  if (!events_) return;
  // Anchors the device's timeline to the host clock: once this event has completed, the
  // stream is idle up to it, so its host time is its device time.
  origin_ = record(device_);
  origin_->synchronize();
  origin_s_ = now();
}

int64_t ComputeTimer::start() {
  if (events_) {
    marks_.emplace_back(record(device_), nullptr);
    return static_cast<int64_t>(marks_.size()) - 1;
  }
  host_.emplace_back(now(), now());
  return static_cast<int64_t>(host_.size()) - 1;
}

void ComputeTimer::stop(int64_t interval) {
  if (events_) {
    marks_.at(interval).second = record(device_);
  } else {
    host_.at(interval).second = now();
  }
}

std::vector<std::pair<double, double>> ComputeTimer::finish() {
  if (!events_) return host_;
  std::vector<std::pair<double, double>> out;
  for (const auto& [begin, end] : marks_) {
    const auto& last = end ? end : begin;
    last->synchronize();
    // elapsedTime is in milliseconds.
    out.emplace_back(origin_s_ + origin_->elapsedTime(*begin) / 1e3, origin_s_ + origin_->elapsedTime(*last) / 1e3);
  }
  return out;
}

}  // namespace megatorch::pipeline
