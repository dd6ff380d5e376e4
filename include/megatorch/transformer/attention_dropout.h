#pragma once
// Attention dropout keyed by position, for attention that is cut into pieces.
//
// Under context parallelism a rank computes its queries against the keys in blocks
// (ring steps) or a slice of the heads over the whole sequence (Ulysses), so a mask drawn
// from a generator in the order the pieces happen to be computed would depend on the
// layout, and backward would need the forward's generator offsets per piece. Here whether
// sample b, head h keeps the pair (query position i, key position j) is a hash of
// (key, b, h, i, j) instead (splitmix64's finaliser, chained): a piece of attention draws
// exactly the entries of the full mask it covers, every CP size and comm type draws the
// same mask, and backward recomputes it from the key rather than storing it.
//
// The key is one int64 drawn from the default generator per attention call, which every
// TP and CP rank of a model seeds alike (tp/rng_tracker.h), with heads numbered globally
// (TP rank × heads per rank + local head): TP × CP layouts draw one mask. Recomputation
// replays the draw with the generator's state.
//
// Cost: int64 arithmetic over every (query, key) pair a piece computes (about ten
// elementwise passes), and the pieces run the explicit-scores math path instead of the
// fused flash kernels, which have no way to take an external mask.
#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace megatorch::transformer {

// A 0-dim int64 key in [0, 2^63) drawn from the default generator of `device` (no
// device-to-host synchronisation on CUDA).
at::Tensor draw_attention_dropout_key(c10::Device device);

// Which pairs are kept: bool [batch, heads.numel(), q_positions.numel(), k_positions.numel()],
// each true with probability 1 - p. `heads`, `q_positions`, `k_positions`: int64 global
// head indices and sequence positions; `key` from draw_attention_dropout_key.
at::Tensor attention_dropout_keep(const at::Tensor& key, int64_t batch, const at::Tensor& heads,
                                  const at::Tensor& q_positions, const at::Tensor& k_positions, double p);

// softmax(q kᵀ · scale, causal on positions) with dropout by attention_dropout_keep, times v;
// plain ATen ops (autograd differentiates it). q [b, H, Q, d], k and v [b, G, K, d] with
// H divisible by G (grouped-query attention); `heads` [H] are q's global head indices.
// The reference the context-parallel paths are tested against, and Ulysses' local step.
// `visible` [b or 1, Q, K] (attention_mask.h's visible_keys) replaces the causal mask when given.
at::Tensor keyed_dropout_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& q_positions, const at::Tensor& k_positions,
                                   const at::Tensor& heads, const at::Tensor& key, double p, bool causal,
                                   double scale, const at::Tensor& visible = {});

}  // namespace megatorch::transformer
