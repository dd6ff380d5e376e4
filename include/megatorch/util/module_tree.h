#pragma once
// The top-level ModuleLists of a module tree: those not inside another ModuleList's
// element (a root that is itself a ModuleList is the one, at path ""). Their elements are a model's repeated blocks: ZeRO-3's units
// (train::module_parameters) and the layer index a checkpoint renumbers across pipeline
// stages (pipeline::ModuleStageImpl::global_name).
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <string>
#include <utility>
#include <vector>

namespace megatorch::util {

// (dotted path, list) in registration order.
inline std::vector<std::pair<std::string, std::shared_ptr<torch::nn::ModuleListImpl>>> top_level_module_lists(
    const torch::nn::Module& root) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::ModuleListImpl>>> out;
  if (dynamic_cast<const torch::nn::ModuleListImpl*>(&root) != nullptr) {
    auto self = std::const_pointer_cast<torch::nn::Module>(root.shared_from_this());
    out.emplace_back("", std::static_pointer_cast<torch::nn::ModuleListImpl>(self));
    return out;
  }
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    auto list = std::dynamic_pointer_cast<torch::nn::ModuleListImpl>(item.value());
    if (!list) continue;
    bool nested = false;
    for (const auto& [path, outer] : out) nested |= item.key().rfind(path + ".", 0) == 0;
    if (!nested) out.emplace_back(item.key(), list);
  }
  return out;
}

// The element index and the rest of `name` when it lies inside element `index` of the
// list at `path` ("layers.3.mlp.fc1.weight" under "layers": {3, "mlp.fc1.weight"}; under
// the root list "": "3.mlp.fc1.weight");
// index -1 when it does not.
inline std::pair<int64_t, std::string> list_element_of(const std::string& name, const std::string& path) {
  const std::string head = path.empty() ? "" : path + ".";
  if (name.rfind(head, 0) != 0) return {-1, ""};
  const size_t dot = name.find('.', head.size());
  if (dot == std::string::npos) return {-1, ""};
  const std::string index = name.substr(head.size(), dot - head.size());
  if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) return {-1, ""};
  return {std::stoll(index), name.substr(dot + 1)};
}

}  // namespace megatorch::util
