#include "megatorch/tp/cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <algorithm>
#include <limits>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/kernels/cross_entropy_local.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Shard {
  int64_t start = 0;  // first global column of this rank
  int64_t real = 0;   // real columns in the whole vocabulary (the smoothing mean's K)
  at::Tensor padded;  // bool [V/tp]: columns past the real vocabulary, or undefined
};

// `with_mask`: build `padded` (the fused kernels need only start and real).
Shard shard_of(const at::Tensor& logits, const std::string& group, int64_t vocab_size, bool with_mask = true) {
  const TPInfo tp = tp_info(group);
  const int64_t local = logits.size(-1);
  Shard s;
  s.start = tp.rank * local;
  s.real = vocab_size > 0 ? vocab_size : local * tp.size;
  if (with_mask && vocab_size > 0 && s.start + local > vocab_size) {
    s.padded = at::arange(s.start, s.start + local, logits.options().dtype(at::kLong)) >= vocab_size;
  }
  return s;
}

void all_reduce(at::Tensor& t, const std::string& group, comm::ReduceOp op) {
  if (!group.empty()) comm::Group(group).all_reduce(t, op);
}

using FwdOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, c10::string_view, double,
                                                 int64_t, int64_t, bool);
using BwdOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                         double, int64_t, int64_t);

const c10::TypedOperatorHandle<FwdOp>& fwd_op() {
  static const auto h = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("megatorch::_vocab_parallel_cross_entropy_fwd", "")
                            .typed<FwdOp>();
  return h;
}
const c10::TypedOperatorHandle<BwdOp>& bwd_op() {
  static const auto h = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("megatorch::_vocab_parallel_cross_entropy_bwd", "")
                            .typed<BwdOp>();
  return h;
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            const std::string& group, double smoothing, int64_t ignore_index, int64_t vocab_size,
                            bool fused) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [loss, lse] = fwd_op().call(logits, target, group, smoothing, ignore_index, vocab_size, fused);
    ctx->save_for_backward({logits, target, lse});
    ctx->saved_data["group"] = group;
    ctx->saved_data["smoothing"] = smoothing;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["vocab_size"] = vocab_size;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor grad = bwd_op().call(grads[0], saved[0], saved[1], saved[2], ctx->saved_data["group"].toStringRef(),
                                    ctx->saved_data["smoothing"].toDouble(), ctx->saved_data["ignore_index"].toInt(),
                                    ctx->saved_data["vocab_size"].toInt());
    return {grad, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The fused local part: one pass over the shard gives each row's local max m, Σ exp(x - m),
// the raw target logit and Σ x (real columns only); the all-reduces rebase them on the
// global max M: target - M, Σ x - K·M, and Σ exp(x - m)·exp(m - M) per rank.
// -> (target_logit - M, sum_logits - K·M or undefined, sum_exp, M)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_local(const at::Tensor& logits,
                                                                       const at::Tensor& target, const Shard& shard,
                                                                       const std::string& group, double smoothing) {
  const int64_t local = logits.size(-1);
  const int64_t real_cols = std::clamp<int64_t>(shard.real - shard.start, 0, local);
  auto [local_max, sum_exp, target_logit, sum_logits] =
      kernels::cross_entropy_local(logits, target, shard.start, real_cols);
  // fp32 like the unfused path (the kernel gives double for double logits).
  local_max = local_max.to(at::kFloat), sum_exp = sum_exp.to(at::kFloat);
  target_logit = target_logit.to(at::kFloat), sum_logits = sum_logits.to(at::kFloat);
  at::Tensor max = local_max.clone();
  all_reduce(max, group, comm::ReduceOp::kMax);  // all-reduce 1 of 3
  if (smoothing > 0) {
    at::Tensor both = at::stack({target_logit, sum_logits});
    all_reduce(both, group, comm::ReduceOp::kSum);  // all-reduce 2 of 3 (two values per token)
    target_logit = both[0] - max;
    sum_logits = both[1] - max * static_cast<double>(shard.real);
  } else {
    all_reduce(target_logit, group, comm::ReduceOp::kSum);  // all-reduce 2 of 3
    target_logit = target_logit - max;
    sum_logits = at::Tensor();
  }
  // A shard without real columns has m = -inf and Σ = 0: it adds 0.
  sum_exp = sum_exp * (local_max - max).exp();
  all_reduce(sum_exp, group, comm::ReduceOp::kSum);  // all-reduce 3 of 3
  return {target_logit, sum_logits, sum_exp, max};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> vocab_parallel_cross_entropy_forward(const at::Tensor& logits,
                                                                        const at::Tensor& target,
                                                                        const std::string& group, double smoothing,
                                                                        int64_t ignore_index, int64_t vocab_size,
                                                                        bool fused) {
  const Shard shard = shard_of(logits, group, vocab_size);
  const int64_t local = logits.size(-1);
  if (fused) {
    auto [target_logit, sum_logits, sum_exp, max] = fused_local(logits, target, shard, group, smoothing);
    const at::Tensor log_sum_exp = sum_exp.log();
    at::Tensor loss = log_sum_exp - target_logit;
    if (smoothing > 0) loss = (1 - smoothing) * loss + smoothing * (log_sum_exp - sum_logits / shard.real);
    loss = loss.masked_fill(target == ignore_index, 0);
    return {loss, log_sum_exp + max};
  }
  at::Tensor x = logits.to(at::kFloat);
  if (shard.padded.defined()) x = x.masked_fill(shard.padded, -std::numeric_limits<float>::infinity());
  at::Tensor max = std::get<0>(x.max(-1));
  all_reduce(max, group, comm::ReduceOp::kMax);  // all-reduce 1 of 3
  x = x - max.unsqueeze(-1);

  const at::Tensor outside = (target < shard.start).logical_or(target >= shard.start + local);
  const at::Tensor local_target = (target - shard.start).masked_fill(outside, 0);
  at::Tensor target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0);
  at::Tensor sum_logits;
  if (smoothing > 0) {
    at::Tensor both = at::stack({target_logit, (shard.padded.defined() ? x.masked_fill(shard.padded, 0) : x).sum(-1)});
    all_reduce(both, group, comm::ReduceOp::kSum);  // all-reduce 2 of 3 (two values per token)
    target_logit = both[0];
    sum_logits = both[1];
  } else {
    all_reduce(target_logit, group, comm::ReduceOp::kSum);  // all-reduce 2 of 3
  }
  at::Tensor sum_exp = x.exp().sum(-1);
  all_reduce(sum_exp, group, comm::ReduceOp::kSum);  // all-reduce 3 of 3
  const at::Tensor log_sum_exp = sum_exp.log();
  at::Tensor loss = log_sum_exp - target_logit;
  if (smoothing > 0) loss = (1 - smoothing) * loss + smoothing * (log_sum_exp - sum_logits / shard.real);
  loss = loss.masked_fill(target == ignore_index, 0);
  return {loss, log_sum_exp + max};
}

at::Tensor vocab_parallel_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                                 const at::Tensor& target, const at::Tensor& log_sum_exp,
                                                 const std::string& group, double smoothing, int64_t ignore_index,
                                                 int64_t vocab_size) {
  const int64_t local = logits.size(-1);
  if (logits.is_cuda() && logits.scalar_type() != at::kDouble) {
    // One fused pass (kernels::cross_entropy_backward_cuda): reads each logit once and
    // writes its gradient once, with the arithmetic of the chain below.
    const Shard shard = shard_of(logits, group, vocab_size, /*with_mask=*/false);
    const int64_t real_cols = std::clamp<int64_t>(shard.real - shard.start, 0, local);
    return kernels::cross_entropy_backward_cuda(grad_loss, logits, target, log_sum_exp, shard.start, real_cols,
                                                shard.real, smoothing, ignore_index);
  }
  const Shard shard = shard_of(logits, group, vocab_size);
  // d loss / d logit_j = p_j - (1-ε)·[j = target] - ε/K over the real columns.
  at::Tensor grad = (logits.to(at::kFloat) - log_sum_exp.unsqueeze(-1)).exp_();
  if (shard.padded.defined()) grad.masked_fill_(shard.padded, 0);
  const at::Tensor outside = (target < shard.start).logical_or(target >= shard.start + local);
  const at::Tensor local_target = (target - shard.start).masked_fill(outside, 0);
  const at::Tensor hit = outside.logical_not().to(at::kFloat) * (1 - smoothing);
  grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1));
  if (smoothing > 0) {
    at::Tensor uniform = at::full({local}, smoothing / shard.real, grad.options());
    if (shard.padded.defined()) uniform.masked_fill_(shard.padded, 0);
    grad.sub_(uniform);
  }
  grad.mul_(grad_loss.to(at::kFloat).masked_fill(target == ignore_index, 0).unsqueeze(-1));
  return grad.to(logits.scalar_type());
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const std::string& group,
                                        double label_smoothing, int64_t ignore_index, c10::optional<int64_t> vocab_size,
                                        bool fused) {
  MEGATORCH_CHECK(logits.dim() >= 1 && target.sizes() == logits.sizes().slice(0, logits.dim() - 1),
                  "vocab_parallel_cross_entropy: expected target of shape logits.shape[:-1] = ",
                  logits.sizes().slice(0, logits.dim() - 1), ", got ", target.sizes());
  MEGATORCH_CHECK(label_smoothing >= 0 && label_smoothing < 1, "expected label_smoothing in [0, 1), got ",
                  label_smoothing);
  MEGATORCH_CHECK(!vocab_size || *vocab_size >= 1, "expected vocab_size >= 1, got ", vocab_size.value_or(0));
  return CrossEntropyFunction::apply(logits, target, group, label_smoothing, ignore_index, vocab_size.value_or(0),
                                     fused);
}

at::Tensor masked_mean_loss(const at::Tensor& per_token, const at::Tensor& labels, int64_t ignore_index) {
  MEGATORCH_CHECK(per_token.numel() == labels.numel(), "masked_mean_loss: expected one label per token loss, got ",
                  per_token.numel(), " losses (", per_token.sizes(), ") and ", labels.numel(), " labels (",
                  labels.sizes(), ")");
  // Ignored tokens' losses are 0 (vocab_parallel_cross_entropy), so the sum needs no mask;
  // the count does. clamp_min: an all-ignored batch gives 0, not NaN.
  const at::Tensor valid = (labels != ignore_index).sum().clamp_min(1).to(per_token.scalar_type());
  return per_token.sum() / valid;
}

}  // namespace megatorch::tp
