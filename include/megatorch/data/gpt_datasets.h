#pragma once
// The train / valid / test GPT datasets from Megatron-LM's data flags, built as Megatron's
// BlendedMegatronDatasetBuilder builds them (so a run reads the same samples as Megatron):
//
//   --data-path PREFIX                one dataset, split by --split into three GPTDatasets
//   --data-path W1 P1 W2 P2 ...       each prefix split the same way, and each split a
//                                     BlendedDataset drawing from the prefixes by weight;
//                                     dataset d gets ceil(n * w_d) of a split's n samples
//                                     and is built with 0.5% surplus
//   --data-path P1 P2 ...             a blend weighted by each dataset's own sample count
//   --split 969,30,1                  the share of each prefix's *sequences* (documents)
//                                     per split, in order; a 0 share leaves the split empty
//
// Usage from a trainer:
//   auto opts = GPTDataOptions().blend(parse_data_path(args.data_path)).seq_length(1024)
//                   .seed(1234).split("969,30,1").num_samples({train_n, valid_n, test_n});
//   GPTDatasets ds = build_gpt_datasets(opts);
//   at::Tensor tokens = ds.train->get(i);  // int64 [seq_length + 1]; inputs [:-1], labels [1:]
//
// Every rank may call this: it is deterministic and reads the files through mmap.
#include <torch/arg.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megatorch/data/blended_dataset.h"
#include "megatorch/data/gpt_dataset.h"

namespace megatorch::data {

// Dataset prefixes and, optionally, one weight per prefix (empty: no weights given).
struct DataBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;
  static DataBlend weighted(const std::vector<std::pair<double, std::string>>& items);
};

// Megatron's --data-path token list: "P1 P2 ..." or "W1 P1 W2 P2 ..." (weights are numbers).
DataBlend parse_data_path(const std::vector<std::string>& tokens);

// Megatron's split string ("969,30,1", "98,2,0", "1"): numbers normalized to fractions,
// each split a [begin, end) range of fractions, or none when its share is 0.
using SplitMatrix = std::array<std::optional<std::pair<double, double>>, 3>;
SplitMatrix parse_split(const std::string& split);

// Samples per split: train, valid, test.
using SampleCounts = std::array<int64_t, 3>;

struct GPTDataOptions {
  TORCH_ARG(DataBlend, blend);
  TORCH_ARG(int64_t, seq_length) = 0;
  TORCH_ARG(int64_t, seed) = 1234;
  TORCH_ARG(std::string, split) = "969,30,1";
  // Samples wanted per split (train, valid, test); -1: one epoch of that split (only
  // without weights). A dataset has at least this many. Megatron's pretrain_gpt asks for
  // train_iters * gbs, (train_iters / eval_interval + 1) * eval_iters * gbs and
  // eval_iters * gbs (gbs = global batch size).
  TORCH_ARG(SampleCounts, num_samples) = SampleCounts{-1, -1, -1};
};

// A split with a 0 share is an empty dataset (size() == 0), never a null pointer.
struct GPTDatasets {
  std::shared_ptr<const SampleDataset> train;
  std::shared_ptr<const SampleDataset> valid;
  std::shared_ptr<const SampleDataset> test;
  const std::shared_ptr<const SampleDataset>& operator[](Split s) const;
};

GPTDatasets build_gpt_datasets(const GPTDataOptions& options);

}  // namespace megatorch::data
