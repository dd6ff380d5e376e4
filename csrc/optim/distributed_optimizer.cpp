#include "megatorch/optim/distributed_optimizer.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>

#include "megatorch/check.h"
#include "megatorch/kernels/fused_adamw.h"
#include "megatorch/optim/storage.h"
#include "optimizer_state.h"

namespace megatorch::optim {
namespace {

bool is_16bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Overlap of [a, a + n) and [b, b + m), as (begin, length); length 0 when disjoint.
std::pair<int64_t, int64_t> overlap(int64_t a, int64_t n, int64_t b, int64_t m) {
  const int64_t lo = std::max(a, b), hi = std::min(a + n, b + m);
  return {lo, std::max<int64_t>(0, hi - lo)};
}

}  // namespace

namespace {
// The range of bucket b this rank owns: all of it at stage 0.
std::pair<int64_t, int64_t> owned(const BucketPlace& b, int64_t stage, int64_t rank, int64_t dp) {
  if (stage == 0) return {0, b.numel};
  return {rank * b.numel / dp, b.numel / dp};
}
}  // namespace

DistributedOptimizer::DistributedOptimizer(std::vector<std::vector<at::Tensor>> units, const std::string& dp_group,
                                           DistributedOptimizerOptions options, std::vector<ParamInfo> info)
    : units_(std::move(units)), info_(std::move(info)), dp_(dp_group), options_(std::move(options)),
      state_(std::make_unique<State>()) {
  const int64_t stage = options_.zero_stage();
  MEGATORCH_CHECK(stage >= 0 && stage <= 3, "DistributedOptimizer: expected zero_stage in 0..3, got ", stage,
                  "; use 0 (plain DP), 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)");
  for (size_t u = 0; u < units_.size(); ++u) {
    for (const auto& p : units_[u]) {
      MEGATORCH_CHECK(p.defined() && p.is_leaf() && p.requires_grad(),
                      "DistributedOptimizer: expected leaf parameters that require grad; parameter ", params_.size(),
                      " is not (pass model.parameters())");
      MEGATORCH_CHECK(p.scalar_type() == at::kFloat || is_16bit(p.scalar_type()),
                      "DistributedOptimizer: expected fp32, bf16 or fp16 parameters; parameter ", params_.size(), " is ",
                      p.scalar_type());
      params_.push_back(p);
      unit_of_param_.push_back(static_cast<int64_t>(u));
    }
  }
  MEGATORCH_CHECK(!params_.empty(), "DistributedOptimizer: got no parameters; pass the model's parameters");
  if (info_.empty()) info_.resize(params_.size());
  MEGATORCH_CHECK(info_.size() == params_.size(), "DistributedOptimizer: expected one ParamInfo per parameter (",
                  params_.size(), "), got ", info_.size());
  const bool has_fp16 = std::any_of(params_.begin(), params_.end(), [](const at::Tensor& p) { return p.scalar_type() == at::kHalf; });
  MEGATORCH_CHECK(!has_fp16 || options_.loss_scaler(),
                  "DistributedOptimizer: fp16 parameters need a loss scaler (their gradients overflow without one); set "
                  "DistributedOptimizerOptions::loss_scaler (e.g. std::make_shared<DynamicLossScaler>()), or use bf16");
  const int64_t dp = dp_.size();
  check_same_parameters_across_ranks();
  const int64_t bucket = options_.bucket_size() > 0 ? options_.bucket_size() : default_bucket_size(dp);
  std::vector<bool> alone(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    alone[i] = info_[i].own_bucket;
    MEGATORCH_CHECK(info_[i].grad_sum_ranks.empty() || (info_[i].own_bucket && info_[i].grad_sum_ranks.size() == 2 &&
                                                       !info_[i].grad_sum_group.empty()),
                    "DistributedOptimizer: parameter ", i, " has grad_sum_ranks; expected exactly two ranks of a "
                    "grad_sum_group and own_bucket set (so both copies are sharded alike)");
  }
  layout_ = build_bucket_layout(units_, bucket, dp, stage == 3, alone);
  build_buffers();
  register_hooks();
}

DistributedOptimizer::~DistributedOptimizer() {
  for (const auto& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

std::pair<int64_t, int64_t> DistributedOptimizer::owned_range(int64_t b) const {
  return owned(layout_.buckets[b], options_.zero_stage(), dp_.rank(), dp_.size());
}

void DistributedOptimizer::for_each_owned_slice(int64_t b, const OwnedSliceFn& fn) const {
  const auto [begin, len] = owned_range(b);
  for (int64_t i : layout_.buckets[b].params) {
    const auto& pp = layout_.params[i];
    const auto [lo, n] = overlap(pp.offset, pp.numel, begin, len);
    if (n > 0) fn(i, lo - begin, lo - pp.offset, n);
  }
}

// Every DP rank must hold the same parameter list, or the bucket collectives would not
// match: compare a fingerprint first and fail on every rank (no hang) when they differ.
void DistributedOptimizer::check_same_parameters_across_ranks() {
  if (dp_.size() == 1) return;
  uint64_t hash = 1469598103934665603ull;
  auto mix = [&](uint64_t v) { hash = (hash ^ v) * 1099511628211ull; };
  int64_t numel = 0;
  for (const auto& p : params_) {
    mix(static_cast<uint64_t>(p.scalar_type()));
    for (int64_t d : p.sizes()) mix(static_cast<uint64_t>(d));
    numel += p.numel();
  }
  at::Tensor mine = at::tensor({static_cast<int64_t>(params_.size()), numel, static_cast<int64_t>(hash >> 1),
                                static_cast<int64_t>(units_.size())},
                               at::kLong);
  if (params_[0].is_cuda()) mine = mine.to(params_[0].device());
  const at::Tensor all = dp_.all_gather(mine).cpu().view({dp_.size(), 4});
  for (int64_t r = 0; r < dp_.size(); ++r) {
    MEGATORCH_CHECK(at::equal(all[r], all[0]), "DistributedOptimizer: expected the same parameters on every rank of DP group '",
                    dp_.name(), "'; rank 0 has ", all[0][0].item<int64_t>(), " parameters (", all[0][1].item<int64_t>(),
                    " elements) in ", all[0][3].item<int64_t>(), " units, rank ", r, " has ", all[r][0].item<int64_t>(), " (",
                    all[r][1].item<int64_t>(), " elements) in ", all[r][3].item<int64_t>(),
                    " units, or their shapes/dtypes differ; build the same model on every DP rank");
  }
}

void DistributedOptimizer::build_buffers() {
  const int64_t stage = options_.zero_stage(), dp = dp_.size();
  const auto device = params_[0].device();
  auto& st = *state_;
  st.buckets.resize(layout_.buckets.size());
  st.unit_buckets.assign(units_.size(), {});
  st.unit_ready.assign(units_.size(), 0);
  st.unit_param_buckets.assign(units_.size(), {});
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& list = st.unit_param_buckets[unit_of_param_[i]];
    const int64_t b = layout_.params[i].bucket;
    if (std::find(list.begin(), list.end(), b) == list.end()) list.push_back(b);
  }
  auto grad_dtype = [&](at::ScalarType t) { return is_16bit(t) && options_.grad_in_fp32() ? at::kFloat : t; };
  // Stages 0-2 keep every parameter in one flat buffer per dtype (stage 3 one per unit).
  for (const auto& [dtype, numel] : layout_.buffers) {
    if (stage < 3) st.param_buffers.push_back(at::zeros({numel}, at::TensorOptions().dtype(dtype).device(device)));
    if (stage < 2) st.grad_buffers.push_back(at::zeros({numel}, at::TensorOptions().dtype(grad_dtype(dtype)).device(device)));
  }
  auto buffer_index = [&](at::ScalarType t) {
    for (size_t i = 0; i < layout_.buffers.size(); ++i) {
      if (layout_.buffers[i].first == t) return static_cast<int64_t>(i);
    }
    return int64_t{-1};
  };
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& place = layout_.buckets[b];
    auto& bs = st.buckets[b];
    st.unit_buckets[place.unit].push_back(static_cast<int64_t>(b));
    const int64_t buf = buffer_index(place.dtype);
    bs.param_full = stage < 3 ? st.param_buffers[buf].narrow(0, place.begin, place.numel)
                              : at::zeros({place.numel}, at::TensorOptions().dtype(place.dtype).device(device));
    for (int64_t i : place.params) {
      const auto& pp = layout_.params[i];
      bs.param_full.narrow(0, pp.offset, pp.numel).copy_(params_[i].detach().reshape(-1));
    }
    // Start from identical parameters on every DP rank, as DDP does.
    if (options_.broadcast_parameters() && dp > 1) dp_.broadcast(bs.param_full, 0);
    for (int64_t i : place.params) {
      const auto& pp = layout_.params[i];
      at::Tensor& p = params_[i];
      {
        at::NoGradGuard no_grad;
        p.set_data(bs.param_full.narrow(0, pp.offset, pp.numel).view(p.sizes()));
      }
      p.mutable_grad() = at::Tensor();
    }
    const auto [begin, len] = owned_range(static_cast<int64_t>(b));
    bs.param_shard = stage < 3 ? bs.param_full.narrow(0, begin, len) : bs.param_full.narrow(0, begin, len).clone();
    if (stage < 2) {
      bs.grad_full = st.grad_buffers[buf].narrow(0, place.begin, place.numel);
      bs.grad_shard = bs.grad_full.narrow(0, begin, len);
      for (int64_t i : place.params) {
        const auto& pp = layout_.params[i];
        params_[i].mutable_grad() = bs.grad_full.narrow(0, pp.offset, pp.numel).view(params_[i].sizes());
      }
    } else {
      bs.grad_shard = at::zeros({len}, at::TensorOptions().dtype(grad_dtype(place.dtype)).device(device));
    }
    bs.master = is_16bit(place.dtype) ? bs.param_shard.to(at::kFloat) : bs.param_shard;
    bs.exp_avg = at::zeros({len}, at::TensorOptions().dtype(at::kFloat).device(device));
    if (options_.kind() == OptimizerKind::kAdamW) bs.exp_avg_sq = at::zeros_like(bs.exp_avg);
  }
  if (stage == 3) {
    for (size_t u = 0; u < units_.size(); ++u) release_unit(static_cast<int64_t>(u));
  }
}

// In-flight work of an abandoned backward (a step that was not taken) and prefetches no
// forward or backward consumed: waited for and dropped, so nothing stale is used later
// and no collective writes into a buffer being zeroed or updated.
void DistributedOptimizer::drain_in_flight() {
  for (auto& bs : state_->buckets) {
    bs.work.wait();  // a no-op when nothing is in flight
    bs.work = comm::Work();
    bs.launched = false;
    bs.ready = 0;
    if (bs.prefetch) bs.prefetch->wait();
    bs.prefetch.reset();
  }
  std::fill(state_->unit_ready.begin(), state_->unit_ready.end(), 0);
}

void DistributedOptimizer::zero_grad() {
  drain_in_flight();
  for (auto& bs : state_->buckets) {
    bs.grad_shard.zero_();
    if (options_.zero_stage() < 2) bs.grad_full.zero_();
    bs.ready = 0;
  }
  std::fill(state_->unit_ready.begin(), state_->unit_ready.end(), 0);
  if (options_.zero_stage() >= 2) {
    for (auto& bs : state_->buckets) bs.grad_full = at::Tensor();
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
  }
}

// The groups a step's reductions (overflow, norm) span: model parallel, plus DP once
// every DP rank holds only a shard of the gradients.
static std::vector<std::string> reduction_groups(const DistributedOptimizerOptions& o, const comm::Group& dp) {
  std::vector<std::string> groups = o.model_parallel_groups();
  if (o.zero_stage() >= 1 && dp.size() > 1) groups.push_back(dp.name());
  return groups;
}

bool DistributedOptimizer::found_overflow() {
  // Built on the device, read once: one host synchronisation per step, not one per bucket.
  at::Tensor flag = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(params_[0].device()));
  for (const auto& bs : state_->buckets) flag = at::maximum(flag, at::logical_not(at::isfinite(bs.grad_shard).all()).to(at::kFloat));
  for (const auto& g : reduction_groups(options_, dp_)) comm::Group(g).all_reduce(flag, comm::ReduceOp::kMax);
  return flag.item<float>() > 0;
}

double DistributedOptimizer::global_grad_norm() {
  // Each parameter counted once: only the owned range of each bucket, only parameters
  // marked counted_in_norm (not a TP-replicated copy on tp rank > 0, not a tied copy).
  // Norms of contiguous fp32 slices (vectorised, no copies), their squares summed in double.
  at::Tensor sum = at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(params_[0].device()));
  const auto add = [&sum](const at::Tensor& g) {
    const at::Tensor n = at::linalg_vector_norm(g, 2);
    sum += (n * n).to(at::kDouble);
  };
  for (size_t b = 0; b < state_->buckets.size(); ++b) {
    const auto& bs = state_->buckets[b];
    const auto& place = layout_.buckets[b];
    const auto [begin, len] = owned_range(static_cast<int64_t>(b));
    const bool all_counted = std::all_of(place.params.begin(), place.params.end(),
                                         [this](int64_t i) { return info_[i].counted_in_norm; });
    if (all_counted) {  // the common case: one norm over the owned, used part of the bucket
      const auto [lo, n] = overlap(0, place.used, begin, len);
      if (n > 0) add(bs.grad_shard.narrow(0, lo - begin, n));
      continue;
    }
    for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t at, int64_t, int64_t n) {
      if (info_[i].counted_in_norm) add(bs.grad_shard.narrow(0, at, n));
    });
  }
  for (const auto& g : reduction_groups(options_, dp_)) comm::Group(g).all_reduce(sum);
  return std::sqrt(sum.item<double>());
}

bool DistributedOptimizer::step() {
  finish_param_gather();  // a forward that skipped some unit leaves its gather pending
  finish_grad_sync();
  // A unit prefetched but never gathered this step would otherwise hold pre-update values.
  for (auto& bs : state_->buckets) {
    if (bs.prefetch) bs.prefetch->wait();
    bs.prefetch.reset();
  }
  double grad_scale = 1.0;  // unscale and clip in one multiply
  skipped_ = false;
  if (const auto& scaler = options_.loss_scaler()) {
    const double used = scaler->scale();  // what this step's loss was multiplied by
    skipped_ = scaler->update(found_overflow());
    // A skipped step leaves parameters and optimizer state untouched, bit for bit.
    if (skipped_) return false;
    grad_scale = 1.0 / used;
  }
  grad_norm_ = global_grad_norm() * grad_scale;
  if (options_.clip_grad() > 0) {
    const double coef = options_.clip_grad() / (grad_norm_ + 1e-6);
    if (coef < 1.0) grad_scale *= coef;
  }
  ++step_;
  update_shards(grad_scale);
  // Stages 1-2: every rank updated its range; put the full parameters back together
  // (now, or unit by unit as the next forward reaches them).
  if (options_.zero_stage() == 1 || options_.zero_stage() == 2) {
    launch_param_gathers();
    if (!options_.overlap_param_gather()) finish_param_gather();
  }
  // Stage 3: a unit still gathered holds the old values; the next use gathers the new.
  for (int64_t u = 0; u < num_units(); ++u) release_unit(u);
  return true;
}

// The optimizer update on this rank's range of every bucket, parameter by parameter
// (weight decay is per parameter): one multi-tensor call per (weight decay, 16-bit copy).
void DistributedOptimizer::update_shards(double grad_scale) {
  struct Lists {
    std::vector<at::Tensor> master, grad, m, v, model;
  };
  std::map<std::pair<bool, bool>, Lists> lists;  // (weight decay, writes a 16-bit model copy)
  for (size_t b = 0; b < state_->buckets.size(); ++b) {
    auto& bs = state_->buckets[b];
    // Unscaled, clipped fp32 gradients of the owned range (16-bit ones are upcast first).
    at::Tensor g = bs.grad_shard.scalar_type() == at::kFloat ? bs.grad_shard : bs.grad_shard.to(at::kFloat);
    if (grad_scale != 1.0) g.mul_(grad_scale);
    const bool model_copy = is_16bit(layout_.buckets[b].dtype);
    for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t first, int64_t, int64_t n) {
      Lists& l = lists[{info_[i].weight_decay, model_copy}];
      l.master.push_back(bs.master.narrow(0, first, n));
      l.grad.push_back(g.narrow(0, first, n));
      l.m.push_back(bs.exp_avg.narrow(0, first, n));
      if (bs.exp_avg_sq.defined()) l.v.push_back(bs.exp_avg_sq.narrow(0, first, n));
      if (model_copy) l.model.push_back(bs.param_shard.narrow(0, first, n));
    });
  }
  const auto& o = options_;
  at::NoGradGuard no_grad;
  for (auto& [key, l] : lists) {
    const double wd = key.first ? o.weight_decay() : 0.0;
    if (o.kind() == OptimizerKind::kAdamW) {
      std::optional<at::TensorList> model;
      if (key.second) model = at::TensorList(l.model);
      kernels::fused_adamw_(l.master, l.grad, l.m, l.v, o.lr(), o.beta1(), o.beta2(), o.eps(), wd, step_, model);
      continue;
    }
    // SGD with momentum, as torch.optim.SGD: coupled weight decay, the buffer starts at g.
    for (size_t j = 0; j < l.master.size(); ++j) {
      at::Tensor d = wd != 0 ? l.grad[j] + wd * l.master[j] : l.grad[j];
      if (o.momentum() != 0) {
        if (step_ == 1) {
          l.m[j].copy_(d);
        } else {
          l.m[j].mul_(o.momentum()).add_(d);
        }
        d = l.m[j];
      }
      l.master[j].add_(d, -o.lr());
      if (key.second) l.model[j].copy_(l.master[j]);
    }
  }
}

void DistributedOptimizer::copy_master_to_params() {
  finish_param_gather();  // an older gather must not land on top of these values
  at::NoGradGuard no_grad;
  for (auto& bs : state_->buckets) {
    if (!bs.master.is_same(bs.param_shard)) bs.param_shard.copy_(bs.master);
  }
  if (options_.zero_stage() == 1 || options_.zero_stage() == 2) {
    for (auto& bs : state_->buckets) {
      at::Tensor full = dp_.all_gather(bs.param_shard);
      if (dp_.size() > 1) bs.param_full.copy_(full);
    }
  }
}

void DistributedOptimizer::copy_params_to_master() {
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < state_->buckets.size(); ++b) {
    auto& bs = state_->buckets[b];
    if (options_.zero_stage() == 3) {
      MEGATORCH_CHECK(bs.gathered, "DistributedOptimizer::copy_params_to_master: expected every unit gathered at ZeRO-3 "
                      "(gather_unit) so the loaded parameters are readable; unit ", layout_.buckets[b].unit, " is not");
      const auto [begin, len] = owned_range(static_cast<int64_t>(b));
      bs.param_shard.copy_(bs.param_full.narrow(0, begin, len));
    }
    if (!bs.master.is_same(bs.param_shard)) bs.master.copy_(bs.param_shard);
  }
}

std::map<std::string, int64_t> DistributedOptimizer::memory_stats() const {
  const int64_t stage = options_.zero_stage(), dp = dp_.size();
  const int64_t states = options_.kind() == OptimizerKind::kAdamW ? 2 : 1;
  std::map<std::string, int64_t> m{{"param_bytes", 0}, {"grad_bytes", 0}, {"master_param_bytes", 0},
                                   {"optimizer_state_bytes", 0}, {"padding_bytes", 0}};
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& place = layout_.buckets[b];
    const auto& bs = state_->buckets[b];
    const int64_t psize = at::elementSize(place.dtype), gsize = at::elementSize(bs.grad_shard.scalar_type());
    const auto [begin, len] = owned(place, stage, dp_.rank(), dp);
    const int64_t owned_used = overlap(0, place.used, begin, len).second, owned_pad = len - owned_used;
    const int64_t full_pad = place.numel - place.used;
    // Parameters: all of them (stages 0-2) or the owned range (stage 3).
    m["param_bytes"] += (stage < 3 ? place.used : owned_used) * psize;
    m["padding_bytes"] += (stage < 3 ? full_pad : owned_pad) * psize;
    m["grad_bytes"] += (stage < 2 ? place.used : owned_used) * gsize;
    m["padding_bytes"] += (stage < 2 ? full_pad : owned_pad) * gsize;
    if (is_16bit(place.dtype)) {
      m["master_param_bytes"] += owned_used * 4;
      m["padding_bytes"] += owned_pad * 4;
    }
    m["optimizer_state_bytes"] += owned_used * 4 * states;
    m["padding_bytes"] += owned_pad * 4 * states;
  }
  int64_t total = 0;
  for (const auto& [k, v] : m) total += v;
  m["total_bytes"] = total;
  return m;
}

std::map<std::string, at::Tensor> DistributedOptimizer::state_dict() const {
  std::map<std::string, at::Tensor> out;
  out["step"] = at::tensor(step_, at::kLong);
  out["zero_stage"] = at::tensor(options_.zero_stage(), at::kLong);
  out["dp_size"] = at::tensor(dp_.size(), at::kLong);
  const bool adam = options_.kind() == OptimizerKind::kAdamW;
  for (size_t b = 0; b < state_->buckets.size(); ++b) {
    const auto& bs = state_->buckets[b];
    const std::string key = "bucket." + std::to_string(b) + ".";
    out[key + "master"] = bs.master.detach().clone();
    out[key + (adam ? "exp_avg" : "momentum")] = bs.exp_avg.clone();
    if (adam) out[key + "exp_avg_sq"] = bs.exp_avg_sq.clone();
  }
  if (const auto& scaler = options_.loss_scaler()) {
    for (const auto& [k, v] : scaler->state_dict()) out["loss_scaler." + k] = at::tensor(v, at::kDouble);
  }
  return out;
}

void DistributedOptimizer::load_state_dict(const std::map<std::string, at::Tensor>& state) {
  auto get = [&](const std::string& key) -> const at::Tensor& {
    auto it = state.find(key);
    MEGATORCH_CHECK(it != state.end(), "DistributedOptimizer::load_state_dict: expected key '", key,
                    "' (a state_dict of the same layout: same parameters, zero stage, DP size and optimizer); it is "
                    "missing. To change the layout, load through the checkpoint code, which reshards");
    return it->second;
  };
  MEGATORCH_CHECK(get("zero_stage").item<int64_t>() == options_.zero_stage() && get("dp_size").item<int64_t>() == dp_.size(),
                  "DistributedOptimizer::load_state_dict: expected a state of ZeRO stage ", options_.zero_stage(),
                  " over ", dp_.size(), " DP ranks, got stage ", get("zero_stage").item<int64_t>(), " over ",
                  get("dp_size").item<int64_t>(), "; load through the checkpoint code to reshard");
  const bool adam = options_.kind() == OptimizerKind::kAdamW;
  // Check every shape before changing anything.
  for (size_t b = 0; b < state_->buckets.size(); ++b) {
    const std::string key = "bucket." + std::to_string(b) + ".";
    for (const char* name : {"master", adam ? "exp_avg" : "momentum"}) {
      MEGATORCH_CHECK(get(key + name).numel() == state_->buckets[b].exp_avg.numel(),
                      "DistributedOptimizer::load_state_dict: '", key, name, "' has ", get(key + name).numel(),
                      " elements, expected ", state_->buckets[b].exp_avg.numel(), " (another model or bucket size?)");
    }
  }
  at::NoGradGuard no_grad;
  step_ = get("step").item<int64_t>();
  for (size_t b = 0; b < state_->buckets.size(); ++b) {
    auto& bs = state_->buckets[b];
    const std::string key = "bucket." + std::to_string(b) + ".";
    bs.master.copy_(get(key + "master"));
    bs.exp_avg.copy_(get(key + (adam ? "exp_avg" : "momentum")));
    if (adam) bs.exp_avg_sq.copy_(get(key + "exp_avg_sq"));
  }
  if (const auto& scaler = options_.loss_scaler()) {
    std::map<std::string, double> s;
    for (const auto& [k, v] : state) {
      if (k.rfind("loss_scaler.", 0) == 0) s[k.substr(12)] = v.item<double>();
    }
    scaler->load_state_dict(s);
  }
  copy_master_to_params();
}

std::vector<DistributedOptimizer::ParamStateShard> DistributedOptimizer::param_state_shards() {
  std::vector<ParamStateShard> out;
  const bool adam = options_.kind() == OptimizerKind::kAdamW;
  for (size_t b = 0; b < state_->buckets.size(); ++b) {
    auto& bs = state_->buckets[b];
    for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t at, int64_t in_param, int64_t n) {
      ParamStateShard s{i, in_param, in_param + n, {}};
      s.tensors["master"] = bs.master.detach().narrow(0, at, n);
      s.tensors[adam ? "exp_avg" : "momentum"] = bs.exp_avg.narrow(0, at, n);
      if (adam) s.tensors["exp_avg_sq"] = bs.exp_avg_sq.narrow(0, at, n);
      out.push_back(std::move(s));
    });
  }
  return out;
}

}  // namespace megatorch::optim
