// ParamAndGradBuffer's construction: checking the parameters, laying them out in buckets,
// moving their data into the flat buffers and pointing .grad into them. The reduction
// during backward is in grad_reduction.cpp.
#include "megatorch/optim/param_and_grad_buffer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>

#include "megatorch/check.h"
#include "megatorch/util/fnv1a.h"

namespace megatorch::optim {
ParamAndGradBuffer::ParamAndGradBuffer(std::vector<std::vector<at::Tensor>> units, const std::string& dp_group,
                                       ParamAndGradBufferOptions options, std::vector<ParamInfo> info)
    : units_(std::move(units)), info_(std::move(info)), dp_(dp_group), options_(std::move(options)) {
  const int64_t stage = options_.zero_stage();
  MEGATORCH_CHECK(stage >= 0 && stage <= 3, "DistributedOptimizer: expected zero_stage in 0..3, got ", stage,
                  "; use 0 (plain DP), 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)");
  MEGATORCH_CHECK(options_.grad_average_over() >= 0, "DistributedOptimizer: expected grad_average_over >= 0, got ",
                  options_.grad_average_over(), "; use 0 (average over the DP group) or the number of ranks whose "
                  "gradients the reduced sum should be averaged over");
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
  std::vector<bool> alone(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    alone[i] = info_[i].own_bucket;
    MEGATORCH_CHECK(info_[i].grad_sum_ranks.empty() || (info_[i].own_bucket && info_[i].grad_sum_ranks.size() == 2 &&
                                                       !info_[i].grad_sum_group.empty()),
                    "DistributedOptimizer: parameter ", i, " has grad_sum_ranks; expected exactly two ranks of a "
                    "grad_sum_group and own_bucket set (so both copies are sharded alike)");
  }
  check_same_parameters_across_ranks();
  const int64_t dp = dp_.size();
  const int64_t bucket = options_.bucket_size() > 0 ? options_.bucket_size() : default_bucket_size(dp);
  layout_ = build_bucket_layout(units_, bucket, dp, stage == 3, alone);
  build_buffers();
  plan_partial_sums();
  register_hooks();
}

// Every DP rank must hold the same parameter list, or the bucket collectives would not
// match: compare a fingerprint first and fail on every rank (no hang) when they differ.
void ParamAndGradBuffer::check_same_parameters_across_ranks() {
  if (dp_.size() == 1) return;
  util::Fnv1a hash;
  int64_t numel = 0;
  for (const auto& p : params_) {
    hash.mix(static_cast<uint64_t>(p.scalar_type()));
    for (int64_t d : p.sizes()) hash.mix(static_cast<uint64_t>(d));
    numel += p.numel();
  }
  at::Tensor mine = at::tensor({static_cast<int64_t>(params_.size()), numel, static_cast<int64_t>(hash.value() >> 1),
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

void ParamAndGradBuffer::build_buffers() {
  const int64_t stage = options_.zero_stage(), dp = dp_.size();
  const auto device = params_[0].device();
  buckets_.resize(layout_.buckets.size());
  auto grad_dtype = [&](at::ScalarType t) { return is_16bit(t) && options_.grad_in_fp32() ? at::kFloat : t; };
  // Stages 0-2 keep every parameter in one flat buffer per dtype (stage 3: one per bucket).
  for (const auto& [dtype, numel] : layout_.buffers) {
    if (stage < 3) param_buffers_.push_back(at::zeros({numel}, at::TensorOptions().dtype(dtype).device(device)));
    if (stage < 2) grad_buffers_.push_back(at::zeros({numel}, at::TensorOptions().dtype(grad_dtype(dtype)).device(device)));
  }
  auto buffer_index = [&](at::ScalarType t) {
    for (size_t i = 0; i < layout_.buffers.size(); ++i) {
      if (layout_.buffers[i].first == t) return static_cast<int64_t>(i);
    }
    return int64_t{-1};
  };
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    const auto& place = layout_.buckets[b];
    auto& bs = buckets_[b];
    const int64_t buf = buffer_index(place.dtype);
    bs.param_full = stage < 3 ? param_buffers_[buf].narrow(0, place.begin, place.numel)
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
      bs.grad_full = grad_buffers_[buf].narrow(0, place.begin, place.numel);
      bs.grad_shard = bs.grad_full.narrow(0, begin, len);
      for (int64_t i : place.params) {
        const auto& pp = layout_.params[i];
        params_[i].mutable_grad() = bs.grad_full.narrow(0, pp.offset, pp.numel).view(params_[i].sizes());
      }
    } else {
      bs.grad_shard = at::zeros({len}, at::TensorOptions().dtype(grad_dtype(place.dtype)).device(device));
    }
  }
}

std::pair<int64_t, int64_t> ParamAndGradBuffer::owned_range(int64_t b) const {
  const auto& place = layout_.buckets[b];
  if (options_.zero_stage() == 0) return {0, place.numel};
  const int64_t dp = dp_.size();
  return {dp_.rank() * place.numel / dp, place.numel / dp};
}

void ParamAndGradBuffer::for_each_owned_slice(int64_t b, const OwnedSliceFn& fn) const {
  const auto [begin, len] = owned_range(b);
  for (int64_t i : layout_.buckets[b].params) {
    const auto& pp = layout_.params[i];
    const auto [lo, n] = range_overlap(pp.offset, pp.numel, begin, len);
    if (n > 0) fn(i, lo - begin, lo - pp.offset, n);
  }
}

void ParamAndGradBuffer::zero_grad() {
  drain_in_flight();
  std::fill(grad_added_.begin(), grad_added_.end(), 0);
  const bool keep_full = options_.zero_stage() < 2;
  for (auto& bs : buckets_) {
    if (keep_full) {
      bs.grad_full.zero_();  // the shard is a part of it: one pass
    } else {
      bs.grad_shard.zero_();
      bs.grad_full = at::Tensor();
    }
  }
  if (!keep_full) {
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
  }
}

}  // namespace megatorch::optim
