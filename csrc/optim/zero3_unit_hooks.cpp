// ZeRO-3's just-in-time parameters: a unit is gathered before its forward (the next unit
// prefetched), freed after it, gathered again when the gradient reaches the unit's
// output (the previous unit prefetched) and freed once its gradients are in
// (DistributedOptimizer::on_grad_ready).
#include <torch/autograd.h>

#include "megatorch/check.h"
#include "megatorch/optim/distributed_optimizer.h"
#include "megatorch/optim/storage.h"
#include "optimizer_state.h"

namespace megatorch::optim {
namespace {

// Identity whose backward gathers a unit before autograd runs the unit's backward, and
// prefetches the unit whose backward comes next.
struct GatherBeforeBackward : torch::autograd::Function<GatherBeforeBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t optimizer, int64_t unit,
                            int64_t next) {
    ctx->saved_data["optimizer"] = optimizer;
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["next"] = next;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* opt = reinterpret_cast<DistributedOptimizer*>(ctx->saved_data["optimizer"].toInt());
    opt->gather_unit(ctx->saved_data["unit"].toInt());
    opt->prefetch_unit(ctx->saved_data["next"].toInt());
    return {grads[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The hooks of one chunk: its root unit `first` (embedding, final norm, head), then its
// layers first+1..last. Forward runs root, layers in order, root (the head); backward the
// root (head), layers last to first, root (embedding). Prefetches stay inside the chunk:
// under interleaving the next chunk to run is the schedule's choice, not this one's.
class Zero3UnitHooks : public models::UnitHooks {
 public:
  Zero3UnitHooks(DistributedOptimizer* opt, int64_t first, int64_t last) : opt_(opt), first_(first), last_(last) {}
  void before_forward(int64_t unit) override {
    opt_->gather_unit(unit);
    if (unit + 1 <= last_) opt_->prefetch_unit(unit + 1);
  }
  at::Tensor after_forward(int64_t unit, const at::Tensor& output) override {
    opt_->release_unit(unit);
    if (!output.requires_grad() || !at::GradMode::is_enabled()) return output;
    const int64_t next = unit == first_ ? last_ : unit - 1 > first_ ? unit - 1 : -1;
    return GatherBeforeBackward::apply(output, reinterpret_cast<int64_t>(opt_), unit, next);
  }

 private:
  DistributedOptimizer* opt_;
  int64_t first_, last_;
};

}  // namespace

std::shared_ptr<models::UnitHooks> DistributedOptimizer::unit_hooks(int64_t first, int64_t last) {
  MEGATORCH_CHECK(0 <= first && first <= last && last < num_units(), "DistributedOptimizer::unit_hooks: expected ",
                  "0 <= first <= last < ", num_units(), " (the units of one chunk), got ", first, "..", last);
  if (options_.zero_stage() == 3) return std::make_shared<Zero3UnitHooks>(this, first, last);
  return param_gather_hooks(*this);
}

// ---- the units gathered, prefetched and freed ----

void DistributedOptimizer::prefetch_unit(int64_t u) {
  if (options_.zero_stage() != 3 || u < 0 || u >= num_units()) return;
  for (int64_t b : state_->unit_buckets[u]) {
    auto& bs = state_->buckets[b];
    if (!bs.gathered && !bs.prefetch) bs.prefetch = dp_.all_gather_async(bs.param_shard);
  }
}

void DistributedOptimizer::gather_unit(int64_t u) {
  MEGATORCH_CHECK(u >= 0 && u < num_units(), "DistributedOptimizer::gather_unit: expected a unit in [0, ", num_units(),
                  "), got ", u);
  if (options_.zero_stage() != 3) return finish_param_gather(u);
  prefetch_unit(u);
  at::NoGradGuard no_grad;
  for (int64_t b : state_->unit_buckets[u]) {
    auto& bs = state_->buckets[b];
    if (bs.gathered) continue;
    at::Tensor full = bs.prefetch->wait();
    bs.prefetch.reset();
    resize_storage(bs.param_full, bs.param_full.numel() * bs.param_full.element_size());
    bs.param_full.copy_(dp_.size() > 1 ? full : bs.param_shard);
    bs.gathered = true;
  }
}

void DistributedOptimizer::release_unit(int64_t u) {
  if (options_.zero_stage() != 3) return;
  for (int64_t b : state_->unit_buckets[u]) {
    auto& bs = state_->buckets[b];
    if (!bs.gathered) continue;
    resize_storage(bs.param_full, 0);
    bs.gathered = false;
  }
}

}  // namespace megatorch::optim
