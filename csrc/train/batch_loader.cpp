#include "megatorch/train/batch_loader.h"

#include <ATen/ATen.h>

#include "megatorch/check.h"
#include "megatorch/tp/cross_entropy.h"
#include "megatorch/transformer/packed_sequence.h"

namespace megatorch::train {

MicroBatchLoader::MicroBatchLoader(const data::SampleDataset& dataset, MicroBatchLoaderOptions options)
    : dataset_(dataset), options_(std::move(options)) {
  const auto& o = options_;
  MEGATORCH_CHECK(o.micro_batch_size() >= 1 && o.num_micro_batches() >= 1 && o.data_parallel_size() >= 1 &&
                      o.data_parallel_rank() >= 0 && o.data_parallel_rank() < o.data_parallel_size() &&
                      o.seq_length() >= 1,
                  "MicroBatchLoader: expected micro_batch_size, num_micro_batches, data_parallel_size, seq_length >= 1 "
                  "and 0 <= data_parallel_rank < data_parallel_size; got ",
                  o.micro_batch_size(), ", ", o.num_micro_batches(), ", ", o.data_parallel_size(), ", ", o.seq_length(),
                  " and rank ", o.data_parallel_rank());
  MEGATORCH_CHECK(o.eod() >= 0 || !(o.reset_position_ids() || o.reset_attention_mask() || o.eod_mask_loss()),
                  "MicroBatchLoader: --reset-position-ids, --reset-attention-mask and --eod-mask-loss split documents "
                  "at the end-of-document token, but none was given (eod ", o.eod(), "); use a tokenizer with one");
}

MicroBatchLoader::~MicroBatchLoader() {
  if (next_.valid()) next_.wait();
}

int64_t MicroBatchLoader::global_batch_size() const {
  return options_.micro_batch_size() * options_.num_micro_batches() * options_.data_parallel_size();
}

std::vector<pipeline::MicroBatch> MicroBatchLoader::read_host(int64_t first_sample) const {
  const int64_t b = options_.micro_batch_size(), dp = options_.data_parallel_size(), s = options_.seq_length();
  MEGATORCH_CHECK(first_sample >= 0 && first_sample + global_batch_size() <= dataset_.size(), "gpt_pretrain: the dataset has ",
                  dataset_.size(), " samples, the run needs ", first_sample + global_batch_size(),
                  "; lower --train-iters/--eval-iters or add data");
  const auto host = at::TensorOptions().dtype(at::kLong).pinned_memory(pins_memory());
  std::vector<pipeline::MicroBatch> out;
  for (int64_t k = 0; k < options_.num_micro_batches(); ++k) {
    const int64_t first = first_sample + k * b * dp + options_.data_parallel_rank() * b;
    std::vector<at::Tensor> rows;
    for (int64_t i = 0; i < b; ++i) rows.push_back(dataset_.get(first + i));
    const at::Tensor tokens = at::stack(rows);
    MEGATORCH_CHECK(tokens.size(1) == s + 1, "gpt_pretrain: expected samples of seq_length + 1 = ", s + 1,
                    " tokens, the dataset gives ", tokens.size(1));
    pipeline::MicroBatch mb{at::empty({b, s}, host), at::empty({b, s}, host), {}};
    mb.ids.copy_(tokens.narrow(1, 0, s));
    mb.labels.copy_(tokens.narrow(1, 1, s));
    // Megatron's loss mask: the token after an EOD (the next document's first) is not
    // predicted from the EOD.
    if (options_.eod_mask_loss()) mb.labels.masked_fill_(mb.ids == options_.eod(), tp::kIgnoreIndex);
    const auto packed = transformer::pack_documents(mb.ids, options_.eod(), options_.reset_position_ids(),
                                                    options_.reset_attention_mask());
    if (packed.position_ids.defined()) mb.tensors["position_ids"] = packed.position_ids;
    if (packed.document_ids.defined()) mb.tensors["document_ids"] = packed.document_ids;
    out.push_back(std::move(mb));
  }
  return out;
}

std::vector<pipeline::MicroBatch> MicroBatchLoader::to_device(std::vector<pipeline::MicroBatch> host) const {
  if (options_.device().is_cpu()) return host;
  // From pinned memory the copies are asynchronous on the current stream, ordered before
  // the kernels that read them; the caching host allocator keeps the pinned blocks until
  // the copies are done.
  for (auto& mb : host) mb = mb.to(options_.device(), /*non_blocking=*/true);
  return host;
}

std::vector<pipeline::MicroBatch> MicroBatchLoader::load(int64_t first_sample) {
  std::vector<pipeline::MicroBatch> host;
  if (next_.valid() && next_first_ == first_sample) {
    host = next_.get();  // rethrows what the worker threw
    ++prefetched_loads_;
  } else {
    if (next_.valid()) next_.wait();  // a preparation nobody asked for (e.g. after a resume)
    next_ = {};
    host = read_host(first_sample);
  }
  const int64_t following = first_sample + global_batch_size();
  next_first_ = -1;
  if (options_.prefetch() && following + global_batch_size() <= dataset_.size()) {
    next_first_ = following;
    next_ = std::async(std::launch::async, [this, following] { return read_host(following); });
  }
  return to_device(std::move(host));
}

}  // namespace megatorch::train
