#include "megatorch/tp/row_parallel_linear.h"

#include <ATen/ATen.h>

#include "megatorch/check.h"
#include "megatorch/fp8/linear.h"
#include "megatorch/tp/fused_linear.h"
#include "megatorch/tp/init.h"

namespace megatorch::tp {

using comm::Mapping;

at::Tensor row_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               const std::string& group, bool input_is_parallel, bool sequence_parallel,
                               const c10::intrusive_ptr<fp8::LinearScaling>& fp8) {
  MEGATORCH_CHECK(input_is_parallel || !sequence_parallel,
                  "row_parallel_linear: sequence_parallel needs input_is_parallel (the input of a sequence-parallel "
                  "row layer is the hidden-split output of a column layer)");
  const at::Tensor x = input_is_parallel ? input : map_region(Mapping::kScatterToTP, input, group);
  MEGATORCH_CHECK(x.size(-1) == weight.size(1), "row_parallel_linear: expected input features ", weight.size(1),
                  " per rank (weight shard [out, in/tp] = ", weight.sizes(), "), got input ", x.sizes());
  at::Tensor y = fp8 ? fp8::linear(x, weight, c10::nullopt, fp8) : tp::linear(x, weight, c10::nullopt);
  // The GEMM's output is read by nothing else: g sums it in place, without a copy.
  if (sequence_parallel) {
    y = map_region(Mapping::kReduceScatterToSP, y, group);
  } else if (!group.empty()) {
    y = is_traced(x, weight, bias) ? map_region(Mapping::kReduceFromTP, y, group) : comm::reduce_from_tp_region_(y, group);
  }
  return bias.has_value() && bias->defined() ? y + *bias : y;
}

RowParallelLinearImpl::RowParallelLinearImpl(RowParallelLinearOptions options_) : options(std::move(options_)) {
  reset();
}

void RowParallelLinearImpl::reset() {
  tp = tp_info(options.group());
  MEGATORCH_CHECK(options.in_features() % tp.size == 0, "RowParallelLinear '", options.init().name(),
                  "': expected in_features ", options.in_features(), " to be divisible by the tensor-parallel size ",
                  tp.size);
  const auto& o = options;
  const auto t = at::TensorOptions().dtype(o.init().dtype()).device(o.init().device());
  weight = register_parameter("weight", at::empty({o.out_features(), o.in_features() / tp.size}, t));
  if (o.bias()) bias = register_parameter("bias", at::empty({o.out_features()}, t));
  reset_parameters();
  set_fp8(o.fp8());
}

void RowParallelLinearImpl::set_fp8(const fp8::Fp8Options& fp8) {
  options.fp8(fp8);
  // The input is split along its features over TP; the output gradient is whole on every
  // TP rank (all-gathered first under SP).
  const std::string& seq = options.fp8_sequence_group();
  build_fp8_scaling(options.init().name(), fp8, weight, options.group(), {options.group(), seq}, {seq});
}

void RowParallelLinearImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const auto& o = options;
  ShardSpec spec{{o.out_features(), o.in_features()}, 1, tp.rank, tp.size, 1};
  weight.copy_(init_shard(spec, o.init().name() + ".weight", o.init().seed(), InitMethod::kNormal, o.init().std(),
                          o.init().shard_local()));
  if (bias.defined()) bias.zero_();
}

std::map<std::string, ParameterLayout> RowParallelLinearImpl::parameter_layouts() const {
  const auto& o = options;
  std::map<std::string, ParameterLayout> out;
  out["weight"].spec = ShardSpec{{o.out_features(), o.in_features()}, 1, tp.rank, tp.size, 1};
  if (bias.defined()) out["bias"] = replicated_layout(bias, o.sequence_parallel());
  return out;
}

void RowParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "megatorch::tp::RowParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", tp=" << tp.size << ", bias=" << options.bias()
         << ", input_is_parallel=" << options.input_is_parallel()
         << ", sequence_parallel=" << options.sequence_parallel()
         << (fp8_scaling ? ", fp8=" + fp8::describe(options.fp8()) : std::string()) << ")";
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& input) {
  const bool add_bias = bias.defined() && !options.skip_bias_add();
  return row_parallel_linear(input, weight, add_bias ? c10::optional<at::Tensor>(bias) : c10::nullopt,
                             options.group(), options.input_is_parallel(), options.sequence_parallel(), fp8_scaling);
}

at::Tensor RowParallelLinearImpl::forward_without_bias(const at::Tensor& input) {
  return row_parallel_linear(input, weight, c10::nullopt, options.group(), options.input_is_parallel(),
                             options.sequence_parallel(), fp8_scaling);
}

}  // namespace megatorch::tp
