#pragma once
// Zero-bubble's split backward (Qi et al. 2023) for any autograd graph, so any Stage's
// chunks (GPT's layers, a user's own modules) run it without a special layer: B computes
// only the gradient of the stage input, which the previous stage waits for; W, run later
// to fill a bubble, computes the weight gradients.
//
// How: the graph from the stage output is cut where the input-gradient path and a
// weight-gradient path part at a matrix product (a "split node": the mm / addmm of a
// linear layer, a linear layer's own autograd function). B runs the engine for the input
// gradient alone, so each split node computes only its input-side gradient (at::linear's
// backward skips the weight GEMM; megatorch's sequence-parallel linear skips its
// re-gather), and a pre-hook keeps the output gradient the node was given. Parameters
// reached otherwise (norms, biases added on their own: cheap reductions whose node W
// would have to run again) get their gradients in B.
// After B the split nodes' edges into the input path are cut, so W, one engine run from
// the split nodes with those gradients, computes only the parameter side: the weight GEMM
// with the layer input the node saved, and nothing on the input path. What W needs
// is exactly the layer inputs and output gradients; B frees the other saved activations
// of the input path. W accumulates into .grad through the parameters' AccumulateGrad
// nodes, so gradient hooks (a data-parallel bucket's reduction) fire when W completes.
//
// Work autograd does as a side effect inside B (full-layer recomputation's replay
// accumulates its layer's weight gradients) stays in B.
#include <ATen/Tensor.h>
#include <torch/csrc/autograd/edge.h>

#include <memory>
#include <vector>

namespace megatorch::pipeline {

// The weight-gradient pass a split backward left for later.
class WeightGradPass {
 public:
  // Runs it once (the weight gradients accumulate into the parameters' .grad) and drops
  // what it held (the layer inputs and output gradients).
  void run();
  // Whether run() has work: false after run(), or when B already did everything.
  bool pending() const { return !roots_.empty(); }
  // The graph points W starts from: the split nodes (1 when W runs the whole backward of a
  // first stage, which has no input gradient to compute).
  int64_t num_roots() const { return split_nodes_; }

 private:
  friend WeightGradPass backward_input(const at::Tensor& output, const at::Tensor& grad, const at::Tensor& input);
  std::vector<torch::autograd::Edge> roots_;  // (split node, input number) for each gradient it was given in B
  std::vector<at::Tensor> grads_;     // those gradients
  int64_t split_nodes_ = 0;
};

// B: backward from `output` (a stage output, or the loss) with `grad`, computing only the
// gradient of `input` (a leaf requiring grad; it accumulates into input.grad()). Returns the
// pass W runs later. With `input` undefined (the first stage: nothing to send back) B
// computes nothing and W is the whole backward. `output`'s data may have been freed (sent
// and deallocated): only its graph is used.
WeightGradPass backward_input(const at::Tensor& output, const at::Tensor& grad, const at::Tensor& input);

}  // namespace megatorch::pipeline
