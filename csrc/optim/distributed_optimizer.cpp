// DistributedOptimizer: the update (AdamW or SGD on fp32 masters, clipping, loss scaling)
// and the optimizer state; the buffers and their reduction are ParamAndGradBuffer's, the
// gathering of sharded parameters ParamSharding's.
#include "megatorch/optim/distributed_optimizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "megatorch/check.h"
#include "megatorch/kernels/fused_adamw.h"
#include "megatorch/util/strings.h"

namespace megatorch::optim {
namespace {

ParamAndGradBufferOptions buffer_options(const DistributedOptimizerOptions& o) {
  return ParamAndGradBufferOptions()
      .zero_stage(o.zero_stage())
      .bucket_size(o.bucket_size())
      .grad_in_fp32(o.grad_in_fp32())
      .overlap_grad_reduce(o.overlap_grad_reduce())
      .broadcast_parameters(o.broadcast_parameters())
      .grad_average_over(o.grad_average_over())
      .gradient_accumulation_fusion(o.gradient_accumulation_fusion());
}

const std::string kScalerPrefix = "loss_scaler.";

}  // namespace

DistributedOptimizer::DistributedOptimizer(std::vector<std::vector<at::Tensor>> units, const std::string& dp_group,
                                           DistributedOptimizerOptions options, std::vector<ParamInfo> info)
    : options_(std::move(options)) {
  const bool has_fp16 = std::any_of(units.begin(), units.end(), [](const std::vector<at::Tensor>& u) {
    return std::any_of(u.begin(), u.end(), [](const at::Tensor& p) { return p.defined() && p.scalar_type() == at::kHalf; });
  });
  MEGATORCH_CHECK(!has_fp16 || options_.loss_scaler(),
                  "DistributedOptimizer: fp16 parameters need a loss scaler (their gradients overflow without one); set "
                  "DistributedOptimizerOptions::loss_scaler (e.g. std::make_shared<DynamicLossScaler>()), or use bf16");
  buffer_ = std::make_shared<ParamAndGradBuffer>(std::move(units), dp_group, buffer_options(options_), std::move(info));
  sharding_ = ParamSharding::create(buffer_, options_.overlap_param_gather());
  std::weak_ptr<ParamSharding> sharding = sharding_;
  buffer_->set_grad_ready_observer([sharding](int64_t param) {
    if (auto s = sharding.lock()) s->on_param_grad_ready(param);
  });
  // The groups a step's reductions (overflow, norm) span: model parallel, plus DP once
  // every DP rank holds only a shard of the gradients.
  for (const auto& g : options_.model_parallel_groups()) reduction_groups_.emplace_back(g);
  if (options_.zero_stage() >= 1 && buffer_->dp_group().size() > 1) reduction_groups_.push_back(buffer_->dp_group());
  build_state();
}

// The hooks that reach the buffer go with it; nothing in flight outlives the optimizer.
DistributedOptimizer::~DistributedOptimizer() { buffer_->set_grad_ready_observer(nullptr); }

void DistributedOptimizer::build_state() {
  const auto& layout = buffer_->layout();
  const auto device = buffer_->parameters()[0].device();
  const auto fp32 = at::TensorOptions().dtype(at::kFloat).device(device);
  auto& buckets = buffer_->buckets();
  state_.resize(buckets.size());
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bs = buckets[b];
    auto& st = state_[b];
    const int64_t len = bs.grad_shard.numel();
    st.master = is_16bit(layout.buckets[b].dtype) ? bs.param_shard.to(at::kFloat) : bs.param_shard;
    st.exp_avg = at::zeros({len}, fp32);
    if (options_.kind() == OptimizerKind::kAdamW) st.exp_avg_sq = at::zeros_like(st.exp_avg);
    if (bs.grad_shard.scalar_type() != at::kFloat) st.grad32 = at::zeros({len}, fp32);
  }
  // Weight decay is per parameter: one list per (weight decay, 16-bit copy) class.
  auto lists_for = [this](bool wd, bool model_copy) -> UpdateLists& {
    for (auto& l : update_lists_) {
      if (l.weight_decay == wd && l.model_copy == model_copy) return l;
    }
    update_lists_.push_back(UpdateLists{wd, model_copy, {}, {}, {}, {}, {}});
    return update_lists_.back();
  };
  const auto& info = buffer_->info();
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bs = buckets[b];
    auto& st = state_[b];
    const at::Tensor g = st.grad32.defined() ? st.grad32 : bs.grad_shard;
    const bool model_copy = is_16bit(layout.buckets[b].dtype);
    buffer_->for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t first, int64_t, int64_t n) {
      UpdateLists& l = lists_for(info[i].weight_decay, model_copy);
      l.master.push_back(st.master.narrow(0, first, n));
      l.grad.push_back(g.narrow(0, first, n));
      l.m.push_back(st.exp_avg.narrow(0, first, n));
      if (st.exp_avg_sq.defined()) l.v.push_back(st.exp_avg_sq.narrow(0, first, n));
      if (model_copy) l.model.push_back(bs.param_shard.narrow(0, first, n));
    });
  }
}

void DistributedOptimizer::zero_grad() {
  buffer_->zero_grad();
  // Prefetches no forward or backward consumed, and the counts of an abandoned backward.
  sharding_->drop_prefetches();
  sharding_->reset_backward();
}

at::Tensor DistributedOptimizer::overflow_and_norm() {
  // Each parameter counted once in the norm: only the owned range of each bucket, only
  // parameters marked counted_in_norm (not a TP-replicated copy on tp rank > 0, not a tied
  // copy). Norms of contiguous fp32 slices (vectorised, no copies), squares summed in
  // double. Both numbers stay on the device until one reduction and one read.
  const auto& layout = buffer_->layout();
  const auto& info = buffer_->info();
  const auto& buckets = buffer_->buckets();
  at::Tensor acc = at::zeros({2}, at::TensorOptions().dtype(at::kDouble).device(buffer_->parameters()[0].device()));
  at::Tensor nonfinite = acc.select(0, 0), sum = acc.select(0, 1);
  const auto add = [&sum](const at::Tensor& g) {
    const at::Tensor n = at::linalg_vector_norm(g, 2);
    sum += (n * n).to(at::kDouble);
  };
  // Only a loss scaler, or a NaN check, acts on an overflow: otherwise the pass is skipped.
  const bool check_finite = options_.loss_scaler() != nullptr || options_.check_finite_grads();
  for (size_t b = 0; b < buckets.size(); ++b) {
    const auto& grad = buckets[b].grad_shard;
    const auto& place = layout.buckets[b];
    if (check_finite) nonfinite += at::logical_not(at::isfinite(grad).all()).to(at::kDouble);
    const auto [begin, len] = buffer_->owned_range(static_cast<int64_t>(b));
    const bool all_counted = std::all_of(place.params.begin(), place.params.end(),
                                         [&info](int64_t i) { return info[i].counted_in_norm; });
    if (all_counted) {  // the common case: one norm over the owned, used part of the bucket
      const auto [lo, n] = range_overlap(0, place.used, begin, len);
      if (n > 0) add(grad.narrow(0, lo - begin, n));
      continue;
    }
    buffer_->for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t at, int64_t, int64_t n) {
      if (info[i].counted_in_norm) add(grad.narrow(0, at, n));
    });
  }
  // A sum of flags is positive where any rank's is: the overflow flag needs no MAX.
  for (auto& g : reduction_groups_) g.all_reduce(acc);
  return acc;
}

void DistributedOptimizer::finish_backward() {
  sharding_->finish_param_gather();  // a forward that skipped some unit leaves its gather pending
  buffer_->finish_grad_sync();
  // A unit prefetched but never gathered this step would otherwise hold pre-update values.
  sharding_->drop_prefetches();
}

at::Tensor DistributedOptimizer::prepare_step_on_device() {
  finish_backward();
  return overflow_and_norm();
}

GradStats DistributedOptimizer::prepare_step() {
  const at::Tensor host = prepare_step_on_device().cpu();
  const double* v = host.data_ptr<double>();
  return {v[0] > 0, v[1]};
}

double DistributedOptimizer::grad_norm() const {
  if (grad_norm_on_device_.defined()) {
    grad_norm_ = grad_norm_on_device_.item<double>();
    grad_norm_on_device_ = at::Tensor();
  }
  return grad_norm_;
}

void DistributedOptimizer::apply_step(double grad_scale, double grad_norm) {
  grad_norm_ = grad_norm;
  grad_norm_on_device_ = at::Tensor();
  take_step(grad_scale, at::Tensor());
}

void DistributedOptimizer::apply_step(const at::Tensor& grad_scale, const at::Tensor& grad_norm) {
  grad_norm_on_device_ = grad_norm;
  take_step(1.0, grad_scale);
}

void DistributedOptimizer::take_step(const c10::Scalar& grad_scale, const at::Tensor& scale_on_device) {
  skipped_ = false;
  ++step_;
  update(grad_scale, scale_on_device);
  // Every rank updated its range: the sharding makes the parameters whole again (stages
  // 1-2: all-gathers, now or as the next forward reaches each unit; stage 3: frees the
  // units still gathered, which hold the old values).
  sharding_->after_update();
}

bool DistributedOptimizer::step() { return step_together({this}); }

namespace {

// Everything checked before the first collective: a refusal on one rank is a refusal on
// all (the options are the same everywhere), so no rank is left waiting.
void check_together(const std::vector<DistributedOptimizer*>& optimizers) {
  MEGATORCH_CHECK(!optimizers.empty(), "step_together: expected at least one DistributedOptimizer, got none");
  for (size_t i = 0; i < optimizers.size(); ++i) {
    MEGATORCH_CHECK(optimizers[i] != nullptr, "step_together: optimizer ", i, " is null; pass the optimizers to step");
    for (size_t j = 0; j < i; ++j) {
      MEGATORCH_CHECK(optimizers[j] != optimizers[i], "step_together: optimizer ", i, " is optimizer ", j,
                      " again; pass each optimizer once (its parameters would be updated twice)");
    }
  }
  const auto& first = optimizers.front()->options();
  for (size_t i = 1; i < optimizers.size(); ++i) {
    const auto& o = optimizers[i]->options();
    // One loss scaled every gradient: one scale unscales them and one update follows.
    MEGATORCH_CHECK(o.loss_scaler() == first.loss_scaler(), "step_together: expected every optimizer to share "
                    "optimizer 0's loss scaler (", first.loss_scaler() ? "a DynamicLossScaler" : "none",
                    "); optimizer ", i, " has ", o.loss_scaler() ? "a different one" : "none",
                    ". Give all of them the same std::shared_ptr<DynamicLossScaler> in loss_scaler (or none)");
    // One global norm, one clip coefficient.
    MEGATORCH_CHECK(o.clip_grad() == first.clip_grad(), "step_together: expected every optimizer to have optimizer 0's "
                    "clip_grad (", first.clip_grad(), "); optimizer ", i, " has ", o.clip_grad(),
                    ". Set the same clip_grad on all of them (the norm they clip is their joint one)");
  }
}

}  // namespace

bool step_together(const std::vector<DistributedOptimizer*>& optimizers) {
  check_together(optimizers);
  const auto& first = optimizers.front()->options();
  if (!first.loss_scaler()) {
    // Nothing to decide on the host: the norm and the clip coefficient stay on the device,
    // computed as finish_step_together computes them (the same bits).
    at::Tensor sum_of_squares;
    for (auto* opt : optimizers) {
      const at::Tensor s = opt->prepare_step_on_device().select(0, 1);
      sum_of_squares = sum_of_squares.defined() ? sum_of_squares + s : s;
    }
    const at::Tensor norm = sum_of_squares.sqrt();
    at::Tensor scale;
    if (first.clip_grad() > 0) scale = (first.clip_grad() / (norm + 1e-6)).clamp_max(1.0).to(at::kFloat);
    for (auto* opt : optimizers) opt->apply_step(scale, norm);
    return true;
  }
  GradStats total;
  for (auto* opt : optimizers) {
    const GradStats s = opt->prepare_step();
    total.overflow = total.overflow || s.overflow;
    total.sum_of_squares += s.sum_of_squares;  // disjoint parameters: the squared norms add
  }
  return finish_step_together(optimizers, total);
}

bool finish_step_together(const std::vector<DistributedOptimizer*>& optimizers, const GradStats& total) {
  check_together(optimizers);
  const auto& first = optimizers.front()->options();
  double grad_scale = 1.0;  // unscale and clip in one multiply
  if (const auto& scaler = first.loss_scaler()) {
    const double used = scaler->scale();  // what this step's loss was multiplied by
    // A skipped step leaves parameters and optimizer state untouched, bit for bit.
    if (scaler->update(total.overflow)) {
      for (auto* opt : optimizers) opt->skip_step();
      return false;
    }
    grad_scale = 1.0 / used;
  }
  const double grad_norm = std::sqrt(total.sum_of_squares) * grad_scale;
  if (first.clip_grad() > 0) {
    const double coef = first.clip_grad() / (grad_norm + 1e-6);
    if (coef < 1.0) grad_scale *= coef;
  }
  for (auto* opt : optimizers) opt->apply_step(grad_scale, grad_norm);
  return true;
}

// The optimizer update on this rank's range of every bucket: unscaled, clipped fp32
// gradients (16-bit ones upcast first), then one multi-tensor call per list.
void DistributedOptimizer::update(const c10::Scalar& grad_scale, const at::Tensor& scale_on_device) {
  at::NoGradGuard no_grad;
  for (size_t b = 0; b < state_.size(); ++b) {
    auto& st = state_[b];
    const auto& grad = buffer_->buckets()[b].grad_shard;
    at::Tensor g = st.grad32.defined() ? st.grad32.copy_(grad) : grad;
    if (scale_on_device.defined()) {
      g.mul_(scale_on_device);
    } else if (grad_scale.toDouble() != 1.0) {
      g.mul_(grad_scale);
    }
  }
  const auto& o = options_;
  for (auto& l : update_lists_) {
    const double wd = l.weight_decay ? o.weight_decay() : 0.0;
    if (o.kind() == OptimizerKind::kAdamW) {
      std::optional<at::TensorList> model;
      if (l.model_copy) model = at::TensorList(l.model);
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
      if (l.model_copy) l.model[j].copy_(l.master[j]);
    }
  }
}

void DistributedOptimizer::copy_master_to_params() {
  sharding_->finish_param_gather();  // an older gather must not land on top of these values
  at::NoGradGuard no_grad;
  auto& buckets = buffer_->buckets();
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (!state_[b].master.is_same(buckets[b].param_shard)) buckets[b].param_shard.copy_(state_[b].master);
  }
  if (options_.zero_stage() == 1 || options_.zero_stage() == 2) {
    auto& dp = buffer_->dp_group();
    for (auto& bs : buckets) {
      at::Tensor full = dp.all_gather(bs.param_shard);
      if (dp.size() > 1) bs.param_full.copy_(full);
    }
  }
}

void DistributedOptimizer::copy_params_to_master() {
  at::NoGradGuard no_grad;
  auto& buckets = buffer_->buckets();
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto& bs = buckets[b];
    if (options_.zero_stage() == 3) {
      MEGATORCH_CHECK(sharding_->is_gathered(static_cast<int64_t>(b)),
                      "DistributedOptimizer::copy_params_to_master: expected every unit gathered at ZeRO-3 "
                      "(gather_unit) so the loaded parameters are readable; unit ", layout().buckets[b].unit, " is not");
      const auto [begin, len] = buffer_->owned_range(static_cast<int64_t>(b));
      bs.param_shard.copy_(bs.param_full.narrow(0, begin, len));
    }
    if (!state_[b].master.is_same(bs.param_shard)) state_[b].master.copy_(bs.param_shard);
  }
}

std::map<std::string, int64_t> DistributedOptimizer::memory_stats() const {
  const int64_t stage = options_.zero_stage();
  const int64_t states = options_.kind() == OptimizerKind::kAdamW ? 2 : 1;
  std::map<std::string, int64_t> m{{"param_bytes", 0}, {"grad_bytes", 0}, {"master_param_bytes", 0},
                                   {"optimizer_state_bytes", 0}, {"padding_bytes", 0}};
  for (size_t b = 0; b < layout().buckets.size(); ++b) {
    const auto& place = layout().buckets[b];
    const auto& bs = buffer_->buckets()[b];
    const int64_t psize = at::elementSize(place.dtype), gsize = at::elementSize(bs.grad_shard.scalar_type());
    const auto [begin, len] = buffer_->owned_range(static_cast<int64_t>(b));
    const int64_t owned_used = range_overlap(0, place.used, begin, len).second, owned_pad = len - owned_used;
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
  out["dp_size"] = at::tensor(dp_group().size(), at::kLong);
  const bool adam = options_.kind() == OptimizerKind::kAdamW;
  for (size_t b = 0; b < state_.size(); ++b) {
    const auto& bs = state_[b];
    const std::string key = "bucket." + std::to_string(b) + ".";
    out[key + "master"] = bs.master.detach().clone();
    out[key + (adam ? "exp_avg" : "momentum")] = bs.exp_avg.clone();
    if (adam) out[key + "exp_avg_sq"] = bs.exp_avg_sq.clone();
  }
  if (const auto& scaler = options_.loss_scaler()) {
    for (const auto& [k, v] : scaler->state_dict()) out[kScalerPrefix + k] = at::tensor(v, at::kDouble);
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
  MEGATORCH_CHECK(get("zero_stage").item<int64_t>() == options_.zero_stage() && get("dp_size").item<int64_t>() == dp_group().size(),
                  "DistributedOptimizer::load_state_dict: expected a state of ZeRO stage ", options_.zero_stage(),
                  " over ", dp_group().size(), " DP ranks, got stage ", get("zero_stage").item<int64_t>(), " over ",
                  get("dp_size").item<int64_t>(), "; load through the checkpoint code to reshard");
  const bool adam = options_.kind() == OptimizerKind::kAdamW;
  // Check every shape before changing anything.
  for (size_t b = 0; b < state_.size(); ++b) {
    const std::string key = "bucket." + std::to_string(b) + ".";
    for (const char* name : {"master", adam ? "exp_avg" : "momentum"}) {
      MEGATORCH_CHECK(get(key + name).numel() == state_[b].exp_avg.numel(),
                      "DistributedOptimizer::load_state_dict: '", key, name, "' has ", get(key + name).numel(),
                      " elements, expected ", state_[b].exp_avg.numel(), " (another model or bucket size?)");
    }
  }
  at::NoGradGuard no_grad;
  step_ = get("step").item<int64_t>();
  for (size_t b = 0; b < state_.size(); ++b) {
    auto& bs = state_[b];
    const std::string key = "bucket." + std::to_string(b) + ".";
    bs.master.copy_(get(key + "master"));
    bs.exp_avg.copy_(get(key + (adam ? "exp_avg" : "momentum")));
    if (adam) bs.exp_avg_sq.copy_(get(key + "exp_avg_sq"));
  }
  if (const auto& scaler = options_.loss_scaler()) {
    std::map<std::string, double> s;
    for (const auto& [k, v] : state) {
      if (const auto name = util::strip_prefix(k, kScalerPrefix)) s[std::string(*name)] = v.item<double>();
    }
    scaler->load_state_dict(s);
  }
  copy_master_to_params();
}

std::vector<DistributedOptimizer::ParamStateShard> DistributedOptimizer::param_state_shards() {
  std::vector<ParamStateShard> out;
  const bool adam = options_.kind() == OptimizerKind::kAdamW;
  for (size_t b = 0; b < state_.size(); ++b) {
    auto& bs = state_[b];
    buffer_->for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t at, int64_t in_param, int64_t n) {
      ParamStateShard s{i, in_param, in_param + n, {}};
      s.tensors["master"] = bs.master.detach().narrow(0, at, n);
      s.tensors[adam ? "exp_avg" : "momentum"] = bs.exp_avg.narrow(0, at, n);
      if (adam) s.tensors["exp_avg_sq"] = bs.exp_avg_sq.narrow(0, at, n);
      out.push_back(std::move(s));
    });
  }
  return out;
}

std::vector<DistributedOptimizer::ParamStateShard> DistributedOptimizer::grad_shards() {
  std::vector<ParamStateShard> out;
  for (size_t b = 0; b < state_.size(); ++b) {
    const auto& st = state_[b];
    // 16-bit gradients were upcast into grad32 by the step; fp32 ones are the owned range.
    const at::Tensor g = st.grad32.defined() ? st.grad32 : buffer_->buckets()[b].grad_shard;
    buffer_->for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t at, int64_t in_param, int64_t n) {
      out.push_back({i, in_param, in_param + n, {{"grad", g.narrow(0, at, n)}}});
    });
  }
  return out;
}

std::vector<int64_t> DistributedOptimizer::nonfinite_grad_params() const {
  std::vector<int64_t> out;
  for (size_t b = 0; b < buffer_->buckets().size(); ++b) {
    const at::Tensor& grad = buffer_->buckets()[b].grad_shard;
    if (at::isfinite(grad).all().item<bool>()) continue;
    buffer_->for_each_owned_slice(static_cast<int64_t>(b), [&](int64_t i, int64_t at, int64_t, int64_t n) {
      if (!at::isfinite(grad.narrow(0, at, n)).all().item<bool>() && std::find(out.begin(), out.end(), i) == out.end()) {
        out.push_back(i);
      }
    });
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace megatorch::optim
