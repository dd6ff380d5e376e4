// Ring attention (--cp-comm-type p2p) with the causal load balancing of
// context_parallel.h: rank r holds chunks r and 2c-1-r of the sequence.
//
// Forward, step i = 0..c-1: rank r holds the K, V block of rank (r - i) mod c (K and V
// packed into one message); the hop for step i+1 (send to r+1, receive from r-1) is posted
// before step i computes. Under the causal mask a step computes one of three shapes
// (step_shape): its own block causally; an earlier rank's block (src < r): all 2L queries
// against that block's first chunk, unmasked; a later rank's (src > r): this rank's
// second chunk of queries against the whole block, unmasked. Partial outputs merge by
// log-sum-exp rescaling in fp32 (fp64 for double inputs).
//
// Backward runs the ring the other way so that each dK, dV buffer ends at its owner: at
// step j = 0..c-1 rank r works on the block of rank (r + 1 + j) mod c, which arrives from
// r + 1 (c - 1 K, V hops; step c - 1 is the own block). The dK, dV buffer of that block
// comes from r + 1 too (it was there at step j - 1), gains this rank's contribution and
// goes on to r - 1 (c - 1 hops, in the input dtype); at step c - 1 it is this rank's dK,
// dV. Each step's gradients are flash style from the final output and log-sum-exp.
//
// Attention dropout (attention_dropout.h): a step multiplies its probabilities, normalised
// by its own log-sum-exp, by the keep mask of its (query, key) positions over 1 - p; the
// merge's rescaling then normalises them by the whole row's, as dropout after softmax
// asks. Backward: dV = (P∘D)ᵀdO and dS = P∘(D∘dO·Vᵀ − rowsum(dO∘O)), the same row sum as
// without dropout (O already carries D), so only the mask, recomputed from the key, is
// new. Steps with dropout run the math kernel.
//
// Packed documents and sliding windows (Visibility): each step masks its (query, key)
// pairs by their global positions and the documents' ids there, on the math kernel. A row
// may see nothing of a block (another document): its step output is 0 and its log-sum-exp
// -inf, which the merge leaves out; the own block always holds the query itself.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <limits>
#include <string>
#include <tuple>

#include "context_parallel_internal.h"
#include "megatorch/comm/group.h"
#include "megatorch/transformer/attention_dropout.h"
#include "megatorch/transformer/attention_mask.h"

namespace megatorch::transformer::detail {
namespace {

using comm::P2POp;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Gloo pairs a send with a receive by (peer, tag): one tag per step and kind of transfer.
enum Transfer : int64_t { kForwardKV = 0, kBackwardKV = 1, kBackwardDKV = 2 };
int64_t tag(Transfer t, int64_t step) { return 3 * step + t; }

// What one step computes: rows [q_begin, q_begin + q_len) of the local queries against
// columns [k_begin, k_begin + k_len) of the held block, causally or not.
struct StepShape {
  int64_t q_begin, q_len, k_begin, k_len;
  bool causal;
};

StepShape step_shape(int64_t owner, int64_t rank, int64_t n, bool causal) {
  const int64_t half = n / 2;
  if (!causal) return {0, n, 0, n, false};
  if (owner == rank) return {0, n, 0, n, true};       // positions increase with the local index
  if (owner < rank) return {0, n, 0, half, false};    // chunk `owner` precedes both of ours
  return {half, half, 0, n, false};                   // only our chunk 2c-1-r follows both of its
}

int64_t unmasked_pairs(const StepShape& s) { return s.causal ? s.q_len * (s.q_len + 1) / 2 : s.q_len * s.k_len; }

// Accumulation dtype of outputs, log-sum-exps and gradients.
c10::ScalarType acc_type(c10::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// GQA: query head h uses key/value head h / (heads / groups), as SDPA's enable_gqa.
at::Tensor expand_heads(const at::Tensor& kv, int64_t heads) {
  const int64_t groups = kv.size(1);
  return groups == heads ? kv : kv.repeat_interleave(heads / groups, 1);
}

// The adjoint of expand_heads: each key/value head's gradient is its group's sum.
at::Tensor reduce_heads(const at::Tensor& g, int64_t groups) {
  const int64_t heads = g.size(1);
  if (heads == groups) return g;
  return g.reshape({g.size(0), groups, heads / groups, g.size(2), g.size(3)}).sum(2);
}

at::Tensor causal_mask(int64_t n, const at::Tensor& like) {  // true above the diagonal: masked
  return at::ones({n, n}, like.options().dtype(at::kBool)).triu_(1);
}

// Attention dropout of one call: its probability, key, q's global head indices and the
// global positions of this rank's queries.
struct Dropout {
  double p = 0;
  at::Tensor key, heads, q_positions;
  int64_t seq = 0, cp = 1;  // the whole sequence's length and the CP size

  // Step `s`'s keep mask (over the block of CP rank `owner`) divided by 1 - p, in
  // `dtype`; undefined without dropout.
  at::Tensor scaled_keep(const StepShape& s, int64_t owner, int64_t batch, c10::ScalarType dtype) const {
    if (p == 0) return {};
    const at::Tensor k_positions = context_parallel_positions(seq, cp, owner, key.device());
    return attention_dropout_keep(key, batch, heads, q_positions.narrow(0, s.q_begin, s.q_len),
                                  k_positions.narrow(0, s.k_begin, s.k_len), p)
        .to(dtype)
        .mul_(1.0 / (1.0 - p));
  }
};

// A tensor as a plain argument (the dropout key, the document ids): autograd's apply would
// otherwise take it for an input (and reject it undefined).
struct PlainTensor {
  at::Tensor tensor;
};

// Which (query, key) pairs of a step are visible beyond the step's causal shape: packed
// documents (their ids [b, S] over the whole sequence) and a sliding window.
struct Visibility {
  at::Tensor documents;
  int64_t window = 0;
  at::Tensor q_positions;
  int64_t seq = 0, cp = 1;

  bool active() const { return documents.defined() || (window > 0 && window < seq); }
  // Step `s`'s mask [b or 1, 1, q_len, k_len] (true: visible); undefined when not active.
  at::Tensor mask(const StepShape& s, int64_t owner, bool causal) const {
    if (!active()) return {};
    const at::Tensor k_positions = context_parallel_positions(seq, cp, owner, q_positions.device());
    return visible_keys(q_positions.narrow(0, s.q_begin, s.q_len), k_positions.narrow(0, s.k_begin, s.k_len), causal,
                        window, documents)
        .unsqueeze(1);
  }
};

Visibility visibility_of(const at::Tensor& documents, int64_t window, const at::Tensor& q, int64_t c, int64_t r) {
  Visibility v;
  v.documents = documents;
  v.window = window;
  v.seq = q.size(2) * c;
  v.cp = c;
  if (!v.active()) return v;
  v.q_positions = context_parallel_positions(v.seq, c, r, q.device());
  return v;
}

enum class Kernel { kMath, kFlashCpu, kFlashCuda };

Kernel pick_kernel(const at::Tensor& q, bool use_sdpa, double dropout, bool masked) {
  if (!use_sdpa || dropout > 0 || masked) return Kernel::kMath;  // the fused kernels take no external mask
  const auto t = q.scalar_type();
  const bool half = t == at::kHalf || t == at::kBFloat16;
  if (q.is_cpu() && (half || t == at::kFloat || t == at::kDouble)) return Kernel::kFlashCpu;
  if (q.is_cuda() && half && q.size(3) % 8 == 0 && q.size(3) <= 256) return Kernel::kFlashCuda;
  return Kernel::kMath;
}

// One step's attention: its output (any float dtype) and log-sum-exp (accumulation dtype).
// `keep`: the step's scaled keep mask (math kernel only), undefined without dropout;
// `visible`: its pair mask (Visibility, math kernel only), which replaces the causal one.
std::tuple<at::Tensor, at::Tensor> step_forward(Kernel kernel, const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, bool causal, double scale,
                                                const at::Tensor& keep, const at::Tensor& visible) {
  switch (kernel) {
    case Kernel::kFlashCpu:
      return at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, std::nullopt, scale);
    case Kernel::kFlashCuda: {
      auto r = at::_scaled_dot_product_flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal,
                                                        false, scale);
      return {std::get<0>(r), std::get<1>(r)};
    }
    case Kernel::kMath: break;
  }
  const auto acc = acc_type(q.scalar_type());
  at::Tensor s = at::matmul(q.to(acc), k.to(acc).transpose(-2, -1)).mul_(scale);
  const double inf = std::numeric_limits<double>::infinity();
  if (visible.defined()) {
    s.masked_fill_(visible.logical_not(), -inf);
  } else if (causal) {
    s.masked_fill_(causal_mask(s.size(-1), s), -inf);
  }
  at::Tensor lse = at::logsumexp(s, -1);
  at::Tensor probs = s.sub_(lse.unsqueeze(-1)).exp_();
  if (visible.defined()) probs.masked_fill_(visible.logical_not(), 0.0);  // rows that see nothing: 0, not NaN
  if (keep.defined()) probs.mul_(keep);
  return {at::matmul(probs, v.to(acc)), lse};
}

// One step's gradients from the final output and log-sum-exp of its rows; `delta` is
// rowsum(dO * O) (math kernel only: the fused kernels compute it themselves).
std::tuple<at::Tensor, at::Tensor, at::Tensor> step_backward(Kernel kernel, const at::Tensor& dout, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& out, const at::Tensor& lse,
                                                             const at::Tensor& delta, bool causal, double scale,
                                                             const at::Tensor& keep, const at::Tensor& visible) {
  switch (kernel) {
    case Kernel::kFlashCpu:
      return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                      std::nullopt, scale);
    case Kernel::kFlashCuda: {
      const at::Tensor none;  // cumulative sequence lengths: not variable-length
      // No dropout: the RNG state is not read; empty like the forward returns then.
      const at::Tensor philox = at::empty({}, at::dtype(at::kLong));
      return at::_scaled_dot_product_flash_attention_backward(
          dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(), none,
          none, q.size(2), k.size(2), 0.0, causal, philox, philox, scale);
    }
    case Kernel::kMath: break;
  }
  const auto acc = acc_type(q.scalar_type());
  const at::Tensor qf = q.to(acc), kf = k.to(acc), vf = v.to(acc), dof = dout.to(acc);
  at::Tensor p = at::matmul(qf, kf.transpose(-2, -1)).mul_(scale).sub_(lse.unsqueeze(-1)).exp_();
  if (visible.defined()) {
    p.masked_fill_(visible.logical_not(), 0.0);
  } else if (causal) {
    p.masked_fill_(causal_mask(p.size(-1), p), 0.0);
  }
  at::Tensor dv = at::matmul((keep.defined() ? p * keep : p).transpose(-2, -1), dof);
  at::Tensor dp = at::matmul(dof, vf.transpose(-2, -1));
  if (keep.defined()) dp.mul_(keep);
  at::Tensor ds = p.mul_(dp.sub_(delta.unsqueeze(-1)));
  return {at::matmul(ds, kf).mul_(scale), at::matmul(ds.transpose(-2, -1), qf).mul_(scale), dv};
}

Dropout dropout_of(double p, const at::Tensor& key, int64_t head_offset, const at::Tensor& q, int64_t c, int64_t r) {
  Dropout d;
  if (p == 0) return d;
  d.p = p;
  d.key = key;
  d.heads = at::arange(head_offset, head_offset + q.size(1), q.options().dtype(at::kLong));
  d.seq = q.size(2) * c;
  d.cp = c;
  d.q_positions = context_parallel_positions(d.seq, c, r, q.device());
  return d;
}

// The K, V (or dK, dV) block [2, b, groups, 2L, d] sent to `to` while one arrives from `from`.
comm::Work hop(comm::Group& g, const at::Tensor& send, const at::Tensor& recv, int64_t to, int64_t from, int64_t t) {
  return g.batch_p2p({P2POp{P2POp::Kind::kSend, send, to, t}, P2POp{P2POp::Kind::kRecv, recv, from, t}});
}

class RingAttention : public torch::autograd::Function<RingAttention> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::string& group, bool causal, double scale, bool use_sdpa, double dropout,
                            PlainTensor dropout_key, int64_t head_offset, PlainTensor documents, int64_t window) {
    comm::Group g(group);
    const int64_t c = g.size(), r = g.rank(), n = q.size(2), heads = q.size(1);
    const auto acc = acc_type(q.scalar_type());
    const Visibility vis = visibility_of(documents.tensor, window, q, c, r);
    const Kernel kernel = pick_kernel(q, use_sdpa, dropout, vis.active());
    const Dropout drop = dropout_of(dropout, dropout_key.tensor, head_offset, q, c, r);
    at::Tensor held = at::stack({k, v});  // K and V travel as one message
    at::Tensor out, lse;                  // accumulation dtype: [b, heads, 2L, d], [b, heads, 2L]
    int64_t pairs = 0;
    for (int64_t i = 0; i < c; ++i) {
      comm::Work transfer;
      at::Tensor next;
      if (i + 1 < c) {  // the next step's block, in flight while this one computes
        next = at::empty_like(held);
        transfer = hop(g, held, next, (r + 1) % c, (r + c - 1) % c, tag(kForwardKV, i));
      }
      const int64_t owner = (r - i + c) % c;
      const StepShape s = step_shape(owner, r, n, causal);
      auto [o, l] = step_forward(kernel, q.narrow(2, s.q_begin, s.q_len),
                                 expand_heads(held[0].narrow(2, s.k_begin, s.k_len), heads),
                                 expand_heads(held[1].narrow(2, s.k_begin, s.k_len), heads), s.causal, scale,
                                 drop.scaled_keep(s, owner, q.size(0), acc), vis.mask(s, owner, causal));
      pairs += unmasked_pairs(s);
      if (i == 0) {  // covers every row (the diagonal, or everything when not causal)
        out = o.to(acc).contiguous();
        lse = l.to(acc).contiguous();
      } else {
        at::Tensor out_rows = out.narrow(2, s.q_begin, s.q_len), lse_rows = lse.narrow(2, s.q_begin, s.q_len);
        const at::Tensor step_lse = l.to(acc);
        const at::Tensor merged = at::logaddexp(lse_rows, step_lse);
        out_rows.mul_((lse_rows - merged).exp_().unsqueeze(-1));
        out_rows.add_(o.to(acc) * (step_lse - merged).exp_().unsqueeze(-1));
        lse_rows.copy_(merged);
      }
      if (i + 1 < c) {
        transfer.wait();
        held = next;
      }
    }
    count_attention_call(pairs);
    at::Tensor result = out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, result, lse});
    if (dropout > 0) ctx->saved_data["dropout_key"] = dropout_key.tensor;
    ctx->saved_data["group"] = group;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["use_sdpa"] = use_sdpa;
    ctx->saved_data["dropout"] = dropout;
    ctx->saved_data["head_offset"] = head_offset;
    if (documents.tensor.defined()) ctx->saved_data["documents"] = documents.tensor;
    ctx->saved_data["window"] = window;
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const at::Tensor& dout = grads[0];
    variable_list result(12);  // q, k, v, then the nine other arguments
    if (!dout.defined()) return result;
    comm::Group g(ctx->saved_data["group"].toStringRef());
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const double dropout = ctx->saved_data["dropout"].toDouble();
    const int64_t c = g.size(), r = g.rank(), n = q.size(2), heads = q.size(1), groups = k.size(1);
    const auto documents = ctx->saved_data.find("documents");
    const Visibility vis = visibility_of(documents == ctx->saved_data.end() ? at::Tensor() : documents->second.toTensor(),
                                         ctx->saved_data["window"].toInt(), q, c, r);
    const Kernel kernel = pick_kernel(q, ctx->saved_data["use_sdpa"].toBool(), dropout, vis.active());
    const Dropout drop = dropout_of(dropout, dropout > 0 ? ctx->saved_data["dropout_key"].toTensor() : at::Tensor(),
                                    ctx->saved_data["head_offset"].toInt(), q, c, r);
    const int64_t prev = (r + c - 1) % c, next_rank = (r + 1) % c;
    const auto dtype = q.scalar_type(), acc = acc_type(dtype);
    at::Tensor delta;
    if (kernel == Kernel::kMath) delta = (dout.to(acc) * out.to(acc)).sum(-1);
    at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(acc));
    const at::Tensor own = at::stack({k, v});
    // K, V of block r + 1 + j arrive from r + 1 before step j; the hop before step j sends
    // on the block this rank held at step j - 1 (its own at j = 0).
    at::Tensor kv_next;
    comm::Work kv_transfer;
    if (c > 1) {
      kv_next = at::empty_like(own);
      kv_transfer = hop(g, own, kv_next, prev, next_rank, tag(kBackwardKV, 0));
    }
    at::Tensor dkv_recv, dkv;
    comm::Work dkv_transfer;
    for (int64_t j = 0; j < c; ++j) {
      const int64_t owner = (r + 1 + j) % c;
      at::Tensor kv = own;
      if (j + 1 < c) {
        kv_transfer.wait();
        kv = kv_next;
        if (j + 2 < c) {  // the next step's block, in flight while this one computes
          kv_next = at::empty_like(own);
          kv_transfer = hop(g, kv, kv_next, prev, next_rank, tag(kBackwardKV, j + 1));
        }
      }
      const StepShape s = step_shape(owner, r, n, causal);
      const at::Tensor rows_delta = delta.defined() ? delta.narrow(2, s.q_begin, s.q_len) : delta;
      auto [dq_s, dk_s, dv_s] = step_backward(
          kernel, dout.narrow(2, s.q_begin, s.q_len), q.narrow(2, s.q_begin, s.q_len),
          expand_heads(kv[0].narrow(2, s.k_begin, s.k_len), heads),
          expand_heads(kv[1].narrow(2, s.k_begin, s.k_len), heads),
          out.narrow(2, s.q_begin, s.q_len), lse.narrow(2, s.q_begin, s.q_len), rows_delta, s.causal, scale,
          drop.scaled_keep(s, owner, q.size(0), acc), vis.mask(s, owner, causal));
      dq.narrow(2, s.q_begin, s.q_len).add_(dq_s);
      dkv = at::zeros(own.sizes(), own.options().dtype(acc));
      dkv[0].narrow(2, s.k_begin, s.k_len).copy_(reduce_heads(dk_s.to(acc), groups));
      dkv[1].narrow(2, s.k_begin, s.k_len).copy_(reduce_heads(dv_s.to(acc), groups));
      if (j > 0) {  // the block's gradient from the ranks before this one on its way home
        dkv_transfer.wait();
        dkv.add_(dkv_recv);
      }
      if (j + 1 < c) {  // on to r - 1; its gradient so far for block r + 2 + j arrives from r + 1
        const at::Tensor send = dkv.to(dtype);
        dkv_recv = at::empty_like(send);
        dkv_transfer = hop(g, send, dkv_recv, prev, next_rank, tag(kBackwardDKV, j));
      }
    }
    result[0] = dq.to(dtype);
    result[1] = dkv[0].to(dtype);
    result[2] = dkv[1].to(dtype);
    return result;
  }
};

}  // namespace

at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const ContextParallelAttentionOptions& options) {
  const auto& documents = options.documents();
  return RingAttention::apply(q, k, v, options.group(), options.causal(), attention_scale(options, q.size(3)),
                              options.use_sdpa(), options.dropout(), PlainTensor{options.dropout_key()},
                              options.head_offset(), PlainTensor{documents ? documents->ids : at::Tensor()},
                              options.window());
}

}  // namespace megatorch::transformer::detail
