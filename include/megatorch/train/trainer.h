#pragma once
// The training loop behind gpt_pretrain: a ParallelState from the torchrun environment,
// this rank's pipeline stage of the GPT, the ZeRO DistributedOptimizer over the DP group,
// Megatron-compatible data, and per iteration: the schedule's forward and backward over
// the micro-batches, gradient finalisation (SP partial sums, tied embeddings), the
// optimizer step with the LR schedule, Megatron-style logs, evaluation and checkpoints.
#include <nlohmann/json.hpp>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/ckpt/sharded_entry.h"
#include "megatorch/data/gpt_datasets.h"
#include "megatorch/optim/distributed_optimizer.h"
#include "megatorch/parallel/parallel_state.h"
#include "megatorch/pipeline/executor.h"
#include "megatorch/pipeline/pipeline_stage.h"
#include "megatorch/train/arguments.h"
#include "megatorch/train/batch_loader.h"
#include "megatorch/train/lr_schedule.h"

namespace megatorch::train {

struct IterationStats {
  int64_t iteration = 0;
  double loss = 0;  // global mean over the batch (every rank)
  double lr = 0;
  double grad_norm = 0;
  double loss_scale = 1;
  bool skipped = false;
  double seconds = 0;
};

class Trainer {
 public:
  explicit Trainer(TrainArguments args);
  ~Trainer();

  // Runs from the current iteration to --train-iters (evaluating, logging and saving on
  // their intervals; the last iteration always evaluates and, with --save, saves). Returns the last iteration's stats.
  IterationStats train();
  IterationStats train_step();
  // Mean loss over `iters` global batches of a split (every rank gets it): each batch's
  // micro-batches forward only through the pipeline executor, each micro-batch's loss
  // averaged over its non-ignored tokens, as in training.
  double evaluate(data::Split split, int64_t iters);

  void save_checkpoint();
  // Loads --load (any layout); false when it holds no checkpoint yet.
  bool load_checkpoint();

  int64_t iteration() const { return iteration_; }
  const TrainArguments& args() const { return args_; }
  const parallel::ParallelState& parallel_state() const { return *state_; }
  pipeline::PipelineStage& stage() { return stage_; }
  optim::DistributedOptimizer& optimizer() { return *optimizer_; }
  bool is_logging_rank() const;

 private:
  MicroBatchLoaderOptions loader_options() const;
  std::vector<models::GPTModel> chunks() const;
  std::vector<ckpt::ShardedEntry> checkpoint_entries();
  double reduce_loss(double local_loss_on_last_stage);
  void log(const IterationStats& s, const std::map<std::string, int64_t>& comm_bytes, double tokens_per_s,
           double tflops);

  TrainArguments args_;
  std::unique_ptr<parallel::ParallelState> state_;
  pipeline::PipelineStage stage_{nullptr};
  std::shared_ptr<optim::DynamicLossScaler> scaler_;
  std::unique_ptr<optim::DistributedOptimizer> optimizer_;
  data::GPTDatasets data_;
  std::unique_ptr<MicroBatchLoader> train_batches_;
  LRSchedule lr_;
  int64_t iteration_ = 0;
  int64_t eod_ = -1;  // the tokenizer's end-of-document id (logged)
  int64_t lr_step_ = 0;  // iterations whose update was applied: the LR schedule's clock, as Megatron's
  int64_t num_parameters_ = 0;  // whole model, each parameter once
  double flops_per_token_ = 0;
  std::ofstream json_;
  double last_val_loss_ = -1;
};

}  // namespace megatorch::train
