#pragma once
// ParallelMLP: h -> ffn (column-parallel; [gate; up] for SwiGLU) -> activation ->
// h (row-parallel). GeLU uses the tanh approximation.
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/tp/column_parallel_linear.h"
#include "megatorch/tp/row_parallel_linear.h"
#include "megatorch/transformer/config.h"

namespace megatorch::transformer {

// silu(x1) * x2 for x = [x1, x2] split in halves along the last dim.
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

  ParallelMLPOptions options;
  tp::ColumnParallelLinear fc1{nullptr};
  tp::RowParallelLinear fc2{nullptr};
};
TORCH_MODULE(ParallelMLP);

}  // namespace megatorch::transformer
