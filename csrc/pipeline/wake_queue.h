#pragma once
// The event loop of the schedule simulators (simulator.cpp, nccl_order_model.cpp): every
// rank runs until it blocks, and a rank that unblocks another queues it. Each rank is in
// the queue at most once, so the work is linear in the actions plus the wake-ups.
// Private to csrc/pipeline.
#include <cstdint>
#include <deque>
#include <vector>

namespace megatorch::pipeline {

class WakeQueue {
 public:
  explicit WakeQueue(int64_t ranks) : queued_(ranks, 1) {
    for (int64_t r = 0; r < ranks; ++r) ready_.push_back(r);
  }
  bool empty() const { return ready_.empty(); }
  int64_t pop() {
    const int64_t r = ready_.front();
    ready_.pop_front();
    queued_[r] = 0;
    return r;
  }
  void wake(int64_t rank) {
    if (queued_[rank]) return;
    queued_[rank] = 1;
    ready_.push_back(rank);
  }

 private:
  std::deque<int64_t> ready_;
  std::vector<char> queued_;
};

}  // namespace megatorch::pipeline
