#pragma once
// CUDA-graph capture of a model's transformer layer stack (Megatron's
// --enable-cuda-graph; the scheme of torch.cuda.make_graphed_callables): for each input
// shape the stack's forward and its backward are captured once into two CUDA graphs and
// then replayed, so a micro-batch launches two graphs instead of every layer's kernels
// one by one. What it removes is host time (kernel launches, dispatcher and autograd
// bookkeeping), which matters where a step is launch-bound: small models, micro-batch 1.
//
// A capture holds its own memory (the stack's activations, the gradient of its output,
// the gradients it produces), and a forward cannot replay a capture whose backward has
// not run yet, so each shape gets as many captures as micro-batches are in flight at once
// (under 1F1B: one on the last pipeline stage, up to the pipeline depth on the first). Everything that leaves a graph is copied out, so nothing a caller holds is
// overwritten by a later replay. Parameters are read where they live: the optimizer must
// update them in place (megatorch's optimizers do; ZeRO-3, which frees and regathers
// them, is refused below).
#include <ATen/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/transformer/config.h"

namespace megatorch::transformer {

// Why the layer stack of `config` cannot run as CUDA graphs for `input`, or "" when it
// can: it needs a CUDA input and no work the host must do between kernels or that graphs
// cannot replay (collectives of tensor, sequence, context or expert parallelism, random
// dropout masks, activation recomputation, per-layer hooks such as ZeRO-3's gathers).
// `tp_size` / `cp_size`: the sizes of the stack's tensor- and context-parallel groups.
std::string cuda_graph_unsupported(const TransformerConfig& config, const at::Tensor& input, int64_t tp_size,
                                   int64_t cp_size, bool has_layer_hooks);

class LayerStackGraphs {
 public:
  using Stack = std::function<at::Tensor(const at::Tensor&)>;
  // `params`: every tensor the stack reads that wants a gradient (its parameters), in a
  // fixed order; `warmup`: eager runs on the capture stream before capturing (cuBLAS
  // workspaces, lazy initialisation and autotuning happen outside the capture).
  explicit LayerStackGraphs(std::vector<at::Tensor> params, int64_t warmup = 2);
  ~LayerStackGraphs();
  LayerStackGraphs(const LayerStackGraphs&) = delete;
  LayerStackGraphs& operator=(const LayerStackGraphs&) = delete;

  // stack(input) through captured graphs, differentiable in `input` and the parameters.
  // `constants` are tensors the stack reads that are not inputs (RoPE tables): a capture
  // is only replayed for the same ones (same memory), and holds them. Call with grad mode
  // on, a CUDA input, and cuda_graph_unsupported(...) empty; fails otherwise.
  at::Tensor run(const at::Tensor& input, const std::vector<at::Tensor>& constants, const Stack& stack);

  int64_t captures() const;  // forward/backward graph pairs captured so far
  int64_t replays() const;   // forward replays so far

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace megatorch::transformer
