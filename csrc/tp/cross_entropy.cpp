#include "megatorch/tp/cross_entropy.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <limits>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"

namespace megatorch::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void all_reduce(at::Tensor& t, const std::string& group, comm::ReduceOp op) {
  if (!group.empty()) comm::Group(group).all_reduce(t, op);
}

class VocabParallelCrossEntropy : public torch::autograd::Function<VocabParallelCrossEntropy> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target,
                            const std::string& group, double smoothing, int64_t ignore_index, int64_t vocab_size) {
    const int64_t rank = group.empty() ? 0 : comm::Group(group).rank();
    const int64_t local = logits.size(-1), start = rank * local;
    at::Tensor x = logits.to(at::kFloat);
    at::Tensor padded;  // columns past the real vocabulary, left out of the softmax
    int64_t real = 0;   // real columns over the whole vocabulary (for the smoothing mean)
    if (vocab_size > 0) {
      padded = at::arange(start, start + local, x.options().dtype(at::kLong)) >= vocab_size;
      x = x.masked_fill(padded, -std::numeric_limits<float>::infinity());
      real = vocab_size;
    } else {
      real = local * (group.empty() ? 1 : comm::Group(group).size());
    }
    at::Tensor max = std::get<0>(x.max(-1));
    all_reduce(max, group, comm::ReduceOp::kMax);  // 1
    x = x - max.unsqueeze(-1);

    const at::Tensor outside = (target < start).logical_or(target >= start + local);
    const at::Tensor local_target = (target - start).masked_fill(outside, 0);
    at::Tensor target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0);
    at::Tensor sum_logits;
    if (smoothing > 0) {
      at::Tensor both = at::stack({target_logit, padded.defined() ? x.masked_fill(padded, 0).sum(-1) : x.sum(-1)});
      all_reduce(both, group, comm::ReduceOp::kSum);  // 2 (two values per token)
      target_logit = both[0];
      sum_logits = both[1];
    } else {
      all_reduce(target_logit, group, comm::ReduceOp::kSum);  // 2
    }
    at::Tensor exp = x.exp();
    at::Tensor sum_exp = exp.sum(-1);
    all_reduce(sum_exp, group, comm::ReduceOp::kSum);  // 3
    const at::Tensor log_sum_exp = sum_exp.log();
    at::Tensor loss = log_sum_exp - target_logit;
    if (smoothing > 0) loss = (1 - smoothing) * loss + smoothing * (log_sum_exp - sum_logits / real);
    const at::Tensor ignored = target == ignore_index;
    loss = loss.masked_fill(ignored, 0);

    ctx->save_for_backward({exp.div_(sum_exp.unsqueeze(-1)), local_target, outside, ignored,
                            padded.defined() ? padded : at::Tensor()});
    ctx->saved_data["smoothing"] = smoothing;
    ctx->saved_data["real"] = real;
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0];  // softmax, fp32, reused in place
    const at::Tensor& local_target = saved[1];
    const at::Tensor& outside = saved[2];
    const at::Tensor& ignored = saved[3];
    const at::Tensor& padded = saved[4];
    const double smoothing = ctx->saved_data["smoothing"].toDouble();
    const int64_t real = ctx->saved_data["real"].toInt();
    // d loss / d logit_j = p_j - (1-ε)·[j = target] - ε/K over real columns.
    const at::Tensor hit = outside.logical_not().to(grad.scalar_type()) * (1 - smoothing);
    grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1));
    if (smoothing > 0) {
      at::Tensor uniform = at::full({grad.size(-1)}, smoothing / real, grad.options());
      if (padded.defined()) uniform.masked_fill_(padded, 0);
      grad.sub_(uniform);
    }
    grad.mul_(grads[0].masked_fill(ignored, 0).unsqueeze(-1));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.to(dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& target, const std::string& group,
                                        double label_smoothing, int64_t ignore_index, c10::optional<int64_t> vocab_size) {
  MEGATORCH_CHECK(logits.dim() >= 1 && target.sizes() == logits.sizes().slice(0, logits.dim() - 1),
                  "vocab_parallel_cross_entropy: expected target of shape logits.shape[:-1] = ",
                  logits.sizes().slice(0, logits.dim() - 1), ", got ", target.sizes());
  MEGATORCH_CHECK(label_smoothing >= 0 && label_smoothing < 1, "expected label_smoothing in [0, 1), got ",
                  label_smoothing);
  MEGATORCH_CHECK(!vocab_size || *vocab_size >= 1, "expected vocab_size >= 1, got ", vocab_size.value_or(0));
  return VocabParallelCrossEntropy::apply(logits, target, group, label_smoothing, ignore_index, vocab_size.value_or(0));
}

}  // namespace megatorch::tp
