#include "megatorch/moe/grouped_experts.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "megatorch/check.h"
#include "megatorch/kernels/grouped_gemm.h"
#include "megatorch/kernels/swiglu.h"
#include "megatorch/transformer/mlp.h"

namespace megatorch::moe {

using transformer::Activation;

GroupedExpertsImpl::GroupedExpertsImpl(GroupedExpertsOptions options_) : options(std::move(options_)) { reset(); }

std::map<std::string, std::vector<int64_t>> GroupedExpertsImpl::full_shapes() const {
  const auto& c = options.config();
  const int64_t e = c.num_experts(), h = c.hidden_size(), f = c.moe_ffn();
  const int64_t f1 = f * (c.activation() == Activation::kSwiGLU ? 2 : 1);
  std::map<std::string, std::vector<int64_t>> out{{"fc1_weight", {e, h, f1}}, {"fc2_weight", {e, f, h}}};
  if (c.add_bias_linear()) {
    out["fc1_bias"] = {e, f1};
    out["fc2_bias"] = {e, h};
  }
  return out;
}

void GroupedExpertsImpl::reset() {
  const auto& c = options.config();
  ep = tp::tp_info(options.ep_group());
  MEGATORCH_CHECK(c.num_experts() >= 1 && c.num_experts() % ep.size == 0, "GroupedExperts '", options.name(),
                  "': expected --num-experts (", c.num_experts(), ") to be a positive multiple of the expert-parallel ",
                  "size (", ep.size, ")");
  const auto init = transformer::param_init(c, options.name());
  const auto t = at::TensorOptions().dtype(init.dtype()).device(init.device());
  torch::NoGradGuard no_grad;
  for (const auto& [name, full] : full_shapes()) {
    const tp::ShardSpec spec{full, 0, ep.rank, ep.size, 1};
    const bool is_bias = name.find("bias") != std::string::npos;
    at::Tensor p = register_parameter(name, at::empty(tp::shard_shape(spec), t));
    if (is_bias) {
      p.zero_();
    } else {
      // Named per projection, as the dense MLP's fc1/fc2 are.
      const std::string key = options.name() + (name == "fc1_weight" ? ".fc1.weight" : ".fc2.weight");
      p.copy_(tp::init_shard(spec, key, init.seed(), tp::InitMethod::kNormal, init.std(), init.shard_local()));
    }
    if (name == "fc1_weight") fc1_weight = p;
    if (name == "fc2_weight") fc2_weight = p;
    if (name == "fc1_bias") fc1_bias = p;
    if (name == "fc2_bias") fc2_bias = p;
  }
}

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& rows, const std::vector<int64_t>& counts) {
  const auto& c = options.config();
  const bool grouped = c.moe_grouped_gemm();
  // Each row's local expert, for the biases.
  at::Tensor expert_of_row;
  if (fc1_bias.defined()) {
    expert_of_row = at::repeat_interleave(at::arange(num_local_experts(), rows.options().dtype(at::kLong)),
                                          at::tensor(counts, at::kLong).to(rows.device()), c10::nullopt,
                                          rows.size(0));
  }
  at::Tensor h = kernels::grouped_gemm(rows, fc1_weight, counts, grouped);
  if (fc1_bias.defined()) h = h + fc1_bias.index_select(0, expert_of_row);
  if (c.activation() == Activation::kSwiGLU) {
    h = c.fused_kernels() ? kernels::swiglu(h) : transformer::swiglu(h);
  } else {
    h = at::gelu(h, "tanh");
  }
  at::Tensor out = kernels::grouped_gemm(h, fc2_weight, counts, grouped);
  if (fc2_bias.defined()) out = out + fc2_bias.index_select(0, expert_of_row);
  return out;
}

std::map<std::string, tp::ParameterLayout> GroupedExpertsImpl::parameter_layouts() const {
  std::map<std::string, tp::ParameterLayout> out;
  for (const auto& [name, full] : full_shapes()) out[name].spec = tp::ShardSpec{full, 0, ep.rank, ep.size, 1};
  return out;
}

}  // namespace megatorch::moe
