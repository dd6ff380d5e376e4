#pragma once
// Shared by context_parallel.cpp (layout, checks, counters), ring_attention.cpp (p2p) and
// ulysses_attention.cpp (a2a). Private to the library.
#include <ATen/Tensor.h>

#include <cstdint>

#include "megatorch/transformer/context_parallel.h"

namespace megatorch::transformer::detail {

// Adds one forward call's unmasked (query, key) pairs per sample and head to the counters.
void count_attention_call(int64_t unmasked_pairs);

// The softmax scale the options ask for: 1/sqrt(head_dim) when options.scale() is 0.
double attention_scale(const ContextParallelAttentionOptions& options, int64_t head_dim);

// The two comm types; shapes and the group are already checked (context_parallel.cpp).
at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const ContextParallelAttentionOptions& options);
at::Tensor ulysses_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const ContextParallelAttentionOptions& options);

}  // namespace megatorch::transformer::detail
