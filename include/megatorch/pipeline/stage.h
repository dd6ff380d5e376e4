#pragma once
// Stage: what the pipeline executor needs from this rank's model chunks, for any model.
// With p pipeline ranks and v chunks per rank, chunk c of rank r is virtual stage
// c·p + r (the looped layout), or under the V layout of ZB-V and DualPipeV (v = 2) rank r
// holds virtual stages r and 2p-1-r (schedule.h). A chunk maps the activation received from the previous virtual stage (on the
// first virtual stage: the micro-batch's own tensors) to the activation it sends on; the
// last virtual stage turns its output and the micro-batch's targets into a loss. GPT's
// PipelineStage and ModuleStage (the user's own chunks) are the two implementations.
#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/models/unit_hooks.h"
#include "megatorch/pipeline/schedule.h"
#include "megatorch/pipeline/tied_parameters.h"

namespace torch::nn {
class Module;
}
namespace megatorch::tp {
class RngTracker;
}

namespace megatorch::pipeline {

// One micro-batch: named tensors. `ids` and `labels` are GPT's two (token ids [b, s] read
// by the first stage, targets [b, s] by the last); any other model names its own in
// `tensors` ("pixels", "targets", "attention_mask", ...).
struct MicroBatch {
  at::Tensor ids;
  at::Tensor labels;
  std::map<std::string, at::Tensor> tensors;

  // The tensor called `name`: "ids" and "labels" are the two fields, anything else is
  // looked up in `tensors` (an error naming what the micro-batch holds when missing).
  const at::Tensor& get(const std::string& name) const;
  bool has(const std::string& name) const;
  // Every tensor moved to `device` (non-blocking from pinned memory).
  MicroBatch to(const c10::Device& device, bool non_blocking = false) const;
};

// The tensor a virtual stage sends to the next one: the receiver allocates it from this,
// so both ends must agree before any p2p (Stage implementations check it across ranks).
struct ActivationSpec {
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::kFloat;
  bool operator==(const ActivationSpec& o) const { return shape == o.shape && dtype == o.dtype; }
  bool operator!=(const ActivationSpec& o) const { return !(*this == o); }
};
std::string to_string(const ActivationSpec& spec);

class Stage {
 public:
  virtual ~Stage() = default;

  virtual int64_t pp_rank() const = 0;
  virtual int64_t pp_size() const = 0;
  virtual int64_t num_chunks() const = 0;
  // How the chunks sit on the ranks: the schedule must match (kV for zb-v, dualpipev).
  virtual ChunkLayout chunk_layout() const { return ChunkLayout::kLooped; }
  // The pipeline group's name ("" for a single stage).
  virtual const std::string& pipeline_group() const = 0;
  // Where activations live (and receive buffers are allocated).
  virtual c10::Device device() const = 0;

  // Called once per step with its micro-batches before any p2p, on every pipeline rank:
  // refuses batches the stages cannot run (wrong names or shapes) with a clear error, and
  // fixes what activation_spec returns for them.
  virtual void prepare(const std::vector<MicroBatch>& micro_batches) = 0;
  // What virtual stage `virtual_stage` (< p·v - 1) sends: its output for one micro-batch
  // of the step `prepare` saw.
  virtual ActivationSpec activation_spec(int64_t virtual_stage) const = 0;
  // Chunk `chunk`'s forward: `input` is the previous virtual stage's activation, undefined
  // on the first virtual stage (which reads the micro-batch instead).
  virtual at::Tensor forward_chunk(int64_t chunk, const at::Tensor& input, const MicroBatch& micro_batch) = 0;
  // The last virtual stage's loss for one micro-batch: a scalar, the mean over whatever
  // the model averages (GPT: its non-ignored tokens). The executor averages micro-batches.
  virtual at::Tensor micro_batch_loss(const at::Tensor& output, const MicroBatch& micro_batch) = 0;

  // The parameters this stage shares with others, as one TiedParameters (empty without).
  virtual const TiedParameters& ties() const = 0;
  // Gradients of parameters this stage shares with others (GPT's tied embedding, any
  // user-declared tie) summed over all copies. Call after the step's backward, unless the
  // optimizer was told to sum them (train::stage_parameters marks them).
  virtual void allreduce_tied_grads() = 0;
  // Under sequence parallelism, partial gradients of TP-replicated parameters summed
  // over the TP group (unless the optimizer sums them). A no-op otherwise.
  virtual void allreduce_sequence_parallel_grads() = 0;

  // ZeRO-3 / overlapped ZeRO-1/2 gathers: the optimizer's hooks for chunk `chunk`'s units
  // `first_unit` (its root) .. `last_unit` (train::stage_parameters numbers them).
  virtual void set_unit_hooks(int64_t chunk, std::shared_ptr<models::UnitHooks> hooks, int64_t first_unit,
                              int64_t last_unit) = 0;

  // The module that owns every chunk (train()/eval(), parameters, state dicts).
  virtual torch::nn::Module& stage_module() = 0;
  // Chunk `c`'s module.
  virtual std::shared_ptr<torch::nn::Module> chunk_module(int64_t c) const = 0;

  // The dropout streams of the chunks' TP regions (saved and restored with checkpoints);
  // null when the model has none.
  virtual std::shared_ptr<tp::RngTracker> rng_tracker() const { return nullptr; }

  // Ranks that split each micro-batch's sequence (context parallelism): the stage slices
  // its micro-batches to this rank's share and returns a loss that, summed over them and
  // averaged over DP x CP, is the whole sequence's. 1: the stage sees whole sequences.
  virtual int64_t context_parallel_size() const { return 1; }

  bool is_first_virtual_stage(int64_t chunk) const { return virtual_stage(chunk) == 0; }
  bool is_last_virtual_stage(int64_t chunk) const { return virtual_stage(chunk) == pp_size() * num_chunks() - 1; }
  int64_t virtual_stage(int64_t chunk) const {
    return pipeline::virtual_stage(chunk, pp_rank(), pp_size(), chunk_layout());
  }
};

}  // namespace megatorch::pipeline
