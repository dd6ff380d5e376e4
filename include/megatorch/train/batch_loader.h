#pragma once
// The micro-batches of one training step on the training device, with the next step's
// prepared in the background: a worker thread reads the samples and stacks them into
// host memory (page-locked when the device is a GPU) while the current step computes,
// and the copies to the device are non-blocking, so neither the device waits for the
// dataset nor the host for the copy.
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <future>
#include <vector>

#include "megatorch/data/gpt_dataset.h"
#include "megatorch/pipeline/executor.h"

namespace megatorch::train {

struct MicroBatchLoaderOptions {
  TORCH_ARG(int64_t, micro_batch_size) = 1;
  TORCH_ARG(int64_t, num_micro_batches) = 1;  // per DP rank and step
  TORCH_ARG(int64_t, data_parallel_size) = 1;
  TORCH_ARG(int64_t, data_parallel_rank) = 0;
  TORCH_ARG(int64_t, seq_length) = 0;
  TORCH_ARG(c10::Device, device) = c10::kCPU;
  // Prepare the global batch after each one loaded (off: every load reads synchronously).
  TORCH_ARG(bool, prefetch) = true;
  // Packed documents (Megatron's flags; transformer/packed_sequence.h), split at token `eod`:
  // micro-batches carry "position_ids" restarting after each EOD, "document_ids" that keep
  // attention inside documents, and labels ignored where the input is the EOD.
  TORCH_ARG(int64_t, eod) = -1;
  TORCH_ARG(bool, reset_position_ids) = false;
  TORCH_ARG(bool, reset_attention_mask) = false;
  TORCH_ARG(bool, eod_mask_loss) = false;
};

class MicroBatchLoader {
 public:
  // `dataset` must outlive the loader.
  MicroBatchLoader(const data::SampleDataset& dataset, MicroBatchLoaderOptions options);
  ~MicroBatchLoader();  // waits for a preparation in flight
  MicroBatchLoader(const MicroBatchLoader&) = delete;
  MicroBatchLoader& operator=(const MicroBatchLoader&) = delete;

  // This DP rank's micro-batches of the global batch that starts at sample
  // `first_sample`, on the device (as Megatron's sampler: global micro-batch k holds
  // b·dp samples, DP rank r takes b of them). Then starts preparing the next global batch.
  std::vector<pipeline::MicroBatch> load(int64_t first_sample);

  int64_t global_batch_size() const;
  // Loads served by a background preparation (the rest were read synchronously: the
  // first one, and any that did not follow the previous).
  int64_t prefetched_loads() const { return prefetched_loads_; }
  // Host batches are page-locked (pinned) exactly when the device is a GPU.
  bool pins_memory() const { return options_.device().is_cuda(); }

 private:
  std::vector<pipeline::MicroBatch> read_host(int64_t first_sample) const;
  std::vector<pipeline::MicroBatch> to_device(std::vector<pipeline::MicroBatch> host) const;

  const data::SampleDataset& dataset_;
  MicroBatchLoaderOptions options_;
  std::future<std::vector<pipeline::MicroBatch>> next_;
  int64_t next_first_ = -1;
  int64_t prefetched_loads_ = 0;
};

}  // namespace megatorch::train
