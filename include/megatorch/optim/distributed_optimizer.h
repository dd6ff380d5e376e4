#pragma once
// DistributedOptimizer: data-parallel gradient reduction and the ZeRO-sharded optimizer.
//
//   stage 0  every DP rank holds everything; gradients are all-reduced.
//   stage 1  optimizer states (and fp32 master weights) are sharded: DP rank r owns the
//            contiguous range r of every bucket; gradients are reduce-scattered into the
//            full gradient buffer (only the owned range is used) and the updated
//            parameters are all-gathered after the step: 2Ψ per step, as plain DP.
//   stage 2  + a rank keeps only its gradient shard (full gradients live in per-bucket
//            staging buffers from the first backward until the bucket's reduce-scatter).
//   stage 3  + parameters are sharded: a unit (a transformer layer) is all-gathered right
//            before its forward and again before its backward and freed after each (FSDP):
//            3Ψ per step.
//
// Gradients: every parameter's .grad is a view into a flat per-dtype buffer, so autograd
// accumulates into it in place (micro-batches add up with no communication). 16-bit
// parameters get fp32 gradients by default (Megatron's main_grad): .grad is then fp32.
// When the last micro-batch's backward has produced all of a bucket's gradients, its
// collective starts asynchronously (set_grad_sync(true), the default; turn it off for
// all but the last micro-batch); step() waits for all of them. Averaging over DP is a
// scale by 1/d followed by a sum: the same on every backend (Gloo has no AVG), exact
// for power-of-two d.
#include <ATen/Tensor.h>
#include <torch/arg.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "megatorch/comm/group.h"
#include "megatorch/models/unit_hooks.h"
#include "megatorch/optim/bucket_layout.h"
#include "megatorch/optim/loss_scaler.h"

namespace megatorch::optim {

enum class OptimizerKind { kAdamW, kSGD };

struct DistributedOptimizerOptions {
  TORCH_ARG(int64_t, zero_stage) = 0;
  TORCH_ARG(OptimizerKind, kind) = OptimizerKind::kAdamW;
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, beta1) = 0.9;  // AdamW
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(double, momentum) = 0.9;  // SGD
  TORCH_ARG(int64_t, bucket_size) = 0;  // elements per bucket; 0: Megatron's max(40M, 1M·dp)
  TORCH_ARG(bool, grad_in_fp32) = true;  // fp32 gradients for 16-bit parameters
  TORCH_ARG(double, clip_grad) = 0.0;    // max global L2 norm; 0: no clipping
  // Required for fp16 parameters (fp16 gradients overflow without one); optional otherwise.
  TORCH_ARG(std::shared_ptr<DynamicLossScaler>, loss_scaler) = nullptr;
  // Model-parallel groups whose ranks hold other parts of the model (TP, PP): the global
  // gradient norm and the overflow flag are reduced over them (and over DP when sharded).
  TORCH_ARG(std::vector<std::string>, model_parallel_groups) = {};
  // Start bucket collectives during backward; off: all of them start in step().
  TORCH_ARG(bool, overlap_grad_reduce) = true;
  // Stages 1-2: step() only launches the all-gathers of the updated parameters (in
  // forward order) and the next forward waits for each unit's buckets just before the
  // unit runs (Megatron's overlap_param_gather). Needs the model to run unit_hooks()
  // (attach_unit_hooks); anything else that reads parameters calls finish_param_gather().
  TORCH_ARG(bool, overlap_param_gather) = false;
  // Broadcast parameters from DP rank 0 at construction (as DDP does).
  TORCH_ARG(bool, broadcast_parameters) = true;
};

// How each parameter enters the global gradient norm and the weight decay.
struct ParamInfo {
  bool counted_in_norm = true;  // false for copies held elsewhere too (TP-replicated on tp rank > 0, a tied copy)
  bool weight_decay = true;
  // Non-empty: this rank's gradient is a partial sum over that group (a norm weight or
  // bias under sequence parallelism, over TP). The optimizer adds the group's parts after
  // its own DP reduction, on the range it owns (sums commute), so the DP reduction can
  // overlap backward. Every rank of the group must hold the same parameters in the same
  // order, and the same DP rank: the TP group of a model replica.
  std::string grad_sum_group;
  // With grad_sum_group: the two ranks of the group that hold copies of the parameter (the
  // tied embedding: first and last pipeline stage), which exchange their parts; empty:
  // every rank of the group (an all-reduce).
  std::vector<int64_t> grad_sum_ranks;
  // A bucket of its own, so every copy is sharded alike (required with grad_sum_ranks).
  bool own_bucket = false;
};

class DistributedOptimizer {
 public:
  // `units` lists the parameters unit by unit (stage 3 gathers and frees a unit at once;
  // stages 0-2 only use them to order buckets). `info` is per parameter, flattened in the
  // same order (empty: defaults for all). `dp_group` is the data-parallel group's name.
  DistributedOptimizer(std::vector<std::vector<at::Tensor>> units, const std::string& dp_group,
                       DistributedOptimizerOptions options, std::vector<ParamInfo> info = {});
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  // Whether the next backward's completed buckets start their collectives (false for all
  // but the last micro-batch of a step).
  void set_grad_sync(bool enabled) { grad_sync_ = enabled; }
  // Sets every gradient to zero (stages 0-1) or drops the staging buffers (stages 2-3).
  void zero_grad();
  // Waits for (or starts) every bucket's reduction, checks for overflow, clips, updates
  // the owned shard and makes the full parameters current again (all-gather after the step
  // for stages 1-2). Returns false when the step was skipped (overflow).
  bool step();

  void set_lr(double lr) { options_.lr(lr); }
  double lr() const { return options_.lr(); }
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t step) { step_ = step; }  // restoring a checkpoint
  // Of the last step, before clipping (0 before any step).
  double grad_norm() const { return grad_norm_; }
  bool last_step_skipped() const { return skipped_; }

  // Bytes this rank holds between steps, by kind: param_bytes, grad_bytes,
  // master_param_bytes, optimizer_state_bytes (padding elements excluded), padding_bytes,
  // total_bytes.
  std::map<std::string, int64_t> memory_stats() const;

  // This rank's optimizer state: "step", then per bucket b "bucket.<b>.master",
  // ".exp_avg", ".exp_avg_sq" (AdamW) or ".momentum" (SGD) (the owned shard, fp32), and
  // the scaler. load_state_dict expects the same layout (the checkpoint code reshards).
  std::map<std::string, at::Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, at::Tensor>& state);

  // One parameter's part of this rank's optimizer state: elements [begin, end) of its
  // flattened tensor, as views into the optimizer's fp32 buffers ("master", "exp_avg",
  // "exp_avg_sq" or "momentum"); writing into them loads state. After writing masters,
  // call copy_master_to_params().
  struct ParamStateShard {
    int64_t param = 0;  // index in the flattened parameter list
    int64_t begin = 0, end = 0;
    std::map<std::string, at::Tensor> tensors;
  };
  std::vector<ParamStateShard> param_state_shards();
  void copy_master_to_params();
  // The other direction, after the model's parameters were loaded in place (stage 3:
  // with every unit gathered): the owned shard and the fp32 masters take their values.
  void copy_params_to_master();

  // Stages 1-2 with overlap_param_gather: waits for the all-gathers of the buckets holding
  // `unit`'s parameters (every bucket: unit -1) that step() launched. A no-op otherwise.
  void finish_param_gather(int64_t unit = -1);
  // Bucket all-gathers launched by step() and not yet waited for.
  int64_t pending_param_gathers() const;

  // ZeRO-3: gather / free one unit's full parameters (stages 1-2: finish_param_gather).
  void gather_unit(int64_t unit);
  void release_unit(int64_t unit);
  // Starts the unit's all-gather without waiting (gather_unit then waits for it).
  void prefetch_unit(int64_t unit);
  // Hooks for models::GPTModelImpl::set_unit_hooks (nullptr when the stage needs none).
  // ZeRO-3: gather before each unit's forward and backward, free after each (the unit
  // indices are those of `units`). Stages 1-2 with overlap_param_gather: wait for the
  // unit's parameter all-gathers before its forward.
  // `first`..`last`: the units of one model chunk (its root unit, then its layers), so
  // prefetching stays inside the chunk that runs next.
  std::shared_ptr<models::UnitHooks> unit_hooks(int64_t first, int64_t last);

  const BucketLayout& layout() const { return layout_; }
  const std::vector<at::Tensor>& parameters() const { return params_; }
  const DistributedOptimizerOptions& options() const { return options_; }
  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  const comm::Group& dp_group() const { return dp_; }

  struct State;  // buffers and in-flight work, defined in the source

 private:
  void check_same_parameters_across_ranks();
  void build_buffers();
  void register_hooks();
  // fn(parameter index, offset in the bucket's owned shard, offset in the parameter,
  // length) for every parameter slice of bucket b inside this rank's owned range.
  using OwnedSliceFn = std::function<void(int64_t, int64_t, int64_t, int64_t)>;
  void for_each_owned_slice(int64_t b, const OwnedSliceFn& fn) const;
  std::pair<int64_t, int64_t> owned_range(int64_t bucket) const;
  void ensure_grad_staging(int64_t bucket);
  void wait_bucket(int64_t bucket);
  void on_grad_ready(int64_t param);
  void start_bucket(int64_t bucket);
  void finish_grad_sync();
  void sum_partial_grads();
  void drain_in_flight();
  void launch_param_gathers();
  bool found_overflow();
  double global_grad_norm();
  void update_shards(double grad_scale);

  std::vector<std::vector<at::Tensor>> units_;
  std::vector<at::Tensor> params_;
  std::vector<int64_t> unit_of_param_;
  std::vector<ParamInfo> info_;
  comm::Group dp_;
  DistributedOptimizerOptions options_;
  BucketLayout layout_;
  std::unique_ptr<State> state_;
  bool grad_sync_ = true;
  int64_t step_ = 0;
  double grad_norm_ = 0.0;
  bool skipped_ = false;
};

}  // namespace megatorch::optim
