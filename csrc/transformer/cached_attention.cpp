// ParallelAttention's inference path: the new tokens' keys and values go into a KV cache
// and their queries attend over everything cached. Kept apart from attention.cpp so the
// training forward stays exactly as it is.
#include <ATen/ATen.h>

#include <cmath>

#include "megatorch/check.h"
#include "megatorch/transformer/attention.h"
#include "megatorch/transformer/attention_mask.h"

namespace megatorch::transformer {

at::Tensor ParallelAttentionImpl::forward_cached_without_bias(const at::Tensor& x, const at::Tensor& rope_freqs,
                                                              inference::KVCache& cache) {
  const auto& c = options.config();
  MEGATORCH_CHECK(!is_training(), "ParallelAttention::forward_cached_without_bias: expected eval mode (no dropout); "
                  "call eval() on the model before generating");
  // Appending tokens to a cache assumes earlier tokens never see later ones.
  MEGATORCH_CHECK(c.causal_attention(), "ParallelAttention::forward_cached_without_bias: expected causal attention, "
                  "got causal_attention(false): a KV cache holds keys that later tokens must not change, which "
                  "bidirectional attention breaks; run the whole sequence through forward() instead");
  MEGATORCH_CHECK(!c.sequence_parallel(), "ParallelAttention::forward_cached_without_bias: expected a configuration "
                  "without sequence parallelism (each step has too few tokens to split); build the model with "
                  "sequence_parallel(false)");
  const int64_t d = c.head_dim();
  const int64_t s = x.size(0), b = x.size(1);
  const int64_t start = cache.length, end = start + s;
  MEGATORCH_CHECK(cache.k.defined() && cache.k.size(1) == b && cache.k.size(2) == local_groups && cache.k.size(3) == d,
                  "ParallelAttention: expected a KV cache [len, ", b, ", ", local_groups, ", ", d, "], got ",
                  cache.k.defined() ? cache.k.sizes() : at::IntArrayRef{}, "; make it with inference::make_kv_caches");
  MEGATORCH_CHECK(end <= cache.capacity(), "ParallelAttention: the KV cache holds ", cache.capacity(),
                  " positions, ", start, " used, and ", s, " more were given; make it for the longest sequence");
  auto [q, k, v] = project_qkv(x, rope_freqs);
  cache.k.narrow(0, start, s).copy_(k);
  cache.v.narrow(0, start, s).copy_(v);
  cache.length = end;
  // SDPA wants [b, heads, s, d].
  const at::Tensor qb = q.permute({1, 2, 0, 3});
  const at::Tensor kb = cache.k.narrow(0, 0, end).permute({1, 2, 0, 3});
  const at::Tensor vb = cache.v.narrow(0, 0, end).permute({1, 2, 0, 3});
  // New token i sits at position start + i and sees keys 0..start + i (the last `window`
  // of them with a sliding window). SDPA's is_causal aligns the mask top-left, right only
  // when nothing is cached; one new token sees all, unless the window cuts the cache.
  c10::optional<at::Tensor> mask;
  const bool windowed = window > 0 && end > window;
  const bool causal = start == 0 && s > 1 && !windowed;
  if ((start > 0 && s > 1) || windowed) {
    const auto opts = at::TensorOptions().dtype(at::kLong).device(x.device());
    mask = causal_window_mask(at::arange(start, end, opts), at::arange(end, opts), window);  // [s, end]
  }
  const at::Tensor out = at::scaled_dot_product_attention(qb, kb, vb, mask, 0.0, causal,
                                                          1.0 / std::sqrt(static_cast<double>(d)),
                                                          /*enable_gqa=*/local_groups != local_heads);
  const at::Tensor context = out.permute({2, 0, 1, 3}).reshape({s, b, local_heads * d});
  const auto& o = proj->options;
  return tp::row_parallel_linear(context, proj->weight, c10::nullopt, o.group(), o.input_is_parallel(),
                                 /*sequence_parallel=*/false);
}

}  // namespace megatorch::transformer
