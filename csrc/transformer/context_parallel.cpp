// Context parallelism: the load-balanced sequence layout, the checks every comm type
// shares, the counters, and the dispatch to ring_attention.cpp (p2p) or
// ulysses_attention.cpp (a2a).
#include "megatorch/transformer/context_parallel.h"

#include <ATen/ATen.h>

#include <atomic>
#include <cmath>

#include "context_parallel_internal.h"
#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/util/enum_names.h"

namespace megatorch::transformer {
namespace {

std::atomic<int64_t> g_unmasked_pairs{0};
std::atomic<int64_t> g_attention_calls{0};

void check_layout(const char* what, int64_t seq_length, int64_t cp_size, int64_t cp_rank) {
  MEGATORCH_CHECK(cp_size >= 1, what, ": expected a context-parallel size >= 1, got ", cp_size);
  MEGATORCH_CHECK(cp_rank >= 0 && cp_rank < cp_size, what, ": expected a CP rank in [0, ", cp_size, "), got ",
                  cp_rank);
  MEGATORCH_CHECK(seq_length >= 1, what, ": expected a sequence of at least one token, got ", seq_length);
  MEGATORCH_CHECK(cp_size == 1 || seq_length % (2 * cp_size) == 0, what, ": expected the sequence length (",
                  seq_length, ") to be divisible by 2 x the context-parallel size (2 x ", cp_size, " = ",
                  2 * cp_size, "): each CP rank holds two of 2c equal chunks; pad the sequence or change "
                  "--seq-length or --context-parallel-size");
}

}  // namespace

const char* to_string(CpCommType t) {
  switch (t) {
    case CpCommType::kP2P: return "p2p";
    case CpCommType::kA2A: return "a2a";
  }
  return "?";
}

CpCommType parse_cp_comm_type(const std::string& s) {
  // p2p: ring attention; a2a: Ulysses all-to-all.
  return util::parse_enum(s, {CpCommType::kP2P, CpCommType::kA2A}, "--cp-comm-type");
}

at::Tensor context_parallel_positions(int64_t seq_length, int64_t cp_size, int64_t cp_rank, c10::Device device) {
  check_layout("context_parallel_positions", seq_length, cp_size, cp_rank);
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  if (cp_size == 1) return at::arange(seq_length, opts);
  const int64_t chunk = seq_length / (2 * cp_size);
  const int64_t second = 2 * cp_size - 1 - cp_rank;
  return at::cat({at::arange(cp_rank * chunk, (cp_rank + 1) * chunk, opts),
                  at::arange(second * chunk, (second + 1) * chunk, opts)});
}

at::Tensor context_parallel_slice(const at::Tensor& x, int64_t dim, int64_t cp_size, int64_t cp_rank) {
  MEGATORCH_CHECK(x.defined() && x.dim() > 0, "context_parallel_slice: expected a tensor with at least one dim, got ",
                  x.defined() ? "a 0-dim tensor" : "an undefined tensor");
  const int64_t nd = x.dim();
  MEGATORCH_CHECK(dim >= -nd && dim < nd, "context_parallel_slice: expected dim in [", -nd, ", ", nd,
                  ") for a tensor of shape ", x.sizes(), ", got ", dim);
  if (dim < 0) dim += nd;
  check_layout("context_parallel_slice", x.size(dim), cp_size, cp_rank);
  if (cp_size == 1) return x;
  const int64_t chunk = x.size(dim) / (2 * cp_size);
  return at::cat({x.narrow(dim, cp_rank * chunk, chunk), x.narrow(dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)},
                 dim);
}

at::Tensor context_parallel_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const ContextParallelAttentionOptions& options) {
  const char* what = "context_parallel_attention";
  MEGATORCH_CHECK(q.defined() && k.defined() && v.defined() && q.dim() == 4 && k.dim() == 4 && v.dim() == 4, what,
                  ": expected q [b, heads, 2L, d] and k, v [b, groups, 2L, d], got ranks ",
                  q.defined() ? q.dim() : -1, ", ", k.defined() ? k.dim() : -1, ", ", v.defined() ? v.dim() : -1,
                  " (-1: undefined); pass them as [batch, heads, tokens, head_dim]");
  MEGATORCH_CHECK(k.sizes() == v.sizes(), what, ": expected k and v of one shape, got ", k.sizes(), " and ",
                  v.sizes(), "; split the key/value projection into equal halves");
  MEGATORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3), what,
                  ": expected q and k to agree in batch, local sequence and head dim, got q ", q.sizes(), " and k ",
                  k.sizes(), "; slice q, k and v of one sequence with context_parallel_slice");
  MEGATORCH_CHECK(k.size(1) >= 1 && q.size(1) % k.size(1) == 0, what, ": expected the query heads (", q.size(1),
                  ") to be a multiple of the key/value heads (", k.size(1), ") (grouped-query attention); choose "
                  "a number of query groups that divides the heads");
  MEGATORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                      q.device() == k.device() && q.device() == v.device(),
                  what, ": expected q, k, v of one dtype on one device, got ", q.scalar_type(), "/", k.scalar_type(),
                  "/", v.scalar_type(), " on ", q.device(), "/", k.device(), "/", v.device(),
                  "; convert them together");
  MEGATORCH_CHECK(q.is_floating_point(), what, ": expected floating-point q, k, v, got ", q.scalar_type(),
                  "; attention needs a float dtype");
  MEGATORCH_CHECK(options.dropout() >= 0 && options.dropout() < 1, what, ": expected a dropout probability in [0, 1), "
                  "got ", options.dropout());
  const at::Tensor& key = options.dropout_key();
  MEGATORCH_CHECK(options.dropout() == 0 || (key.defined() && key.numel() == 1 && key.scalar_type() == at::kLong &&
                                             key.device() == q.device()),
                  what, ": dropout ", options.dropout(), " needs a one-element int64 dropout_key on ", q.device(),
                  ", got ", key.defined() ? c10::str(key.scalar_type(), key.sizes(), " on ", key.device()) : "none",
                  "; pass .dropout_key(draw_attention_dropout_key(q.device())), the same on every rank");
  comm::Group group(options.group());
  const int64_t c = group.size();
  MEGATORCH_CHECK(c == 1 || q.size(2) % 2 == 0, what, ": expected an even local sequence (two chunks of L tokens "
                  "each, context_parallel_slice), got ", q.size(2), " tokens on a CP group of ", c,
                  " ranks; slice the sequence with context_parallel_slice");
  const auto& documents = options.documents();
  MEGATORCH_CHECK(!documents || (documents->ids.dim() == 2 && documents->ids.size(0) == q.size(0) &&
                                 documents->ids.size(1) == q.size(2) * c),
                  what, ": expected document ids [b, S] over the whole sequence, [", q.size(0), ", ", q.size(2) * c,
                  "], got ", documents ? documents->ids.sizes() : at::IntArrayRef{},
                  "; pass the micro-batch's unsliced document_ids");
  MEGATORCH_CHECK(options.window() >= 0, what, ": expected a window >= 0 (0: none), got ", options.window());
  if (options.comm_type() == CpCommType::kA2A) {
    const int64_t heads = q.size(1), groups = k.size(1);
    MEGATORCH_CHECK(heads % c == 0 && groups % c == 0, "Ulysses (--cp-comm-type a2a) splits the heads over the ",
                    "context-parallel ranks: it needs the attention heads and key/value heads per tensor-parallel "
                    "rank divisible by --context-parallel-size ", c, ", got ", heads, " heads and ", groups,
                    " key/value heads; use --cp-comm-type p2p or a context-parallel size that divides both");
    return detail::ulysses_attention(q, k, v, options);
  }
  return detail::ring_attention(q, k, v, options);
}

ContextParallelCounters context_parallel_counters() {
  ContextParallelCounters out;
  out.unmasked_pairs = g_unmasked_pairs.load(std::memory_order_relaxed);
  out.attention_calls = g_attention_calls.load(std::memory_order_relaxed);
  return out;
}

void reset_context_parallel_counters() {
  g_unmasked_pairs.store(0, std::memory_order_relaxed);
  g_attention_calls.store(0, std::memory_order_relaxed);
}

namespace detail {

void count_attention_call(int64_t unmasked_pairs) {
  g_unmasked_pairs.fetch_add(unmasked_pairs, std::memory_order_relaxed);
  g_attention_calls.fetch_add(1, std::memory_order_relaxed);
}

double attention_scale(const ContextParallelAttentionOptions& options, int64_t head_dim) {
  return options.scale() != 0.0 ? options.scale() : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

}  // namespace detail
}  // namespace megatorch::transformer
