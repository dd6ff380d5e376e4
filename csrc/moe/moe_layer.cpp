#include "megatorch/moe/moe_layer.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "megatorch/check.h"
#include "megatorch/moe/token_dispatcher.h"
#include "megatorch/transformer/recompute.h"

namespace megatorch::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Identity on the layer output whose backward also hands the auxiliary loss the gradient
// the main loss's backward gives the main loss (Megatron's MoEAuxLossAutoScaler).
class AttachAuxLoss : public torch::autograd::Function<AttachAuxLoss> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& output, const at::Tensor& loss, double scale) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["loss"] = loss.detach();  // for its dtype and device only
    return output;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor loss = ctx->saved_data["loss"].toTensor();
    return {grads[0], at::full({}, ctx->saved_data["scale"].toDouble(), loss.options()), at::Tensor()};
  }
};

}  // namespace

MoELayerImpl::MoELayerImpl(MoELayerOptions options_) : options(std::move(options_)) { reset(); }

void MoELayerImpl::reset() {
  const auto& c = options.config();
  MEGATORCH_CHECK(c.num_experts() >= 1, "MoELayer '", options.name(), "': expected --num-experts >= 1, got ",
                  c.num_experts());
  router = register_module("router", TopKRouter(TopKRouterOptions(c).group(options.group()).name(options.name() + ".router")));
  experts = register_module("experts", GroupedExperts(GroupedExpertsOptions(c)
                                                          .ep_group(c.expert_parallel_group())
                                                          .etp_group(c.expert_tensor_parallel_group())
                                                          .name(options.name() + ".experts")));
  if (c.moe_shared_expert_intermediate_size() > 0) {
    auto shared = c;
    shared.ffn_hidden_size(c.moe_shared_expert_intermediate_size());
    shared_expert = register_module(
        "shared_expert", transformer::ParallelMLP(transformer::ParallelMLPOptions(shared)
                                                      .group(options.group())
                                                      .name(options.name() + ".shared_expert")));
  }
  reset_stats();
}

void MoELayerImpl::reset_stats() {
  const auto opts = at::TensorOptions().device(router->weight.device());
  stats_.aux_loss = at::zeros({}, opts.dtype(at::kFloat));
  stats_.z_loss = at::zeros({}, opts.dtype(at::kFloat));
  stats_.routed = at::zeros({options.config().num_experts()}, opts.dtype(at::kLong));
  stats_.dropped = at::zeros({}, opts.dtype(at::kLong));
  stats_.forwards = 0;
}

void MoELayerImpl::record(const Routing& r) {
  // A recomputed layer replays its forward in backward: count the first run only.
  if (transformer::recompute_replaying()) return;
  if (r.aux_loss.defined()) stats_.aux_loss += r.aux_loss.detach();
  if (r.z_loss.defined()) stats_.z_loss += r.z_loss.detach();
  stats_.routed += r.routed;
  stats_.dropped += r.dropped;
  stats_.forwards += 1;
}

at::Tensor MoELayerImpl::forward(const at::Tensor& x) {
  const auto& c = options.config();
  const at::Tensor tokens = x.reshape({-1, x.size(-1)});
  const Routing routing = router->forward(tokens);
  if (is_training()) record(routing);
  const ExpertFn run_experts = [this](const at::Tensor& rows, const std::vector<int64_t>& counts) {
    return experts->forward(rows, counts);
  };
  at::Tensor out = dispatch_and_combine(tokens, routing, run_experts,
                                        DispatchOptions()
                                            .type(c.moe_token_dispatcher_type())
                                            .ep_group(c.expert_parallel_group())
                                            .num_experts(c.num_experts()))
                       .view(x.sizes());
  if (shared_expert) out = out + shared_expert->forward(x);
  at::Tensor loss = routing.aux_loss;
  if (routing.z_loss.defined()) loss = loss.defined() ? loss + routing.z_loss : routing.z_loss;
  if (loss.defined() && loss.requires_grad()) out = AttachAuxLoss::apply(out, loss, aux_loss_backward_scale_);
  return out;
}

std::vector<at::Tensor> MoELayerImpl::sequence_parallel_parameters() const {
  // The router sees only this rank's tokens. The shared expert is a TP MLP: only its
  // row-parallel bias is replicated.
  std::vector<at::Tensor> out{router->weight};
  if (shared_expert && shared_expert->fc2->bias.defined()) out.push_back(shared_expert->fc2->bias);
  return out;
}

std::vector<MoELayerImpl*> moe_layers(torch::nn::Module& root) {
  std::vector<MoELayerImpl*> out;
  if (auto* self = dynamic_cast<MoELayerImpl*>(&root)) out.push_back(self);
  for (const auto& m : root.modules(/*include_self=*/false)) {
    if (auto* layer = dynamic_cast<MoELayerImpl*>(m.get())) out.push_back(layer);
  }
  return out;
}

void set_aux_loss_backward_scale(torch::nn::Module& root, double scale) {
  for (auto* layer : moe_layers(root)) layer->set_aux_loss_backward_scale(scale);
}

bool is_expert_parameter(torch::nn::Module& root, const at::Tensor& param) {
  for (auto* layer : moe_layers(root)) {
    for (const auto& p : layer->experts->parameters()) {
      if (p.is_same(param)) return true;
    }
  }
  return false;
}

}  // namespace megatorch::moe
