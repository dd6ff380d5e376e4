#include "megatorch/tp/column_parallel_linear.h"

#include <ATen/ATen.h>

#include "megatorch/check.h"
#include "megatorch/fp8/linear.h"
#include "megatorch/tp/fused_linear.h"
#include "megatorch/tp/init.h"
#include "megatorch/tp/sequence_parallel_linear.h"

namespace megatorch::tp {

using comm::Mapping;

at::Tensor column_parallel_linear(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                                  const std::string& group, bool gather_output, bool sequence_parallel,
                                  const c10::intrusive_ptr<fp8::LinearScaling>& fp8) {
  MEGATORCH_CHECK(input.size(-1) == weight.size(1), "column_parallel_linear: expected input features ",
                  weight.size(1), " (weight shard [out/tp, in] = ", weight.sizes(), "), got input ", input.sizes());
  // Sequence parallel: one autograd function that keeps the input shard, not the gathered
  // input, and re-gathers it in backward (sequence_parallel_linear.h). It calls the process
  // group directly, so fake, functional and meta tensors and dispatch modes (torch.compile,
  // opcheck, shape-only passes) take the composition of the gather operator and at::linear,
  // which every tracer follows and which computes the same.
  at::Tensor y;
  if (fp8) {
    // The gathered input is quantised once and kept in FP8 for the weight gradient.
    y = fp8::linear(map_region(sequence_parallel ? Mapping::kGatherFromSP : Mapping::kCopyToTP, input, group), weight,
                    bias, fp8);
  } else if (sequence_parallel && !group.empty() && !is_traced(input, weight, bias)) {
    y = sequence_parallel_column_linear(input, weight, bias, group);
  } else {
    const at::Tensor x = map_region(sequence_parallel ? Mapping::kGatherFromSP : Mapping::kCopyToTP, input, group);
    y = tp::linear(x, weight, bias);
  }
  return gather_output ? map_region(Mapping::kGatherFromTP, y, group) : y;
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(ColumnParallelLinearOptions options_)
    : options(std::move(options_)) {
  reset();
}

void ColumnParallelLinearImpl::reset() {
  tp = tp_info(options.group());
  MEGATORCH_CHECK(options.out_features() % (tp.size * options.parts()) == 0, "ColumnParallelLinear '",
                  options.init().name(), "': expected out_features ", options.out_features(),
                  " to be divisible by the tensor-parallel size x parts = ", tp.size, " x ", options.parts());
  MEGATORCH_CHECK(!(options.gather_output() && options.sequence_parallel()),
                  "ColumnParallelLinear: gather_output and sequence_parallel cannot both be set; the output of a "
                  "sequence-parallel column layer stays split along the hidden dim");
  const auto& o = options;
  const auto t = at::TensorOptions().dtype(o.init().dtype()).device(o.init().device());
  weight = register_parameter("weight", at::empty({o.out_features() / tp.size, o.in_features()}, t));
  if (o.bias()) bias = register_parameter("bias", at::empty({o.out_features() / tp.size}, t));
  reset_parameters();
  set_fp8(o.fp8());
}

void ColumnParallelLinearImpl::set_fp8(const fp8::Fp8Options& fp8) {
  options.fp8(fp8);
  // The input is whole on every TP rank (gathered first under SP); the output gradient is
  // split along its features over TP.
  const std::string& seq = options.fp8_sequence_group();
  build_fp8_scaling(options.init().name(), fp8, weight, options.group(), {seq}, {options.group(), seq});
}

void ColumnParallelLinearImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const auto& o = options;
  ShardSpec spec{{o.out_features(), o.in_features()}, 0, tp.rank, tp.size, o.parts()};
  weight.copy_(init_shard(spec, o.init().name() + ".weight", o.init().seed(), InitMethod::kNormal, o.init().std(),
                          o.init().shard_local()));
  if (bias.defined()) bias.zero_();
}

std::map<std::string, ParameterLayout> ColumnParallelLinearImpl::parameter_layouts() const {
  const auto& o = options;
  std::map<std::string, ParameterLayout> out;
  out["weight"].spec = ShardSpec{{o.out_features(), o.in_features()}, 0, tp.rank, tp.size, o.parts()};
  if (bias.defined()) out["bias"].spec = ShardSpec{{o.out_features()}, 0, tp.rank, tp.size, o.parts()};
  return out;
}

void ColumnParallelLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "megatorch::tp::ColumnParallelLinear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", tp=" << tp.size << ", bias=" << options.bias()
         << ", gather_output=" << options.gather_output() << ", sequence_parallel=" << options.sequence_parallel()
         << (fp8_scaling ? ", fp8=" + fp8::describe(options.fp8()) : std::string()) << ")";
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& input) {
  const bool add_bias = bias.defined() && !options.skip_bias_add();
  return column_parallel_linear(input, weight, add_bias ? c10::optional<at::Tensor>(bias) : c10::nullopt,
                                options.group(), options.gather_output(), options.sequence_parallel(), fp8_scaling);
}

}  // namespace megatorch::tp
