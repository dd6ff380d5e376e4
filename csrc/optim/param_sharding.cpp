#include "megatorch/optim/param_sharding.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include "megatorch/check.h"
#include "megatorch/optim/storage.h"

namespace megatorch::optim {
namespace {

// Live ParamShardings by handle. Handles are never reused, so a stale one finds nothing.
struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::weak_ptr<ParamSharding>> live;
  std::atomic<int64_t> next{1};
};
Registry& registry() {
  static Registry r;
  return r;
}

// Identity whose backward gathers a unit before autograd runs the unit's backward, and
// prefetches the unit whose backward comes next.
struct GatherBeforeBackward : torch::autograd::Function<GatherBeforeBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t sharding, int64_t unit,
                            int64_t next) {
    ctx->saved_data["sharding"] = sharding;
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["next"] = next;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto sharding = ParamSharding::from_handle(ctx->saved_data["sharding"].toInt());
    sharding->begin_unit_backward(ctx->saved_data["unit"].toInt());
    sharding->prefetch_unit(ctx->saved_data["next"].toInt());
    return {grads[0], at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A hook object outliving its optimizer (a model kept after the optimizer was dropped)
// must not reach into freed buffers either.
std::shared_ptr<ParamSharding> lock_or_fail(const std::weak_ptr<ParamSharding>& weak) {
  auto s = weak.lock();
  MEGATORCH_CHECK(s, "a model's unit hooks ran after the DistributedOptimizer that shards its parameters was destroyed; "
                  "keep the optimizer alive as long as the model runs, or build the model again without its hooks");
  return s;
}

// ZeRO-3: the hooks of one chunk, its root unit `first` (embedding, final norm, head),
// then its layers first+1..last. Forward runs root, layers in order, root (the head);
// backward the root (head), layers last to first, root (embedding).
class Zero3UnitHooks : public models::UnitHooks {
 public:
  Zero3UnitHooks(std::weak_ptr<ParamSharding> sharding, int64_t first, int64_t last)
      : sharding_(std::move(sharding)), first_(first), last_(last) {}
  void before_forward(int64_t unit) override {
    const auto s = lock_or_fail(sharding_);
    s->gather_unit(unit);
    if (unit + 1 <= last_) s->prefetch_unit(unit + 1);
  }
  at::Tensor after_forward(int64_t unit, const at::Tensor& output) override {
    const auto s = lock_or_fail(sharding_);
    s->release_unit(unit);
    if (!output.requires_grad() || !at::GradMode::is_enabled()) return output;
    const int64_t next = unit == first_ ? last_ : unit - 1 > first_ ? unit - 1 : -1;
    return GatherBeforeBackward::apply(output, s->handle(), unit, next);
  }

 private:
  std::weak_ptr<ParamSharding> sharding_;
  int64_t first_, last_;
};

// ZeRO-1/2 with overlap_param_gather: wait for the unit's parameters before its forward.
class ParamGatherHooks : public models::UnitHooks {
 public:
  explicit ParamGatherHooks(std::weak_ptr<ParamSharding> sharding) : sharding_(std::move(sharding)) {}
  void before_forward(int64_t unit) override { lock_or_fail(sharding_)->finish_param_gather(unit); }
  at::Tensor after_forward(int64_t, const at::Tensor& output) override { return output; }

 private:
  std::weak_ptr<ParamSharding> sharding_;
};

}  // namespace

std::shared_ptr<ParamSharding> ParamSharding::create(std::shared_ptr<ParamAndGradBuffer> buffer,
                                                     bool overlap_param_gather) {
  std::shared_ptr<ParamSharding> s(new ParamSharding(std::move(buffer), overlap_param_gather));
  auto& r = registry();
  s->handle_ = r.next++;
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live[s->handle_] = s;
  return s;
}

ParamSharding::ParamSharding(std::shared_ptr<ParamAndGradBuffer> buffer, bool overlap_param_gather)
    : buffer_(std::move(buffer)), overlap_param_gather_(overlap_param_gather) {
  const auto& layout = buffer_->layout();
  const int64_t units = buffer_->num_units();
  buckets_.resize(layout.buckets.size());
  unit_buckets_.assign(units, {});
  unit_param_buckets_.assign(units, {});
  unit_grads_ready_.assign(units, 0);
  for (size_t b = 0; b < layout.buckets.size(); ++b) unit_buckets_[layout.buckets[b].unit].push_back(static_cast<int64_t>(b));
  for (size_t i = 0; i < buffer_->parameters().size(); ++i) {
    auto& list = unit_param_buckets_[buffer_->unit_of_param(static_cast<int64_t>(i))];
    const int64_t b = layout.params[i].bucket;
    if (std::find(list.begin(), list.end(), b) == list.end()) list.push_back(b);
  }
  // Stage 3 starts with every unit sharded: the buffer left the full copies in place.
  if (zero_stage() == 3) release_all();
}

ParamSharding::~ParamSharding() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live.erase(handle_);
}

std::shared_ptr<ParamSharding> ParamSharding::from_handle(int64_t handle) {
  auto& r = registry();
  std::shared_ptr<ParamSharding> s;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.live.find(handle);
    if (it != r.live.end()) s = it->second.lock();
  }
  MEGATORCH_CHECK(s, "ZeRO-3 backward: the DistributedOptimizer that shards this unit's parameters was destroyed "
                  "before the backward reached it; keep the optimizer alive until backward (and step) are done");
  return s;
}

std::shared_ptr<models::UnitHooks> ParamSharding::unit_hooks(int64_t first, int64_t last) {
  MEGATORCH_CHECK(0 <= first && first <= last && last < num_units(), "DistributedOptimizer::unit_hooks: expected ",
                  "0 <= first <= last < ", num_units(), " (the units of one chunk), got ", first, "..", last);
  if (zero_stage() == 3) return std::make_shared<Zero3UnitHooks>(weak_from_this(), first, last);
  const bool overlaps = (zero_stage() == 1 || zero_stage() == 2) && overlap_param_gather_;
  return overlaps ? std::make_shared<ParamGatherHooks>(weak_from_this()) : nullptr;
}

// ---- ZeRO-3: the units gathered, prefetched and freed ----

void ParamSharding::prefetch_unit(int64_t u) {
  if (zero_stage() != 3 || u < 0 || u >= num_units()) return;
  auto& buckets = buffer_->buckets();
  for (int64_t b : unit_buckets_[u]) {
    auto& g = buckets_[b];
    if (!g.gathered && !g.prefetch) g.prefetch = buffer_->dp_group().all_gather_async(buckets[b].param_shard);
  }
}

void ParamSharding::gather_unit(int64_t u) {
  MEGATORCH_CHECK(u >= 0 && u < num_units(), "DistributedOptimizer::gather_unit: expected a unit in [0, ", num_units(),
                  "), got ", u);
  if (zero_stage() != 3) return finish_param_gather(u);
  prefetch_unit(u);
  at::NoGradGuard no_grad;
  auto& buckets = buffer_->buckets();
  const bool alone = buffer_->dp_group().size() == 1;
  for (int64_t b : unit_buckets_[u]) {
    auto& g = buckets_[b];
    if (g.gathered) continue;
    at::Tensor full = g.prefetch->wait();
    g.prefetch.reset();
    auto& bs = buckets[b];
    resize_storage(bs.param_full, bs.param_full.numel() * bs.param_full.element_size());
    bs.param_full.copy_(alone ? bs.param_shard : full);
    g.gathered = true;
  }
}

void ParamSharding::release_unit(int64_t u) {
  if (zero_stage() != 3) return;
  auto& buckets = buffer_->buckets();
  for (int64_t b : unit_buckets_[u]) {
    if (!buckets_[b].gathered) continue;
    resize_storage(buckets[b].param_full, 0);
    buckets_[b].gathered = false;
  }
}

void ParamSharding::release_all() {
  for (int64_t u = 0; u < num_units(); ++u) release_unit(u);
}

void ParamSharding::drop_prefetches() {
  for (auto& g : buckets_) {
    if (g.prefetch) g.prefetch->wait();
    g.prefetch.reset();
  }
}

void ParamSharding::begin_unit_backward(int64_t unit) {
  // The gradient reached this unit's output: the unit B ran before it has its input
  // gradient computed, and (split) nothing later reads its parameters.
  if (split_backward_ && backward_unit_ >= 0 && backward_unit_ != unit) release_unit(backward_unit_);
  backward_unit_ = unit;
  gather_unit(unit);
}

void ParamSharding::on_param_grad_ready(int64_t param) {
  // Under a split backward a unit's gradients come over B and W of interleaved
  // micro-batches: counting them says nothing about when B is done with the unit.
  if (zero_stage() != 3 || split_backward_) return;
  // The unit's backward is over once all of its gradients are in: free its parameters.
  const int64_t u = buffer_->unit_of_param(param);
  if (++unit_grads_ready_[u] == static_cast<int64_t>(buffer_->units()[u].size())) {
    unit_grads_ready_[u] = 0;
    release_unit(u);
  }
}

void ParamSharding::reset_backward() { std::fill(unit_grads_ready_.begin(), unit_grads_ready_.end(), 0); }

// ---- ZeRO-1/2: the post-update all-gathers ----

void ParamSharding::after_update() {
  if (zero_stage() == 3) {
    // A unit still gathered holds the old values; the next use gathers the new.
    release_all();
    return;
  }
  if (zero_stage() == 0) return;
  if (buffer_->dp_group().size() > 1) {
    // Buckets are laid out in backward order: the forward needs the last one first.
    auto& buckets = buffer_->buckets();
    for (auto b = static_cast<int64_t>(buckets.size()) - 1; b >= 0; --b) {
      auto& g = buckets_[b];
      if (!g.param_gather) g.param_gather = buffer_->dp_group().all_gather_async(buckets[b].param_shard);
    }
  }
  if (!overlap_param_gather_) finish_param_gather();
}

void ParamSharding::finish_param_gather(int64_t unit) {
  auto& buckets = buffer_->buckets();
  auto finish = [&](int64_t b) {
    auto& g = buckets_[b];
    if (!g.param_gather) return;
    const at::Tensor full = g.param_gather->wait();
    g.param_gather.reset();
    at::NoGradGuard no_grad;
    buckets[b].param_full.copy_(full);
  };
  if (unit < 0) {
    for (size_t b = 0; b < buckets_.size(); ++b) finish(static_cast<int64_t>(b));
    return;
  }
  for (int64_t b : unit_param_buckets_.at(unit)) finish(b);
}

int64_t ParamSharding::pending_param_gathers() const {
  int64_t n = 0;
  for (const auto& g : buckets_) n += g.param_gather ? 1 : 0;
  return n;
}

}  // namespace megatorch::optim
