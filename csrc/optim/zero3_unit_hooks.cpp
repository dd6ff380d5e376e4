// ZeRO-3's just-in-time parameters: a unit is gathered before its forward (the next unit
// prefetched), freed after it, gathered again when the gradient reaches the unit's
// output (the previous unit prefetched) and freed once its gradients are in
// (DistributedOptimizer::on_grad_ready).
#include <torch/autograd.h>

#include "megatorch/optim/distributed_optimizer.h"

namespace megatorch::optim {
namespace {

// Identity whose backward gathers a unit before autograd runs the unit's backward.
struct GatherBeforeBackward : torch::autograd::Function<GatherBeforeBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t optimizer, int64_t unit) {
    ctx->saved_data["optimizer"] = optimizer;
    ctx->saved_data["unit"] = unit;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* opt = reinterpret_cast<DistributedOptimizer*>(ctx->saved_data["optimizer"].toInt());
    const int64_t unit = ctx->saved_data["unit"].toInt();
    opt->gather_unit(unit);
    // Backward visits the layers last to first; the root unit (0) comes first of all.
    opt->prefetch_unit(unit == 0 ? opt->num_units() - 1 : unit - 1 >= 1 ? unit - 1 : -1);
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

class Zero3UnitHooks : public models::UnitHooks {
 public:
  explicit Zero3UnitHooks(DistributedOptimizer* opt) : opt_(opt) {}
  void before_forward(int64_t unit) override {
    opt_->gather_unit(unit);
    if (unit + 1 < opt_->num_units()) opt_->prefetch_unit(unit + 1);
  }
  at::Tensor after_forward(int64_t unit, const at::Tensor& output) override {
    opt_->release_unit(unit);
    if (!output.requires_grad() || !at::GradMode::is_enabled()) return output;
    return GatherBeforeBackward::apply(output, reinterpret_cast<int64_t>(opt_), unit);
  }

 private:
  DistributedOptimizer* opt_;
};

}  // namespace

std::shared_ptr<models::UnitHooks> DistributedOptimizer::unit_hooks() { return std::make_shared<Zero3UnitHooks>(this); }

}  // namespace megatorch::optim
