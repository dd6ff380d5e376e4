// Parameter layouts, optimizer grouping and checkpoint entries of a user's module tree
// (no GPT): units from the top-level ModuleLists, flags and specs from the layers' own
// layouts, replicated for every parameter no parallel layer describes.
#include <catch2/catch.hpp>
#include <megatorch/ckpt/module_checkpoint.h>
#include <megatorch/megatorch.h>
#include <megatorch/tp/parameter_layout.h>
#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fake_tp_group.h"

namespace mt = megatorch;
namespace nn = torch::nn;

namespace {

// A raw shard of a [8, 3] table split along dim 0, described by the module itself.
class ShardedTableImpl : public nn::Cloneable<ShardedTableImpl>, public mt::tp::ShardedModule {
 public:
  explicit ShardedTableImpl(std::string group, int64_t claimed_rows = 8)
      : group_(std::move(group)), rows_(claimed_rows) {
    reset();
  }
  void reset() override {
    tp = mt::tp::tp_info(group_);
    table = register_parameter("table", torch::zeros({8 / tp.size, 3}));
  }
  std::map<std::string, mt::tp::ParameterLayout> parameter_layouts() const override {
    mt::tp::ParameterLayout l;
    l.spec = mt::tp::ShardSpec{{rows_, 3}, 0, tp.rank, tp.size, 1};
    l.valid_rows = 7;
    return {{"table", l}};
  }
  at::Tensor table;
  mt::tp::TPInfo tp;

 private:
  std::string group_;
  int64_t rows_;
};
TORCH_MODULE(ShardedTable);

// A block with a ModuleList of its own: inside an element, so no unit of its own.
class BlockImpl : public nn::Cloneable<BlockImpl> {
 public:
  explicit BlockImpl(std::string group) : group_(std::move(group)) { reset(); }
  void reset() override {
    fc = register_module("fc", mt::tp::ColumnParallelLinear(mt::tp::ColumnParallelLinearOptions(4, 8).group(group_)));
    out = register_module("out", mt::tp::RowParallelLinear(
                                     mt::tp::RowParallelLinearOptions(8, 4).group(group_).sequence_parallel(true)));
    inner = register_module("inner", nn::ModuleList(nn::LayerNorm(nn::LayerNormOptions({4})), nn::Linear(4, 4)));
  }
  mt::tp::ColumnParallelLinear fc{nullptr};
  mt::tp::RowParallelLinear out{nullptr};
  nn::ModuleList inner{nullptr};

 private:
  std::string group_;
};
TORCH_MODULE(Block);

class EncoderImpl : public nn::Cloneable<EncoderImpl> {
 public:
  explicit EncoderImpl(std::string group) : group_(std::move(group)) { reset(); }
  void reset() override { layers = register_module("layers", nn::ModuleList(Block(group_), Block(group_))); }
  nn::ModuleList layers{nullptr};

 private:
  std::string group_;
};
TORCH_MODULE(Encoder);

// Root parameters (a raw one, a plain Linear, a sharded table), a top-level list of
// blocks, and a list inside a plain submodule: also top-level.
class NetImpl : public nn::Cloneable<NetImpl> {
 public:
  explicit NetImpl(std::string group) : group_(std::move(group)) { reset(); }
  void reset() override {
    scale = register_parameter("scale", torch::ones({4}));
    head = register_module("head", nn::Linear(4, 2));
    blocks = register_module("blocks", nn::ModuleList(Block(group_), Block(group_)));
    encoder = register_module("encoder", Encoder(group_));
    table = register_module("table", ShardedTable(group_));
  }
  at::Tensor scale;
  nn::Linear head{nullptr};
  nn::ModuleList blocks{nullptr};
  Encoder encoder{nullptr};
  ShardedTable table{nullptr};

 private:
  std::string group_;
};
TORCH_MODULE(Net);

std::vector<std::string> block_names(const std::string& prefix) {
  std::vector<std::string> out;
  for (const char* n : {"fc.weight", "fc.bias", "out.weight", "out.bias", "inner.0.weight", "inner.0.bias",
                        "inner.1.weight", "inner.1.bias"}) {
    out.push_back(prefix + n);
  }
  return out;
}

}  // namespace

TEST_CASE("parameter_layouts: the parallel layers' own layouts, every other parameter replicated", "[layouts]") {
  fake_tp::Group group("module_layouts_tp2", 1, 2);
  Net net(group.name());
  std::map<std::string, mt::tp::ParameterLayout> by_name;
  std::vector<std::string> order;
  for (const auto& [name, layout] : mt::tp::parameter_layouts(*net, /*sequence_parallel=*/false)) {
    by_name[name] = layout;
    order.push_back(name);
  }
  std::vector<std::string> want;
  for (const auto& item : net->named_parameters()) want.push_back(item.key());
  CHECK(order == want);

  const auto& fc_w = by_name.at("blocks.0.fc.weight").spec;
  CHECK(fc_w.full_shape == std::vector<int64_t>{8, 4});
  CHECK((fc_w.partition_dim == 0 && fc_w.rank == 1 && fc_w.world == 2 && fc_w.parts == 1));
  CHECK(by_name.at("blocks.0.fc.bias").spec.full_shape == std::vector<int64_t>{8});
  const auto& out_w = by_name.at("encoder.layers.1.out.weight").spec;
  CHECK((out_w.full_shape == std::vector<int64_t>{4, 8} && out_w.partition_dim == 1 && out_w.rank == 1));
  // The row-parallel bias knows its own SP; the plain parameters take the caller's.
  CHECK(by_name.at("blocks.1.out.bias").spec.partition_dim == -1);
  CHECK(by_name.at("blocks.1.out.bias").partial_grad);
  CHECK(!by_name.at("blocks.1.inner.0.weight").partial_grad);
  const auto& scale = by_name.at("scale");
  CHECK((scale.spec.full_shape == std::vector<int64_t>{4} && scale.spec.partition_dim == -1 &&
         scale.spec.rank == 0 && scale.spec.world == 1 && scale.spec.parts == 1 && scale.valid_rows == -1));
  CHECK(by_name.at("table.table").valid_rows == 7);
  CHECK(by_name.at("table.table").spec.full_shape == std::vector<int64_t>{8, 3});
  CHECK(mt::tp::parameter_layouts(*net, /*sequence_parallel=*/true)[0].second.partial_grad);  // "scale"

  // A layout that does not describe the tensor it holds is refused, naming the parameter.
  ShardedTable wrong(group.name(), /*claimed_rows=*/6);
  CHECK_THROWS_WITH(mt::tp::parameter_layouts(*wrong), Catch::Contains("'table' is [4, 3]") &&
                                                           Catch::Contains("fix its module's parameter_layouts()"));
}

TEST_CASE("module_parameters: units per top-level ModuleList element, flags from the layouts", "[layouts]") {
  fake_tp::Group group("module_params_tp2", 1, 2);
  Net a(group.name()), b(group.name());
  std::vector<std::string> adjusted;
  const auto options =
      mt::train::ParameterGroupingOptions()
          .tp_group(group.name())
          .sequence_parallel(true)
          .adjust([&adjusted](const std::string& name, const at::Tensor& p, mt::optim::ParamInfo& info) {
            adjusted.push_back(name);
            if (name == "head.weight") info.weight_decay = false;
          });
  const auto got = mt::train::module_parameters({a.ptr(), b.ptr()}, options);

  std::vector<std::vector<std::string>> units = {{"scale", "head.weight", "head.bias", "table.table"},
                                                 block_names("blocks.0."), block_names("blocks.1."),
                                                 block_names("encoder.layers.0."), block_names("encoder.layers.1.")};
  std::vector<std::string> names;
  for (int chunk = 0; chunk < 2; ++chunk) {
    for (const auto& u : units) names.insert(names.end(), u.begin(), u.end());
  }
  CHECK(got.names == names);
  std::vector<std::string> named;  // adjust sees each chunk's parameters in named_parameters order
  for (const Net& n : {a, b}) {
    for (const auto& item : n->named_parameters()) named.push_back(item.key());
  }
  CHECK(adjusted == named);
  CHECK(got.chunk_units == std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {5, 9}});
  REQUIRE(got.units.size() == 10);
  const auto params_a = a->named_parameters(), params_b = b->named_parameters();
  size_t i = 0;
  for (size_t u = 0; u < got.units.size(); ++u) {
    REQUIRE(got.units[u].size() == units[u % 5].size());
    for (const auto& t : got.units[u]) {
      INFO(names[i]);
      CHECK(t.is_same((u < 5 ? params_a : params_b)[names[i]]));
      const auto& info = got.info[i];
      const bool sharded = names[i] == "table.table" || names[i].find(".fc.") != std::string::npos ||
                           names[i].find("out.weight") != std::string::npos;
      CHECK(info.counted_in_norm == sharded);  // TP rank 1: replicated copies count on rank 0
      CHECK(info.weight_decay == (t.dim() > 1 && names[i] != "head.weight"));
      CHECK(info.grad_sum_group == (sharded ? "" : group.name()));  // partial under SP
      ++i;
    }
  }

  // Rank 0 counts everything; without the caller's SP only the row-parallel biases, whose
  // layers run sequence-parallel, are partial.
  fake_tp::Group rank0("module_params_tp2_rank0", 0, 2);
  Net c(rank0.name());
  const auto own =
      mt::train::module_parameters({c.ptr()}, mt::train::ParameterGroupingOptions().tp_group(rank0.name()));
  for (size_t j = 0; j < own.info.size(); ++j) {
    INFO(own.names[j]);
    CHECK(own.info[j].counted_in_norm);
    const bool row_bias = own.names[j].size() > 8 && own.names[j].compare(own.names[j].size() - 8, 8, "out.bias") == 0;
    CHECK(own.info[j].grad_sum_group == (row_bias ? rank0.name() : ""));
  }
  // Without a TP group (size 1) nothing needs a sum.
  Net d("");
  const auto alone =
      mt::train::module_parameters({d.ptr()}, mt::train::ParameterGroupingOptions().sequence_parallel(true));
  for (const auto& info : alone.info) {
    CHECK(info.counted_in_norm);
    CHECK(info.grad_sum_group.empty());
  }
}

TEST_CASE("module_parameters: a root that is a ModuleList, a model without lists", "[layouts]") {
  nn::ModuleList list(nn::Linear(2, 2), nn::Linear(2, 3));
  const auto got = mt::train::module_parameters({list.ptr()});
  REQUIRE(got.units.size() == 3);
  CHECK(got.units[0].empty());
  CHECK(got.names == std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias"});
  CHECK(got.info[1].weight_decay == false);
  CHECK(got.info[0].counted_in_norm);

  nn::Linear plain(3, 3);
  const auto one = mt::train::module_parameters({plain.ptr()});
  CHECK(one.units.size() == 1);
  CHECK(one.chunk_units == std::vector<std::pair<int64_t, int64_t>>{{0, 0}});
  CHECK_THROWS_WITH(mt::train::module_parameters({nullptr}), Catch::Contains("got a null chunk 0 of 1"));
}

TEST_CASE("module_entries: specs from the layouts, replicated parameters written by TP rank 0", "[layouts]") {
  fake_tp::Group group("module_entries_tp2", 1, 2);
  Net net(group.name());
  const auto layouts = mt::tp::parameter_layouts(*net);
  const auto params = net->named_parameters();
  const auto opts = mt::ckpt::ModuleEntriesOptions()
                        .prefix("m/")
                        .tp_rank(1)
                        .rename([](const std::string& n) { return n == "scale" ? "gain" : n; })
                        .writes([](const std::string& n) { return n != "blocks.0.fc.weight"; });
  const auto entries = mt::ckpt::module_entries(*net, opts);
  REQUIRE(entries.size() == layouts.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& [name, layout] = layouts[i];
    const auto& e = entries[i];
    INFO(name);
    CHECK(e.key == "m/" + (name == "scale" ? std::string("gain") : name));
    CHECK(e.spec.full_shape == layout.spec.full_shape);
    CHECK(e.spec.partition_dim == layout.spec.partition_dim);
    CHECK(e.spec.rank == layout.spec.rank);
    CHECK(e.spec.world == layout.spec.world);
    CHECK(e.valid_rows == layout.valid_rows);
    CHECK(e.tensor.is_same(params[name]));
    CHECK(e.write == (layout.spec.partition_dim >= 0 && name != "blocks.0.fc.weight"));
    mt::ckpt::validate_entry(e);
  }
  for (const auto& e : mt::ckpt::module_entries(*net, mt::ckpt::ModuleEntriesOptions().writer(false))) {
    CHECK(!e.write);
  }
  // TP rank 0 writes the replicated ones too.
  for (const auto& e : mt::ckpt::module_entries(*net)) CHECK(e.write);
}
