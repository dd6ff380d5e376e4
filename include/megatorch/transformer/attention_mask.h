#pragma once
// Which keys a query may attend to, as the boolean mask SDPA takes (true: attend): causal
// attention, optionally within a sliding window, over explicit positions. Used where the
// queries are not the keys' own prefix (a KV cache) or a window cuts the prefix.
#include <ATen/ATen.h>

namespace megatorch::transformer {

// [sq, sk]: key j is visible to query i when k_positions[j] <= q_positions[i] and, with
// window > 0, q_positions[i] - k_positions[j] < window (HF's and Mistral's convention: a
// window of w tokens includes the query's own).
at::Tensor causal_window_mask(const at::Tensor& q_positions, const at::Tensor& k_positions, int64_t window);

// The same with packed documents: [b, sq, sk], key j visible to query i of row r when, besides
// the causal window (causal false: no causal or window condition), documents[r] (the whole
// sequence's document ids [b, S], indexed by position) is equal at both positions.
// Undefined documents: [1, sq, sk].
at::Tensor visible_keys(const at::Tensor& q_positions, const at::Tensor& k_positions, bool causal, int64_t window,
                        const at::Tensor& documents);

}  // namespace megatorch::transformer
