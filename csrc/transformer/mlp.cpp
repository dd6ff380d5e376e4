#include "megatorch/transformer/mlp.h"

#include <ATen/ATen.h>

#include "megatorch/kernels/bias_gelu.h"
#include "megatorch/kernels/swiglu.h"

namespace megatorch::transformer {

at::Tensor swiglu(const at::Tensor& x) {
  const auto halves = x.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

ParallelMLPImpl::ParallelMLPImpl(ParallelMLPOptions options_) : options(std::move(options_)) { reset(); }

void ParallelMLPImpl::reset() {
  const auto& c = options.config();
  const bool glu = c.activation() == Activation::kSwiGLU;
  // Fused GeLU takes fc1's bias into its kernel; SwiGLU's bias stays in the linear.
  const bool fused_bias = c.fused_kernels() && !glu && c.mlp_bias();
  // SwiGLU's fused [gate; up] weight is sharded block by block (parts = 2), so each
  // rank's shard is [its gate rows; its up rows] and the local chunk(2) pairs them.
  fc1 = register_module("fc1", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.hidden_size(),
                                                                                         c.ffn() * (glu ? 2 : 1))
                                                            .bias(c.mlp_bias())
                                                            .skip_bias_add(fused_bias)
                                                            .sequence_parallel(c.sequence_parallel())
                                                            .parts(glu ? 2 : 1)
                                                            .group(options.group())
                                                            .fp8(c.fp8())
                                                            .fp8_sequence_group(c.context_parallel_group())
                                                            .init(param_init(c, options.name() + ".fc1"))));
  fc2 = register_module("fc2", tp::RowParallelLinear(tp::RowParallelLinearOptions(c.ffn(), c.hidden_size())
                                                         .bias(c.mlp_bias())
                                                         .input_is_parallel(true)
                                                         .sequence_parallel(c.sequence_parallel())
                                                         .group(options.group())
                                                         .fp8(c.fp8())
                                                         .fp8_sequence_group(c.context_parallel_group())
                                                         .init(param_init(c, options.name() + ".fc2"))));
}

at::Tensor ParallelMLPImpl::activation(const at::Tensor& x) {
  const auto& c = options.config();
  const at::Tensor h = fc1->forward(x);
  if (c.activation() == Activation::kSwiGLU) return c.fused_kernels() ? kernels::swiglu(h) : swiglu(h);
  if (fc1->options.skip_bias_add()) return kernels::bias_gelu(h, fc1->bias);
  return at::gelu(h, "tanh");  // no bias to fuse: ATen's GeLU is one kernel already
}

at::Tensor ParallelMLPImpl::forward(const at::Tensor& x) { return fc2->forward(activation(x)); }

at::Tensor ParallelMLPImpl::forward_without_bias(const at::Tensor& x) {
  return fc2->forward_without_bias(activation(x));
}

}  // namespace megatorch::transformer
