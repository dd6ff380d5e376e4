// ParamAndGradBuffer's gradient reduction: a hook after each parameter's gradient is
// accumulated counts its bucket in, a full bucket starts its all-reduce (stage 0) or
// reduce-scatter (1-3) while backward goes on, finish_grad_sync() waits for them and adds
// the partial sums other ranks hold (SP's norms, the tied embedding's copies).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <map>

#include "megatorch/check.h"
#include "megatorch/optim/param_and_grad_buffer.h"

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

ParamAndGradBuffer::~ParamAndGradBuffer() {
  for (const auto& p : params_) {
    torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
    if (options_.gradient_accumulation_fusion()) unregister_main_grad(p);
  }
}

void ParamAndGradBuffer::register_hooks() {
  grad_added_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(
        params_[i], std::make_unique<GradReadyHook>([this, i] { on_grad_ready(static_cast<int64_t>(i)); }));
    if (options_.gradient_accumulation_fusion()) register_main_grad(params_[i], this, static_cast<int64_t>(i));
  }
}

at::Tensor ParamAndGradBuffer::main_grad(int64_t i) {
  const auto& pp = layout_.params[i];
  ensure_grad_staging(pp.bucket);
  return buckets_[pp.bucket].grad_full.narrow(0, pp.offset, pp.numel).view(params_[i].sizes());
}

void ParamAndGradBuffer::mark_added(int64_t i) { grad_added_[i] = 1; }

// Stages 2-3: a bucket's full gradients live in a staging buffer from its first
// gradient of the step until its reduce-scatter has finished.
void ParamAndGradBuffer::ensure_grad_staging(int64_t b) {
  auto& bs = buckets_[b];
  if (bs.grad_full.defined()) return;
  const auto& place = layout_.buckets[b];
  bs.grad_full = at::zeros({place.numel}, bs.grad_shard.options());
}

void ParamAndGradBuffer::on_grad_ready(int64_t i) {
  const auto& pp = layout_.params[i];
  auto& bs = buckets_[pp.bucket];
  at::Tensor& p = params_[i];
  // Autograd accumulates in place into a .grad that is already our view; a fresh .grad
  // (stages 2-3 after the staging was dropped, or one the user reset) is added in.
  at::Tensor view = main_grad(i);
  const at::Tensor g = p.grad();
  if (grad_added_[i]) {
    // The weight-gradient GEMM added into the buffer already (gradient-accumulation
    // fusion); what autograd stored is its placeholder.
    grad_added_[i] = 0;
    p.mutable_grad() = view;
  } else if (g.defined() && g.data_ptr() != view.data_ptr()) {
    view.add_(g);
    p.mutable_grad() = view;
  }
  if (++bs.ready == static_cast<int64_t>(layout_.buckets[pp.bucket].params.size())) {
    bs.ready = 0;
    if (grad_sync_ && options_.overlap_grad_reduce()) start_bucket(pp.bucket);
  }
  if (observer_) observer_(i);
}

void ParamAndGradBuffer::start_bucket(int64_t b) {
  auto& bs = buckets_[b];
  if (bs.launched) return;
  bs.launched = true;
  if (options_.zero_stage() >= 2) ensure_grad_staging(b);
  const int64_t dp = dp_.size();
  const int64_t divisor = options_.grad_average_over() > 0 ? options_.grad_average_over() : dp;
  // Gloo has no average: scale by 1/divisor, then sum (exact for powers of two). A group of
  // one rank still divides when told to average over more ranks than it has.
  if (divisor != 1) bs.grad_full.mul_(1.0 / static_cast<double>(divisor));
  if (dp == 1) return;
  bs.work = options_.zero_stage() == 0 ? dp_.all_reduce_async(bs.grad_full) : dp_.reduce_scatter_async(bs.grad_full);
}

void ParamAndGradBuffer::wait_bucket(int64_t b) {
  auto& bs = buckets_[b];
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

// The in-flight reductions of an abandoned backward (a step that was not taken): waited
// for and dropped, so no collective writes into a buffer being zeroed.
void ParamAndGradBuffer::drain_in_flight() {
  for (auto& bs : buckets_) {
    bs.work.wait();  // a no-op when nothing is in flight
    bs.work = comm::Work();
    bs.launched = false;
    bs.ready = 0;
  }
}

void ParamAndGradBuffer::finish_grad_sync() {
  for (size_t b = 0; b < buckets_.size(); ++b) start_bucket(static_cast<int64_t>(b));
  for (size_t b = 0; b < buckets_.size(); ++b) {
    wait_bucket(static_cast<int64_t>(b));
    buckets_[b].launched = false;
    buckets_[b].ready = 0;
  }
  sum_partial_grads();
}

// ParamInfo::grad_sum_group: one all-reduce per group over the concatenated slices this
// rank owns (all of each gradient at stage 0). The group's ranks own the same slices, as
// their layouts are the same, so the sums line up element for element.
// With grad_sum_ranks the two copies' owners exchange their slices (one coalesced batch)
// and add: a + b on one rank, b + a on the other, the same bits.
// The slices are views into the persistent grad_shard of each bucket: found once.
void ParamAndGradBuffer::plan_partial_sums() {
  std::map<std::pair<std::string, std::vector<int64_t>>, std::vector<at::Tensor>> slices;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bs = buckets_[b];
    for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t at, int64_t, int64_t n) {
      const auto& info = info_[i];
      if (!info.grad_sum_group.empty()) slices[{info.grad_sum_group, info.grad_sum_ranks}].push_back(bs.grad_shard.narrow(0, at, n));
    });
  }
  for (auto& [key, views] : slices) {
    const auto& [group_name, ranks] = key;
    comm::Group group(group_name);
    int64_t peer = -1;
    if (!ranks.empty()) {
      MEGATORCH_CHECK(ranks[0] != ranks[1] && (ranks[0] == group.rank() || ranks[1] == group.rank()),
                      "DistributedOptimizer: grad_sum_ranks {", ranks[0], ", ", ranks[1], "} of group '", group_name,
                      "' must be two ranks, this rank (", group.rank(), ") one of them");
      peer = ranks[0] == group.rank() ? ranks[1] : ranks[0];
    }
    partial_sums_.push_back(PartialSum{std::move(group), peer, std::move(views)});
  }
}

void ParamAndGradBuffer::sum_partial_grads() {
  at::NoGradGuard no_grad;
  for (auto& sum : partial_sums_) {
    comm::reduce_flattened(sum.views, [&sum](at::Tensor& flat) {
      if (sum.peer < 0) {
        sum.group.all_reduce(flat);
        return;
      }
      at::Tensor other = at::empty_like(flat);
      sum.group.batch_p2p({{comm::P2POp::Kind::kSend, flat, sum.peer, 0}, {comm::P2POp::Kind::kRecv, other, sum.peer, 0}})
          .wait();
      flat.add_(other);
    });
  }
}

}  // namespace megatorch::optim
