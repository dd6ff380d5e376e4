#pragma once
// LayerNorm or RMSNorm over the last dim, statistics in fp32 whatever the input dtype.
// Replicated across TP; under sequence parallelism each rank normalises its own
// sequence shard, so its gradients are partial and are summed over the TP group
// (GPTModel::allreduce_sequence_parallel_grads).
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/transformer/config.h"

namespace megatorch::transformer {

// The unfused RMSNorm (ATen ops, fp32 statistics): the reference of kernels::rms_norm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

struct NormOptions {
  explicit NormOptions(int64_t hidden) : hidden_(hidden) {}
  TORCH_ARG(int64_t, hidden);
  TORCH_ARG(Normalization, kind) = Normalization::kLayerNorm;
  TORCH_ARG(double, eps) = 1e-5;
  TORCH_ARG(bool, bias) = true;  // LayerNorm's beta (RMSNorm has none)
  TORCH_ARG(c10::ScalarType, dtype) = c10::kFloat;
  TORCH_ARG(c10::Device, device) = c10::kCPU;
  // kernels::layer_norm / rms_norm (one pass per row); off: at::layer_norm / rms_norm above.
  TORCH_ARG(bool, fused) = true;
};

class NormImpl : public torch::nn::Cloneable<NormImpl> {
 public:
  explicit NormImpl(NormOptions options);
  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& x);

  NormOptions options;
  at::Tensor weight;
  at::Tensor bias;  // undefined for RMSNorm or without bias
};
TORCH_MODULE(Norm);

// The norm `config` describes (kind, epsilon, LayerNorm's beta with the linear biases,
// dtype, device, fused kernels): each layer's two norms and the final one.
Norm make_norm(const TransformerConfig& config);

}  // namespace megatorch::transformer
