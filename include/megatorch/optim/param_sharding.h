#pragma once
// ParamSharding: when a sharded parameter is whole, and the unit schedule that decides it.
//
//   ZeRO-3 (FSDP): between uses a unit (a transformer layer, or a model chunk's root:
//     embedding, final norm, head) holds only this rank's range. It is all-gathered right
//     before its forward, with the next unit prefetched, freed after it, gathered again when
//     the gradient reaches its output (the unit whose backward comes next prefetched) and
//     freed once all of its gradients are in. Under a split backward (zero bubble: B the
//     input gradients, W the weight gradients later, micro-batches interleaved) a unit's
//     gradients arrive over several passes, so set_split_backward(true) frees it instead
//     when B moves on to the next unit: W multiplies layer inputs with output gradients
//     and reads no parameter, and the DP reduction waits for the step's last W as before.
//   ZeRO-1/2 with overlap_param_gather: after the optimizer updated its ranges,
//     launch_param_gathers() starts one all-gather per bucket in forward order and the
//     forward of each unit first waits for the buckets holding its parameters, so later
//     gathers run under earlier units' compute (Megatron's overlap_param_gather).
//
// unit_hooks() gives the hooks a model runs around each unit's forward (GPTModel's
// set_unit_hooks; Python's megatorch.nn.FullyShard calls them through the optimizer's
// before_unit_forward / after_unit_forward). The autograd node that gathers before a
// unit's backward holds a handle, not a pointer: if the ParamSharding (its optimizer) is
// destroyed before that backward runs, the backward fails with an error saying so
// instead of touching freed memory.
#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "megatorch/comm/group.h"
#include "megatorch/models/unit_hooks.h"
#include "megatorch/optim/param_and_grad_buffer.h"

namespace megatorch::optim {

class ParamSharding : public std::enable_shared_from_this<ParamSharding> {
 public:
  // Shares the buffer's buckets (its param_full / param_shard); `overlap_param_gather`:
  // stages 1-2 defer the post-step all-gathers to the next forward.
  static std::shared_ptr<ParamSharding> create(std::shared_ptr<ParamAndGradBuffer> buffer, bool overlap_param_gather);
  ~ParamSharding();
  ParamSharding(const ParamSharding&) = delete;
  ParamSharding& operator=(const ParamSharding&) = delete;

  // ZeRO-3: gather / free one unit's full parameters (stages 1-2: finish_param_gather).
  void gather_unit(int64_t unit);
  void release_unit(int64_t unit);
  void release_all();
  // Starts the unit's all-gather without waiting (gather_unit then waits for it).
  void prefetch_unit(int64_t unit);
  // Waits for and drops prefetches nothing consumed (their values may be stale).
  void drop_prefetches();

  // Stages 1-2: every rank updated its range; start putting the full parameters back
  // together, and (without overlap_param_gather) wait for it.
  void after_update();
  // Stages 1-2 with overlap_param_gather: waits for the all-gathers of the buckets holding
  // `unit`'s parameters (every bucket: unit -1) that after_update() launched. A no-op otherwise.
  void finish_param_gather(int64_t unit = -1);
  int64_t pending_param_gathers() const;

  // Counts a parameter's gradient in (ParamAndGradBuffer's observer): ZeRO-3 frees a
  // unit once all of its gradients are in, which ends its backward.
  void on_param_grad_ready(int64_t param);
  // Forgets the gradient counts of an abandoned backward (zero_grad).
  void reset_backward();
  // ZeRO-3 under a split-backward schedule (above); TrainingLoop sets it for zb-h1, zb-v
  // and dualpipev.
  void set_split_backward(bool on) { split_backward_ = on; }
  // The unit whose backward is starting (a GatherBeforeBackward node): gathers it, and
  // under a split backward frees the unit whose input-gradient pass just ended.
  void begin_unit_backward(int64_t unit);

  // Hooks for one model chunk's units `first` (its root) .. `last` (its last layer);
  // prefetching stays inside the chunk, as under interleaving the next chunk to run is the
  // schedule's choice. nullptr when the stage needs none.
  std::shared_ptr<models::UnitHooks> unit_hooks(int64_t first, int64_t last);

  bool is_gathered(int64_t bucket) const { return buckets_[bucket].gathered; }
  int64_t num_units() const { return buffer_->num_units(); }
  int64_t zero_stage() const { return buffer_->zero_stage(); }

  // The live ParamSharding behind a handle an autograd node saved; fails loudly when it
  // was destroyed (its optimizer went out of scope before backward).
  static std::shared_ptr<ParamSharding> from_handle(int64_t handle);
  int64_t handle() const { return handle_; }

 private:
  ParamSharding(std::shared_ptr<ParamAndGradBuffer> buffer, bool overlap_param_gather);

  struct BucketGather {
    bool gathered = true;                    // stage 3: param_full holds the whole bucket
    std::optional<comm::Work> prefetch;      // stage 3: an all-gather started ahead of use
    std::optional<comm::Work> param_gather;  // stages 1-2: launched by after_update
  };

  std::shared_ptr<ParamAndGradBuffer> buffer_;
  bool overlap_param_gather_;
  std::vector<BucketGather> buckets_;
  std::vector<std::vector<int64_t>> unit_buckets_;        // stage 3: the unit's own buckets
  std::vector<std::vector<int64_t>> unit_param_buckets_;  // buckets holding any parameter of the unit
  std::vector<int64_t> unit_grads_ready_;
  bool split_backward_ = false;
  int64_t backward_unit_ = -1;  // split backward: the unit B gathered last
  int64_t handle_ = 0;
};

}  // namespace megatorch::optim
