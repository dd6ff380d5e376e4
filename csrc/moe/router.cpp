#include "megatorch/moe/router.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cmath>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/tp/init.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::moe {

using transformer::RouterScore;

at::Tensor load_balancing_loss(const at::Tensor& prob_sum, const at::Tensor& routed, int64_t total_tokens, int64_t topk,
                               double coeff) {
  MEGATORCH_CHECK(prob_sum.dim() == 1 && routed.sizes() == prob_sum.sizes(), "load_balancing_loss: expected the ",
                  "probability sums and routed counts as two [E] tensors, got ", prob_sum.sizes(), " and ", routed.sizes());
  MEGATORCH_CHECK(total_tokens >= 1 && topk >= 1, "load_balancing_loss: expected total_tokens and topk >= 1, got ",
                  total_tokens, " and ", topk);
  const double e = static_cast<double>(prob_sum.size(0)), t = static_cast<double>(total_tokens);
  // sum_i (routed_i / (T k)) (prob_sum_i / T), times coeff E; the counts are constants.
  return (prob_sum.to(at::kFloat) * routed.to(at::kFloat)).sum() * (coeff * e / (t * t * static_cast<double>(topk)));
}

at::Tensor z_loss(const at::Tensor& logits, int64_t total_tokens, double coeff) {
  MEGATORCH_CHECK(total_tokens >= 1, "z_loss: expected total_tokens >= 1, got ", total_tokens);
  return at::logsumexp(logits.to(at::kFloat), -1).square().sum() * (coeff / static_cast<double>(total_tokens));
}

int64_t expert_capacity(int64_t tokens, int64_t topk, int64_t experts, double factor) {
  MEGATORCH_CHECK(experts >= 1 && factor > 0, "expert_capacity: expected experts >= 1 and a factor > 0, got ", experts,
                  " and ", factor);
  const double c = std::ceil(static_cast<double>(tokens * topk) * factor / static_cast<double>(experts));
  return std::max<int64_t>(1, static_cast<int64_t>(c));
}

at::Tensor capacity_selection(const at::Tensor& weights, const at::Tensor& routed_mask, int64_t capacity, bool pad) {
  const int64_t t = weights.size(0);
  const int64_t keep = std::min(capacity, t);
  // Routed tokens rank by weight (>= 0); unrouted ones sit below them all at -1, so padding
  // takes them only once an expert's routed tokens are exhausted. A stable descending sort
  // breaks ties by token index on every device.
  const at::Tensor key = at::where(routed_mask, weights.detach().to(at::kFloat), at::full({}, -1.0f, weights.options().dtype(at::kFloat)));
  const at::Tensor order = std::get<1>(key.t().sort(/*stable=*/true, /*dim=*/1, /*descending=*/true));  // [E, T]
  const at::Tensor top = order.narrow(1, 0, keep);
  at::Tensor sel = at::zeros({weights.size(1), t}, weights.options().dtype(at::kBool));
  sel.scatter_(1, top, true);
  return pad ? sel : sel & routed_mask.t();
}

TopKRouterImpl::TopKRouterImpl(TopKRouterOptions options_) : options(std::move(options_)) { reset(); }

void TopKRouterImpl::reset() {
  const auto& c = options.config();
  const auto init = transformer::param_init(c, options.name());
  const auto t = at::TensorOptions().dtype(init.dtype()).device(init.device());
  weight = register_parameter("weight", at::empty({c.num_experts(), c.hidden_size()}, t));
  {
    torch::NoGradGuard no_grad;
    const tp::ShardSpec spec{{c.num_experts(), c.hidden_size()}, -1, 0, 1, 1};
    weight.copy_(tp::init_shard(spec, init.name() + ".weight", init.seed(), tp::InitMethod::kNormal, init.std()));
  }
  if (c.moe_router_enable_expert_bias()) {
    expert_bias = register_buffer("expert_bias", at::zeros({c.num_experts()}, t.dtype(at::kFloat)));
  }
}

Routing TopKRouterImpl::forward(const at::Tensor& x) {
  const auto& c = options.config();
  MEGATORCH_CHECK(x.dim() == 2 && x.size(1) == c.hidden_size(), "TopKRouter '", options.name(),
                  "': expected tokens [T, ", c.hidden_size(), "], got ", x.sizes());
  const int64_t k = c.moe_router_topk(), e = c.num_experts(), t = x.size(0);
  const at::Tensor logits = at::linear(x.to(at::kFloat), weight.to(at::kFloat));  // [T, E]
  // What the top-k is taken over, and each expert's score (the weight if chosen).
  at::Tensor scores;
  if (c.moe_router_score_function() == RouterScore::kSigmoid) {
    scores = at::sigmoid(logits);
  } else {
    scores = c.moe_router_pre_softmax() ? at::softmax(logits, -1) : logits;
  }
  const at::Tensor choose = expert_bias.defined() ? scores.detach() + expert_bias : scores.detach();
  const at::Tensor idx = std::get<1>(choose.topk(k, -1));  // [T, k]
  at::Tensor w = scores.gather(1, idx);
  if (c.moe_router_score_function() == RouterScore::kSoftmax && !c.moe_router_pre_softmax()) w = at::softmax(w, -1);
  if (c.moe_router_norm_topk_prob() && k > 1) w = w / (w.sum(-1, true) + 1e-20);
  if (c.moe_router_topk_scaling_factor() != 1.0) w = w * c.moe_router_topk_scaling_factor();

  Routing r;
  r.weights = at::zeros({t, e}, w.options()).scatter(1, idx, w);
  const at::Tensor routed_mask = at::zeros({t, e}, x.options().dtype(at::kBool)).scatter_(1, idx, true);
  r.routed = routed_mask.sum(0);  // int64
  if (c.moe_expert_capacity_factor() > 0) {
    const int64_t cap = expert_capacity(t, k, e, c.moe_expert_capacity_factor());
    r.selection = capacity_selection(r.weights, routed_mask, cap, c.moe_pad_expert_input_to_capacity());
    r.dropped = (routed_mask.t() & r.selection.logical_not()).sum().item<int64_t>();
  } else {
    r.selection = routed_mask.t().contiguous();
  }

  if (c.moe_aux_loss_coeff() > 0 || c.moe_z_loss_coeff() > 0) {
    // The token group: TP (its ranks hold other tokens under sequence parallelism) and CP.
    const std::string& tp_group = c.sequence_parallel() ? options.group() : std::string();
    const auto tp = tp::tp_info(tp_group);
    const auto cp = tp::tp_info(c.context_parallel_group());
    const int64_t total = t * tp.size * cp.size;
    // CP ranks' gradients are averaged with DP's (times cp restores their sum), TP ranks'
    // added (the router weight's partial gradient under SP).
    const double cp_sum = static_cast<double>(cp.size);
    if (c.moe_aux_loss_coeff() > 0) {
      at::Tensor counts = r.routed.to(at::kFloat);
      if (tp.size > 1) comm::Group(tp_group).all_reduce(counts);
      if (cp.size > 1) comm::Group(c.context_parallel_group()).all_reduce(counts);
      // Sigmoid scores are normalised per token first (Megatron's rule for the loss).
      const at::Tensor probs = c.moe_router_score_function() == RouterScore::kSigmoid
                                   ? scores / (scores.sum(-1, true) + 1e-20)
                                   : at::softmax(logits, -1);
      r.aux_loss = load_balancing_loss(probs.sum(0), counts, total, k, c.moe_aux_loss_coeff() * cp_sum);
    }
    if (c.moe_z_loss_coeff() > 0) r.z_loss = z_loss(logits, total, c.moe_z_loss_coeff() * cp_sum);
  }
  return r;
}

void TopKRouterImpl::update_expert_bias(const at::Tensor& tokens_per_expert) {
  if (!expert_bias.defined()) return;
  torch::NoGradGuard no_grad;
  const at::Tensor load = tokens_per_expert.to(expert_bias.device(), at::kFloat);
  expert_bias.add_(at::sign(load.mean() - load) * options.config().moe_router_bias_update_rate());
}

}  // namespace megatorch::moe
