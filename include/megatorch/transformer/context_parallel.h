#pragma once
// Context parallelism: the sequence split across the ranks of a CP group, attention
// included (Megatron-core's context_parallel_size; Liu et al.'s ring attention with
// Brandon et al.'s causal load balancing; DeepSpeed-Ulysses).
//
// Layout (both comm types). A sequence of S tokens is cut into 2c chunks of L = S/2c;
// CP rank r holds chunks r and 2c-1-r, in that order, so under a causal mask every rank
// has the same work. The global positions of a rank's 2L tokens increase with the local
// index, so causal masking on global positions is lower-triangular on local indices.
//
// p2p (ring attention): K and V travel the ring in c-1 steps; each step's partial
// attention is merged with log-sum-exp rescaling. Backward circulates K, V (c-1 hops)
// and the accumulating dK, dV (c-1 hops, arriving at their owner). Only local Q, K, V,
// the output and the log-sum-exp are saved. GQA: only the key/value heads travel.
//
// a2a (Ulysses): one all-to-all turns sequence shards of Q, K, V into head shards of
// the whole sequence; attention runs locally; one all-to-all turns the output back.
// Heads and key/value heads (per TP rank) must be divisible by c.
#include <torch/arg.h>
#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>

#include "megatorch/transformer/packed_sequence.h"

namespace megatorch::transformer {

enum class CpCommType { kP2P, kA2A };
const char* to_string(CpCommType t);              // "p2p" | "a2a"
CpCommType parse_cp_comm_type(const std::string& s);  // the inverse, failing with the valid names

// The global positions of CP rank `cp_rank`'s tokens, in local order: int64 [2L] with
// L = seq_length / (2 cp_size). Fails unless seq_length is divisible by 2 cp_size.
// cp_size 1: arange(seq_length).
at::Tensor context_parallel_positions(int64_t seq_length, int64_t cp_size, int64_t cp_rank,
                                      c10::Device device = c10::kCPU);
// The part of `x` (of size seq_length along `dim`) that CP rank `cp_rank` holds, in
// local order. x itself when cp_size is 1.
at::Tensor context_parallel_slice(const at::Tensor& x, int64_t dim, int64_t cp_size, int64_t cp_rank);

struct ContextParallelAttentionOptions {
  explicit ContextParallelAttentionOptions(std::string group) : group_(std::move(group)) {}
  // The CP process group's registered name (ParallelState's "<name>.cp").
  TORCH_ARG(std::string, group);
  TORCH_ARG(CpCommType, comm_type) = CpCommType::kP2P;
  TORCH_ARG(bool, causal) = true;
  // Softmax scale; 0 means 1/sqrt(head dim).
  TORCH_ARG(double, scale) = 0.0;
  // Each step's attention through ATen's fused SDPA kernels that return the log-sum-exp
  // (flash attention on CPU, and on CUDA for fp16/bf16); false: the math path (explicit
  // scores, any device and dtype). Same numbers to rounding.
  TORCH_ARG(bool, use_sdpa) = true;
  // Attention dropout: the probability of dropping a (query, key) pair, 0 for none. Above 0
  // the mask is keyed by position (attention_dropout.h): `dropout_key` (one int64 from
  // draw_attention_dropout_key, the same on every rank of the group) and the global index
  // of q's first head (TP rank x heads per TP rank) choose it, so every CP size and comm
  // type drops the same pairs. Each piece then runs the math path.
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(at::Tensor, dropout_key) = {};
  TORCH_ARG(int64_t, head_offset) = 0;
  // Packed documents over the whole sequence (packed_sequence.h): a query sees only keys of
  // its own document. A sliding window of `window` keys (0: none). Either runs the ring's
  // pieces on the math path with the pair mask; Ulysses attends document by document.
  TORCH_ARG(Documents, documents) = nullptr;
  TORCH_ARG(int64_t, window) = 0;
};

// Attention of this rank's queries over the whole sequence (with dropout when asked). q [b, heads, 2L, d], k and v
// [b, groups, 2L, d] (heads divisible by groups: GQA), laid out as
// context_parallel_positions says; returns [b, heads, 2L, d]. Differentiable in q, k, v.
// Every rank of the group calls it with the same shapes.
at::Tensor context_parallel_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const ContextParallelAttentionOptions& options);

// What the ring attention computed on this rank since the last reset: (query, key)
// pairs not masked out, per sample and head, forward only. Under the causal split every
// CP rank counts (2c-1)·L² + L(L+1) per call.
// p2p counts what each ring step computes: the own block causally (2L(2L+1)/2), every
// other block 2L·L. a2a counts this rank's share of the whole sequence's attention
// spread over all heads: (heads/c)·S(S+1)/2 / heads = S(S+1)/2c, the same number.
// Without the causal mask both count 2L·S. Atomics: safe to read from any thread.
struct ContextParallelCounters {
  int64_t unmasked_pairs = 0;
  int64_t attention_calls = 0;  // forward calls of context_parallel_attention
};
ContextParallelCounters context_parallel_counters();
void reset_context_parallel_counters();

}  // namespace megatorch::transformer
