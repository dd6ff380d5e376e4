#pragma once
// DistributedOptimizer: the ZeRO-sharded optimizer update on top of the data-parallel
// gradient buffers (param_and_grad_buffer.h) and the parameter sharding (param_sharding.h).
//
//   stage 0  every DP rank holds everything; gradients are all-reduced.
//   stage 1  optimizer states (and fp32 master weights) are sharded: DP rank r owns the
//            contiguous range r of every bucket; gradients are reduce-scattered and the
//            updated parameters all-gathered after the step: 2Ψ per step, as plain DP.
//   stage 2  + a rank keeps only its gradient shard between steps.
//   stage 3  + parameters are sharded: a unit (a transformer layer) is all-gathered right
//            before its forward and again before its backward and freed after each (FSDP):
//            3Ψ per step.
//
// This class owns what the update needs: the fp32 master copy of this rank's range of every
// bucket, AdamW's moments (or SGD's momentum), the step count, gradient clipping and the
// loss scaler's overflow check. step() waits for the buffer's reductions, checks overflow
// and computes the global gradient norm with one reduction and one host synchronisation,
// updates its ranges with one multi-tensor call per (weight decay, 16-bit copy) class over
// views made once, then hands the parameters to ParamSharding to make them whole again.
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
#include "megatorch/optim/param_and_grad_buffer.h"
#include "megatorch/optim/param_sharding.h"

namespace megatorch::optim {

enum class OptimizerKind { kAdamW, kSGD };

struct DistributedOptimizerOptions {
  TORCH_ARG(int64_t, zero_stage) = 0;
  TORCH_ARG(OptimizerKind, kind) = OptimizerKind::kAdamW;
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, beta1) = 0.9;  // AdamW
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  // torch.optim.AdamW's and Megatron's default, as in the Python wrapper.
  TORCH_ARG(double, weight_decay) = 0.01;
  TORCH_ARG(double, momentum) = 0.9;  // SGD
  TORCH_ARG(int64_t, bucket_size) = 0;  // elements per bucket; 0: Megatron's max(40M, 1M·dp)
  TORCH_ARG(bool, grad_in_fp32) = true;  // fp32 gradients for 16-bit parameters
  TORCH_ARG(double, clip_grad) = 0.0;    // max global L2 norm; 0: no clipping
  // Required for fp16 parameters (fp16 gradients overflow without one); optional otherwise.
  TORCH_ARG(std::shared_ptr<DynamicLossScaler>, loss_scaler) = nullptr;
  // Count non-finite gradients in prepare_step (GradStats::overflow) without a loss scaler
  // too, every owned element whether counted in the norm or not (TrainingLoop's NaN check).
  TORCH_ARG(bool, check_finite_grads) = false;
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
  // The DP reduction sums each gradient over the DP group and divides by this; 0: the DP
  // group's size (the mean). Expert parameters are reduced over the expert-DP group but
  // averaged over DP x CP, as the dense ones (Megatron's expert gradient scaling): that
  // group may be smaller or larger than DP x CP, and may hold ranks that saw different
  // tokens of the same sequences (TP ranks under sequence parallelism), whose
  // contributions must add rather than average.
  TORCH_ARG(int64_t, grad_average_over) = 0;
  // Megatron's --gradient-accumulation-fusion: the tensor-parallel layers' weight-gradient
  // GEMMs accumulate into the gradient buffer itself (optim/main_grad.h). The first
  // micro-batch's gradients are the unfused ones bit for bit; later ones differ only where
  // the BLAS splits the token dimension into blocks (rounding, ~1e-7 relative).
  TORCH_ARG(bool, gradient_accumulation_fusion) = false;
};

// What DistributedOptimizer::prepare_step found in this optimizer's reduced gradients,
// already reduced over its groups: whether any is non-finite, and the sum of squares of
// those counted in the norm (not yet unscaled).
struct GradStats {
  bool overflow = false;
  double sum_of_squares = 0.0;
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
  void set_grad_sync(bool enabled) { buffer_->set_grad_sync(enabled); }
  // Sets every gradient to zero (stages 0-1) or drops the staging buffers (stages 2-3).
  void zero_grad();
  // Waits for (or starts) every bucket's reduction, checks for overflow, clips, updates
  // the owned shard and makes the full parameters current again (all-gather after the step
  // for stages 1-2). Returns false when the step was skipped (overflow).
  // step_together({this}): the phases below with this optimizer's scaler and clip_grad.
  bool step();

  // step() in phases, so several optimizers can share one norm, one overflow decision and
  // one loss-scaler update (step_together). Collective over this optimizer's groups.
  // Finishes the parameter gathers and the gradient reduction, and returns the overflow
  // flag and the squared norm, reduced over the model-parallel groups (and DP once
  // gradients are sharded).
  GradStats prepare_step();
  // prepare_step without reading the result: [non-finite count, squared norm] as a double
  // tensor on the parameters' device (the count only with a loss scaler; 0 without).
  at::Tensor prepare_step_on_device();
  // Updates with gradients multiplied by grad_scale (unscaling and clipping in one), and
  // records grad_norm (what grad_norm() reports) and one more step.
  void apply_step(double grad_scale, double grad_norm);
  // The same with both on the device: grad_scale a 0-dim fp32 tensor (undefined: 1), the
  // norm a 0-dim tensor read only when grad_norm() is asked for it.
  void apply_step(const at::Tensor& grad_scale, const at::Tensor& grad_norm);
  // Records a step skipped on overflow: nothing changes but last_step_skipped().
  void skip_step() { skipped_ = true; }

  void set_lr(double lr) { options_.lr(lr); }
  double lr() const { return options_.lr(); }
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t step) { step_ = step; }  // restoring a checkpoint
  // Of the last step, before clipping (0 before any step). After a step without a loss
  // scaler this is the first read of the norm from the device (a synchronisation on a GPU).
  double grad_norm() const;
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
  // The gradient the last step applied (reduced, averaged, fp32: "grad"), over the same
  // ranges; valid from the step until the next zero_grad.
  std::vector<ParamStateShard> grad_shards();
  // The parameters (indices in the flattened list) whose reduced gradient in this rank's
  // owned range holds a NaN or an Inf, after prepare_step: where a non-finite norm came
  // from. One pass over the owned gradients, read on the host (a synchronisation).
  std::vector<int64_t> nonfinite_grad_params() const;
  void copy_master_to_params();
  // The other direction, after the model's parameters were loaded in place (stage 3:
  // with every unit gathered): the owned shard and the fp32 masters take their values.
  void copy_params_to_master();

  // Parameter gathering (param_sharding.h): ZeRO-3's units, ZeRO-1/2's deferred gathers.
  void finish_param_gather(int64_t unit = -1) { sharding_->finish_param_gather(unit); }
  int64_t pending_param_gathers() const { return sharding_->pending_param_gathers(); }
  void gather_unit(int64_t unit) { sharding_->gather_unit(unit); }
  void release_unit(int64_t unit) { sharding_->release_unit(unit); }
  void prefetch_unit(int64_t unit) { sharding_->prefetch_unit(unit); }
  // ZeRO-3 under a split-backward schedule (zb-h1, zb-v, dualpipev): param_sharding.h.
  void set_split_backward(bool on) { sharding_->set_split_backward(on); }
  // Hooks for models::GPTModelImpl::set_unit_hooks for the units `first`..`last` of one
  // model chunk (its root unit, then its layers); nullptr when the stage needs none.
  std::shared_ptr<models::UnitHooks> unit_hooks(int64_t first, int64_t last) { return sharding_->unit_hooks(first, last); }

  const BucketLayout& layout() const { return buffer_->layout(); }
  const std::vector<at::Tensor>& parameters() const { return buffer_->parameters(); }
  const DistributedOptimizerOptions& options() const { return options_; }
  int64_t num_units() const { return buffer_->num_units(); }
  const comm::Group& dp_group() const { return buffer_->dp_group(); }
  ParamAndGradBuffer& buffer() { return *buffer_; }
  ParamSharding& sharding() { return *sharding_; }

 private:
  // The update's state for one bucket: this rank's range of it, in fp32.
  struct BucketState {
    at::Tensor master;               // aliases the parameter range for fp32 parameters
    at::Tensor exp_avg, exp_avg_sq;  // AdamW; SGD keeps its momentum in exp_avg
    at::Tensor grad32;               // 16-bit gradients upcast here (undefined for fp32 ones)
  };
  // The update's operands per (weight decay, writes a 16-bit model copy): views into the
  // buckets, made once as the layout never changes.
  struct UpdateLists {
    bool weight_decay = false, model_copy = false;
    std::vector<at::Tensor> master, grad, m, v, model;
  };

  void build_state();
  // Non-finite gradients anywhere (any rank) and the global squared norm: one reduction.
  at::Tensor overflow_and_norm();
  void finish_backward();
  // One more step: gradients times `scale` (a double, or, when defined, `scale_on_device`,
  // a 0-dim fp32 tensor), the update, then the sharding's after_update.
  void take_step(const c10::Scalar& scale, const at::Tensor& scale_on_device);
  void update(const c10::Scalar& scale, const at::Tensor& scale_on_device);

  DistributedOptimizerOptions options_;
  std::shared_ptr<ParamAndGradBuffer> buffer_;
  std::shared_ptr<ParamSharding> sharding_;
  std::vector<BucketState> state_;
  std::vector<UpdateLists> update_lists_;
  std::vector<comm::Group> reduction_groups_;  // model parallel, + DP once gradients are sharded
  int64_t step_ = 0;
  mutable double grad_norm_ = 0.0;
  mutable at::Tensor grad_norm_on_device_;  // read into grad_norm_ on first use
  bool skipped_ = false;
};

// Steps several optimizers over disjoint parameters as one (Megatron-core's
// ChainedOptimizer): dense parameters over DP x CP and expert parameters over the
// expert-DP group. One overflow decision (any optimizer's), one global norm (the sum of
// their squared norms, each already reduced over its own groups, so each optimizer's
// groups must cover every rank holding its parameters), one update of the loss scaler
// they share, one clip coefficient. Every optimizer must have the same loss_scaler
// pointer (or all none) and the same clip_grad. Returns false when the step was skipped.
// With one optimizer: exactly step(). Without a loss scaler nothing is read from the device:
// the norm, the clip coefficient and the update stay there (no synchronisation on a GPU).
bool step_together(const std::vector<DistributedOptimizer*>& optimizers);
// The second half of step_together, from their stats already combined by the caller:
// for stats that need a reduction no optimizer's groups span (expert parameters, whose
// optimizer exists only on pipeline stages holding experts, summed over the pipeline).
bool finish_step_together(const std::vector<DistributedOptimizer*>& optimizers, const GradStats& total);

}  // namespace megatorch::optim
