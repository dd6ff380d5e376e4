#include "megatorch/pipeline/module_stage.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

#include <sstream>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/tp/parameter_layout.h"
#include "megatorch/transformer/context_parallel.h"
#include "megatorch/util/fnv1a.h"
#include "megatorch/util/module_tree.h"

namespace megatorch::pipeline {
namespace {

int64_t fingerprint(const std::string& s) {
  util::Fnv1a h;
  h.mix_bytes(s);
  return static_cast<int64_t>(h.value() >> 1);
}

// Shapes and dtypes of every tensor of a micro-batch: the key activation specs are made for.
std::string shapes_key(const MicroBatch& mb) {
  std::ostringstream o;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    if (t.defined()) o << name << ":" << c10::toString(t.scalar_type()) << t.sizes() << ";";
  };
  add("ids", mb.ids);
  add("labels", mb.labels);
  for (const auto& [k, t] : mb.tensors) add(k, t);
  return o.str();
}

// An activation spec as a fixed-size row of longs: [ndim, dtype, dims...].
constexpr int64_t kMaxDims = 8;
at::Tensor encode(const ActivationSpec& spec) {
  MEGATORCH_CHECK(static_cast<int64_t>(spec.shape.size()) <= kMaxDims, "pipeline: activations of at most ", kMaxDims,
                  " dims travel between stages, got ", to_string(spec));
  at::Tensor row = at::zeros({kMaxDims + 2}, at::kLong);
  row[0] = static_cast<int64_t>(spec.shape.size());
  row[1] = static_cast<int64_t>(spec.dtype);
  for (size_t i = 0; i < spec.shape.size(); ++i) row[2 + i] = spec.shape[i];
  return row;
}
ActivationSpec decode(const at::Tensor& row) {
  ActivationSpec spec;
  spec.dtype = static_cast<c10::ScalarType>(row[1].item<int64_t>());
  for (int64_t i = 0; i < row[0].item<int64_t>(); ++i) spec.shape.push_back(row[2 + i].item<int64_t>());
  return spec;
}

}  // namespace

ModuleStageImpl::ModuleStageImpl(std::vector<torch::nn::AnyModule> chunks, ModuleStageOptions options_)
    : options(std::move(options_)), chunks_(std::move(chunks)) {
  reset();
}

void ModuleStageImpl::reset() {
  MEGATORCH_CHECK(!chunks_.empty(), "ModuleStage: expected at least one chunk (one module per virtual stage of this "
                  "rank), got none");
  if (!options.pp_group().empty()) {
    comm::Group pp(options.pp_group());
    pp_rank_ = pp.rank();
    pp_size_ = pp.size();
  }
  if (!options.cp_group().empty()) {
    comm::Group cp(options.cp_group());
    cp_rank_ = cp.rank();
    cp_size_ = cp.size();
  }
  MEGATORCH_CHECK(cp_size_ == 1 || !options.sequence_dims().empty(), "ModuleStage: the CP group '", options.cp_group(),
                  "' splits each sequence over ", cp_size_, " ranks, but no micro-batch tensor is named to split; pass "
                  "ModuleStageOptions().sequence_dims({{\"", options.input(), "\", 1}, {\"targets\", 1}}) with the ",
                  "tensors that hold the sequence and their sequence dim");
  for (const auto& [name, dim] : options.sequence_dims()) {
    MEGATORCH_CHECK(dim >= 0, "ModuleStage: sequence_dims['", name, "'] is ", dim, "; expected the sequence's dim as ",
                    "a non-negative index");
  }
  auto list = register_module("chunks", torch::nn::ModuleList());
  for (auto& c : chunks_) {
    MEGATORCH_CHECK(!c.is_empty(), "ModuleStage: chunk ", list->size(), " holds no module");
    list->push_back(c.ptr());
  }
  MEGATORCH_CHECK(chunk_layout() == ChunkLayout::kLooped || num_chunks() == 2, "ModuleStage: the V chunk layout ",
                  "holds 2 chunks per rank (virtual stages r and 2p-1-r), got ", num_chunks());
  if (is_last_virtual_stage(num_chunks() - 1)) {
    MEGATORCH_CHECK(options.loss() != nullptr, "ModuleStage: the last virtual stage needs a loss; pass "
                    "ModuleStageOptions().loss([](const at::Tensor& output, const MicroBatch& mb) { ... })");
  }
  // Every rank must hold the same number of chunks: the schedules pair virtual stages by it.
  if (pp_size_ > 1) {
    comm::Group pp(options.pp_group());
    at::Tensor v = at::tensor({num_chunks(), static_cast<int64_t>(chunk_layout())}, at::kLong);
    const at::Tensor all = pp.all_gather(v.unsqueeze(0), 0);
    MEGATORCH_CHECK(at::all(all == v).item<bool>(), "ModuleStage: pipeline ranks hold (chunks, layout) ", all,
                    "; every rank must hold the same number of chunks (virtual stages per rank) in the same layout");
  }
  // Global names: each top-level ModuleList's elements numbered across the virtual
  // stages in order, from one all-gather of (list, virtual stage, length) rows.
  std::vector<int64_t> rows;
  std::vector<std::vector<std::string>> paths(chunks_.size());
  for (int64_t c = 0; c < num_chunks(); ++c) {
    for (const auto& [path, l] : util::top_level_module_lists(*chunks_[c].ptr())) {
      paths[c].push_back(path);
      rows.insert(rows.end(), {fingerprint(path), virtual_stage(c), static_cast<int64_t>(l->size())});
    }
  }
  at::Tensor all = at::tensor(rows, at::kLong).view({-1, 3});
  if (pp_size_ > 1) {
    comm::Group pp(options.pp_group());
    at::Tensor count = at::tensor({all.size(0)}, at::kLong);
    pp.all_reduce(count, comm::ReduceOp::kMax);
    at::Tensor padded = at::full({count.item<int64_t>(), 3}, -1, at::kLong);
    padded.narrow(0, 0, all.size(0)).copy_(all);
    all = count.item<int64_t>() > 0 ? pp.all_gather(padded.unsqueeze(0), 0).view({-1, 3}) : padded;
  }
  list_offsets_.assign(chunks_.size(), {});
  for (int64_t c = 0; c < num_chunks(); ++c) {
    for (const auto& path : paths[c]) {
      int64_t offset = 0;
      for (int64_t i = 0; i < all.size(0); ++i) {
        if (all[i][0].item<int64_t>() == fingerprint(path) && all[i][1].item<int64_t>() < virtual_stage(c)) {
          offset += all[i][2].item<int64_t>();
        }
      }
      list_offsets_[c][path] = offset;
    }
  }
  std::vector<TiedCopy> copies;
  for (const auto& t : options.tied()) {
    MEGATORCH_CHECK(t.chunk >= 0 && t.chunk < num_chunks(), "ModuleStage: tie '", t.name, "' names chunk ", t.chunk,
                    " but this rank holds chunks [0, ", num_chunks(), ")");
    const auto params = chunks_[t.chunk].ptr()->named_parameters();
    const at::Tensor* p = params.find(t.parameter);
    MEGATORCH_CHECK(p != nullptr, "ModuleStage: tie '", t.name, "' names parameter '", t.parameter, "' of chunk ",
                    t.chunk, ", which has none of that name; its parameters are named like '",
                    params.is_empty() ? std::string("(none)") : params.keys().front(), "'");
    copies.push_back({t.name, t.chunk, *p});
  }
  ties_ = TiedParameters(std::move(copies), options.pp_group(), num_chunks(), chunk_layout());
  hooks_.assign(chunks_.size(), {});
  specs_.clear();
  specs_key_.clear();
}

std::shared_ptr<torch::nn::Module> ModuleStageImpl::clone(const c10::optional<c10::Device>& device) const {
  std::vector<torch::nn::AnyModule> copies;
  for (const auto& c : chunks_) copies.push_back(c.clone(device));
  auto o = options;
  if (device) o.device(*device);
  return std::make_shared<ModuleStageImpl>(std::move(copies), o);
}

std::string ModuleStageImpl::global_name(int64_t c, const std::string& local_name) const {
  for (const auto& t : options.tied()) {
    if (t.chunk == c && t.parameter == local_name) return t.name;
  }
  for (const auto& [path, offset] : list_offsets_.at(c)) {
    const auto [index, rest] = util::list_element_of(local_name, path);
    if (index >= 0) return (path.empty() ? "" : path + ".") + std::to_string(offset + index) + "." + rest;
  }
  return local_name;
}

void ModuleStageImpl::prepare(const std::vector<MicroBatch>& mbs) {
  MEGATORCH_CHECK(!mbs.empty(), "pipeline: expected at least one micro-batch");
  const std::string key = shapes_key(mbs[0]);
  for (size_t i = 1; i < mbs.size(); ++i) {
    MEGATORCH_CHECK(shapes_key(mbs[i]) == key, "pipeline: expected every micro-batch of a step to hold the same ",
                    "tensors with the same shapes (the activations between stages are sized once per step), got ",
                    key, " for micro-batch 0 and ", shapes_key(mbs[i]), " for micro-batch ", i);
  }
  if (is_first_virtual_stage(0) && !options.forward()) mbs[0].get(options.input());  // names what is missing
  local_micro_batch(mbs[0]);  // names a sequence tensor that is missing or does not split
  if (key == specs_key_) return;
  const int64_t stages = pp_size_ * num_chunks();
  if (options.activation()) {
    specs_.clear();
    for (int64_t s = 0; s + 1 < stages; ++s) specs_.push_back(options.activation()(s, mbs[0]));
    if (pp_size_ > 1 && !specs_.empty()) {
      // Every rank computed every boundary: they must agree before any receive is sized.
      std::vector<at::Tensor> rows;
      for (const auto& s : specs_) rows.push_back(encode(s));
      const at::Tensor mine = at::stack(rows);
      const at::Tensor all = comm::Group(options.pp_group()).all_gather(mine.unsqueeze(0), 0);
      for (int64_t r = 0; r < pp_size_; ++r) {
        MEGATORCH_CHECK(at::equal(all[r], mine), "pipeline: pipeline rank ", r, " declares other activations than rank ",
                        pp_rank_, " for micro-batches ", key, "; every rank must be given the same micro-batch shapes "
                        "and the same activation function");
      }
    }
  } else {
    infer_activations(mbs[0]);
  }
  specs_key_ = key;
}

void ModuleStageImpl::infer_activations(const MicroBatch& sample) {
  const int64_t stages = pp_size_ * num_chunks();
  specs_.assign(std::max<int64_t>(stages - 1, 0), {});
  at::NoGradGuard no_grad;
  for (int64_t s = 0; s + 1 < stages; ++s) {
    const int64_t owner = rank_of_virtual_stage(s, pp_size_, chunk_layout());
    const int64_t c = chunk_of_virtual_stage(s, pp_size_, chunk_layout());
    at::Tensor row = at::zeros({kMaxDims + 2}, at::kLong);
    if (owner == pp_rank_) {
      // On zeros, in eval mode: no dropout draws, so the run's random streams are untouched.
      auto module = chunks_[c].ptr();
      const bool training = module->is_training();
      module->eval();
      at::Tensor input;
      if (s > 0) input = at::zeros(specs_[s - 1].shape, at::TensorOptions().dtype(specs_[s - 1].dtype).device(device()));
      const at::Tensor out = run_chunk(c, input, sample);
      module->train(training);
      MEGATORCH_CHECK(out.defined(), "pipeline: chunk ", c, " (virtual stage ", s, ") returned no tensor");
      row = encode({out.sizes().vec(), out.scalar_type()});
    }
    if (pp_size_ > 1) comm::Group(options.pp_group()).broadcast(row, owner);
    specs_[s] = decode(row);
  }
}

ActivationSpec ModuleStageImpl::activation_spec(int64_t s) const {
  MEGATORCH_CHECK(s >= 0 && s < static_cast<int64_t>(specs_.size()), "pipeline: no activation spec for virtual stage ",
                  s, "; run prepare(micro_batches) first (the executor does)");
  return specs_[s];
}

at::Tensor ModuleStageImpl::run_chunk(int64_t c, const at::Tensor& input, const MicroBatch& mb) {
  const ChunkHooks& h = hooks_[c];
  const bool wrap = h.hooks && !h.module_runs_them;
  // A chunk that does not run the hooks itself is gathered whole before its forward.
  if (wrap) {
    for (int64_t u = h.first; u <= h.last; ++u) h.hooks->before_forward(u);
  }
  at::Tensor out;
  const MicroBatch local = local_micro_batch(mb);
  if (options.forward()) {
    out = options.forward()(chunks_[c], virtual_stage(c), input, local);
  } else {
    out = chunks_[c].forward<at::Tensor>(input.defined() ? input : local.get(options.input()));
  }
  if (wrap) {
    // The root last, so its gather runs first in backward (as GPTModel's head).
    for (int64_t u = h.first + 1; u <= h.last; ++u) out = h.hooks->after_forward(u, out);
    out = h.hooks->after_forward(h.first, out);
  }
  return out;
}

at::Tensor ModuleStageImpl::forward_chunk(int64_t c, const at::Tensor& input, const MicroBatch& mb) {
  at::Tensor out = run_chunk(c, input, mb);
  const int64_t s = virtual_stage(c);
  if (!is_last_virtual_stage(c)) {
    const ActivationSpec got{out.sizes().vec(), out.scalar_type()};
    // Caught here, before the send: a mismatch on the wire would hang or corrupt the peer.
    MEGATORCH_CHECK(got == activation_spec(s), "pipeline: chunk ", c, " (virtual stage ", s, ") returned ",
                    to_string(got), " but the next stage expects ", to_string(activation_spec(s)),
                    options.activation() ? " (ModuleStageOptions::activation)" : " (inferred for these micro-batches)",
                    "; a chunk's output must depend only on the micro-batch shapes");
  }
  return out;
}

at::Tensor ModuleStageImpl::micro_batch_loss(const at::Tensor& output, const MicroBatch& mb) {
  at::Tensor loss = options.loss()(output, local_micro_batch(mb));
  MEGATORCH_CHECK(loss.defined() && loss.numel() == 1, "ModuleStage: expected the loss function to return a scalar "
                  "(the micro-batch's mean loss), got ", loss.defined() ? loss.sizes() : at::IntArrayRef{});
  return loss.reshape({});
}

MicroBatch ModuleStageImpl::local_micro_batch(const MicroBatch& mb) const {
  if (cp_size_ == 1) return mb;
  MicroBatch local = mb;
  for (const auto& [name, dim] : options.sequence_dims()) {
    const at::Tensor& whole = mb.get(name);
    MEGATORCH_CHECK(dim < whole.dim() && whole.size(dim) % (2 * cp_size_) == 0, "ModuleStage: micro-batch tensor '",
                    name, "' of shape ", whole.sizes(), " holds the sequence along dim ", dim, " (sequence_dims), ",
                    "which must exist and divide into 2 x ", cp_size_, " chunks (the CP size: each rank holds two); ",
                    "pad the sequence or fix sequence_dims");
    at::Tensor part = transformer::context_parallel_slice(whole, dim, cp_size_, cp_rank_);
    if (name == "ids") {
      local.ids = part;
    } else if (name == "labels") {
      local.labels = part;
    } else {
      local.tensors[name] = part;
    }
  }
  return local;
}

void ModuleStageImpl::allreduce_sequence_parallel_grads() {
  if (!options.sequence_parallel() || options.tp_group().empty()) return;
  comm::Group tp(options.tp_group());
  if (tp.size() == 1) return;
  std::vector<at::Tensor> grads;
  for (const auto& c : chunks_) {
    const auto params = c.ptr()->named_parameters();
    for (const auto& [name, layout] : tp::parameter_layouts(*c.ptr(), /*sequence_parallel=*/true)) {
      const at::Tensor& p = params[name];
      if (layout.partial_grad && p.grad().defined()) grads.push_back(p.grad());
    }
  }
  if (grads.empty()) return;
  std::vector<at::Tensor> parts;
  for (const auto& g : grads) parts.push_back(g.reshape(-1));
  at::Tensor flat = at::cat(parts);
  tp.all_reduce(flat);
  int64_t at = 0;
  for (auto& g : grads) {
    g.copy_(flat.narrow(0, at, g.numel()).view_as(g));
    at += g.numel();
  }
}

void ModuleStageImpl::set_unit_hooks(int64_t c, std::shared_ptr<models::UnitHooks> hooks, int64_t first_unit,
                                     int64_t last_unit) {
  MEGATORCH_CHECK(c >= 0 && c < num_chunks(), "ModuleStage: no chunk ", c, " on this rank");
  ChunkHooks& h = hooks_[c];
  h = ChunkHooks{hooks, first_unit, last_unit, false};
  if (auto* runs = dynamic_cast<models::RunsUnitHooks*>(chunks_[c].ptr().get())) {
    runs->set_unit_hooks(hooks, first_unit);
    h.module_runs_them = true;
  }
}

}  // namespace megatorch::pipeline
