#pragma once
// TrainingLoop: the training loop for any model built from megatorch's parallel layers.
// It makes the process groups from the torchrun environment; the user builds this
// rank's pipeline stage on them (a pipeline::ModuleStage of their own chunks, or GPT's
// PipelineStage) and supplies micro-batches per DP rank; the loop runs the schedule's
// forward and backward, the gradient reductions (DP, sequence-parallel partial sums,
// tied parameters), the ZeRO optimizer step with clipping, loss scaling and the LR
// schedule, the Megatron-style log line and the JSON log, evaluation, and resharding
// checkpoints (save and resume at any layout, with the stage's dropout streams).
// gpt_pretrain is one program on it (train::Trainer).
//
//   train::TrainingLoop loop(train::TrainingLoopOptions().tensor_parallel(2).pipeline_parallel(2)
//                                .num_micro_batches(4).train_iters(100).lr(1e-3));
//   pipeline::ModuleStage stage(my_chunks(loop), pipeline::ModuleStageOptions()
//                                   .pp_group(loop.pp_group()).loss(my_loss));
//   loop.set_model(stage.ptr());
//   loop.train([&](int64_t step) { return my_micro_batches(step, loop.dp_rank()); });
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/sharded_entry.h"
#include "megatorch/fp8/recipe.h"
#include "megatorch/moe/moe_stats.h"
#include "megatorch/optim/distributed_optimizer.h"
#include "megatorch/parallel/parallel_state.h"
#include "megatorch/pipeline/executor.h"
#include "megatorch/pipeline/stage.h"
#include "megatorch/train/fault_injection.h"
#include "megatorch/train/lr_schedule.h"
#include "megatorch/train/model_parameters.h"

namespace megatorch::train {

// This DP rank's micro-batches of global batch `step` (0-based: the step a resumed run
// continues from is its checkpoint's iteration). Evaluation sources are indexed from 0
// for every evaluation; an empty vector means there is nothing to evaluate.
using BatchSource = std::function<std::vector<pipeline::MicroBatch>(int64_t step)>;

struct IterationStats {
  int64_t iteration = 0;
  double loss = 0;  // global mean over the batch (every rank)
  double lr = 0;
  double grad_norm = 0;
  double loss_scale = 1;
  bool skipped = false;
  double seconds = 0;
  // The host's own time to issue the step (run_step from start to return). On a CPU it is
  // `seconds`; on a GPU, where the host queues work and returns, it is the launch and
  // bookkeeping cost: a step whose host time nears its wall time is launch-bound.
  double host_seconds = 0;
  moe::MoEStepReport moe;  // per MoE layer: losses and tokens per expert (empty: no experts)
  // log_straggler, on logged iterations: each rank's compute time in the step (the
  // schedule's forward and backward actions), by global rank; empty otherwise.
  std::vector<double> rank_compute_seconds;
  // rerun_mode validate_results: "" (no rerun), "transient" (the rerun differed; its step
  // was applied) or "reproducible" (the rerun gave the same loss: a data or model fault).
  std::string rerun;
};

// Iterations [first, last], counted from 1.
using IterationRange = std::pair<int64_t, int64_t>;

struct TrainingLoopOptions {
  // Layout: tp × cp × pp × dp = the torchrun world. `name` prefixes the process groups.
  TORCH_ARG(int64_t, tensor_parallel) = 1;
  TORCH_ARG(int64_t, pipeline_parallel) = 1;
  // Context parallelism: ranks that split each sequence. The stage must split it too
  // (GPT's PipelineStage on a config whose context_parallel_group is cp_group());
  // gradients and ZeRO shards then span DP × CP.
  TORCH_ARG(int64_t, context_parallel) = 1;
  // The expert layers' layout inside DP x CP x TP (Megatron's parallel folding): their
  // ep x etp ranks re-split each pipeline stage; the rest is expert-data-parallel.
  TORCH_ARG(int64_t, expert_parallel) = 1;
  TORCH_ARG(int64_t, expert_tensor_parallel) = 1;
  TORCH_ARG(int64_t, virtual_chunks) = 1;
  TORCH_ARG(std::string, schedule) = "1f1b";  // gpipe | 1f1b | interleaved | zb-h1 | zb-v | dualpipev (or an alias)
  TORCH_ARG(int64_t, zero_stage) = 0;
  TORCH_ARG(std::string, name) = "model";
  TORCH_ARG(std::string, device) = "auto";   // auto | cpu | cuda | cuda:N
  TORCH_ARG(std::string, backend) = "auto";  // auto | nccl | gloo
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::milliseconds(0);  // 0: the default
  TORCH_ARG(int64_t, seed) = 1234;  // the default generator, before the model is built
  // Batches: samples per micro-batch and micro-batches per DP rank and step (logs, counts).
  TORCH_ARG(int64_t, micro_batch_size) = 1;
  TORCH_ARG(int64_t, num_micro_batches) = 1;
  TORCH_ARG(int64_t, train_iters) = 100;
  // Optimizer and learning rate (Megatron's defaults).
  TORCH_ARG(double, lr) = 3e-4;
  TORCH_ARG(double, min_lr) = 0.0;
  TORCH_ARG(int64_t, lr_warmup_iters) = 0;
  TORCH_ARG(int64_t, lr_decay_iters) = 0;  // 0: train_iters
  TORCH_ARG(std::string, lr_decay_style) = "cosine";  // constant | linear | cosine
  TORCH_ARG(double, weight_decay) = 0.01;
  TORCH_ARG(double, adam_beta1) = 0.9;
  TORCH_ARG(double, adam_beta2) = 0.999;
  TORCH_ARG(double, adam_eps) = 1e-8;
  TORCH_ARG(double, clip_grad) = 1.0;  // 0: no clipping
  // The tensor-parallel layers' weight-gradient GEMMs accumulate into the gradient buffer
  // (Megatron's gradient_accumulation_fusion; DistributedOptimizerOptions).
  TORCH_ARG(bool, gradient_accumulation_fusion) = true;
  // Iterations [first, last] (counted from 1; {0, 0}: none) whose step runs under CUDA's
  // sync debug mode "error": a device-to-host synchronisation inside the step (an item(),
  // a D2H copy, a size-dependent allocation) fails the run naming the iteration. Reading
  // the logged values after the step is outside the check. Nothing to check on a CPU.
  TORCH_ARG(IterationRange, sync_debug_iterations) = IterationRange{0, 0};
  // Mixed precision: the parameters' dtype is the model's; fp16 adds dynamic loss scaling.
  TORCH_ARG(bool, fp16) = false;
  TORCH_ARG(double, initial_loss_scale) = 4294967296.0;
  TORCH_ARG(int64_t, loss_scale_window) = 1000;
  TORCH_ARG(int64_t, hysteresis) = 2;
  // FP8 GEMMs (fp8/recipe.h) for every ColumnParallelLinear / RowParallelLinear of the
  // model that has none (tp::convert_to_fp8; format kNone: nothing changes). GPT's layers
  // take it from TransformerConfig::fp8, which also keeps chosen layers in bf16.
  // Checkpoints record the model's recipe and its scaling state.
  TORCH_ARG(fp8::Fp8Options, fp8) = {};
  // Logging: the Megatron-style line every log_interval iterations (a short progress
  // line in between) and, with log_json, one JSON object per iteration.
  TORCH_ARG(int64_t, log_interval) = 1;
  TORCH_ARG(std::string, log_json) = "";
  TORCH_ARG(std::string, loss_name) = "loss";   // "lm loss" for GPT
  TORCH_ARG(bool, log_perplexity) = false;      // exp(loss) on the validation line
  TORCH_ARG(int64_t, tokens_per_sample) = 1;    // tokens/s = samples/s · this
  // FLOPs per token given the whole model's parameter count, for TFLOP/s per rank (GPT:
  // PaLM's 6Ψ + 12·L·h·s); null reports 0.
  TORCH_ARG(std::function<double(int64_t num_parameters)>, flops_per_token) = nullptr;
  TORCH_ARG(std::string, timeline) = "";        // SVG of iteration 2's schedule
  // One line after set_model: the layout, ZeRO stage and parameter count (gpt_pretrain
  // prints its own).
  TORCH_ARG(bool, print_summary) = true;
  // Evaluation every eval_interval iterations (0: at the end only) over eval_iters batches.
  TORCH_ARG(int64_t, eval_interval) = 0;
  TORCH_ARG(int64_t, eval_iters) = 4;
  // Checkpoints: save every save_interval iterations (and at the end) to `save`; resume
  // from `load` (any layout). finetune: weights only, iteration 0.
  TORCH_ARG(std::string, save) = "";
  TORCH_ARG(int64_t, save_interval) = 0;
  TORCH_ARG(std::string, load) = "";
  TORCH_ARG(int64_t, load_iteration) = -1;  // -1: the one `latest` names (Megatron's --ckpt-step)
  TORCH_ARG(bool, finetune) = false;
  // Also save the gradients the step before each save applied, as "optim/grad/<name>"
  // (reduced and averaged, fp32; never loaded): what megatorch-verify-layout compares.
  TORCH_ARG(bool, save_grads) = false;
  TORCH_ARG(bool, load_optimizer) = true;
  TORCH_ARG(bool, load_rng) = true;
  // Saved with every checkpoint (metadata.json's model_config); on load, `load_comparison`
  // (default: model_config) must equal the saved one's same fields.
  TORCH_ARG(nlohmann::json, model_config) = nlohmann::json::object();
  TORCH_ARG(nlohmann::json, load_comparison) = nullptr;
  // Fault tolerance (Megatron's flags). async_save: a save copies this rank's pieces to
  // host memory and a background thread writes them; `latest` moves once every rank's
  // file is complete (ckpt::AsyncSave), checked after each iteration. A new save waits
  // for the previous; train() returns only after the last is published.
  TORCH_ARG(bool, async_save) = false;
  // On SIGTERM or SIGINT every rank finishes the iteration, saves (when `save` is set) and
  // train() returns with exit_reason() set: a preempted job resumes from there. The same
  // after every exit_interval iterations, or once exit_duration_in_mins have passed since
  // the loop was made (0: never). One tiny all-reduce per iteration while any is on.
  TORCH_ARG(bool, exit_signal_handler) = false;
  TORCH_ARG(int64_t, exit_interval) = 0;
  TORCH_ARG(double, exit_duration_in_mins) = 0;
  // A NaN or Inf in the loss, or (without a loss scaler, which owns overflows) in the
  // reduced gradients, stops the run before the optimizer step, naming the iteration and
  // the ranks and parameters where the gradients were non-finite. Reading the loss and
  // the norm is one device-to-host synchronisation per step on a GPU.
  TORCH_ARG(bool, check_for_nan_in_loss_and_grad) = true;
  // Instead skip up to this many such steps (nothing applied, each logged), then stop.
  TORCH_ARG(int64_t, skip_nan_steps) = 0;
  // On logged iterations (log_interval, the last): every rank's compute time in the step,
  // min / median / max and the slowest rank, in the log line and log_json ("straggler").
  // Timing the step's compute waits for the device once on a GPU.
  TORCH_ARG(bool, log_straggler) = false;
  // Megatron's re-run state machine: "disabled" or "validate_results". When a step's loss
  // is NaN / Inf or above spike_threshold x the mean of the last 20 steps' losses, the step
  // runs again from the same state (parameters, micro-batches, random generators) before
  // anything is applied. A different loss is reported as a transient fault, naming the
  // ranks whose own share of the loss differed, and the rerun's step is kept; the same
  // loss as a data or model fault, naming the iteration's samples, and the step goes on as
  // any other (the NaN check stops a NaN). Reads the loss every step (a GPU synchronisation).
  TORCH_ARG(std::string, rerun_mode) = "disabled";
  TORCH_ARG(double, spike_threshold) = 10.0;
};

class TrainingLoop {
 public:
  // Makes the process groups (tp × pp × dp over the torchrun world) and seeds the default
  // generator; the model is built after, on the groups.
  explicit TrainingLoop(TrainingLoopOptions options);
  ~TrainingLoop();

  const parallel::ParallelState& parallel_state() const { return *state_; }
  std::string tp_group() const;
  std::string pp_group() const;  // "" without pipeline parallelism
  std::string dp_group() const;
  std::string cp_group() const;  // "" without context parallelism
  // The expert layers' groups: experts, each expert's tensor split, and its replicas
  // (registered names at every size, 1 included).
  std::string ep_group() const;
  std::string etp_group() const;
  std::string edp_group() const;
  // The group gradients are averaged over and ZeRO shards over: DP, or DP × CP.
  std::string grad_group() const;
  int64_t dp_rank() const;
  int64_t dp_size() const;
  c10::Device device() const;

  // This rank's stage (every chunk built), its parameters grouped for the optimizer
  // (train::stage_parameters with `grouping`); builds the DistributedOptimizer and hooks
  // ZeRO-3's gathers into the chunks, then loads `load` when it holds a checkpoint.
  void set_model(std::shared_ptr<pipeline::Stage> stage, const ParameterGroupingOptions& grouping = {});

  // Runs from the current iteration to train_iters, evaluating on `valid` (if given),
  // logging and saving on their intervals. Returns the last iteration's stats.
  // The loss and the gradient norm are read from the device only for iterations whose
  // values are used (log_interval, the last, log_json, on_iteration, MoE statistics, a
  // loss scaler's decision): in between a step has no device-to-host synchronisation, and
  // IterationStats::seconds is the mean over the iterations since the last one read.
  IterationStats train(const BatchSource& train, const BatchSource& valid = nullptr);
  // One step on these micro-batches (moved to the loop's device when elsewhere).
  IterationStats train_step(const std::vector<pipeline::MicroBatch>& micro_batches);
  // Mean loss over `iters` batches of `source` (the schedule's forwards only; every rank
  // gets it); -1 when the source has nothing.
  double evaluate(const BatchSource& source, int64_t iters);
  // Saves at the current iteration; with async_save, starts the save (after publishing
  // the one in flight) and returns while it is written.
  void save_checkpoint();
  // Waits for the asynchronous save in flight, if any, and publishes it (collective).
  void finish_checkpoint_save();
  bool load_checkpoint();  // false when `load` holds none yet
  // Why train() stopped before train_iters ("" when it did not): "signal SIGTERM",
  // "exit interval 100", "exit duration 60 min".
  const std::string& exit_reason() const { return exit_reason_; }
  // NaN / Inf steps skipped so far (skip_nan_steps).
  int64_t nan_steps_skipped() const { return nan_steps_skipped_; }

  int64_t iteration() const { return iteration_; }
  const TrainingLoopOptions& options() const { return options_; }
  pipeline::Stage& stage() { return *stage_; }
  optim::DistributedOptimizer& optimizer() { return *optimizer_; }
  // The experts' optimizer over the expert-DP group (null on stages without experts).
  optim::DistributedOptimizer* expert_optimizer() { return expert_optimizer_.get(); }
  int64_t num_parameters() const { return num_parameters_; }  // whole model, each once
  bool is_logging_rank() const;
  // This iteration's validation loss inside on_iteration (-1: none was evaluated).
  double last_validation_loss() const { return last_val_loss_; }
  // samples per step: micro_batch_size · num_micro_batches · dp.
  int64_t global_batch_size() const;
  // Appends one record to log_json (the logging rank; nothing without log_json).
  void write_log_json(const nlohmann::json& record);
  // Called after each iteration's log (every rank): a program's own reporting.
  std::function<void(const IterationStats&)> on_iteration;

 private:
  // Both optimizers, dense first (the expert one where this stage has experts).
  std::vector<optim::DistributedOptimizer*> optimizers() const;
  // One step of every optimizer: one norm over both, one loss-scaler update. With the
  // NaN check, `loss` (the reduced loss, on the device) and the norm are checked first.
  bool step_optimizers(const at::Tensor& loss);
  // Stops the run, or skips the step (skip_nan_steps), after a non-finite loss or norm.
  void on_nonfinite_step(double loss, bool bad_grads, double sum_of_squares);
  // "" or why every rank stops now (the signal, the interval, the clock): collective.
  std::string exit_requested();
  // The fault injection's gradient hooks on this rank (fault_injection.h).
  void attach_fault_hooks();
  // rerun_mode: whether `loss` calls for a rerun on any rank, and the verdict on the two
  // runs (every rank's own share of the loss in each names the ranks that differed). Both
  // collective over the world.
  bool suspicious_loss(double loss);
  std::string judge_rerun(double first, double second, double own_first, double own_second);
  // Every rank's compute seconds of the step (log_straggler): collective over the world.
  std::vector<double> gather_compute_seconds(double busy_seconds);
  optim::DistributedOptimizerOptions optimizer_options() const;
  // `with_grads`: the optimizers' last gradients too (save_grads).
  std::vector<ckpt::ShardedEntry> checkpoint_entries(bool with_grads = false);
  std::vector<pipeline::MicroBatch> on_device(std::vector<pipeline::MicroBatch> micro_batches) const;
  // The last pipeline stage's loss averaged over DP (summed over CP), on every rank: on
  // the device (a 1-element double tensor), or read.
  // `injected`: added to this rank's share first (fault injection).
  at::Tensor reduce_loss_on_device(const at::Tensor& last_stage_loss, double injected = 0);
  double reduce_loss(const at::Tensor& last_stage_loss);
  // A step whose loss and gradient norm are still on the device.
  struct PendingStats {
    IterationStats stats;  // everything but loss and grad_norm
    at::Tensor loss;       // reduce_loss_on_device's
  };
  PendingStats run_step(const std::vector<pipeline::MicroBatch>& micro_batches);
  IterationStats read_stats(const PendingStats& pending);
  // Whether iteration `it`'s values are used (train's note above).
  bool reads_values(int64_t it) const;
  void log(const IterationStats& s, const std::map<std::string, int64_t>& comm_bytes);
  void log_validation();

  TrainingLoopOptions options_;
  std::unique_ptr<parallel::ParallelState> state_;
  std::shared_ptr<pipeline::Stage> stage_;
  std::shared_ptr<optim::DynamicLossScaler> scaler_;
  std::unique_ptr<optim::DistributedOptimizer> optimizer_;
  ModelParameters params_;  // the dense ones
  std::unique_ptr<optim::DistributedOptimizer> expert_optimizer_;
  ModelParameters expert_params_;
  std::pair<int64_t, int64_t> moe_shape_{0, 0};  // (layers, experts) of the model; (0, 0): dense
  std::string fp8_recipe_ = "none";  // fp8::describe of the model's FP8 layers: what checkpoints record
  LRSchedule lr_;
  bool optimizer_sums_ties_ = false;
  pipeline::ScheduleKind schedule_kind_ = pipeline::ScheduleKind::kOneFOneB;  // options' schedule, parsed once
  int64_t iteration_ = 0;
  int64_t nccl_check_id_ = 0;  // this loop's namespace for the NCCL check's trace exchange
  int64_t lr_step_ = 0;  // iterations whose update was applied: the LR schedule's clock
  int64_t num_parameters_ = 0;
  std::ofstream json_;
  double last_val_loss_ = -1;
  std::unique_ptr<ckpt::AsyncSave> pending_save_;  // async_save: written, not yet published
  std::chrono::steady_clock::time_point save_started_;  // the last save's start (after its copy)
  int64_t nan_steps_skipped_ = 0;
  std::string exit_reason_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  FaultInjection faults_;
  std::vector<double> recent_losses_;  // rerun_mode: the last 20 applied steps' losses
};

}  // namespace megatorch::train
