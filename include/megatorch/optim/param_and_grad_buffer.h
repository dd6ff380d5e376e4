#pragma once
// ParamAndGradBuffer: the data-parallel half of the distributed optimizer (Megatron's
// param_and_grad_buffer + distributed_data_parallel). It owns where parameters and
// gradients live and how gradients are reduced over DP; it updates nothing.
//
// Parameters and gradients live in flat per-dtype buffers cut into buckets (bucket_layout.h):
// every parameter's data is a view into its bucket, and so is its .grad, so autograd
// accumulates micro-batches in place with no communication. 16-bit parameters get fp32
// gradients by default (Megatron's main_grad). When the last micro-batch's backward has
// produced all of a bucket's gradients (set_grad_sync(true)), the bucket's collective starts
// asynchronously: an all-reduce at ZeRO stage 0, a reduce-scatter from stage 1, after which
// only this rank's owned range [r·n/d, (r+1)·n/d) of the bucket is used. Stage 2 keeps
// only that range between steps (full gradients live in a staging buffer from the bucket's
// first gradient until its reduce-scatter is done); stage 3 also keeps only the owned range
// of the parameters (param_sharding.h gathers them). Averaging over DP is a scale by 1/d
// then a sum: the same on every backend (Gloo has no AVG), exact for power-of-two d
// (grad_average_over: another d).
#include <ATen/Tensor.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "megatorch/comm/group.h"
#include "megatorch/optim/main_grad.h"
#include "megatorch/optim/bucket_layout.h"

namespace megatorch::optim {

// How each parameter enters the global gradient norm, the weight decay and the reduction.
struct ParamInfo {
  bool counted_in_norm = true;  // false for copies held elsewhere too (TP-replicated on tp rank > 0, a tied copy)
  bool weight_decay = true;
  // Non-empty: this rank's gradient is a partial sum over that group (a norm weight or
  // bias under sequence parallelism, over TP). The buffer adds the group's parts after
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

struct ParamAndGradBufferOptions {
  // 0: everything replicated; 1-2: gradients reduce-scattered (2: only the shard kept);
  // 3: parameters sharded too, one bucket per unit and dtype.
  TORCH_ARG(int64_t, zero_stage) = 0;
  TORCH_ARG(int64_t, bucket_size) = 0;   // elements per bucket; 0: Megatron's max(40M, 1M·dp)
  TORCH_ARG(bool, grad_in_fp32) = true;  // fp32 gradients for 16-bit parameters
  // Start bucket collectives during backward; off: all of them start in finish_grad_sync().
  TORCH_ARG(bool, overlap_grad_reduce) = true;
  // Broadcast parameters from DP rank 0 at construction (as DDP does).
  TORCH_ARG(bool, broadcast_parameters) = true;
  // The reduction sums over the DP group and divides by this; 0: the group's size. Another
  // divisor when the group is not the one to average over (expert parameters: reduced
  // over expert-DP, averaged over DP x CP; see DistributedOptimizerOptions).
  TORCH_ARG(int64_t, grad_average_over) = 0;
  // Register every parameter's gradient slice as its main grad (optim/main_grad.h): the
  // tensor-parallel layers' weight-gradient GEMMs then accumulate into the buffer directly.
  TORCH_ARG(bool, gradient_accumulation_fusion) = false;
};

class ParamAndGradBuffer : public MainGradSink {
 public:
  // One bucket's tensors: views into the flat buffers, or the bucket's own storage.
  struct Bucket {
    at::Tensor grad_full;    // [n] gradients; stages 2-3: staging, undefined between steps
    at::Tensor grad_shard;   // the owned range [n/d] (stage 0: all n); persistent
    at::Tensor param_full;   // [n] parameters; stage 3: its storage is freed between uses
    at::Tensor param_shard;  // the owned range (stage 3: the only persistent copy)
    int64_t ready = 0;       // gradients accumulated by this backward
    bool launched = false;   // its collective started
    comm::Work work;
  };

  // `units` lists the parameters unit by unit (stage 3 shards each unit as its own
  // buckets; stages 0-2 use them to order buckets). `info` is per parameter, flattened in
  // the same order (empty: defaults). `dp_group` is the data-parallel group's name.
  // Collective over DP: checks that every rank holds the same parameters.
  ParamAndGradBuffer(std::vector<std::vector<at::Tensor>> units, const std::string& dp_group,
                     ParamAndGradBufferOptions options, std::vector<ParamInfo> info = {});
  ~ParamAndGradBuffer() override;
  ParamAndGradBuffer(const ParamAndGradBuffer&) = delete;
  ParamAndGradBuffer& operator=(const ParamAndGradBuffer&) = delete;

  // Whether the next backward's completed buckets start their collectives (false for all
  // but the last micro-batch of a step).
  void set_grad_sync(bool enabled) { grad_sync_ = enabled; }
  // Zero every gradient (stages 0-1) or drop the staging buffers (stages 2-3), after
  // waiting for any reduction still in flight (an abandoned backward).
  void zero_grad();
  // Starts every bucket's reduction not started yet, waits for all of them, and adds the
  // partial sums other ranks hold (ParamInfo::grad_sum_group). Afterwards grad_shard of
  // every bucket holds this rank's reduced gradients.
  void finish_grad_sync();
  // Called after each parameter's gradient is complete for this backward, with its index
  // (ParamSharding frees a ZeRO-3 unit once all of its gradients are in).
  void set_grad_ready_observer(std::function<void(int64_t)> observer) { observer_ = std::move(observer); }

  // MainGradSink (with gradient_accumulation_fusion): parameter i's slice of its bucket's
  // gradients (stages 2-3: of the staging buffer, made on first use in a step).
  at::Tensor main_grad(int64_t param) override;
  void mark_added(int64_t param) override;

  // The range [begin, begin + length) of bucket b this rank owns: all of it at stage 0.
  std::pair<int64_t, int64_t> owned_range(int64_t bucket) const;
  // fn(parameter index, offset in the bucket's owned range, offset in the parameter,
  // length) for every parameter slice of bucket b inside this rank's owned range.
  using OwnedSliceFn = std::function<void(int64_t, int64_t, int64_t, int64_t)>;
  void for_each_owned_slice(int64_t bucket, const OwnedSliceFn& fn) const;

  int64_t zero_stage() const { return options_.zero_stage(); }
  const ParamAndGradBufferOptions& options() const { return options_; }
  const BucketLayout& layout() const { return layout_; }
  std::vector<Bucket>& buckets() { return buckets_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const std::vector<at::Tensor>& parameters() const { return params_; }
  const std::vector<ParamInfo>& info() const { return info_; }
  const std::vector<std::vector<at::Tensor>>& units() const { return units_; }
  int64_t unit_of_param(int64_t param) const { return unit_of_param_[param]; }
  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  comm::Group& dp_group() { return dp_; }
  const comm::Group& dp_group() const { return dp_; }

 private:
  void check_same_parameters_across_ranks();
  void build_buffers();
  void register_hooks();
  void ensure_grad_staging(int64_t bucket);
  void on_grad_ready(int64_t param);
  void start_bucket(int64_t bucket);
  void wait_bucket(int64_t bucket);
  void drain_in_flight();
  void plan_partial_sums();
  void sum_partial_grads();

  // The slices of one grad_sum_group (and pair of ranks) this rank owns.
  struct PartialSum {
    comm::Group group;
    int64_t peer = -1;  // grad_sum_ranks: the other copy's rank; -1: all-reduce over the group
    std::vector<at::Tensor> views;
  };

  std::vector<std::vector<at::Tensor>> units_;
  std::vector<at::Tensor> params_;
  std::vector<int64_t> unit_of_param_;
  std::vector<ParamInfo> info_;
  comm::Group dp_;
  ParamAndGradBufferOptions options_;
  BucketLayout layout_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> param_buffers_, grad_buffers_;  // stages 0-2 / 0-1, one per dtype
  std::vector<PartialSum> partial_sums_;
  std::function<void(int64_t)> observer_;
  std::vector<char> grad_added_;  // per parameter: its GEMM added this backward's gradient
  bool grad_sync_ = true;
};

}  // namespace megatorch::optim
