#include "megatorch/inference/kv_cache.h"

#include <ATen/ATen.h>

#include <limits>

#include "megatorch/check.h"
#include "megatorch/models/gpt_model.h"

namespace megatorch::inference {

using transformer::Positions;

int64_t max_sequence_length(const transformer::TransformerConfig& c) {
  int64_t limit = std::numeric_limits<int64_t>::max();
  // A learned table ends; RoPE and sliding windows go on (cached attention masks the window).
  if (c.position_embedding_type() == Positions::kLearned) limit = c.max_positions();
  return limit;
}

void check_sequence_length(const transformer::TransformerConfig& c, int64_t total) {
  const int64_t limit = max_sequence_length(c);
  if (total <= limit) return;
  MEGATORCH_FAIL("generation: expected the prompt plus the new tokens to fit the model's learned position table of ",
                 limit, " tokens, got ", total,
                 " tokens; shorten the prompt or lower --max-new-tokens");
}

std::vector<KVCache> make_kv_caches(const models::GPTModelImpl& model, int64_t max_len, int64_t batch) {
  const auto& c = model.options.config();
  MEGATORCH_CHECK(max_len >= 1 && batch >= 1, "make_kv_caches: expected max_len >= 1 and batch >= 1, got ", max_len,
                  " and ", batch);
  check_sequence_length(c, max_len);
  const int64_t groups = c.query_groups() / model.tp.size;
  const auto t = at::TensorOptions().dtype(c.params_dtype()).device(c.device());
  std::vector<KVCache> caches(model.layers->size());
  for (auto& cache : caches) {
    cache.k = at::empty({max_len, batch, groups, c.head_dim()}, t);
    cache.v = at::empty({max_len, batch, groups, c.head_dim()}, t);
  }
  return caches;
}

}  // namespace megatorch::inference
