#include "megatorch/transformer/mlp.h"

#include <ATen/ATen.h>

namespace megatorch::transformer {

at::Tensor swiglu(const at::Tensor& x) {
  const auto halves = x.chunk(2, -1);
  return at::silu(halves[0]) * halves[1];
}

ParallelMLPImpl::ParallelMLPImpl(ParallelMLPOptions options_) : options(std::move(options_)) { reset(); }

void ParallelMLPImpl::reset() {
  const auto& c = options.config();
  const bool glu = c.activation() == Activation::kSwiGLU;
  // SwiGLU's fused [gate; up] weight is sharded block by block (parts = 2), so each
  // rank's shard is [its gate rows; its up rows] and the local chunk(2) pairs them.
  fc1 = register_module("fc1", tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.hidden_size(),
                                                                                         c.ffn() * (glu ? 2 : 1))
                                                            .bias(c.add_bias_linear())
                                                            .sequence_parallel(c.sequence_parallel())
                                                            .parts(glu ? 2 : 1)
                                                            .group(options.group())
                                                            .init(param_init(c, options.name() + ".fc1"))));
  fc2 = register_module("fc2", tp::RowParallelLinear(tp::RowParallelLinearOptions(c.ffn(), c.hidden_size())
                                                         .bias(c.add_bias_linear())
                                                         .input_is_parallel(true)
                                                         .sequence_parallel(c.sequence_parallel())
                                                         .group(options.group())
                                                         .init(param_init(c, options.name() + ".fc2"))));
}

at::Tensor ParallelMLPImpl::forward(const at::Tensor& x) {
  const at::Tensor h = fc1->forward(x);
  const bool glu = options.config().activation() == Activation::kSwiGLU;
  return fc2->forward(glu ? swiglu(h) : at::gelu(h, "tanh"));
}

}  // namespace megatorch::transformer
