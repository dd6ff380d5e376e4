#include "megatorch/data/gpt_dataset.h"

#include <numeric>
#include <string>

#include "megatorch/check.h"
#include "megatorch/data/numpy_random.h"

namespace megatorch::data {

const char* split_name(Split split) {
  switch (split) {
    case Split::kTrain: return "train";
    case Split::kValid: return "valid";
    case Split::kTest: return "test";
  }
  return "?";
}

namespace {

// Sequences [begin, end) repeated num_epochs times and shuffled as one array; with a
// separate final epoch, the first num_epochs - 1 and the last are shuffled apart (Megatron's
// _build_document_index).
std::vector<int32_t> build_document_index(int64_t begin, int64_t end, int64_t num_epochs, NumpyRandomState& rng,
                                          bool separate_final_epoch) {
  if (separate_final_epoch && num_epochs > 1) {
    std::vector<int32_t> first = build_document_index(begin, end, num_epochs - 1, rng, false);
    const std::vector<int32_t> last = build_document_index(begin, end, 1, rng, false);
    first.insert(first.end(), last.begin(), last.end());
    return first;
  }
  std::vector<int32_t> index;
  index.reserve(static_cast<size_t>(num_epochs * (end - begin)));
  for (int64_t e = 0; e < num_epochs; ++e) {
    for (int64_t d = begin; d < end; ++d) index.push_back(static_cast<int32_t>(d));
  }
  rng.shuffle(index);
  return index;
}

// Megatron's helpers.cpp build_sample_idx with drop_last_partial_sequence and one extra
// token per sample: row k is (position in the document index, token offset) where sample k
// starts; row k + 1 is where it ends (its last token is the next sample's first).
std::vector<int64_t> build_sample_index(const std::vector<int32_t>& sizes, const std::vector<int32_t>& document_index,
                                        int64_t seq_length, int64_t num_epochs, int64_t tokens_per_epoch) {
  constexpr int64_t kExtra = 1;
  const int64_t num_samples = (num_epochs * tokens_per_epoch - kExtra) / seq_length;
  std::vector<int64_t> sample(static_cast<size_t>(2 * (num_samples + 1)));
  int64_t doc_pos = 0, doc_offset = 0;
  sample[0] = 0;
  sample[1] = 0;
  const auto last_pos = static_cast<int64_t>(document_index.size()) - 1;
  for (int64_t k = 1; k <= num_samples; ++k) {
    int64_t remaining = seq_length + kExtra;
    while (remaining != 0) {
      const int64_t doc_length = sizes[static_cast<size_t>(document_index[static_cast<size_t>(doc_pos)])] - doc_offset;
      remaining -= doc_length;
      if (remaining <= 0) {
        doc_offset += remaining + doc_length - kExtra;
        remaining = 0;
      } else {
        if (doc_pos == last_pos) {
          // Out of documents: only the last sample can get here, and it ends at the
          // stream's last token.
          MEGATORCH_CHECK(k == num_samples, "internal error: sample index ran out of documents at sample ", k, " of ",
                          num_samples);
          doc_offset = sizes[static_cast<size_t>(document_index[static_cast<size_t>(doc_pos)])] - kExtra;
          break;
        }
        ++doc_pos;
        doc_offset = 0;
      }
    }
    sample[static_cast<size_t>(2 * k)] = doc_pos;
    sample[static_cast<size_t>(2 * k + 1)] = doc_offset;
  }
  return sample;
}

std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, NumpyRandomState& rng) {
  std::vector<int64_t> first(static_cast<size_t>(num_samples));
  std::iota(first.begin(), first.end(), int64_t{0});
  rng.shuffle(first);
  if (num_samples == total_size) return first;
  std::vector<int64_t> last(static_cast<size_t>(total_size - num_samples));
  std::iota(last.begin(), last.end(), num_samples);
  rng.shuffle(last);
  first.insert(first.end(), last.begin(), last.end());
  return first;
}

}  // namespace

GPTDataset::GPTDataset(std::shared_ptr<const IndexedDataset> data, int64_t begin, int64_t end, GPTDatasetOptions options)
    : data_(std::move(data)), options_(options) {
  MEGATORCH_CHECK(data_ != nullptr, "GPTDataset needs an indexed dataset");
  const std::string& prefix = data_->path_prefix();
  const int64_t s = options_.seq_length;
  MEGATORCH_CHECK(s > 1, "expected --seq-length > 1, got ", s);
  MEGATORCH_CHECK(0 <= begin && begin <= end && end <= data_->num_sequences(), prefix, ": sequence range [", begin, ", ", end,
                  ") is outside the dataset's ", data_->num_sequences(), " sequences");
  const std::vector<int32_t> sizes = data_->sequence_lengths();
  for (int64_t d = begin; d < end; ++d) tokens_per_epoch_ += sizes[static_cast<size_t>(d)];
  const int64_t requested = options_.num_samples;
  // A split shorter than one sample (seq_length + 1 tokens) could only repeat the same few
  // documents inside every sample, and Megatron's epoch loop runs on (forever for an empty
  // split) to get there: refuse it at once, with the numbers, when samples are wanted.
  MEGATORCH_CHECK(requested <= 0 || tokens_per_epoch_ >= s + 1, prefix, ": the ", split_name(options_.split),
                  " split (sequences [", begin, ", ", end, ") of the dataset's ", data_->num_sequences(), " sequences, ",
                  data_->num_documents(), " documents, ", data_->num_tokens(), " tokens) has ",
                  tokens_per_epoch_ == 0 ? "no" : std::to_string(tokens_per_epoch_), " tokens, fewer than one sample of ", s + 1, " tokens (--seq-length ", s, " + 1), but ", requested,
                  " samples were requested from it; use more data, give that split a larger share of --split, or "
                  "lower --seq-length");
  if (tokens_per_epoch_ == 0) {
    num_epochs_ = 0;
    sample_index_ = {0, 0};
    return;
  }

  num_epochs_ = 1;
  if (requested >= 0) {
    const int64_t tokens_needed = requested * s + 1;
    for (int64_t tokens = tokens_per_epoch_; tokens < tokens_needed; tokens += tokens_per_epoch_) ++num_epochs_;
  }
  // When the last epoch is used for less than 80% of its samples, Megatron shuffles it on
  // its own, so that the earlier epochs are not skewed towards the documents it uses.
  bool separate_final_epoch = false;
  int64_t samples_before_final_epoch = 0;
  if (num_epochs_ > 1) {
    samples_before_final_epoch = ((num_epochs_ - 1) * tokens_per_epoch_ - 1) / s;
    const int64_t from_final_epoch = requested - samples_before_final_epoch;
    const int64_t per_epoch = (tokens_per_epoch_ - 1) / s;
    MEGATORCH_CHECK(from_final_epoch >= 0 && from_final_epoch <= per_epoch + 1, "internal error: ", from_final_epoch,
                    " samples from the final epoch of ", per_epoch);
    separate_final_epoch = from_final_epoch < static_cast<int64_t>(0.80 * static_cast<double>(per_epoch));
  }

  NumpyRandomState rng(options_.seed);
  document_index_ = build_document_index(begin, end, num_epochs_, rng, separate_final_epoch);
  sample_index_ = build_sample_index(sizes, document_index_, s, num_epochs_, tokens_per_epoch_);
  const int64_t total = static_cast<int64_t>(sample_index_.size()) / 2 - 1;
  shuffle_index_ = build_shuffle_index(separate_final_epoch ? samples_before_final_epoch : total, total, rng);
}

void GPTDataset::read(int64_t i, int64_t* out) const {
  MEGATORCH_CHECK(i >= 0 && i < size(), data_->path_prefix(), ": ", split_name(options_.split), " sample ", i,
                  " out of range [0, ", size(), ")");
  const int64_t k = shuffle_index_[static_cast<size_t>(i)];
  const int64_t doc_beg = sample_index_[static_cast<size_t>(2 * k)], off_beg = sample_index_[static_cast<size_t>(2 * k + 1)];
  const int64_t doc_end = sample_index_[static_cast<size_t>(2 * k + 2)], off_end = sample_index_[static_cast<size_t>(2 * k + 3)];
  const int64_t want = options_.seq_length + 1;
  int64_t filled = 0;
  for (int64_t pos = doc_beg; pos <= doc_end; ++pos) {
    const int64_t seq = document_index_[static_cast<size_t>(pos)];
    const int64_t offset = pos == doc_beg ? off_beg : 0;
    const int64_t length = pos == doc_end ? off_end + 1 - offset : data_->sequence_length(seq) - offset;
    MEGATORCH_CHECK(filled + length <= want, "internal error: sample ", i, " spans more than ", want, " tokens");
    data_->read(seq, offset, length, out + filled);
    filled += length;
  }
  MEGATORCH_CHECK(filled == want, "internal error: sample ", i, " has ", filled, " tokens, expected ", want);
}

at::Tensor GPTDataset::get(int64_t i) const {
  at::Tensor t = at::empty({options_.seq_length + 1}, at::kLong);
  read(i, t.data_ptr<int64_t>());
  return t;
}

}  // namespace megatorch::data
