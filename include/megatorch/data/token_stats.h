#pragma once
// The range of token ids in an indexed dataset, so a trainer can refuse data that does not
// fit its vocabulary before step 1 (an id past the vocabulary is masked by every
// tensor-parallel shard, one inside the padding gives an infinite loss: both train on
// garbage without an error).
//
// The whole PREFIX.bin is scanned once, through mmap, in the dtype its .idx names, and the
// result is cached beside the data in PREFIX.max_id.json together with the .bin's size and
// modification time and the dtype: a changed .bin (or .idx dtype) is scanned again. The
// cache is written atomically (a temporary file renamed over it); where the directory
// cannot be written (read-only data) nothing is cached and nothing fails.
#include <cstdint>
#include <string>

namespace megatorch::data {

struct TokenIdRange {
  int64_t min_id = 0;      // smallest token id (0 when the dataset has no tokens)
  int64_t max_id = -1;     // largest token id; -1 when the dataset has no tokens
  int64_t num_tokens = 0;  // tokens in the .bin
  bool from_cache = false; // read from PREFIX.max_id.json rather than scanned
};

std::string token_stats_cache_path(const std::string& prefix);  // prefix + ".max_id.json"

// The id range of PREFIX.bin (the dataset is opened and validated first).
TokenIdRange token_id_range(const std::string& prefix);

// Shorthand for token_id_range(prefix).max_id.
int64_t max_token_id(const std::string& prefix);

}  // namespace megatorch::data
