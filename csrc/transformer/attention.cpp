#include "megatorch/transformer/attention.h"

#include <ATen/ATen.h>

#include <cmath>

#include "megatorch/check.h"
#include "megatorch/comm/mappings.h"
#include "megatorch/kernels/rotary.h"
#include "megatorch/transformer/attention_dropout.h"
#include "megatorch/transformer/attention_mask.h"
#include "megatorch/transformer/context_parallel.h"
#include "megatorch/transformer/recompute.h"

namespace megatorch::transformer {

at::Tensor rope_frequencies(int64_t seq_length, int64_t head_dim, double base, c10::Device device) {
  return rope_frequencies(seq_length, head_dim, base, RopeScaling(), device);
}

at::Tensor rope_frequencies(int64_t seq_length, const TransformerConfig& c, c10::Device device) {
  return rope_frequencies(seq_length, c.rotary_dim(), c.rotary_base(), c.rope_scaling(), device);
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& freqs) {
  const int64_t r = freqs.size(-1), d = x.size(-1);
  MEGATORCH_CHECK(r <= d && r % 2 == 0, "apply_rope: expected an even rotary dim <= head dim ", d, ", got ", r);
  const at::Tensor rot = x.narrow(-1, 0, r);
  const at::Tensor x1 = rot.narrow(-1, 0, r / 2), x2 = rot.narrow(-1, r / 2, r / 2);
  const at::Tensor rotated = at::cat({-x2, x1}, -1);
  const at::Tensor out = (rot * freqs.cos() + rotated * freqs.sin()).to(x.scalar_type());
  return r == d ? out : at::cat({out, x.narrow(-1, r, d - r)}, -1);
}

ParallelAttentionImpl::ParallelAttentionImpl(ParallelAttentionOptions options_) : options(std::move(options_)) {
  reset();
}

void ParallelAttentionImpl::reset() {
  const auto& c = options.config();
  const int64_t tp = tp::tp_info(options.group()).size;
  c.validate(tp, tp::tp_info(c.context_parallel_group()).size);
  local_heads = c.num_attention_heads() / tp;
  if (c.position_embedding_type() == Positions::kRope) {
    rope_scale_ = rope_inverse_frequencies(c.rotary_dim(), c.rotary_base(), c.rope_scaling(), c.seq_length())
                      .attention_scaling;
  }
  local_groups = c.query_groups() / tp;
  window = c.attention_window(options.layer_number());
  const int64_t d = c.head_dim();
  // The fused QKV weight is laid out group by group — [q heads of the group, k, v] —
  // so a contiguous slice of its rows holds whole key/value groups with their queries.
  const int64_t qkv_out = (c.num_attention_heads() + 2 * c.query_groups()) * d;
  qkv = register_module("qkv", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.hidden_size(), qkv_out)
                                                              .bias(c.qkv_bias())
                                                              .sequence_parallel(c.sequence_parallel())
                                                              .group(options.group())
                                                              .fp8(c.fp8())
                                                              .fp8_sequence_group(c.context_parallel_group())
                                                              .init(param_init(c, options.name() + ".qkv"))));
  proj = register_module("proj", tp::RowParallelLinear(tp::RowParallelLinearOptions(c.num_attention_heads() * d,
                                                                                     c.hidden_size())
                                                           .bias(c.proj_bias())
                                                           .input_is_parallel(true)
                                                           .sequence_parallel(c.sequence_parallel())
                                                           .group(options.group())
                                                           .fp8(c.fp8())
                                                           .fp8_sequence_group(c.context_parallel_group())
                                                           .init(param_init(c, options.name() + ".proj"))));
  if (c.qk_layernorm()) {
    // Each TP rank's heads, whole sequences: the gradient is summed in autograd (norm_heads).
    Norm q = make_norm(c, d), k = make_norm(c, d);
    q->options.partial_grad_under_sp(false);
    k->options.partial_grad_under_sp(false);
    q_norm = register_module("q_norm", q);
    k_norm = register_module("k_norm", k);
  }
}

at::Tensor ParallelAttentionImpl::core_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const Documents& documents) {
  const auto& c = options.config();
  // SDPA wants [b, heads, s, d].
  const at::Tensor qb = q.permute({1, 2, 0, 3}), kb = k.permute({1, 2, 0, 3}), vb = v.permute({1, 2, 0, 3});
  const double p = is_training() ? c.attention_dropout() : 0.0;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim()));
  at::Tensor out;
  MEGATORCH_CHECK(!documents || c.causal_attention(), "ParallelAttention: packed documents need causal attention, "
                  "got causal_attention(false); drop --reset-attention-mask or build the model causal");
  if (!c.context_parallel_group().empty()) {
    // The sequence is split over the CP group: attention crosses it (context_parallel.h).
    // Dropout is keyed by position and global head (attention_dropout.h), its key drawn
    // from the default generator, which every TP and CP rank holds alike.
    auto cp = ContextParallelAttentionOptions(c.context_parallel_group())
                  .comm_type(c.cp_comm_type())
                  .causal(c.causal_attention())
                  .scale(scale)
                  .documents(documents)
                  .window(window);
    if (p > 0) {
      cp.dropout(p)
          .dropout_key(draw_attention_dropout_key(qb.device()))
          .head_offset(tp::tp_info(options.group()).rank * local_heads);
    }
    out = context_parallel_attention(qb, kb, vb, cp);
  } else {
    // Each TP rank holds other heads: its attention dropout draws from its own stream.
    c10::optional<tp::RngTracker::Fork> fork;
    if (p > 0 && options.rng()) fork.emplace(*options.rng(), tp::kModelParallelRng);
    if (documents) {
      out = document_causal_attention(qb, kb, vb, documents->runs, p, scale, window);
    } else {
      // A window shorter than the sequence cuts the causal prefix: an explicit mask.
      const int64_t s = qb.size(2);
      c10::optional<at::Tensor> mask;
      if (window > 0 && window < s && c.causal_attention()) {
        const at::Tensor pos = at::arange(s, at::TensorOptions().dtype(at::kLong).device(qb.device()));
        mask = causal_window_mask(pos, pos, window);
      }
      out = at::scaled_dot_product_attention(qb, kb, vb, mask, p, /*is_causal=*/c.causal_attention() && !mask, scale,
                                             /*enable_gqa=*/local_groups != local_heads);
    }
  }
  const int64_t b = out.size(0), s = out.size(2);
  return out.permute({2, 0, 1, 3}).reshape({s, b, local_heads * c.head_dim()});
}

at::Tensor ParallelAttentionImpl::rotate(const at::Tensor& x, const at::Tensor& rope_freqs) const {
  // The fused kernel takes one angle table for every row ([s, 1, 1, r]).
  const at::Tensor out = options.config().fused_kernels() && rope_freqs.size(1) == 1
                             ? kernels::rotary_embedding(x, rope_freqs)
                             : apply_rope(x, rope_freqs);
  if (rope_scale_ == 1.0) return out;
  // YaRN scales cos and sin, so the rotated channels alone (HF's attention_scaling).
  const int64_t r = rope_freqs.size(-1), d = out.size(-1);
  return r == d ? out * rope_scale_ : at::cat({out.narrow(-1, 0, r) * rope_scale_, out.narrow(-1, r, d - r)}, -1);
}

std::array<at::Tensor, 3> ParallelAttentionImpl::split_qkv(const at::Tensor& mixed) const {
  const int64_t d = options.config().head_dim(), per_group = local_heads / local_groups;
  const int64_t s = mixed.size(0), b = mixed.size(1);
  const auto parts = mixed.view({s, b, local_groups, per_group + 2, d}).split_with_sizes({per_group, 1, 1}, 3);
  return {parts[0].reshape({s, b, local_heads, d}), parts[1].squeeze(3), parts[2].squeeze(3)};
}

at::Tensor ParallelAttentionImpl::norm_heads(Norm& norm, const at::Tensor& x) const {
  const std::string& group = options.group();
  if (tp::tp_info(group).size == 1) return norm->forward(x);
  const auto shared = [&group](const at::Tensor& t) { return t.defined() ? comm::copy_to_tp_region(t, group) : t; };
  return norm->forward(x, shared(norm->weight), shared(norm->bias));
}

std::array<at::Tensor, 3> ParallelAttentionImpl::project_qkv(const at::Tensor& x, const at::Tensor& rope_freqs) {
  auto [q, k, v] = split_qkv(qkv->forward(x));
  if (q_norm) {
    q = norm_heads(q_norm, q);
    k = norm_heads(k_norm, k);
  }
  if (rope_freqs.defined()) {
    q = rotate(q, rope_freqs);
    k = rotate(k, rope_freqs);
  }
  return {q, k, v};
}

at::Tensor ParallelAttentionImpl::context(const at::Tensor& x, const at::Tensor& rope_freqs,
                                          const Documents& documents) {
  const auto& c = options.config();
  auto [q, k, v] = project_qkv(x, rope_freqs);
  if (c.recompute() == Recompute::kSelective && is_training()) {
    // Selective recomputation: keep q, k, v; replay softmax, dropout and the products.
    return recompute([this, documents](const torch::autograd::variable_list& in) {
             return torch::autograd::variable_list{core_attention(in[0], in[1], in[2], documents)};
           },
           {q, k, v}, options.rng().get())[0];
  }
  return core_attention(q, k, v, documents);
}

at::Tensor ParallelAttentionImpl::forward(const at::Tensor& x, const at::Tensor& rope_freqs,
                                          const Documents& documents) {
  return proj->forward(context(x, rope_freqs, documents));
}

at::Tensor ParallelAttentionImpl::forward_without_bias(const at::Tensor& x, const at::Tensor& rope_freqs,
                                                       const Documents& documents) {
  return proj->forward_without_bias(context(x, rope_freqs, documents));
}

}  // namespace megatorch::transformer
