#pragma once
// LayerNorm or RMSNorm over the last dim, statistics in fp32 whatever the input dtype.
// Replicated across TP; under sequence parallelism each rank normalises its own
// sequence shard, so its gradients are partial and are summed over the TP group
// (GPTModel::allreduce_sequence_parallel_grads).
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "megatorch/tp/parameter_layout.h"
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
  // Under sequence parallelism its gradient is a partial sum over TP (a norm of this rank's
  // sequence shard). false: complete on every rank whatever the parallelism (QK-norm, whose
  // weight enters through copy_to_tp_region): the optimizer must not sum it again.
  TORCH_ARG(bool, partial_grad_under_sp) = true;
};

class NormImpl : public torch::nn::Cloneable<NormImpl>, public tp::ShardedModule {
 public:
  explicit NormImpl(NormOptions options);
  void reset() override;
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  at::Tensor forward(const at::Tensor& x);
  // forward with other tensors standing for weight and bias (e.g. the weight passed through
  // a TP mapping, as QK-norm does): the same kernel and options.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);
  // Replicated; with partial_grad_under_sp false, described so (else the generic rule).
  std::map<std::string, tp::ParameterLayout> parameter_layouts() const override;

  NormOptions options;
  at::Tensor weight;
  at::Tensor bias;  // undefined for RMSNorm or without bias
};
TORCH_MODULE(Norm);

// The norm `config` describes (kind, epsilon, LayerNorm's beta with the linear biases,
// dtype, device, fused kernels): each layer's two norms and the final one.
Norm make_norm(const TransformerConfig& config);
// The same norm over `size` channels (QK-norm's head_dim).
Norm make_norm(const TransformerConfig& config, int64_t size);

}  // namespace megatorch::transformer
