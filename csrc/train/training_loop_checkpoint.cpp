// TrainingLoop's checkpoints: the model by global parameter name, the optimizer state as
// each parameter's slice of it (a ZeRO range of its TP or EP shard), the random
// generators' states, so any layout loads any other (training_loop.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "megatorch/check.h"
#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/module_checkpoint.h"
#include "megatorch/comm/group.h"
#include "megatorch/moe/moe_layer.h"
#include "megatorch/tp/fp8_layer.h"
#include "megatorch/train/training_loop.h"

namespace megatorch::train {
namespace {

using parallel::GroupKind;
using Clock = std::chrono::steady_clock;

// Generator states as JSON-able bytes and back (they are small uint8 tensors).
std::vector<uint8_t> state_bytes(const at::Tensor& state) {
  const at::Tensor s = state.contiguous();
  return {s.data_ptr<uint8_t>(), s.data_ptr<uint8_t>() + s.numel()};
}
at::Tensor state_tensor(const nlohmann::json& bytes) { return at::tensor(bytes.get<std::vector<uint8_t>>()).to(at::kByte); }

}  // namespace

std::vector<ckpt::ShardedEntry> TrainingLoop::checkpoint_entries(bool with_grads) {
  // Replicas of a parameter (and ZeRO's shards of its state) span DP × CP; an expert's
  // span expert-DP (its EP rank's copies).
  const int64_t dp_rank = comm::Group(grad_group()).rank();
  const int64_t edp_rank = state_->edp_rank();
  // write flags from the model entries say who writes among TP ranks and tied copies.
  auto model = ckpt::stage_entries(*stage_, /*writer=*/true);
  std::vector<ckpt::ShardedEntry> out;
  const auto is_expert = [this](const at::Tensor& t) {
    if (!expert_optimizer_) return false;
    for (const auto& p : expert_optimizer_->parameters()) {
      if (p.is_same(t)) return true;
    }
    return false;
  };
  // Experts are not replicated over TP but over expert-DP, and expert-TP for a whole one
  // (fc2's bias): etp rank 0 writes those.
  for (auto& e : model) {
    if (is_expert(e.tensor)) e.write = (e.spec.partition_dim >= 0 && e.spec.world > 1) || state_->etp_rank() == 0;
  }
  for (auto* opt : optimizers()) {
    const bool experts = opt == expert_optimizer_.get();
    const int64_t replica = experts ? edp_rank : dp_rank;
    const auto& params = opt->parameters();
    std::vector<const ckpt::ShardedEntry*> of_param(params.size(), nullptr);
    for (const auto& e : model) {
      for (size_t i = 0; i < params.size(); ++i) {
        if (e.tensor.is_same(params[i])) of_param[i] = &e;
      }
    }
    const bool sharded_state = opt->options().zero_stage() >= 1;
    auto shards = opt->param_state_shards();
    if (with_grads) {
      auto grads = opt->grad_shards();
      shards.insert(shards.end(), grads.begin(), grads.end());
    }
    for (auto shard : shards) {
      const auto* e = of_param[shard.param];
      MEGATORCH_CHECK(e != nullptr, "checkpoint: optimizer parameter ", shard.param, " has no checkpoint entry");
      const std::string name = e->key.substr(e->key.find('/') + 1);
      for (auto& [kind, t] : shard.tensors) {
        ckpt::ShardedEntry o = *e;
        o.key = "optim/" + kind + "/" + name;
        o.begin = shard.begin;
        o.end = shard.end;
        o.tensor = t;
        o.write = e->write && (sharded_state || replica == 0);
        out.push_back(std::move(o));
      }
    }
  }
  // FP8 scaling state (amax histories, scales): replicated over TP (reduced amaxes), named
  // after the layer's weight ("model/layers.3.mlp.fc1.fp8.input.scale").
  for (const auto& item : stage_->stage_module().named_modules("", /*include_self=*/false)) {
    auto* layer = dynamic_cast<tp::Fp8Layer*>(item.value().get());
    if (!layer || !layer->fp8_scaling) continue;
    const auto own = item.value()->named_parameters(/*recurse=*/false);
    const at::Tensor* weight = own.find("weight");
    const auto entry = std::find_if(model.begin(), model.end(),
                                    [&](const ckpt::ShardedEntry& e) { return weight && e.tensor.is_same(*weight); });
    MEGATORCH_CHECK(entry != model.end(), "checkpoint: the FP8 layer '", item.key(), "' has no weight entry to name "
                    "its scaling state after");
    const std::string prefix = entry->key.substr(0, entry->key.size() - std::string("weight").size()) + "fp8.";
    for (const auto& [name, t] : layer->fp8_scaling->state()) {
      ckpt::ShardedEntry e;
      e.key = prefix + name;
      e.spec = tp::ShardSpec{t.sizes().vec(), -1, 0, 1, 1};
      e.tensor = t;
      e.write = state_->tp_rank() == 0 && dp_rank == 0;
      out.push_back(std::move(e));
    }
  }
  for (auto& e : model) {
    e.write = e.write && (is_expert(e.tensor) ? edp_rank : dp_rank) == 0;
    out.push_back(std::move(e));
  }
  // DeepSeek's expert biases: model state that is no parameter (replicated, like a norm's).
  for (auto* layer : moe::moe_layers(stage_->stage_module())) {
    const at::Tensor& bias = layer->router->expert_bias;
    if (!bias.defined()) continue;
    ckpt::ShardedEntry e;
    e.key = "model/layers." + std::to_string(layer->options.layer_number()) + ".mlp.router.expert_bias";
    e.spec = tp::ShardSpec{bias.sizes().vec(), -1, 0, 1, 1};
    e.tensor = bias;
    e.write = state_->tp_rank() == 0 && dp_rank == 0;
    out.push_back(std::move(e));
  }
  return out;
}

void TrainingLoop::save_checkpoint() {
  // One save at a time: the one in flight is published first.
  finish_checkpoint_save();
  const auto start = Clock::now();
  // ZeRO-3 keeps only shards: gather every unit so the model entries are readable.
  for (int64_t u = 0; u < optimizer_->num_units(); ++u) optimizer_->gather_unit(u);
  ckpt::CheckpointState st;
  st.model_config = options_.model_config();
  st.state = {{"iteration", iteration_},
              {"consumed_samples", iteration_ * global_batch_size()},
              {"optimizer_step", optimizer_->step_count()},
              {"lr_step", lr_step_},
              {"fp8_recipe", fp8_recipe_}};
  if (scaler_) st.state["loss_scaler"] = scaler_->state_dict();
  // The default generator and the TP tracker's streams (dropout inside TP regions): a
  // resumed run draws the same masks as an uninterrupted one.
  st.rank_state = {{"cpu_rng", state_bytes(tp::default_generator_state(c10::kCPU))}};
  // On a GPU dropout draws from the device's generator (its seed and offset).
  if (state_->device().is_cuda()) st.rank_state["cuda_rng"] = state_bytes(tp::default_generator_state(state_->device()));
  if (const auto tracker = stage_->rng_tracker()) {
    for (const auto& [name, state] : tracker->snapshot().states) st.rank_state["rng_streams"][name] = state_bytes(state);
  }
  const std::string world = state_->group_name(GroupKind::kWorld);
  if (options_.async_save()) {
    // The pieces are copied to host memory here; the writer thread takes it from there.
    pending_save_ = std::make_unique<ckpt::AsyncSave>(
        options_.save(), iteration_, checkpoint_entries(options_.save_grads()), st, world,
        ckpt::AsyncSaveOptions().write_delay(std::chrono::milliseconds(faults_.slow_save_ms)));
  } else {
    ckpt::save_checkpoint(options_.save(), iteration_, checkpoint_entries(options_.save_grads()), st, world);
  }
  for (int64_t u = 0; u < optimizer_->num_units(); ++u) optimizer_->release_unit(u);
  save_started_ = Clock::now();
  if (is_logging_rank()) {
    const double blocked = std::chrono::duration<double>(save_started_ - start).count();
    if (options_.async_save()) {
      std::printf("\n[megatorch] saving checkpoint at iteration %ld to %s in the background (training blocked %.3f s)\n",
                  iteration_, options_.save().c_str(), blocked);
    } else {
      std::printf("\n[megatorch] saved checkpoint at iteration %ld to %s (%.3f s)\n", iteration_,
                  options_.save().c_str(), blocked);
    }
    std::fflush(stdout);
  }
}

void TrainingLoop::finish_checkpoint_save() {
  if (!pending_save_) return;
  const auto start = Clock::now();
  // Released whatever publishing does: a failed save is not retried.
  const std::unique_ptr<ckpt::AsyncSave> save = std::move(pending_save_);
  save->finish();
  if (is_logging_rank()) {
    const auto now = Clock::now();
    std::printf("\n[megatorch] saved checkpoint at iteration %ld to %s (asynchronously: published %.3f s after it "
                "started, training blocked %.3f s here)\n",
                save->iteration(), options_.save().c_str(), std::chrono::duration<double>(now - save_started_).count(),
                std::chrono::duration<double>(now - start).count());
    std::fflush(stdout);
  }
}

bool TrainingLoop::load_checkpoint() {
  const auto& o = options_;
  if (o.load_iteration() < 0 && ckpt::latest_iteration(o.load()) < 0) {
    if (is_logging_rank()) std::printf("[megatorch] no checkpoint in %s yet: starting from scratch\n", o.load().c_str());
    return false;
  }
  const auto meta = ckpt::read_metadata(o.load(), o.load_iteration());
  bool saved_optimizer = false;
  for (const auto& t : meta.at("tensors").items()) saved_optimizer |= t.key().rfind("optim/", 0) == 0;
  // Megatron's --finetune: the weights only, as if they had been initialised so.
  const bool has_optimizer = saved_optimizer && !o.finetune() && o.load_optimizer();
  const bool load_rng = !o.finetune() && o.load_rng();
  // FP8 scaling state belongs to its recipe: another recipe (or none) starts its own, and
  // only as a deliberate --finetune.
  const std::string saved_recipe = meta.at("state").value("fp8_recipe", std::string("none"));
  MEGATORCH_CHECK(saved_recipe == fp8_recipe_ || o.finetune(), "checkpoint: ", o.load(), " was trained with FP8 recipe '",
                  saved_recipe, "' but this run uses '", fp8_recipe_, "'; give the same --fp8-* flags, or --finetune "
                  "to continue from its weights with fresh FP8 scales");
  auto entries = checkpoint_entries();
  if (saved_recipe != fp8_recipe_) {
    entries.erase(std::remove_if(entries.begin(), entries.end(),
                                 [](const ckpt::ShardedEntry& e) { return e.key.find(".fp8.") != std::string::npos; }),
                  entries.end());
  }
  if (!has_optimizer) {
    entries.erase(std::remove_if(entries.begin(), entries.end(),
                                 [](const ckpt::ShardedEntry& e) { return e.key.rfind("optim/", 0) == 0; }),
                  entries.end());
  }
  for (int64_t u = 0; u < optimizer_->num_units(); ++u) optimizer_->gather_unit(u);
  const nlohmann::json& comparison = o.load_comparison().is_null() ? o.model_config() : o.load_comparison();
  const auto loaded = ckpt::load_checkpoint(
      o.load(), entries,
      ckpt::LoadOptions().iteration(o.load_iteration()).model_config(comparison).group(state_->group_name(GroupKind::kWorld)));
  for (auto* opt : optimizers()) {
    if (has_optimizer) {
      opt->copy_master_to_params();  // the fp32 masters are the exact values
    } else {
      opt->copy_params_to_master();  // e.g. imported from HuggingFace
    }
  }
  for (int64_t u = 0; u < optimizer_->num_units(); ++u) optimizer_->release_unit(u);
  const auto& st = loaded.state.state;
  if (!o.finetune()) {
    iteration_ = st.value("iteration", int64_t{0});
    lr_step_ = st.value("lr_step", iteration_);
  }
  if (has_optimizer) {
    for (auto* opt : optimizers()) opt->set_step_count(st.value("optimizer_step", iteration_));
    if (scaler_ && st.contains("loss_scaler")) scaler_->load_state_dict(st.at("loss_scaler").get<std::map<std::string, double>>());
  }
  const auto& rank_state = loaded.state.rank_state;  // null unless the layout is the same
  if (load_rng && !rank_state.is_null() && rank_state.contains("cpu_rng")) {
    tp::set_default_generator_state(c10::kCPU, state_tensor(rank_state.at("cpu_rng")));
    // A run saved on another kind of device has no state for this one: its masks restart.
    if (state_->device().is_cuda() && rank_state.contains("cuda_rng")) {
      tp::set_default_generator_state(state_->device(), state_tensor(rank_state.at("cuda_rng")));
    }
    const auto tracker = stage_->rng_tracker();
    // The tracker's streams are generator states of the saving run's device kind.
    const bool same_kind = tracker && tracker->device().is_cuda() == rank_state.contains("cuda_rng");
    if (same_kind && rank_state.contains("rng_streams")) {
      tp::RngTracker::Snapshot snap{tp::default_generator_state(tracker->device()), {}};
      for (const auto& [name, bytes] : rank_state.at("rng_streams").items()) snap.states[name] = state_tensor(bytes);
      tracker->restore(snap);
    }
  }
  if (is_logging_rank()) {
    std::printf("[megatorch] loaded checkpoint %s (iteration %ld, saved by %ld ranks)%s%s\n", loaded.path.c_str(),
                st.value("iteration", int64_t{0}), loaded.world_size,
                o.finetune() ? ": weights only (--finetune), starting at iteration 0"
                : has_optimizer ? "" : " without optimizer state",
                !o.finetune() && !load_rng ? ", random generators not restored" : "");
    std::fflush(stdout);
  }
  return true;
}

}  // namespace megatorch::train
