// train::module_parameters: units and optimizer flags for any module tree, from the
// parallel layers' own layouts (tp::parameter_layouts).
#include <map>
#include <string>

#include "megatorch/check.h"
#include "megatorch/tp/parameter_layout.h"
#include "megatorch/tp/tp_group.h"
#include "megatorch/train/model_parameters.h"
#include "megatorch/util/module_tree.h"

namespace megatorch::train {

namespace {

// The element of `elements` that `name` (a module's or a parameter's dotted name) lies in,
// found by its dotted prefixes (elements never nest); -1: none.
int64_t element_of(const std::string& name, const std::map<std::string, int64_t>& elements) {
  std::string::size_type end = name.size();
  while (true) {
    const auto it = elements.find(name.substr(0, end));
    if (it != elements.end()) return it->second;
    if (end == 0) return -1;
    end = name.rfind('.', end - 1);
    if (end == std::string::npos) return -1;
  }
}

// The elements of every top-level ModuleList of `root` (util::top_level_module_lists), by
// dotted name ("layers.3") -> their order: lists in registration order, each list's
// elements in its own. A root that is itself a ModuleList is the one top-level list.
std::map<std::string, int64_t> unit_elements(const torch::nn::Module& root) {
  std::map<std::string, int64_t> elements;
  const auto add_list = [&elements](const std::string& path, const torch::nn::ModuleListImpl& list) {
    for (const auto& child : list.named_children()) {
      const int64_t next = static_cast<int64_t>(elements.size());
      elements.emplace(path.empty() ? child.key() : path + "." + child.key(), next);
    }
  };
  for (const auto& [path, list] : util::top_level_module_lists(root)) add_list(path, *list);
  return elements;
}

}  // namespace

ModelParameters module_parameters(const std::vector<std::shared_ptr<torch::nn::Module>>& chunks,
                                  const ParameterGroupingOptions& options) {
  const tp::TPInfo tp = tp::tp_info(options.tp_group());
  ModelParameters out;
  for (size_t c = 0; c < chunks.size(); ++c) {
    MEGATORCH_CHECK(chunks[c] != nullptr, "module_parameters: expected a module for every chunk, got a null chunk ",
                    c, " of ", chunks.size(), "; pass this rank's model chunks (one, or v when interleaved)");
    const torch::nn::Module& chunk = *chunks[c];
    const auto elements = unit_elements(chunk);
    const auto layouts = tp::parameter_layouts(chunk, options.sequence_parallel());
    const auto params = chunk.named_parameters();  // the same names, in the same order
    struct Param {
      std::string name;
      at::Tensor tensor;
      optim::ParamInfo info;
    };
    std::vector<std::vector<Param>> units(1 + elements.size());
    for (size_t i = 0; i < layouts.size(); ++i) {
      const auto& [name, layout] = layouts[i];
      const at::Tensor& p = params[name];
      optim::ParamInfo info;
      const bool replicated = layout.spec.partition_dim < 0;
      // Every TP rank holds the same copy: counted once in the global norm.
      info.counted_in_norm = !(replicated && tp.rank != 0);
      info.weight_decay = p.dim() > 1;
      if (layout.partial_grad && tp.size > 1) info.grad_sum_group = options.tp_group();
      if (options.adjust()) options.adjust()(name, p, info);
      units[1 + element_of(name, elements)].push_back({name, p, std::move(info)});
    }
    const int64_t first = static_cast<int64_t>(out.units.size());
    for (auto& unit : units) {
      std::vector<at::Tensor> tensors;
      for (auto& p : unit) {
        tensors.push_back(p.tensor);
        out.info.push_back(std::move(p.info));
        out.names.push_back(std::move(p.name));
      }
      out.units.push_back(std::move(tensors));
    }
    out.chunk_units.emplace_back(first, static_cast<int64_t>(out.units.size()) - 1);
  }
  return out;
}

}  // namespace megatorch::train
