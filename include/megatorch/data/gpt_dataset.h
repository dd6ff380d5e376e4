#pragma once
// The GPT sample index over one indexed dataset, built exactly as Megatron-LM's
// megatron.core.datasets.gpt_dataset.GPTDataset builds it, so the same files, split,
// sequence length and seed give the same samples in the same order:
//
//   document index  the split's sequences repeated for as many epochs as the requested
//                   samples need, shuffled with numpy RandomState(seed) (the last epoch
//                   shuffled on its own when less than 80% of it is used)
//   sample index    the shuffled documents concatenated; sample k covers tokens
//                   [k*s, k*s + s + 1) of that stream (s = seq_length), so neighbouring
//                   samples overlap by one token (the last label is the next first input)
//   shuffle index   a permutation of the samples, from the same random state
//
// Megatron caches these arrays in .npy files built by rank 0; here every rank rebuilds
// them (they are deterministic and cheap for the sizes megatorch trains).
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/data/indexed_dataset.h"

namespace megatorch::data {

enum class Split { kTrain = 0, kValid = 1, kTest = 2 };
const char* split_name(Split split);

// What the trainer iterates: a finite list of samples, each seq_length + 1 token ids
// (inputs are [0, s), labels [1, s]).
class SampleDataset {
 public:
  virtual ~SampleDataset() = default;
  virtual int64_t size() const = 0;
  virtual int64_t seq_length() const = 0;
  // Sample i as int64 [seq_length + 1]; i in [0, size()).
  virtual at::Tensor get(int64_t i) const = 0;
};

struct GPTDatasetOptions {
  int64_t seq_length = 0;
  uint32_t seed = 1234;              // Megatron's --seed default
  int64_t num_samples = -1;          // lower bound on the samples to build; -1: one epoch
  Split split = Split::kTrain;
};

class GPTDataset : public SampleDataset {
 public:
  // Samples from sequences [begin, end) of data.
  GPTDataset(std::shared_ptr<const IndexedDataset> data, int64_t begin, int64_t end, GPTDatasetOptions options);

  int64_t size() const override { return static_cast<int64_t>(shuffle_index_.size()); }
  int64_t seq_length() const override { return options_.seq_length; }
  at::Tensor get(int64_t i) const override;
  // The same sample without a tensor: seq_length + 1 values into out.
  void read(int64_t i, int64_t* out) const;

  const IndexedDataset& indexed() const { return *data_; }
  const GPTDatasetOptions& options() const { return options_; }
  int64_t num_epochs() const { return num_epochs_; }
  int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  const std::vector<int32_t>& document_index() const { return document_index_; }
  const std::vector<int64_t>& sample_index() const { return sample_index_; }  // [size()+1, 2] row-major
  const std::vector<int64_t>& shuffle_index() const { return shuffle_index_; }

 private:
  std::shared_ptr<const IndexedDataset> data_;
  GPTDatasetOptions options_;
  int64_t num_epochs_ = 0;
  int64_t tokens_per_epoch_ = 0;
  std::vector<int32_t> document_index_;
  std::vector<int64_t> sample_index_;
  std::vector<int64_t> shuffle_index_;
};

}  // namespace megatorch::data
