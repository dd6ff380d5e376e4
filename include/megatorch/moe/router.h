#pragma once
// TopKRouter: which experts each token goes to, with what weight, and the load-balancing
// losses (Megatron-core's TopKRouter). Scores in fp32 whatever the parameters' dtype.
//
//   softmax           top-k of the logits, softmax over those k (Megatron's default)
//   softmax + pre     softmax over all experts, then its top-k (Mixtral; HF's default)
//   sigmoid           sigmoid scores, top-k (DeepSeek-V3)
// then optionally renormalised to sum to 1 and multiplied by a scaling factor. An expert
// bias (DeepSeek-V3's auxiliary-loss-free balancing) only steers the top-k choice.
//
// Token counts for the losses span the token group: the ranks holding other tokens of the
// same sequences (TP under sequence parallelism, and CP), so the numbers are those of
// whole sequences at any TP and CP size.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/transformer/config.h"

namespace megatorch::moe {

// A rank's tokens routed to experts. Rows of `selection` are experts, columns tokens.
struct Routing {
  at::Tensor weights;    // [T, E] each token's weight per expert, 0 where not routed (differentiable)
  at::Tensor selection;  // [E, T] bool: expert e processes token t (after capacity; padding adds fillers)
  at::Tensor routed;     // [E] int64: top-k assignments per expert on this rank, before capacity
  int64_t dropped = 0;   // assignments dropped by the capacity on this rank
  // This rank's contributions to the auxiliary and z losses (differentiable scalars,
  // coefficients applied; undefined when the coefficient is 0). Added over TP and
  // averaged over DP x CP as the gradients are, they give the whole sequences' losses.
  at::Tensor aux_loss, z_loss;
};

// Switch / Megatron load-balancing loss: coeff * E * sum_i f_i * P_i with f_i =
// routed[i] / (total_tokens * topk) and P_i = prob_sum[i] / total_tokens (prob_sum: the
// full router probabilities summed over the tokens). Uniform probabilities and uniform
// routing give exactly coeff.
at::Tensor load_balancing_loss(const at::Tensor& prob_sum, const at::Tensor& routed, int64_t total_tokens, int64_t topk,
                               double coeff);
// Router z-loss: coeff * sum over the tokens of logsumexp(logits)^2 / total_tokens (the
// mean when total_tokens is the number of rows). All-zero logits give coeff * ln(E)^2.
at::Tensor z_loss(const at::Tensor& logits, int64_t total_tokens, double coeff);
// ceil(tokens * topk * factor / experts), at least 1.
int64_t expert_capacity(int64_t tokens, int64_t topk, int64_t experts, double factor);
// [E, T]: each expert keeps at most `capacity` of its routed tokens, those of the highest
// weight (ties: the lower token index); with `pad` exactly min(capacity, T), filled with
// unrouted tokens (weight 0, so they change no output and no gradient).
at::Tensor capacity_selection(const at::Tensor& weights, const at::Tensor& routed_mask, int64_t capacity, bool pad);

struct TopKRouterOptions {
  explicit TopKRouterOptions(transformer::TransformerConfig config) : config_(std::move(config)) {}
  TORCH_ARG(transformer::TransformerConfig, config);
  TORCH_ARG(std::string, group) = "";  // TP: its ranks hold other tokens under sequence parallelism
  TORCH_ARG(std::string, name) = "router";
};

class TopKRouterImpl : public torch::nn::Cloneable<TopKRouterImpl> {
 public:
  explicit TopKRouterImpl(TopKRouterOptions options);
  void reset() override;
  // x: [T, h], this rank's tokens.
  Routing forward(const at::Tensor& x);
  // DeepSeek-V3's update from the step's tokens per expert (summed over every rank that
  // routes with this router): bias += rate * sign(mean - load). Replicas given the same
  // counts stay equal.
  void update_expert_bias(const at::Tensor& tokens_per_expert);

  TopKRouterOptions options;
  at::Tensor weight;       // [E, h], replicated
  at::Tensor expert_bias;  // [E] fp32 buffer (defined with moe_router_enable_expert_bias)
};
TORCH_MODULE(TopKRouter);

}  // namespace megatorch::moe
