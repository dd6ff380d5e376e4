#include "megatorch/transformer/transformer_layer.h"

#include <ATen/ATen.h>

#include "megatorch/kernels/bias_dropout_add.h"
#include "megatorch/transformer/recompute.h"

namespace megatorch::transformer {

at::Tensor hidden_dropout(const at::Tensor& x, const TransformerConfig& c, bool training, tp::RngTracker* rng) {
  if (!training || c.hidden_dropout() == 0) return x;
  c10::optional<tp::RngTracker::Fork> fork;
  if (c.sequence_parallel() && rng) fork.emplace(*rng, tp::kModelParallelRng);
  return at::dropout(x, c.hidden_dropout(), true);
}

TransformerLayerImpl::TransformerLayerImpl(TransformerLayerOptions options_) : options(std::move(options_)) {
  reset();
}

void TransformerLayerImpl::reset() {
  // A layer kept in bf16 builds its linear layers without FP8.
  TransformerConfig c = options.config();
  if (!c.fp8_layer(options.layer_number())) c.fp8(fp8::Fp8Options());
  const std::string name = "layers." + std::to_string(options.layer_number());
  input_norm = register_module("input_norm", make_norm(c));
  attention = register_module("attention", ParallelAttention(ParallelAttentionOptions(c)
                                                                 .group(options.group())
                                                                 .name(name + ".attention")
                                                                 .layer_number(options.layer_number())
                                                                 .rng(options.rng())));
  post_attention_norm = register_module("post_attention_norm", make_norm(c));
  if (c.is_moe_layer(options.layer_number())) {
    moe = register_module("mlp", moe::MoELayer(moe::MoELayerOptions(c)
                                                   .group(options.group())
                                                   .name(name + ".mlp")
                                                   .layer_number(options.layer_number())));
  } else {
    mlp = register_module("mlp", ParallelMLP(ParallelMLPOptions(c).group(options.group()).name(name + ".mlp")));
  }
}

std::pair<at::Tensor, at::Tensor> TransformerLayerImpl::mlp_block(const at::Tensor& normed) {
  if (moe) return {moe->forward(normed), at::Tensor()};
  return {mlp->forward_without_bias(normed), mlp->fc2->bias};
}

at::Tensor TransformerLayerImpl::dropout_add(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual) {
  const auto& c = options.config();
  if (!c.fused_kernels()) {
    return residual + hidden_dropout(bias.defined() ? x + bias : x, c, is_training(), options.rng().get());
  }
  // One pass, the same draws as hidden_dropout (the default generator, forked as there).
  const bool drop = is_training() && c.hidden_dropout() > 0;
  c10::optional<tp::RngTracker::Fork> fork;
  if (drop && c.sequence_parallel() && options.rng()) fork.emplace(*options.rng(), tp::kModelParallelRng);
  return kernels::bias_dropout_add(x, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt, residual,
                                   c.hidden_dropout(), drop);
}

at::Tensor TransformerLayerImpl::layer(const at::Tensor& x, const at::Tensor& rope_freqs, const Documents& documents) {
  // The row-parallel biases are left to dropout_add (forward = forward_without_bias + bias).
  const at::Tensor a = attention->forward_without_bias(input_norm->forward(x), rope_freqs, documents);
  const at::Tensor h = dropout_add(a, attention->proj->bias, x);
  const auto [m, bias] = mlp_block(post_attention_norm->forward(h));
  return dropout_add(m, bias, h);
}

at::Tensor TransformerLayerImpl::forward(const at::Tensor& x, const at::Tensor& rope_freqs, const Documents& documents) {
  if (options.config().recompute() == Recompute::kFull && is_training()) {
    // Full recomputation keeps only the layer input (2·s·b·h bytes in 16-bit).
    return recompute([this, rope_freqs, documents](const torch::autograd::variable_list& in) {
             return torch::autograd::variable_list{layer(in[0], rope_freqs, documents)};
           },
           {x}, options.rng().get())[0];
  }
  return layer(x, rope_freqs, documents);
}

at::Tensor TransformerLayerImpl::forward_cached(const at::Tensor& x, const at::Tensor& rope_freqs,
                                               inference::KVCache& cache) {
  // layer() with the attention reading and extending the cache (dropout is off in eval).
  const at::Tensor a = attention->forward_cached_without_bias(input_norm->forward(x), rope_freqs, cache);
  const at::Tensor h = dropout_add(a, attention->proj->bias, x);
  const auto [m, bias] = mlp_block(post_attention_norm->forward(h));
  return dropout_add(m, bias, h);
}

std::vector<at::Tensor> TransformerLayerImpl::sequence_parallel_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& n : {input_norm, post_attention_norm}) {
    out.push_back(n->weight);
    if (n->bias.defined()) out.push_back(n->bias);
  }
  if (attention->proj->bias.defined()) out.push_back(attention->proj->bias);
  if (moe) {
    for (const auto& p : moe->sequence_parallel_parameters()) out.push_back(p);
  } else if (mlp->fc2->bias.defined()) {
    out.push_back(mlp->fc2->bias);
  }
  return out;
}

}  // namespace megatorch::transformer
