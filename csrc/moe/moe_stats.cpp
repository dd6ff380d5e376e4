#include "megatorch/moe/moe_stats.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "megatorch/comm/group.h"
#include "megatorch/moe/moe_layer.h"

namespace megatorch::moe {

int64_t MoELayerReport::min_load() const {
  return tokens_per_expert.empty() ? 0 : *std::min_element(tokens_per_expert.begin(), tokens_per_expert.end());
}
int64_t MoELayerReport::max_load() const {
  return tokens_per_expert.empty() ? 0 : *std::max_element(tokens_per_expert.begin(), tokens_per_expert.end());
}
double MoELayerReport::mean_load() const {
  if (tokens_per_expert.empty()) return 0;
  return static_cast<double>(std::accumulate(tokens_per_expert.begin(), tokens_per_expert.end(), int64_t{0})) /
         static_cast<double>(tokens_per_expert.size());
}

double MoEStepReport::aux_loss() const {
  double s = 0;
  for (const auto& l : layers) s += l.aux_loss;
  return layers.empty() ? 0 : s / static_cast<double>(layers.size());
}
double MoEStepReport::z_loss() const {
  double s = 0;
  for (const auto& l : layers) s += l.z_loss;
  return layers.empty() ? 0 : s / static_cast<double>(layers.size());
}
int64_t MoEStepReport::dropped() const {
  int64_t s = 0;
  for (const auto& l : layers) s += l.dropped;
  return s;
}

std::string MoEStepReport::line() const {
  if (layers.empty()) return "";
  int64_t lo = layers[0].min_load(), hi = layers[0].max_load();
  double mean = 0;
  for (const auto& l : layers) {
    lo = std::min(lo, l.min_load());
    hi = std::max(hi, l.max_load());
    mean += l.mean_load();
  }
  mean /= static_cast<double>(layers.size());
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                " | load balancing loss: %.6E | z loss: %.6E | tokens per expert min/max/mean: %ld/%ld/%.1f | "
                "dropped: %ld",
                aux_loss(), z_loss(), lo, hi, mean, dropped());
  return buf;
}

nlohmann::json MoEStepReport::to_json() const {
  nlohmann::json per_layer = nlohmann::json::array();
  for (const auto& l : layers) {
    per_layer.push_back({{"layer", l.layer},
                         {"aux_loss", l.aux_loss},
                         {"z_loss", l.z_loss},
                         {"tokens_per_expert_min", l.min_load()},
                         {"tokens_per_expert_max", l.max_load()},
                         {"tokens_per_expert_mean", l.mean_load()},
                         {"dropped", l.dropped}});
  }
  return {{"aux_loss", aux_loss()}, {"z_loss", z_loss()}, {"dropped", dropped()}, {"layers", per_layer}};
}

std::pair<int64_t, int64_t> moe_shape(torch::nn::Module& root, const std::string& world_group) {
  at::Tensor shape = at::zeros({2}, at::kLong);
  for (auto* layer : moe_layers(root)) {
    const auto& c = layer->options.config();
    shape[0] = std::max(shape[0].item<int64_t>(), c.num_layers());
    shape[1] = std::max(shape[1].item<int64_t>(), c.num_experts());
  }
  comm::Group(world_group).all_reduce(shape, comm::ReduceOp::kMax);
  return {shape[0].item<int64_t>(), shape[1].item<int64_t>()};
}

MoEStepReport reduce_step_stats(torch::nn::Module& root, const std::string& world_group,
                                std::pair<int64_t, int64_t> shape, int64_t data_replicas) {
  MoEStepReport report;
  const auto [num_layers, experts] = shape;
  if (num_layers == 0) return report;
  // Per layer: [present, aux, z, dropped, tokens per expert...], in double (exact counts).
  at::Tensor t = at::zeros({num_layers, 4 + experts}, at::kDouble);
  for (auto* layer : moe_layers(root)) {
    const auto& s = layer->stats();
    const int64_t i = layer->options.layer_number();
    const double forwards = static_cast<double>(std::max<int64_t>(1, s.forwards));
    t[i][0] = 1.0;
    t[i][1] = s.aux_loss.item<double>() / forwards;
    t[i][2] = s.z_loss.item<double>() / forwards;
    t[i][3] = s.dropped.item<double>();
    t[i].narrow(0, 4, s.routed.size(0)).copy_(s.routed.to(at::kCPU, at::kDouble));
    layer->reset_stats();
  }
  comm::Group(world_group).all_reduce(t);  // host tensors go over Gloo on every device
  for (int64_t i = 0; i < num_layers; ++i) {
    if (t[i][0].item<double>() == 0) continue;
    MoELayerReport l;
    l.layer = i;
    // Every rank holding the layer counted its micro-batches once: the DP x CP mean.
    l.aux_loss = t[i][1].item<double>() / static_cast<double>(data_replicas);
    l.z_loss = t[i][2].item<double>() / static_cast<double>(data_replicas);
    l.dropped = static_cast<int64_t>(t[i][3].item<double>());
    for (int64_t e = 0; e < experts; ++e) l.tokens_per_expert.push_back(static_cast<int64_t>(t[i][4 + e].item<double>()));
    report.layers.push_back(std::move(l));
  }
  return report;
}

void update_expert_biases(torch::nn::Module& root, const MoEStepReport& report) {
  for (auto* layer : moe_layers(root)) {
    if (!layer->router->expert_bias.defined()) continue;
    for (const auto& l : report.layers) {
      if (l.layer == layer->options.layer_number()) {
        layer->router->update_expert_bias(at::tensor(l.tokens_per_expert, at::kLong));
      }
    }
  }
}

}  // namespace megatorch::moe
