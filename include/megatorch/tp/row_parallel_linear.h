#pragma once
// Y = X A^T + b with A split by columns (input features) across the TP group:
// weight shard [out, in/tp]; the bias is replicated and added once, after the reduction.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/fp8/recipe.h"
#include "megatorch/tp/fp8_layer.h"
#include "megatorch/tp/init.h"
#include "megatorch/tp/parameter_layout.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::tp {

// input [s, b, in/tp] (input_is_parallel) or [s, b, in] -> [s, b, out], or
// [s/tp, b, out] with sequence_parallel. Forward: the local matmul, then g (all-reduce)
// or the SP reduce-scatter, then the bias. The matmul through FP8 GEMMs when `fp8` is given.
at::Tensor row_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               const std::string& group, bool input_is_parallel = true, bool sequence_parallel = false,
                               const c10::intrusive_ptr<fp8::LinearScaling>& fp8 = {});

struct RowParallelLinearOptions {
  RowParallelLinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  TORCH_ARG(bool, input_is_parallel) = true;
  TORCH_ARG(bool, sequence_parallel) = false;
  TORCH_ARG(bool, skip_bias_add) = false;
  TORCH_ARG(std::string, group) = "";
  TORCH_ARG(ParamInitOptions, init) = {};
  // FP8 GEMMs (fp8/recipe.h); the default format kNone keeps them in the params' dtype.
  TORCH_ARG(fp8::Fp8Options, fp8) = {};
  // A group the tokens are split over besides TP (context parallel): FP8 amaxes of the
  // input and the output gradient are reduced over it too.
  TORCH_ARG(std::string, fp8_sequence_group) = "";
};

class RowParallelLinearImpl : public torch::nn::Cloneable<RowParallelLinearImpl>,
                              public ShardedModule,
                              public Fp8Layer {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features)
      : RowParallelLinearImpl(RowParallelLinearOptions(in_features, out_features)) {}
  explicit RowParallelLinearImpl(RowParallelLinearOptions options);

  void reset() override;
  void reset_parameters();
  void set_fp8(const fp8::Fp8Options& options) override;
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& input);
  // forward without adding the bias (for a caller that fuses it into what follows).
  at::Tensor forward_without_bias(const at::Tensor& input);
  // weight split along dim 1 (input features); bias replicated, its gradient partial
  // under sequence parallelism (each rank adds it to its own sequence shard).
  std::map<std::string, ParameterLayout> parameter_layouts() const override;

  RowParallelLinearOptions options;
  at::Tensor weight;  // [out, in/tp]
  at::Tensor bias;    // [out], replicated across TP (its grad is reduced under SP)
  TPInfo tp;
};
TORCH_MODULE(RowParallelLinear);

}  // namespace megatorch::tp
