#include "megatorch/tp/fp8_layer.h"

#include "megatorch/check.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::tp {
namespace {

// The groups that split a tensor across more than one rank (a size-1 group adds nothing).
std::vector<std::string> splitting(std::vector<std::string> groups) {
  std::vector<std::string> out;
  for (auto& g : groups) {
    if (!g.empty() && tp_info(g).size > 1) out.push_back(std::move(g));
  }
  return out;
}

}  // namespace

void Fp8Layer::build_fp8_scaling(const std::string& layer, const fp8::Fp8Options& options, const at::Tensor& weight,
                                 const std::string& tp_group, std::vector<std::string> input_groups,
                                 std::vector<std::string> grad_groups) {
  if (!options.enabled()) {
    fp8_scaling.reset();
    return;
  }
  options.validate("fp8 layer '" + layer + "'");
  fp8::check_linear_shape(layer, weight.size(0), weight.size(1), weight.scalar_type(), weight.device());
  fp8_scaling = c10::make_intrusive<fp8::LinearScaling>(
      options, weight.device(),
      std::array<std::vector<std::string>, fp8::kNumRoles>{splitting(std::move(input_groups)), splitting({tp_group}),
                                                           splitting(std::move(grad_groups))});
}

std::vector<std::pair<std::string, Fp8Layer*>> fp8_layers(torch::nn::Module& root) {
  std::vector<std::pair<std::string, Fp8Layer*>> out;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    if (auto* layer = dynamic_cast<Fp8Layer*>(item.value().get())) out.emplace_back(item.key(), layer);
  }
  return out;
}

int64_t convert_to_fp8(torch::nn::Module& root, const fp8::Fp8Options& options,
                       const std::function<bool(const std::string&)>& keep) {
  int64_t converted = 0;
  for (auto& [name, layer] : fp8_layers(root)) {
    if (layer->fp8_scaling || (keep && keep(name))) continue;
    layer->set_fp8(options);
    ++converted;
  }
  return converted;
}

std::string fp8_recipe_of(torch::nn::Module& root) {
  std::string recipe = "none", first;
  for (auto& [name, layer] : fp8_layers(root)) {
    if (!layer->fp8_scaling) continue;
    const std::string r = fp8::describe(layer->fp8_scaling->options);
    MEGATORCH_CHECK(recipe == "none" || recipe == r, "fp8: expected one recipe for the model's FP8 layers, got ", recipe,
                    " on '", first, "' and ", r, " on '", name, "'; give every layer the same Fp8Options");
    if (recipe == "none") first = name;
    recipe = r;
  }
  return recipe;
}

}  // namespace megatorch::tp
