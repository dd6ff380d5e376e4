#pragma once
// KVCache: one attention layer's keys and values of the tokens seen so far, so that
// generating a token runs the model over that one position instead of the whole
// sequence. Preallocated for the longest sequence of a request ([max_len, b,
// local_groups, head_dim], this TP rank's key/value groups only); `length` counts the
// positions filled. Keys are stored after RoPE, as attention consumes them.
#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

#include "megatorch/transformer/config.h"

namespace megatorch::models {
class GPTModelImpl;
}

namespace megatorch::inference {

struct KVCache {
  at::Tensor k, v;  // [max_len, b, local_groups, head_dim]
  int64_t length = 0;

  int64_t capacity() const { return k.defined() ? k.size(0) : 0; }
  // Empties the cache for a new sequence (the storage is reused, not cleared).
  void reset() { length = 0; }
};

// The longest sequence (prompt + generated tokens) the model can attend over: its
// learned position table; RoPE models have no limit (INT64_MAX). A sliding window bounds
// what each token sees, not the sequence: the cached attention masks keys past it.
int64_t max_sequence_length(const transformer::TransformerConfig& config);

// Fails, naming both numbers and what to change, when `total` tokens exceed
// max_sequence_length(config).
void check_sequence_length(const transformer::TransformerConfig& config, int64_t total);

// One empty cache per layer of `model` (this pipeline stage's layers), for sequences of
// up to `max_len` tokens in batches of `batch`, in the model's dtype and on its device.
std::vector<KVCache> make_kv_caches(const models::GPTModelImpl& model, int64_t max_len, int64_t batch = 1);

}  // namespace megatorch::inference
