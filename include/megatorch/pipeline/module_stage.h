#pragma once
// ModuleStage: a pipeline stage made of the user's own LibTorch modules, one per chunk
// (virtual stage c·p + r is chunk c of pipeline rank r; under the V layout, rank r's chunks
// are virtual stages r and 2p-1-r). Each chunk's forward maps the
// activation received from the previous virtual stage to the one it sends on; the first
// virtual stage reads the micro-batch tensor named `input`; the last applies `loss` to
// its output and the micro-batch. What travels between stages is declared
// (`activation`) or inferred: once per micro-batch shape, the chunks run forward in
// virtual-stage order on zeros (eval mode, no autograd, no random draws) and each output's
// shape and dtype is broadcast over the pipeline group, so every receive knows its buffer
// before the first real p2p.
//
//   std::vector<torch::nn::AnyModule> chunks{torch::nn::AnyModule(MyBlocks(...))};
//   pipeline::ModuleStage stage(chunks, pipeline::ModuleStageOptions()
//       .pp_group("pp").input("pixels")
//       .loss([](const at::Tensor& logits, const pipeline::MicroBatch& mb) {
//         return at::cross_entropy_loss(logits, mb.get("targets")); }));
//   pipeline::run_pipeline_step(*stage, micro_batches, {});
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/models/unit_hooks.h"
#include "megatorch/pipeline/stage.h"
#include "megatorch/pipeline/tied_parameters.h"
#include "megatorch/tp/rng_tracker.h"

namespace megatorch::pipeline {

// The last virtual stage's loss for one micro-batch (a scalar mean).
using StageLoss = std::function<at::Tensor(const at::Tensor& output, const MicroBatch& micro_batch)>;
// A chunk's forward when it needs more than one tensor (a mask, positions): `input` is
// undefined on the first virtual stage. Default: chunk.forward(input), or on the first
// virtual stage chunk.forward(micro_batch.get(options.input())).
using ChunkForward = std::function<at::Tensor(torch::nn::AnyModule& chunk, int64_t virtual_stage,
                                              const at::Tensor& input, const MicroBatch& micro_batch)>;
// The activation virtual stage `virtual_stage` sends for micro-batches like `micro_batch`.
using ActivationFn = std::function<ActivationSpec(int64_t virtual_stage, const MicroBatch& micro_batch)>;

// Micro-batch tensor name -> the dim along which it holds the sequence.
using SequenceDims = std::map<std::string, int64_t>;

// A parameter of chunk `chunk` (its name inside that chunk) shared under the tie `name`
// with parameters of other chunks (on this or other pipeline ranks).
struct TiedParameter {
  std::string name;
  int64_t chunk = 0;
  std::string parameter;
};

struct ModuleStageOptions {
  TORCH_ARG(std::string, pp_group) = "";  // "" for a single stage
  // kV for the zb-v and dualpipev schedules (two chunks per rank: the first goes down the
  // ranks, the second comes back up, so rank 0's second chunk computes the loss).
  TORCH_ARG(ChunkLayout, chunk_layout) = ChunkLayout::kLooped;
  // The TP group of the chunks' parallel layers, and whether they run sequence parallel:
  // the optimizer's grouping and the checkpoint entries read them (which TP rank writes
  // a replicated parameter, whose gradients are partial).
  TORCH_ARG(std::string, tp_group) = "";
  TORCH_ARG(bool, sequence_parallel) = false;
  // Context parallelism: the CP group the chunks' attention splits each sequence over
  // ("" for none; TrainingLoop's cp_group()), and which micro-batch tensors hold the
  // sequence along which dim ("ids", "labels" or a name in `tensors`). The chunks, the
  // forward function and the loss then see this rank's share of those tensors
  // (transformer::context_parallel_slice: chunks r and 2c-1-r of 2c), and their attention
  // must cross the group (transformer::context_parallel_attention, or megatorch's layers on
  // a config whose context_parallel_group is this group). Positions are
  // transformer::context_parallel_positions(S, c, r).
  //
  // The loss: the mean over this rank's share. The optimizer averages gradients over
  // DP x CP, so equal shares give the whole sequence's mean; with ignored tokens spread
  // unevenly, return (this rank's loss sum) x c / (the whole micro-batch's count), as GPT
  // does (the micro-batch's other tensors are whole, so a loss can count them).
  TORCH_ARG(std::string, cp_group) = "";
  TORCH_ARG(SequenceDims, sequence_dims) = {};
  TORCH_ARG(std::string, input) = "inputs";
  TORCH_ARG(StageLoss, loss) = nullptr;
  TORCH_ARG(ChunkForward, forward) = nullptr;
  TORCH_ARG(ActivationFn, activation) = nullptr;  // null: inferred
  TORCH_ARG(std::vector<TiedParameter>, tied) = {};
  TORCH_ARG(c10::Device, device) = c10::kCPU;
  // The tracker the chunks' layers draw TP-region dropout from (their options' rng), so
  // checkpoints save and restore its streams; null when they have none.
  TORCH_ARG(std::shared_ptr<tp::RngTracker>, rng) = nullptr;
};

class ModuleStageImpl : public torch::nn::Cloneable<ModuleStageImpl>, public Stage {
 public:
  // `chunks`: this rank's, in chunk order. A collective over the pipeline group (the chunk
  // layout for checkpoint names, the ties), so every pipeline rank constructs together.
  ModuleStageImpl(std::vector<torch::nn::AnyModule> chunks, ModuleStageOptions options);
  void reset() override;
  // Clones every chunk (a collective, like construction).
  std::shared_ptr<torch::nn::Module> clone(const c10::optional<c10::Device>& device = c10::nullopt) const override;

  int64_t pp_rank() const override { return pp_rank_; }
  int64_t pp_size() const override { return pp_size_; }
  int64_t num_chunks() const override { return static_cast<int64_t>(chunks_.size()); }
  ChunkLayout chunk_layout() const override { return options.chunk_layout(); }
  const std::string& pipeline_group() const override { return options.pp_group(); }
  c10::Device device() const override { return options.device(); }
  void prepare(const std::vector<MicroBatch>& micro_batches) override;
  ActivationSpec activation_spec(int64_t virtual_stage) const override;
  at::Tensor forward_chunk(int64_t chunk, const at::Tensor& input, const MicroBatch& micro_batch) override;
  at::Tensor micro_batch_loss(const at::Tensor& output, const MicroBatch& micro_batch) override;
  void allreduce_tied_grads() override { ties_.allreduce_grads(); }
  // Under sequence_parallel: the partial gradients (tp::parameter_layouts) summed over TP.
  void allreduce_sequence_parallel_grads() override;
  torch::nn::Module& stage_module() override { return *this; }
  std::shared_ptr<torch::nn::Module> chunk_module(int64_t c) const override { return chunks_.at(c).ptr(); }
  torch::nn::AnyModule& chunk(int64_t c) { return chunks_.at(c); }
  std::shared_ptr<tp::RngTracker> rng_tracker() const override { return options.rng(); }
  int64_t context_parallel_size() const override { return cp_size_; }
  // `mb` as the chunks see it: the tensors named in sequence_dims cut to this CP rank's
  // share (mb itself without context parallelism).
  MicroBatch local_micro_batch(const MicroBatch& mb) const;

  const TiedParameters& ties() const override { return ties_; }
  // Chunk `c`'s parameter `local_name` as the whole model calls it: the top-level
  // ModuleLists' elements renumbered from the number of elements the same list has in
  // the virtual stages before (as GPT's global layer index), a tied parameter by its
  // tie's name. Independent of p and v, so checkpoints reshard.
  std::string global_name(int64_t c, const std::string& local_name) const;

  // ZeRO-3 / overlapped parameter gathers: the optimizer's hooks for chunk `c`'s units,
  // numbered from `first_unit` (the chunk's root, then one per ModuleList element: as
  // train::module_parameters groups them). A chunk that runs hooks itself
  // (models::RunsUnitHooks) gets them, one unit at a time; any other chunk gathers all of
  // its units before its forward and releases them after.
  void set_unit_hooks(int64_t c, std::shared_ptr<models::UnitHooks> hooks, int64_t first_unit,
                      int64_t last_unit) override;

  ModuleStageOptions options;

 private:
  void infer_activations(const MicroBatch& sample);
  at::Tensor run_chunk(int64_t c, const at::Tensor& input, const MicroBatch& micro_batch);

  std::vector<torch::nn::AnyModule> chunks_;
  int64_t pp_rank_ = 0, pp_size_ = 1;
  int64_t cp_rank_ = 0, cp_size_ = 1;
  TiedParameters ties_;
  // Per chunk: top-level ModuleList path -> global index of its first element.
  std::vector<std::map<std::string, int64_t>> list_offsets_;
  std::vector<ActivationSpec> specs_;  // per virtual stage but the last
  std::string specs_key_;              // the micro-batch shapes the specs were made for
  struct ChunkHooks {
    std::shared_ptr<models::UnitHooks> hooks;
    int64_t first = 0, last = -1;
    bool module_runs_them = false;
  };
  std::vector<ChunkHooks> hooks_;
};
TORCH_MODULE(ModuleStage);

}  // namespace megatorch::pipeline
