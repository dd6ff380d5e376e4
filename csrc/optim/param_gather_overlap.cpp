// ZeRO-1/2's parameter all-gather overlapped with the next forward (Megatron's
// overlap_param_gather): step() launches one all-gather per bucket, in the order the
// forward needs them, and returns; the forward of each unit first waits for the buckets
// that hold its parameters, so the gather of later buckets runs under the compute of
// earlier units.
#include "megatorch/optim/distributed_optimizer.h"
#include "optimizer_state.h"

namespace megatorch::optim {
namespace {

class ParamGatherHooks : public models::UnitHooks {
 public:
  explicit ParamGatherHooks(DistributedOptimizer* opt) : opt_(opt) {}
  void before_forward(int64_t unit) override { opt_->finish_param_gather(unit); }
  at::Tensor after_forward(int64_t, const at::Tensor& output) override { return output; }

 private:
  DistributedOptimizer* opt_;
};

}  // namespace

std::shared_ptr<models::UnitHooks> param_gather_hooks(DistributedOptimizer& optimizer) {
  const auto& o = optimizer.options();
  const bool overlaps = (o.zero_stage() == 1 || o.zero_stage() == 2) && o.overlap_param_gather();
  return overlaps ? std::make_shared<ParamGatherHooks>(&optimizer) : nullptr;
}

void DistributedOptimizer::launch_param_gathers() {
  if (dp_.size() == 1) return;  // the shard is the whole bucket, already in place
  // Buckets are laid out in backward order: the forward needs the last one first.
  for (auto b = static_cast<int64_t>(state_->buckets.size()) - 1; b >= 0; --b) {
    auto& bs = state_->buckets[b];
    if (!bs.param_gather) bs.param_gather = dp_.all_gather_async(bs.param_shard);
  }
}

void DistributedOptimizer::finish_param_gather(int64_t unit) {
  auto finish = [this](int64_t b) {
    auto& bs = state_->buckets[b];
    if (!bs.param_gather) return;
    const at::Tensor full = bs.param_gather->wait();
    bs.param_gather.reset();
    at::NoGradGuard no_grad;
    bs.param_full.copy_(full);
  };
  if (unit < 0) {
    for (size_t b = 0; b < state_->buckets.size(); ++b) finish(static_cast<int64_t>(b));
    return;
  }
  for (int64_t b : state_->unit_param_buckets.at(unit)) finish(b);
}

int64_t DistributedOptimizer::pending_param_gathers() const {
  int64_t n = 0;
  for (const auto& bs : state_->buckets) n += bs.param_gather ? 1 : 0;
  return n;
}

}  // namespace megatorch::optim
