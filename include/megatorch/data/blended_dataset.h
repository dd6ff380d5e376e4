#pragma once
// Several SampleDatasets mixed by weight, as Megatron-LM's BlendedDataset mixes them: sample
// k goes to the dataset furthest behind its share (weight * k minus what it already had),
// so any prefix of the blend follows the weights as closely as whole samples allow, and
// the order is deterministic (no random state).
#include <cstdint>
#include <memory>
#include <vector>

#include "megatorch/data/gpt_dataset.h"

namespace megatorch::data {

// Megatron's normalize(): w / sum(w) in float64, the sum taken in numpy's order.
std::vector<double> normalize_weights(const std::vector<double>& weights);

// Megatron's helpers.build_blending_indices: for k in [0, size), which dataset sample k
// comes from and which of that dataset's samples it is. weights must be normalized.
void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index);
// Megatron's build_exhaustive_blending_indices: exactly sizes[d] samples from dataset d.
void build_exhaustive_blending_indices(const std::vector<int64_t>& sizes, std::vector<int16_t>& dataset_index,
                                       std::vector<int64_t>& dataset_sample_index);

class BlendedDataset : public SampleDataset {
 public:
  // size >= 0: that many samples, weights normalized here (Megatron normalizes again even
  // when the caller already did, and so do we, for identical rounding). size == -1: every
  // sample of every dataset once (weights are then the dataset sizes).
  BlendedDataset(std::vector<std::shared_ptr<const SampleDataset>> datasets, std::vector<double> weights, int64_t size);

  int64_t size() const override { return static_cast<int64_t>(dataset_index_.size()); }
  int64_t seq_length() const override { return datasets_.front()->seq_length(); }
  at::Tensor get(int64_t i) const override;

  const std::vector<std::shared_ptr<const SampleDataset>>& datasets() const { return datasets_; }
  const std::vector<double>& weights() const { return weights_; }
  const std::vector<int16_t>& dataset_index() const { return dataset_index_; }
  const std::vector<int64_t>& dataset_sample_index() const { return dataset_sample_index_; }

 private:
  std::vector<std::shared_ptr<const SampleDataset>> datasets_;
  std::vector<double> weights_;
  std::vector<int16_t> dataset_index_;
  std::vector<int64_t> dataset_sample_index_;
};

}  // namespace megatorch::data
