#pragma once
// What ColumnParallelLinear and RowParallelLinear share to run their GEMMs in FP8
// (fp8/linear.h): the scaling state, built from the layer's options, and a way to find
// and convert every such layer of a model.
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "megatorch/fp8/linear.h"

namespace megatorch::tp {

class Fp8Layer {
 public:
  virtual ~Fp8Layer() = default;
  // Runs this layer's GEMMs under `options` from now on (Format::kNone: in the params'
  // dtype again), with a fresh scaling state; fails as fp8::check_linear_shape says.
  virtual void set_fp8(const fp8::Fp8Options& options) = 0;
  // Null while the layer runs without FP8.
  c10::intrusive_ptr<fp8::LinearScaling> fp8_scaling;

 protected:
  // The scaling for a layer whose weight shard is `weight`: the weight's amax over the TP
  // group; the input's and the output gradient's over `split_groups` (those each is split
  // over: TP and/or the sequence group).
  void build_fp8_scaling(const std::string& layer, const fp8::Fp8Options& options, const at::Tensor& weight,
                         const std::string& tp_group, std::vector<std::string> input_groups,
                         std::vector<std::string> grad_groups);
};

// Every Fp8Layer under `root` with its dotted module name ("" for root itself).
std::vector<std::pair<std::string, Fp8Layer*>> fp8_layers(torch::nn::Module& root);

// torchao's convert_to_float8_training for megatorch's layers: `options` on every
// ColumnParallelLinear / RowParallelLinear under root that runs without FP8 and that
// `keep` (given its dotted name) does not keep. Returns how many were converted.
int64_t convert_to_fp8(torch::nn::Module& root, const fp8::Fp8Options& options,
                       const std::function<bool(const std::string&)>& keep = nullptr);

// The recipe of the layers under root, fp8::describe's line: "none" without FP8 layers.
// Fails if two layers were given different recipes (a checkpoint records one).
std::string fp8_recipe_of(torch::nn::Module& root);

}  // namespace megatorch::tp
