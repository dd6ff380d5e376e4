#pragma once
// ParallelMLP: h -> ffn (column-parallel; [gate; up] for SwiGLU) -> activation ->
// h (row-parallel). GeLU uses the tanh approximation. With config.fused_kernels the
// activation is one kernel: bias-GeLU (fc1's bias added inside it) or SwiGLU.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/tp/column_parallel_linear.h"
#include "megatorch/tp/row_parallel_linear.h"
#include "megatorch/transformer/config.h"

namespace megatorch::transformer {

// silu(x1) * x2 for x = [x1, x2] split in halves along the last dim (unfused; the
// reference of kernels::swiglu).
at::Tensor swiglu(const at::Tensor& x);

struct ParallelMLPOptions {
  explicit ParallelMLPOptions(TransformerConfig config) : config_(std::move(config)) {}
  TORCH_ARG(TransformerConfig, config);
  TORCH_ARG(std::string, group) = "";
  TORCH_ARG(std::string, name) = "mlp";
};

class ParallelMLPImpl : public torch::nn::Cloneable<ParallelMLPImpl> {
 public:
  explicit ParallelMLPImpl(ParallelMLPOptions options);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);
  // forward(x) without fc2's bias, which the caller adds (TransformerLayer fuses it into
  // bias-dropout-add): forward(x) = forward_without_bias(x) + fc2->bias.
  at::Tensor forward_without_bias(const at::Tensor& x);

  ParallelMLPOptions options;
  tp::ColumnParallelLinear fc1{nullptr};
  tp::RowParallelLinear fc2{nullptr};

 private:
  at::Tensor activation(const at::Tensor& x);  // fc1 and the activation: [s, b, ffn/tp]
};
TORCH_MODULE(ParallelMLP);

}  // namespace megatorch::transformer
