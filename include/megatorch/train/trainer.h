#pragma once
// The GPT program behind gpt_pretrain, on train::TrainingLoop: Megatron's flags turned
// into the loop's options, this rank's pipeline stage of the GPT, Megatron-compatible
// data as the loop's batch source, the tokenizer and dataset checks, and the model
// configuration saved with (and compared against) checkpoints.
#include <memory>
#include <string>
#include <vector>

#include "megatorch/data/gpt_datasets.h"
#include "megatorch/pipeline/pipeline_stage.h"
#include "megatorch/train/arguments.h"
#include "megatorch/train/batch_loader.h"
#include "megatorch/train/training_loop.h"

namespace megatorch::train {

class Trainer {
 public:
  explicit Trainer(TrainArguments args);
  ~Trainer();

  // Runs from the current iteration to --train-iters (evaluating, logging and saving on
  // their intervals; the last iteration always evaluates and, with --save, saves); with
  // --eval-only evaluates the loaded checkpoint. Returns the last iteration's stats.
  IterationStats train();
  IterationStats train_step();
  // Mean loss over `iters` global batches of a split (every rank gets it): each batch's
  // micro-batches forward only through the pipeline executor, each micro-batch's loss
  // averaged over its non-ignored tokens, as in training.
  double evaluate(data::Split split, int64_t iters);

  void save_checkpoint() { loop_->save_checkpoint(); }
  // Loads --load (any layout); false when it holds no checkpoint yet.
  bool load_checkpoint() { return loop_->load_checkpoint(); }

  int64_t iteration() const { return loop_->iteration(); }
  const TrainArguments& args() const { return args_; }
  const parallel::ParallelState& parallel_state() const { return loop_->parallel_state(); }
  pipeline::PipelineStage& stage() { return stage_; }
  optim::DistributedOptimizer& optimizer() { return loop_->optimizer(); }
  TrainingLoop& loop() { return *loop_; }
  bool is_logging_rank() const { return loop_->is_logging_rank(); }

 private:
  MicroBatchLoaderOptions loader_options() const;
  BatchSource eval_source(data::Split split) const;

  TrainArguments args_;
  std::unique_ptr<TrainingLoop> loop_;
  pipeline::PipelineStage stage_{nullptr};
  data::GPTDatasets data_;
  std::unique_ptr<MicroBatchLoader> train_batches_;
  int64_t eod_ = -1;  // the tokenizer's end-of-document id (logged)
};

}  // namespace megatorch::train
