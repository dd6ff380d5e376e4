// Ulysses attention (--cp-comm-type a2a): an all-to-all trades sequence shards for head
// shards, so each rank holds heads/c query heads (and groups/c key/value heads) of the
// whole sequence; attention runs locally; an all-to-all trades back.
//
// Communication: three all-to-alls in (q, k, v, each its own: they differ in heads under
// GQA) and one out (the output, q's size); backward the same four on the gradients.
// Each counts (c-1)/c of its input's bytes (comm_stats.h).
//
// With attention dropout the local attention is keyed_dropout_attention over this rank's
// slice of the heads (attention_dropout.h), so it drops what the ring and one rank drop.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <string>
#include <vector>

#include "context_parallel_internal.h"
#include "megatorch/comm/group.h"
#include "megatorch/check.h"
#include "megatorch/transformer/attention_dropout.h"
#include "megatorch/transformer/attention_mask.h"
#include "megatorch/transformer/packed_sequence.h"

namespace megatorch::transformer::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// all_to_all with autograd: the gradient goes back by the inverse all-to-all.
class AllToAll : public torch::autograd::Function<AllToAll> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::string& group, int64_t split_dim,
                            int64_t concat_dim) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["split_dim"] = split_dim;
    ctx->saved_data["concat_dim"] = concat_dim;
    return comm::Group(group).all_to_all(x, split_dim, concat_dim);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    comm::Group g(ctx->saved_data["group"].toStringRef());
    at::Tensor dx =
        g.all_to_all(grads[0], ctx->saved_data["concat_dim"].toInt(), ctx->saved_data["split_dim"].toInt());
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const ContextParallelAttentionOptions& options) {
  const std::string& group = options.group();
  comm::Group g(group);
  const int64_t c = g.size(), n = q.size(2), seq = n * c, heads = q.size(1), groups = k.size(1);
  // After the all-to-all the sequence is in rank-chunk order (rank 0's 2L tokens, rank
  // 1's, ...): index i holds global position order[i].
  std::vector<at::Tensor> parts;
  for (int64_t j = 0; j < c; ++j) parts.push_back(context_parallel_positions(seq, c, j, q.device()));
  const at::Tensor order = at::cat(parts);
  const at::Tensor natural = at::argsort(order);  // natural[p]: where position p sits
  // [b, h, 2L, d] -> [b, h/c, S, d] in natural order, and back.
  auto to_heads = [&](const at::Tensor& x) { return AllToAll::apply(x, group, 1, 2).index_select(2, natural); };
  const double scale = attention_scale(options, q.size(3));
  // The whole sequence in natural order: packed documents and windows as on one rank.
  const auto& documents = options.documents();
  const bool windowed = options.causal() && options.window() > 0 && options.window() < seq;
  const at::Tensor positions = at::arange(seq, q.options().dtype(at::kLong));
  at::Tensor o;
  if (options.dropout() > 0) {
    // This rank holds heads [rank·heads/c, (rank+1)·heads/c) of its TP rank's.
    const int64_t mine = heads / c, first = options.head_offset() + g.rank() * mine;
    const at::Tensor ids = documents ? documents->ids : at::Tensor();
    const at::Tensor visible =
        documents || windowed ? visible_keys(positions, positions, options.causal(), options.window(), ids) : at::Tensor();
    o = keyed_dropout_attention(to_heads(q), to_heads(k), to_heads(v), positions, positions,
                                at::arange(first, first + mine, positions.options()), options.dropout_key(),
                                options.dropout(), options.causal(), scale, visible);
  } else if (documents) {
    MEGATORCH_CHECK(options.causal(), "Ulysses attention: packed documents need causal attention");
    o = document_causal_attention(to_heads(q), to_heads(k), to_heads(v), documents->runs, 0.0, scale, options.window());
  } else {
    const c10::optional<at::Tensor> mask =
        windowed ? c10::optional<at::Tensor>(causal_window_mask(positions, positions, options.window())) : c10::nullopt;
    o = at::scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), mask, 0.0, options.causal() && !windowed,
                                         scale, /*enable_gqa=*/groups < heads);
  }
  // Per sample and head of q's `heads`: this rank's heads/c heads each attend S(S+1)/2
  // pairs (S^2 unmasked), i.e. S(S+1)/2c = L(S+1) per head: the ring's (2c-1)L^2 + L(L+1).
  count_attention_call(options.causal() ? seq * (seq + 1) / 2 / c : n * seq);
  return AllToAll::apply(o.index_select(2, order), group, 2, 1);
}

}  // namespace megatorch::transformer::detail
