#include "megatorch/data/blended_dataset.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <set>

#include "megatorch/check.h"

namespace megatorch::data {

namespace {

// numpy's pairwise summation of a contiguous float64 array (8 partial sums in blocks of up
// to 128, halves above that): the order numpy.sum adds in, so normalized weights round
// exactly as Megatron's do.
double pairwise_sum(const double* a, int64_t n) {
  if (n < 8) {
    double res = 0.0;
    for (int64_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    }
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  int64_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

// Megatron's greedy blending rule (its helpers.cpp): sample k comes from the candidate
// dataset furthest behind its share, the lowest index on a tie.
template <typename Candidates>
int64_t furthest_behind(const Candidates& candidates, const std::vector<double>& weights,
                        const std::vector<int64_t>& taken, int64_t k) {
  const double kd = std::max(static_cast<double>(k), 1.0);
  int64_t best = -1;
  double best_error = std::numeric_limits<double>::lowest();
  for (const auto d : candidates) {
    const double error = weights[static_cast<size_t>(d)] * kd - static_cast<double>(taken[static_cast<size_t>(d)]);
    if (error > best_error) {
      best_error = error;
      best = d;
    }
  }
  return best;
}

}  // namespace

std::vector<double> normalize_weights(const std::vector<double>& weights) {
  MEGATORCH_CHECK(!weights.empty(), "expected at least one dataset weight");
  for (double w : weights) {
    MEGATORCH_CHECK(w > 0.0, "dataset weights must be positive, got ", w);
  }
  const double sum = pairwise_sum(weights.data(), static_cast<int64_t>(weights.size()));
  std::vector<double> out(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) out[i] = weights[i] / sum;
  return out;
}

void build_blending_indices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>& dataset_index,
                            std::vector<int64_t>& dataset_sample_index) {
  const auto n = static_cast<int64_t>(weights.size());
  dataset_index.assign(static_cast<size_t>(size), 0);
  dataset_sample_index.assign(static_cast<size_t>(size), 0);
  std::vector<int64_t> taken(static_cast<size_t>(n), 0);
  std::vector<int64_t> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t k = 0; k < size; ++k) {
    const int64_t best = furthest_behind(all, weights, taken, k);
    dataset_index[static_cast<size_t>(k)] = static_cast<int16_t>(best);
    dataset_sample_index[static_cast<size_t>(k)] = taken[static_cast<size_t>(best)]++;
  }
}

void build_exhaustive_blending_indices(const std::vector<int64_t>& sizes, std::vector<int16_t>& dataset_index,
                                       std::vector<int64_t>& dataset_sample_index) {
  const auto n = static_cast<int32_t>(sizes.size());
  int64_t total = 0;
  std::set<int32_t> unspent;
  for (int32_t d = 0; d < n; ++d) {
    total += sizes[static_cast<size_t>(d)];
    if (sizes[static_cast<size_t>(d)] > 0) unspent.insert(d);
  }
  std::vector<double> weights(static_cast<size_t>(n));
  for (int32_t d = 0; d < n; ++d) weights[static_cast<size_t>(d)] = static_cast<double>(sizes[static_cast<size_t>(d)]) / static_cast<double>(total);
  dataset_index.assign(static_cast<size_t>(total), 0);
  dataset_sample_index.assign(static_cast<size_t>(total), 0);
  std::vector<int64_t> taken(static_cast<size_t>(n), 0);
  for (int64_t k = 0; !unspent.empty(); ++k) {
    const auto best = static_cast<int32_t>(furthest_behind(unspent, weights, taken, k));
    dataset_index[static_cast<size_t>(k)] = static_cast<int16_t>(best);
    dataset_sample_index[static_cast<size_t>(k)] = taken[static_cast<size_t>(best)]++;
    if (taken[static_cast<size_t>(best)] == sizes[static_cast<size_t>(best)]) unspent.erase(best);
  }
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const SampleDataset>> datasets, std::vector<double> weights,
                               int64_t size)
    : datasets_(std::move(datasets)) {
  MEGATORCH_CHECK(!datasets_.empty(), "a blend needs at least one dataset");
  MEGATORCH_CHECK(datasets_.size() < 32767, "a blend takes at most 32766 datasets, got ", datasets_.size());
  MEGATORCH_CHECK(weights.size() == datasets_.size(), "a blend of ", datasets_.size(), " datasets got ", weights.size(),
                  " weights");
  for (const auto& d : datasets_) {
    MEGATORCH_CHECK(d != nullptr && d->seq_length() == datasets_.front()->seq_length(),
                    "every dataset of a blend must exist and have the same sequence length");
  }
  if (size >= 0) {
    weights_ = normalize_weights(weights);
    build_blending_indices(weights_, size, dataset_index_, dataset_sample_index_);
  } else {
    MEGATORCH_CHECK(size == -1, "blend size must be >= 0, or -1 for every sample once; got ", size);
    std::vector<int64_t> sizes;
    for (double w : weights) {
      MEGATORCH_CHECK(w >= 0 && w == static_cast<double>(static_cast<int64_t>(w)),
                      "an exhaustive blend takes whole sample counts as weights, got ", w);
      sizes.push_back(static_cast<int64_t>(w));
    }
    weights_ = std::move(weights);
    build_exhaustive_blending_indices(sizes, dataset_index_, dataset_sample_index_);
  }
  // Megatron builds each dataset with a small surplus so the blend never runs past one.
  std::vector<int64_t> needed(datasets_.size(), 0);
  for (size_t k = 0; k < dataset_index_.size(); ++k) {
    auto& n = needed[static_cast<size_t>(dataset_index_[k])];
    n = std::max(n, dataset_sample_index_[k] + 1);
  }
  for (size_t d = 0; d < datasets_.size(); ++d) {
    MEGATORCH_CHECK(needed[d] <= datasets_[d]->size(), "the blend draws ", needed[d], " samples from dataset ", d,
                    ", which has only ", datasets_[d]->size(), "; build that dataset with more samples");
  }
}

at::Tensor BlendedDataset::get(int64_t i) const {
  MEGATORCH_CHECK(i >= 0 && i < size(), "blended sample ", i, " out of range [0, ", size(), ")");
  return datasets_[static_cast<size_t>(dataset_index_[static_cast<size_t>(i)])]->get(
      dataset_sample_index_[static_cast<size_t>(i)]);
}

}  // namespace megatorch::data
