// DistributedOptimizer's gradient reduction (the part Megatron calls the grad buffer's):
// a hook after each parameter's gradient is accumulated counts its bucket in, a full
// bucket starts its all-reduce (stage 0) or reduce-scatter (1-3) while backward goes on,
// step() waits for them and adds the partial sums other ranks hold (SP's norms, the tied
// embedding's copies).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <map>

#include "megatorch/check.h"
#include "megatorch/optim/distributed_optimizer.h"
#include "optimizer_state.h"

namespace megatorch::optim {
namespace {

// Runs after autograd has accumulated a parameter's gradient (once per backward).
class GradReadyHook : public torch::autograd::PostAccumulateGradHook {
 public:
  GradReadyHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  void operator()(const torch::autograd::Variable&) override { fn_(); }

 private:
  std::function<void()> fn_;
};

}  // namespace

void DistributedOptimizer::register_hooks() {
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(
        params_[i], std::make_unique<GradReadyHook>([this, i] { on_grad_ready(static_cast<int64_t>(i)); }));
  }
}

// Stages 2-3: a bucket's full gradients live in a staging buffer from its first
// gradient of the step until its reduce-scatter has finished.
void DistributedOptimizer::ensure_grad_staging(int64_t b) {
  auto& bs = state_->buckets[b];
  if (bs.grad_full.defined()) return;
  const auto& place = layout_.buckets[b];
  bs.grad_full = at::zeros({place.numel}, bs.grad_shard.options());
}

void DistributedOptimizer::on_grad_ready(int64_t i) {
  const auto& pp = layout_.params[i];
  auto& bs = state_->buckets[pp.bucket];
  at::Tensor& p = params_[i];
  ensure_grad_staging(pp.bucket);
  // Autograd accumulates in place into a .grad that is already our view; a fresh .grad
  // (stages 2-3 after the staging was dropped, or one the user reset) is added in.
  at::Tensor view = bs.grad_full.narrow(0, pp.offset, pp.numel).view(p.sizes());
  const at::Tensor g = p.grad();
  if (g.defined() && g.data_ptr() != view.data_ptr()) {
    view.add_(g);
    p.mutable_grad() = view;
  }
  if (++bs.ready == static_cast<int64_t>(layout_.buckets[pp.bucket].params.size())) {
    bs.ready = 0;
    if (grad_sync_ && options_.overlap_grad_reduce()) start_bucket(pp.bucket);
  }
  if (options_.zero_stage() == 3) {
    // The unit's backward is over once all of its gradients are in: free its parameters.
    const int64_t u = unit_of_param_[i];
    if (++state_->unit_ready[u] == static_cast<int64_t>(units_[u].size())) {
      state_->unit_ready[u] = 0;
      release_unit(u);
    }
  }
}

void DistributedOptimizer::start_bucket(int64_t b) {
  auto& bs = state_->buckets[b];
  if (bs.launched) return;
  bs.launched = true;
  if (options_.zero_stage() >= 2) ensure_grad_staging(b);
  const int64_t dp = dp_.size();
  if (dp == 1) return;
  // Gloo has no average: scale by 1/d, then sum (exact for powers of two).
  bs.grad_full.mul_(1.0 / static_cast<double>(dp));
  bs.work = options_.zero_stage() == 0 ? dp_.all_reduce_async(bs.grad_full) : dp_.reduce_scatter_async(bs.grad_full);
}

void DistributedOptimizer::wait_bucket(int64_t b) {
  auto& bs = state_->buckets[b];
  at::Tensor result = bs.work.wait();
  bs.work = comm::Work();
  const int64_t stage = options_.zero_stage();
  if (stage >= 1) bs.grad_shard.copy_(dp_.size() == 1 ? bs.grad_full : result);
  if (stage >= 2) {
    // Only the shard is kept: drop the staging buffer and the gradient views into it.
    bs.grad_full = at::Tensor();
    for (int64_t i : layout_.buckets[b].params) params_[i].mutable_grad() = at::Tensor();
  }
}

void DistributedOptimizer::finish_grad_sync() {
  for (size_t b = 0; b < state_->buckets.size(); ++b) start_bucket(static_cast<int64_t>(b));
  for (size_t b = 0; b < state_->buckets.size(); ++b) {
    wait_bucket(static_cast<int64_t>(b));
    state_->buckets[b].launched = false;
    state_->buckets[b].ready = 0;
  }
  sum_partial_grads();
}

// ParamInfo::grad_sum_group: one all-reduce per group over the concatenated slices this
// rank owns (all of each gradient at stage 0). The group's ranks own the same slices, as
// their layouts are the same, so the sums line up element for element.
// With grad_sum_ranks the two copies' owners exchange their slices (one coalesced batch)
// and add: a + b on one rank, b + a on the other, the same bits.
void DistributedOptimizer::sum_partial_grads() {
  std::map<std::pair<std::string, std::vector<int64_t>>, std::vector<at::Tensor>> slices;
  for (size_t b = 0; b < state_->buckets.size(); ++b) {
    const auto& bs = state_->buckets[b];
    for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t at, int64_t, int64_t n) {
      const auto& info = info_[i];
      if (!info.grad_sum_group.empty()) slices[{info.grad_sum_group, info.grad_sum_ranks}].push_back(bs.grad_shard.narrow(0, at, n));
    });
  }
  at::NoGradGuard no_grad;
  for (auto& [key, views] : slices) {
    const auto& [group_name, ranks] = key;
    comm::Group group(group_name);
    comm::reduce_flattened(views, [&](at::Tensor& flat) {
      if (ranks.empty()) {
        group.all_reduce(flat);
        return;
      }
      const int64_t peer = ranks[0] == group.rank() ? ranks[1] : ranks[0];
      MEGATORCH_CHECK(ranks[0] != ranks[1] && (ranks[0] == group.rank() || ranks[1] == group.rank()),
                      "DistributedOptimizer: grad_sum_ranks {", ranks[0], ", ", ranks[1], "} of group '", group_name,
                      "' must be two ranks, this rank (", group.rank(), ") one of them");
      at::Tensor other = at::empty_like(flat);
      group.batch_p2p({{comm::P2POp::Kind::kSend, flat, peer, 0}, {comm::P2POp::Kind::kRecv, other, peer, 0}}).wait();
      flat.add_(other);
    });
  }
}

}  // namespace megatorch::optim
