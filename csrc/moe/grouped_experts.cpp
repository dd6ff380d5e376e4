#include "megatorch/moe/grouped_experts.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/comm/mappings.h"
#include "megatorch/kernels/grouped_gemm.h"
#include "megatorch/kernels/swiglu.h"
#include "megatorch/moe/token_dispatcher.h"
#include "megatorch/transformer/mlp.h"

namespace megatorch::moe {

using transformer::Activation;

GroupedExpertsImpl::GroupedExpertsImpl(GroupedExpertsOptions options_) : options(std::move(options_)) { reset(); }

namespace {

const char* const kNames[] = {"fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"};

}  // namespace

tp::ShardSpec GroupedExpertsImpl::spec(const std::string& name) const {
  const auto& c = options.config();
  const int64_t e = c.num_experts(), h = c.hidden_size(), f = c.moe_ffn();
  const bool swiglu = c.activation() == Activation::kSwiGLU;
  const int64_t f1 = f * (swiglu ? 2 : 1), parts = swiglu ? 2 : 1;
  // Experts over EP on dim 0 (outer split); each expert's F over ETP like a TP MLP: fc1
  // by columns ([gate | up] block by block), fc2 by rows; fc2's bias whole.
  tp::ShardSpec s;
  if (name == "fc1_weight") s = {{e, h, f1}, 2, etp.rank, etp.size, parts};
  if (name == "fc2_weight") s = {{e, f, h}, 1, etp.rank, etp.size, 1};
  if (name == "fc1_bias") s = {{e, f1}, 1, etp.rank, etp.size, parts};
  if (name == "fc2_bias") s = {{e, h}, -1, 0, 1, 1};
  s.outer_rank = ep.rank;
  s.outer_world = ep.size;
  return s;
}

void GroupedExpertsImpl::reset() {
  const auto& c = options.config();
  ep = tp::tp_info(options.ep_group());
  etp = tp::tp_info(options.etp_group());
  MEGATORCH_CHECK(c.num_experts() >= 1 && c.num_experts() % ep.size == 0, "GroupedExperts '", options.name(),
                  "': expected --num-experts (", c.num_experts(), ") to be a positive multiple of the expert-parallel ",
                  "size (", ep.size, ")");
  MEGATORCH_CHECK(c.moe_ffn() % etp.size == 0, "GroupedExperts '", options.name(), "': expected the experts' FFN ",
                  "size (", c.moe_ffn(), ") to be divisible by the expert-tensor-parallel size (", etp.size,
                  "); choose --moe-ffn-hidden-size or --expert-tensor-parallel-size so that it is");
  const auto init = transformer::param_init(c, options.name());
  const auto t = at::TensorOptions().dtype(init.dtype()).device(init.device());
  torch::NoGradGuard no_grad;
  for (const std::string name : kNames) {
    const bool is_bias = name.find("bias") != std::string::npos;
    if (is_bias && !c.mlp_bias()) continue;
    const tp::ShardSpec s = spec(name);
    at::Tensor p = register_parameter(name, at::empty(tp::shard_shape(s), t));
    if (is_bias) {
      p.zero_();
    } else {
      // Named per projection, as the dense MLP's fc1/fc2 are.
      const std::string key = options.name() + (name == "fc1_weight" ? ".fc1.weight" : ".fc2.weight");
      p.copy_(tp::init_shard(s, key, init.seed(), tp::InitMethod::kNormal, init.std(), init.shard_local()));
    }
    if (name == "fc1_weight") fc1_weight = p;
    if (name == "fc2_weight") fc2_weight = p;
    if (name == "fc1_bias") fc1_bias = p;
    if (name == "fc2_bias") fc2_bias = p;
  }
}

namespace {

// Each row's local expert (for the biases).
at::Tensor expert_of_rows(const std::vector<int64_t>& counts, int64_t rows, const c10::Device& device) {
  const auto t = at::TensorOptions().dtype(at::kLong).device(device);
  return at::repeat_interleave(at::arange(static_cast<int64_t>(counts.size()), t), at::tensor(counts, at::kLong).to(device),
                               c10::nullopt, rows);
}

}  // namespace

at::Tensor GroupedExpertsImpl::compute(const at::Tensor& rows, const std::vector<int64_t>& counts,
                                       const at::Tensor& row_experts) {
  const auto& c = options.config();
  const bool grouped = c.moe_grouped_gemm();
  at::Tensor h = kernels::grouped_gemm(rows, fc1_weight, counts, grouped);
  if (fc1_bias.defined()) h = h + fc1_bias.index_select(0, row_experts);
  if (c.activation() == Activation::kSwiGLU) {
    h = c.fused_kernels() ? kernels::swiglu(h) : transformer::swiglu(h);
  } else {
    h = at::gelu(h, "tanh");
  }
  return kernels::grouped_gemm(h, fc2_weight, counts, grouped);
}

at::Tensor GroupedExpertsImpl::forward(const at::Tensor& rows, const std::vector<int64_t>& counts) {
  const int64_t local = num_local_experts();
  MEGATORCH_CHECK(static_cast<int64_t>(counts.size()) == local, "GroupedExperts '", options.name(), "': expected ",
                  local, " row counts (one per local expert), got ", counts.size());
  at::Tensor out;
  at::Tensor bias = fc2_bias;
  const bool biases = fc1_bias.defined() || fc2_bias.defined();
  // Each own row's expert, for the biases: at ETP 1 fc1's and fc2's rows are the same and
  // share it (one saved index).
  const at::Tensor own_experts = biases ? expert_of_rows(counts, rows.size(0), rows.device()) : at::Tensor();
  if (etp.size == 1) {
    out = compute(rows, counts, own_experts);
  } else {
    // Every ETP rank's rows for these experts, by rank, then by expert for the GEMMs;
    // each rank's columns give a partial output that the reduce-scatter sums per row.
    const std::string& group = options.etp_group();
    const std::vector<int64_t> all =
        host_counts(comm::Group(group).all_gather(at::tensor(counts, at::kLong).to(rows.device()), 0));  // [etp * local]
    std::vector<int64_t> per_rank(etp.size, 0);
    for (int64_t r = 0; r < etp.size; ++r) {
      for (int64_t j = 0; j < local; ++j) per_rank[r] += all[r * local + j];
    }
    const at::Tensor gathered = all_gather_rows(rows, group, per_rank);
    const ExpertRegroup g = regroup_by_expert(all, etp.size, local, rows.device());
    const at::Tensor gathered_experts =
        fc1_bias.defined() ? expert_of_rows(g.counts, gathered.size(0), rows.device()) : at::Tensor();
    const at::Tensor partial =
        compute(gathered.index_select(0, g.order), g.counts, gathered_experts).index_select(0, g.inverse);
    out = reduce_scatter_rows(partial, group, per_rank);
    // Each rank adds the bias to its own rows: its gradient sums over the ETP group.
    if (bias.defined()) bias = comm::copy_to_tp_region(bias, group);
  }
  if (bias.defined()) out = out + bias.index_select(0, own_experts);
  return out;
}

std::map<std::string, tp::ParameterLayout> GroupedExpertsImpl::parameter_layouts() const {
  std::map<std::string, tp::ParameterLayout> out;
  for (const auto& item : named_parameters(/*recurse=*/false)) out[item.key()].spec = spec(item.key());
  return out;
}

}  // namespace megatorch::moe
