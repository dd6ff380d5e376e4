#include "megatorch/tp/rng_tracker.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <mutex>

#include "megatorch/check.h"

namespace megatorch::tp {
namespace {

at::Generator default_generator(c10::Device device) {
  if (device.is_cuda()) return at::globalContext().defaultGenerator(device);
  return at::detail::getDefaultCPUGenerator();
}

at::Tensor seeded_state(c10::Device device, int64_t seed) {
  // A fresh generator of the device's kind, seeded, gives a state without touching
  // the default generator.
  at::Generator gen = default_generator(device).clone();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(static_cast<uint64_t>(seed));
  return gen.get_state();
}

}  // namespace

at::Tensor default_generator_state(c10::Device device) {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_default_generator_state(c10::Device device, const at::Tensor& state) {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

void RngTracker::seed(int64_t seed, int64_t tp_rank, c10::Device device) {
  device_ = device;
  states_.clear();
  {
    at::Generator gen = default_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(static_cast<uint64_t>(seed));
  }
  add(kModelParallelRng, seed + 2718 + tp_rank);
}

void RngTracker::add(const std::string& name, int64_t seed) {
  MEGATORCH_CHECK(!has(name), "RNG stream '", name, "' already exists; choose another name");
  states_[name] = seeded_state(device_, seed);
}

RngTracker::Fork::Fork(RngTracker& tracker, const std::string& name) : tracker_(tracker), name_(name) {
  MEGATORCH_CHECK(tracker_.has(name_), "expected RNG stream '", name_, "' to be seeded; call RngTracker::seed(...) ",
                  "(or add(name, seed)) before forking it");
  saved_default_ = default_generator_state(tracker_.device_);
  set_default_generator_state(tracker_.device_, tracker_.states_.at(name_));
}

RngTracker::Fork::~Fork() {
  tracker_.states_[name_] = default_generator_state(tracker_.device_);
  set_default_generator_state(tracker_.device_, saved_default_);
}

RngTracker::Snapshot RngTracker::snapshot() const {
  Snapshot s;
  s.default_state = default_generator_state(device_);
  for (const auto& [k, v] : states_) s.states[k] = v.clone();
  return s;
}

void RngTracker::restore(const Snapshot& s) {
  set_default_generator_state(device_, s.default_state);
  for (const auto& [k, v] : s.states) states_[k] = v.clone();
}

}  // namespace megatorch::tp
