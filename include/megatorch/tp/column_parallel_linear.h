#pragma once
// Y = X A^T + b with A split by rows (output features) across the TP group:
// weight shard [out/tp, in], bias shard [out/tp]. Megatron's ColumnParallelLinear.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/fp8/recipe.h"
#include "megatorch/tp/fp8_layer.h"
#include "megatorch/tp/init.h"
#include "megatorch/tp/parameter_layout.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::tp {

// input [s, b, in] (or [s/tp, b, in] with sequence_parallel) -> [s, b, out/tp], or
// [s, b, out] with gather_output. Forward: f (or the SP all-gather), the local matmul
// (through FP8 GEMMs when `fp8` is given: fp8/linear.h).
at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                  const std::string& group, bool gather_output = false, bool sequence_parallel = false,
                                  const c10::intrusive_ptr<fp8::LinearScaling>& fp8 = {});

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(bool, gather_output) = false;
  TORCH_ARG(bool, sequence_parallel) = false;
  // Leave the bias out of forward so that a fused kernel can add it (read `bias`).
  TORCH_ARG(bool, skip_bias_add) = false;
  // TP group name; "" runs without tensor parallelism.
  TORCH_ARG(std::string, group) = "";
  // Fused weights made of equal blocks along the output dim (SwiGLU's [gate; up]: 2).
  TORCH_ARG(int64_t, parts) = 1;
  TORCH_ARG(ParamInitOptions, init) = {};
  // FP8 GEMMs (fp8/recipe.h); the default format kNone keeps them in the params' dtype.
  TORCH_ARG(fp8::Fp8Options, fp8) = {};
  // A group the tokens are split over besides TP (context parallel): FP8 amaxes of the
  // input and the output gradient are reduced over it too.
  TORCH_ARG(std::string, fp8_sequence_group) = "";
};

class ColumnParallelLinearImpl : public torch::nn::Cloneable<ColumnParallelLinearImpl>,
                                 public ShardedModule,
                                 public Fp8Layer {
 public:
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features)
      : ColumnParallelLinearImpl(ColumnParallelLinearOptions(in_features, out_features)) {}
  explicit ColumnParallelLinearImpl(ColumnParallelLinearOptions options);

  void reset() override;
  void reset_parameters();
  void set_fp8(const fp8::Fp8Options& options) override;
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& input);
  // weight and bias split along dim 0 (output features), block by block over `parts`.
  std::map<std::string, ParameterLayout> parameter_layouts() const override;

  ColumnParallelLinearOptions options;
  at::Tensor weight;  // [out/tp, in]
  at::Tensor bias;    // [out/tp] or undefined
  TPInfo tp;
};
TORCH_MODULE(ColumnParallelLinear);

}  // namespace megatorch::tp
