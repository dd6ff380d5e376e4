#include "megatorch/tp/parameter_layout.h"

#include "megatorch/check.h"

namespace megatorch::tp {

ParameterLayout replicated_layout(const at::Tensor& param, bool partial_grad) {
  ParameterLayout layout;
  layout.spec = ShardSpec{param.sizes().vec(), -1, 0, 1, 1};
  layout.partial_grad = partial_grad;
  return layout;
}

namespace {

// A layer's description of its own parameter must fit the tensor it holds, or the
// optimizer and the checkpoint would read the wrong elements.
void check_layout(const std::string& name, const at::Tensor& param, const ParameterLayout& layout) {
  const ShardSpec& s = layout.spec;
  MEGATORCH_CHECK(s.partition_dim >= -1 && s.partition_dim < static_cast<int64_t>(s.full_shape.size()) &&
                      s.world >= 1 && s.rank >= 0 && s.rank < s.world && s.parts >= 1,
                  "parameter_layouts: '", name, "' has an invalid layout (partition dim ", s.partition_dim, " of a ",
                  s.full_shape.size(), "-D shape, rank ", s.rank, " of ", s.world, ", parts ", s.parts,
                  "); its module's parameter_layouts() must describe a shard of the full tensor");
  const std::vector<int64_t> local = shard_shape(s);
  MEGATORCH_CHECK(local == param.sizes().vec(), "parameter_layouts: '", name, "' is ", param.sizes(),
                  " but its layout (full shape ", at::IntArrayRef(s.full_shape), ", partition dim ", s.partition_dim,
                  ", world ", s.world, ") gives a shard of ", at::IntArrayRef(local),
                  "; fix its module's parameter_layouts()");
  MEGATORCH_CHECK(layout.valid_rows < 0 || (!s.full_shape.empty() && layout.valid_rows <= s.full_shape[0]),
                  "parameter_layouts: '", name, "' has valid_rows ", layout.valid_rows, " but ",
                  s.full_shape.empty() ? 0 : s.full_shape[0], " rows over the TP group; valid_rows counts real rows "
                  "of dim 0 (-1: no padding)");
}

// The layouts of `module`'s direct parameters, named `prefix` + key.
void add_direct(const torch::nn::Module& module, const std::string& prefix, bool sequence_parallel,
                std::map<std::string, ParameterLayout>& out) {
  const auto* sharded = dynamic_cast<const ShardedModule*>(&module);
  std::map<std::string, ParameterLayout> own;
  if (sharded) own = sharded->parameter_layouts();
  const auto params = module.named_parameters(/*recurse=*/false);
  for (const auto& [key, layout] : own) {
    MEGATORCH_CHECK(params.contains(key), "parameter_layouts: module '", prefix.empty() ? "<root>" : prefix,
                    "' describes a parameter '", key, "' it does not hold; its parameter_layouts() must be keyed by "
                    "the names its own parameters were registered under");
  }
  for (const auto& item : params) {
    const std::string name = prefix.empty() ? item.key() : prefix + "." + item.key();
    const auto it = own.find(item.key());
    if (it == own.end()) {
      out[name] = replicated_layout(item.value(), sequence_parallel);
    } else {
      check_layout(name, item.value(), it->second);
      out[name] = it->second;
    }
  }
}

}  // namespace

std::vector<std::pair<std::string, ParameterLayout>> parameter_layouts(const torch::nn::Module& root,
                                                                       bool sequence_parallel) {
  // include_self would need root to be held by a shared_ptr: take its own parameters apart.
  std::map<std::string, ParameterLayout> by_name;
  add_direct(root, "", sequence_parallel, by_name);
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    add_direct(*item.value(), item.key(), sequence_parallel, by_name);
  }
  std::vector<std::pair<std::string, ParameterLayout>> out;
  for (const auto& item : root.named_parameters()) {
    const auto it = by_name.find(item.key());
    MEGATORCH_CHECK(it != by_name.end(), "parameter_layouts: no module holds '", item.key(), "'");
    out.emplace_back(item.key(), it->second);
  }
  return out;
}

}  // namespace megatorch::tp
