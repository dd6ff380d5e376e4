// ckpt::module_entries: checkpoint entries for any module tree, from the parallel layers'
// own layouts (tp::parameter_layouts).
#include "megatorch/ckpt/module_checkpoint.h"

#include "megatorch/tp/parameter_layout.h"

namespace megatorch::ckpt {

std::vector<ShardedEntry> module_entries(torch::nn::Module& module, const ModuleEntriesOptions& options) {
  const auto params = module.named_parameters();  // the same names, in the same order
  std::vector<ShardedEntry> out;
  for (const auto& [name, layout] : tp::parameter_layouts(module, options.sequence_parallel())) {
    ShardedEntry e;
    e.key = options.prefix() + (options.rename() ? options.rename()(name) : name);
    e.spec = layout.spec;
    e.valid_rows = layout.valid_rows;
    e.tensor = params[name];
    // A TP-replicated parameter is the same on every TP rank: rank 0 writes it.
    e.write = options.writer() && (!options.writes() || options.writes()(name)) &&
              (layout.spec.partition_dim >= 0 || options.tp_rank() == 0);
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace megatorch::ckpt
