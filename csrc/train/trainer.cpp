#include "megatorch/train/trainer.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "megatorch/check.h"
#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/gpt_checkpoint.h"
#include "megatorch/comm/comm_stats.h"
#include "megatorch/comm/group.h"
#include "megatorch/data/token_stats.h"
#include "megatorch/train/model_parameters.h"
#include "megatorch/pipeline/timeline_svg.h"
#include "megatorch/tp/rng_tracker.h"
#include "megatorch/train/device_memory.h"

namespace megatorch::train {
namespace {

using parallel::GroupKind;
using Clock = std::chrono::steady_clock;

int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, rss = 0;
  f >> pages >> rss;
  return rss * 4096;
}

// Generator states as JSON-able bytes and back (they are small uint8 tensors).
std::vector<uint8_t> state_bytes(const at::Tensor& state) {
  const at::Tensor s = state.contiguous();
  return {s.data_ptr<uint8_t>(), s.data_ptr<uint8_t>() + s.numel()};
}
at::Tensor state_tensor(const nlohmann::json& bytes) { return at::tensor(bytes.get<std::vector<uint8_t>>()).to(at::kByte); }

std::string human(double bytes) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(1);
  if (bytes >= 1 << 30) {
    o << bytes / (1 << 30) << " GiB";
  } else {
    o << bytes / (1 << 20) << " MiB";
  }
  return o.str();
}

}  // namespace

Trainer::Trainer(TrainArguments args) : args_(std::move(args)) {
  const auto env = parallel::LaunchEnv::from_environment();
  const bool has_checkpoint = !args_.load.empty() && ckpt::latest_iteration(args_.load) >= 0;
  MEGATORCH_CHECK(!args_.use_checkpoint_args || has_checkpoint, "gpt_pretrain: --use-checkpoint-args needs a checkpoint "
                  "in --load, found none in '", args_.load, "'");
  MEGATORCH_CHECK(!args_.finetune || has_checkpoint, "gpt_pretrain: --finetune starts from a checkpoint's weights but "
                  "'", args_.load, "' holds none; check the --load path");
  // Evaluating a freshly initialised model would report a loss that looks real.
  MEGATORCH_CHECK(!args_.eval_only || has_checkpoint, "gpt_pretrain: --eval-only evaluates the checkpoint in --load, "
                  "found none in '", args_.load, "'; pass --load DIR of a saved run (its latest_checkpointed_iteration.txt)");
  if (has_checkpoint) {
    const auto saved = ckpt::read_metadata(args_.load).at("model_config");
    if (args_.use_checkpoint_args) apply_checkpoint_args(args_, saved);
    // Not a shape (loading does not compare it) but a property of the model: a Mistral's
    // window bounds the sequences it may train on (validate() refuses longer ones).
    args_.sliding_window = saved.value("sliding_window", int64_t{0});
    // RoPE's max positions size no parameter; kept so an export writes the model's own.
    if (saved.value("position_embedding_type", "") == "rope" && !args_.given.count("max-position-embeddings")) {
      args_.max_position_embeddings = std::max(saved.value("max_positions", int64_t{0}), args_.seq_length);
    }
  }
  eod_ = resolve_vocab_size(args_);
  validate(args_, env.world_size);
  // The device is chosen (and a launch that cannot work refused, on every rank) before
  // anything connects.
  auto pstate = parallel::ParallelStateOptions(args_.tensor_model_parallel_size, args_.pipeline_model_parallel_size)
                    .name("gpt")
                    .device(args_.device)
                    .backend(args_.distributed_backend);
  if (args_.distributed_timeout_minutes > 0 && !std::getenv("MEGATORCH_COMM_TIMEOUT_S")) {
    pstate.timeout(std::chrono::milliseconds(static_cast<int64_t>(args_.distributed_timeout_minutes * 60e3)));
  }
  state_ = std::make_unique<parallel::ParallelState>(pstate);
  at::manual_seed(args_.seed);
  auto config = model_config(args_);
  config.device(state_->device());
  stage_ = pipeline::PipelineStage(pipeline::PipelineStageOptions(config)
                                       .tp_group(state_->group_name(GroupKind::kTensor))
                                       .pp_group(args_.pipeline_model_parallel_size > 1
                                                     ? state_->group_name(GroupKind::kPipeline)
                                                     : "")
                                       .virtual_chunks(args_.virtual_chunks));
  if (args_.fp16) {
    scaler_ = std::make_shared<optim::DynamicLossScaler>(optim::LossScalerOptions()
                                                             .initial_scale(args_.initial_loss_scale)
                                                             .growth_interval(args_.loss_scale_window)
                                                             .hysteresis(args_.hysteresis));
  }
  const auto params = pipeline_stage_parameters(stage_);
  // The tied embedding's two copies on one rank (interleaved with one pipeline rank) are
  // summed on .grad after the schedule, so there the reduction must wait for them.
  const bool tied_on_grad = !args_.untie_embeddings_and_output_weights && !optimizer_sums_tied_embedding(stage_) &&
                            args_.virtual_chunks > 1;
  std::vector<std::string> model_groups{state_->group_name(GroupKind::kTensor)};
  if (args_.pipeline_model_parallel_size > 1) model_groups.push_back(state_->group_name(GroupKind::kPipeline));
  optimizer_ = std::make_unique<optim::DistributedOptimizer>(
      params.units, state_->group_name(GroupKind::kData),
      optim::DistributedOptimizerOptions()
          .zero_stage(args_.zero_stage)
          .lr(args_.lr)
          .beta1(args_.adam_beta1)
          .beta2(args_.adam_beta2)
          .eps(args_.adam_eps)
          .weight_decay(args_.weight_decay)
          .clip_grad(args_.clip_grad)
          .loss_scaler(scaler_)
          .model_parallel_groups(model_groups)
          // SP's partial sums and the tied embedding's copies on the first and last stage
          // are added by the optimizer after its DP reduction (ParamInfo::grad_sum_group),
          // so the reduction overlaps backward.
          .overlap_grad_reduce(!tied_on_grad)
          // The forward's unit hooks (attach_unit_hooks below) wait for each unit's gathers.
          .overlap_param_gather(true),
      params.info);
  attach_unit_hooks(chunks(), *optimizer_);
  // The whole model's size, each parameter once (PaLM's FLOPs count uses it).
  at::Tensor count = at::zeros({1}, at::kDouble);
  for (size_t i = 0; i < params.info.size(); ++i) {
    if (params.info[i].counted_in_norm) count += static_cast<double>(optimizer_->parameters()[i].numel());
  }
  comm::Group(state_->group_name(GroupKind::kTensor)).all_reduce(count);
  if (args_.pipeline_model_parallel_size > 1) comm::Group(state_->group_name(GroupKind::kPipeline)).all_reduce(count);
  num_parameters_ = static_cast<int64_t>(count.item<double>());
  // PaLM appendix B: 6Ψ + 12·L·h·s per token (attention counted in full, not halved for causal).
  flops_per_token_ = 6.0 * num_parameters_ + 12.0 * args_.num_layers * args_.hidden_size * args_.seq_length;

  lr_ = LRSchedule{args_.lr, args_.min_lr, args_.lr_warmup_iters, args_.lr_decay_iters, args_.lr_decay_style};
  MEGATORCH_CHECK(!args_.data_path.empty(), "gpt_pretrain: expected --data-path PREFIX (a Megatron .bin/.idx pair, e.g. "
                  "data/default/stdlib_docs_text_document); make one with build/bin/megatorch-preprocess");
  const int64_t eval_runs = args_.eval_interval > 0 ? args_.train_iters / args_.eval_interval + 1 : 1;
  data_ = data::build_gpt_datasets(
      data::GPTDataOptions()
          .blend(data::parse_data_path(args_.data_path))
          .seq_length(args_.seq_length)
          .seed(args_.seed)
          .split(args_.split)
          .num_samples({args_.train_iters * args_.global_batch_size, eval_runs * args_.eval_iters * args_.global_batch_size,
                        args_.eval_iters * args_.global_batch_size}));
  // An id outside the vocabulary trains on garbage without an error (masked by every TP
  // shard, or an infinite loss in the padding). Every rank reads the same files, so all fail alike.
  for (const std::string& prefix : data::parse_data_path(args_.data_path).prefixes) {
    const auto ids = data::token_id_range(prefix);
    MEGATORCH_CHECK(ids.max_id < args_.vocab_size && ids.min_id >= 0, "gpt_pretrain: dataset ", prefix, " holds token ids in [",
                    ids.min_id, ", ", ids.max_id, "] (largest id ", ids.max_id, ") but the vocabulary has ", args_.vocab_size,
                    " ids [0, ", args_.vocab_size, "); pass the --vocab-size / --tokenizer-type the data was preprocessed "
                    "with, or preprocess it again with this tokenizer");
  }
  train_batches_ = std::make_unique<MicroBatchLoader>(*data_.train, loader_options());
  if (!args_.load.empty()) load_checkpoint();
  if (is_logging_rank()) {
    std::printf("[megatorch] gpt_pretrain: world %ld = tp %ld x pp %ld (v %ld) x dp %ld, ZeRO-%ld, %s, %ld parameters\n",
                args_.world_size, args_.tensor_model_parallel_size, args_.pipeline_model_parallel_size,
                args_.virtual_chunks, args_.data_parallel_size, args_.zero_stage,
                args_.bf16 ? "bf16" : args_.fp16 ? "fp16" : "fp32", num_parameters_);
    std::printf("[megatorch] global batch %ld = micro-batch %ld x %ld micro-batches x dp %ld; train samples %ld, "
                "valid %ld\n",
                args_.global_batch_size, args_.micro_batch_size, args_.num_micro_batches, args_.data_parallel_size,
                data_.train->size(), data_.valid->size());
    std::printf("[megatorch] tokenizer %s: vocabulary %ld (padded to %ld), end of document %ld\n",
                args_.tokenizer.tokenizer_type().c_str(), args_.vocab_size,
                tp::padded_vocab_size(args_.vocab_size, args_.tensor_model_parallel_size, args_.make_vocab_size_divisible_by),
                eod_);
    std::fflush(stdout);
    // A resumed run appends to the log of the run it continues.
    if (!args_.log_json.empty()) {
      json_.open(args_.log_json, iteration_ > 0 ? std::ios::app : std::ios::trunc);
      MEGATORCH_CHECK(json_.is_open(), "cannot open the --log-json file '", args_.log_json, "': ", std::strerror(errno),
                      "; check that its directory exists and is writable");
    }
  }
}

Trainer::~Trainer() = default;

bool Trainer::is_logging_rank() const { return state_->rank() == state_->world_size() - 1; }

std::vector<models::GPTModel> Trainer::chunks() const {
  std::vector<models::GPTModel> out;
  for (int64_t c = 0; c < stage_->num_chunks(); ++c) out.push_back(stage_->chunk(c));
  return out;
}

MicroBatchLoaderOptions Trainer::loader_options() const {
  return MicroBatchLoaderOptions()
      .micro_batch_size(args_.micro_batch_size)
      .num_micro_batches(args_.num_micro_batches)
      .data_parallel_size(args_.data_parallel_size)
      .data_parallel_rank(state_->dp_rank())
      .seq_length(args_.seq_length)
      .device(state_->device());
}

// Mean of the last stage's loss over DP, made known on every rank.
double Trainer::reduce_loss(double local) {
  at::Tensor l = at::tensor({state_->pp_rank() == state_->pp_size() - 1 ? local : 0.0}, at::kDouble);
  if (state_->pp_size() > 1) comm::Group(state_->group_name(GroupKind::kPipeline)).all_reduce(l);
  comm::Group(state_->group_name(GroupKind::kData)).all_reduce(l);
  return l.item<double>() / static_cast<double>(args_.data_parallel_size);
}

IterationStats Trainer::train_step() {
  const auto start = Clock::now();
  comm::reset_comm_stats();
  IterationStats s;
  s.iteration = iteration_ + 1;
  s.lr = lr_.at(lr_step_);
  optimizer_->set_lr(s.lr);
  stage_->train();
  const auto mbs = train_batches_->load(iteration_ * args_.global_batch_size);
  optimizer_->zero_grad();
  auto* opt = optimizer_.get();
  const auto result = pipeline::run_pipeline_step(
      stage_, mbs,
      pipeline::ExecutorOptions()
          .schedule(pipeline::parse_schedule_kind(args_.schedule))
          .loss_scale(scaler_ ? scaler_->scale() : 1.0)
          .before_backward([opt](bool last) { opt->set_grad_sync(last); }));
  // (SP's partial sums and a tied embedding across stages: the optimizer adds them.)
  if (!optimizer_sums_tied_embedding(stage_)) stage_->allreduce_tied_embedding_grads();
  s.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  s.skipped = !optimizer_->step();
  // A skipped step computed no norm worth reporting (Megatron logs none).
  s.grad_norm = s.skipped ? std::nan("") : optimizer_->grad_norm();
  if (!s.skipped) ++lr_step_;
  s.loss = reduce_loss(result.loss.defined() ? result.loss.item<double>() : 0.0);
  ++iteration_;
  s.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!args_.timeline.empty() && iteration_ == std::min<int64_t>(2, args_.train_iters)) {
    const auto records = pipeline::gather_timeline(
        result, state_->pp_size() > 1 ? state_->group_name(GroupKind::kPipeline) : state_->group_name(GroupKind::kTensor));
    if (is_logging_rank()) {
      pipeline::TimelineSvgOptions o;
      o.title = "gpt_pretrain iteration " + std::to_string(iteration_) + ": " + args_.schedule + ", p=" +
                std::to_string(state_->pp_size()) + ", m=" + std::to_string(args_.num_micro_batches);
      pipeline::write_timeline_svg(args_.timeline, records, o);
    }
  }
  return s;
}

void Trainer::log(const IterationStats& s, const std::map<std::string, int64_t>& comm_bytes, double tokens_per_s,
                  double tflops) {
  if (!is_logging_rank()) return;
  const auto mem = optimizer_->memory_stats();
  const int64_t rss = resident_bytes();
  const auto device_mem = device_memory_stats(state_->device());
  // The host's resident set on CPU; the allocator's peak on a GPU.
  const double shown = device_mem.empty() ? rss : device_mem.at("cuda_max_allocated_bytes");
  if (json_.is_open()) {
    nlohmann::json j{{"iteration", s.iteration},   {"loss", s.loss},
                     {"lr", s.lr},                 {"grad_norm", s.grad_norm},
                     {"loss_scale", s.loss_scale}, {"skipped", s.skipped},
                     {"tokens_per_s", tokens_per_s}, {"tflops_per_rank", tflops},
                     {"ms_per_iteration", s.seconds * 1e3}, {"consumed_samples", s.iteration * args_.global_batch_size},
                     {"comm_bytes", comm_bytes}};
    nlohmann::json memory(mem);
    memory["rss_bytes"] = rss;
    for (const auto& [k, v] : device_mem) memory[k] = v;
    j["memory_bytes"] = memory;
    if (last_val_loss_ >= 0) j["val_loss"] = last_val_loss_;
    json_ << j.dump() << "\n";
    json_.flush();
    // An append-only log is not renamed into place, but a lost line (a full disk) must
    // stop the run rather than leave a silently truncated log.
    MEGATORCH_CHECK(json_.good(), "writing the --log-json file '", args_.log_json, "' failed: ", std::strerror(errno),
                    "; free space (or raise the file size limit) and resume from the last checkpoint");
  }
  if (s.iteration % args_.log_interval == 0 || s.iteration == args_.train_iters) {
    std::printf("\r [%s] iteration %6ld/%6ld | consumed samples: %9ld | elapsed time per iteration (ms): %.1f | "
                "learning rate: %.3E | lm loss: %.6E | loss scale: %.1f | grad norm: %.3f | skipped: %d | "
                "tokens/s: %.0f | TFLOP/s per rank: %.4f | memory: %s (optimizer %s)\n",
                "megatorch", s.iteration, args_.train_iters, s.iteration * args_.global_batch_size, s.seconds * 1e3,
                s.lr, s.loss, s.loss_scale, s.grad_norm, s.skipped ? 1 : 0, tokens_per_s, tflops, human(shown).c_str(),
                human(mem.at("total_bytes")).c_str());
  } else {
    std::printf("\r  iteration %ld/%ld  loss %.4f  %.0f ms ", s.iteration, args_.train_iters, s.loss, s.seconds * 1e3);
  }
  std::fflush(stdout);
}

IterationStats Trainer::train() {
  IterationStats last;
  if (args_.eval_only) {
    last_val_loss_ = evaluate(data::Split::kValid, args_.eval_iters);
    if (is_logging_rank()) {
      // Full precision: resharded checkpoints are compared by this number.
      std::printf("[megatorch] validation loss at iteration %ld: %.12E\n", iteration_, last_val_loss_);
      if (json_.is_open()) {
        json_ << nlohmann::json{{"iteration", iteration_}, {"val_loss", last_val_loss_}}.dump() << "\n";
        json_.flush();
        MEGATORCH_CHECK(json_.good(), "writing the --log-json file '", args_.log_json, "' failed: ", std::strerror(errno));
      }
    }
    return last;
  }
  const int64_t first = iteration_;
  while (iteration_ < args_.train_iters) {
    last = train_step();
    // Megatron's memory report: once, after the run's first iteration, from every rank of
    // the first DP replica (the others hold the same).
    if (iteration_ == first + 1 && state_->dp_rank() == 0) {
      const std::string memory = device_memory_line(device_memory_stats(state_->device()));
      if (!memory.empty()) std::printf("\n[Rank %ld] (after %ld iterations) %s\n", state_->rank(), iteration_, memory.c_str());
      std::fflush(stdout);
    }
    std::map<std::string, int64_t> comm_bytes;
    for (auto [kind, key] : {std::pair{GroupKind::kTensor, "tp"}, {GroupKind::kData, "dp"}, {GroupKind::kPipeline, "pp"}}) {
      comm_bytes[key] = comm::comm_stats(state_->group_name(kind)).total().bytes;
    }
    const double tokens_per_s = args_.global_batch_size * args_.seq_length / last.seconds;
    const double tflops = tokens_per_s * flops_per_token_ / static_cast<double>(args_.world_size) / 1e12;
    const bool eval_now = args_.eval_interval > 0 && iteration_ % args_.eval_interval == 0;
    if (eval_now || iteration_ == args_.train_iters) last_val_loss_ = evaluate(data::Split::kValid, args_.eval_iters);
    log(last, comm_bytes, tokens_per_s, tflops);
    // A negative loss means nothing was evaluated (--eval-iters 0, or a split too small).
    if ((eval_now || iteration_ == args_.train_iters) && last_val_loss_ >= 0 && is_logging_rank()) {
      const bool progress_line_open = iteration_ % args_.log_interval != 0 && iteration_ != args_.train_iters;
      if (progress_line_open) std::printf("\n");
      std::printf(" validation loss at iteration %ld | lm loss value: %.6E | lm loss PPL: %.3f\n", iteration_,
                  last_val_loss_, std::exp(last_val_loss_));
      std::fflush(stdout);
    }
    last_val_loss_ = -1;
    if (!args_.save.empty() &&
        ((args_.save_interval > 0 && iteration_ % args_.save_interval == 0) || iteration_ == args_.train_iters)) {
      save_checkpoint();
    }
  }
  return last;
}

double Trainer::evaluate(data::Split split, int64_t iters) {
  const auto& ds = *data_[split];
  if (iters == 0 || ds.size() < args_.global_batch_size) return -1;
  stage_->eval();
  double total = 0;
  // Each evaluation walks the split from its start, so every evaluation sees the same data.
  MicroBatchLoader batches(ds, loader_options());
  // The training schedule's forwards through the executor's p2p (Megatron's forward_only).
  const auto options =
      pipeline::ExecutorOptions().schedule(pipeline::parse_schedule_kind(args_.schedule)).forward_only(true);
  for (int64_t i = 0; i < iters; ++i) {
    const auto result = pipeline::run_pipeline_step(stage_, batches.load(i * args_.global_batch_size), options);
    total += reduce_loss(result.loss.defined() ? result.loss.item<double>() : 0.0);
  }
  stage_->train();
  return total / static_cast<double>(iters);
}

// ---- checkpoints: the model by global parameter name, the optimizer state as each
// parameter's slice of it (a ZeRO range of its TP shard), so any layout loads any other.

std::vector<ckpt::ShardedEntry> Trainer::checkpoint_entries() {
  const int64_t dp_rank = state_->dp_rank();
  // write flags from the model entries say who writes among TP ranks and tied copies.
  auto model = ckpt::pipeline_stage_entries(*stage_, ckpt::GPTEntriesOptions().writer(true));
  std::vector<ckpt::ShardedEntry> out;
  const auto& params = optimizer_->parameters();
  std::vector<const ckpt::ShardedEntry*> of_param(params.size(), nullptr);
  for (const auto& e : model) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (e.tensor.is_same(params[i])) of_param[i] = &e;
    }
  }
  const bool sharded_state = optimizer_->options().zero_stage() >= 1;
  for (auto shard : optimizer_->param_state_shards()) {
    const auto* e = of_param[shard.param];
    MEGATORCH_CHECK(e != nullptr, "gpt_pretrain: optimizer parameter ", shard.param, " has no checkpoint entry");
    const std::string name = e->key.substr(e->key.find('/') + 1);
    for (auto& [kind, t] : shard.tensors) {
      ckpt::ShardedEntry o = *e;
      o.key = "optim/" + kind + "/" + name;
      o.begin = shard.begin;
      o.end = shard.end;
      o.tensor = t;
      o.write = e->write && (sharded_state || dp_rank == 0);
      out.push_back(std::move(o));
    }
  }
  for (auto& e : model) {
    e.write = e.write && dp_rank == 0;
    out.push_back(std::move(e));
  }
  return out;
}

void Trainer::save_checkpoint() {
  const auto start = Clock::now();
  // ZeRO-3 keeps only shards: gather every unit so the model entries are readable.
  for (int64_t u = 0; u < optimizer_->num_units(); ++u) optimizer_->gather_unit(u);
  ckpt::CheckpointState st;
  st.model_config = ckpt::gpt_config_json(model_config(args_));
  st.state = {{"iteration", iteration_},
              {"consumed_samples", iteration_ * args_.global_batch_size},
              {"optimizer_step", optimizer_->step_count()},
              {"lr_step", lr_step_}};
  if (scaler_) st.state["loss_scaler"] = scaler_->state_dict();
  // The default generator and the TP tracker's streams (dropout inside TP regions): a
  // resumed run draws the same masks as an uninterrupted one.
  st.rank_state = {{"cpu_rng", state_bytes(tp::default_generator_state(c10::kCPU))}};
  // On a GPU dropout draws from the device's generator (its seed and offset).
  if (state_->device().is_cuda()) st.rank_state["cuda_rng"] = state_bytes(tp::default_generator_state(state_->device()));
  if (const auto& tracker = stage_->chunk(0)->options.rng()) {
    for (const auto& [name, state] : tracker->snapshot().states) st.rank_state["rng_streams"][name] = state_bytes(state);
  }
  ckpt::save_checkpoint(args_.save, iteration_, checkpoint_entries(), st, state_->group_name(GroupKind::kWorld));
  for (int64_t u = 0; u < optimizer_->num_units(); ++u) optimizer_->release_unit(u);
  if (is_logging_rank()) {
    std::printf("\n[megatorch] saved checkpoint at iteration %ld to %s (%.2f s)\n", iteration_, args_.save.c_str(),
                std::chrono::duration<double>(Clock::now() - start).count());
    std::fflush(stdout);
  }
}

namespace {

// What a checkpoint must match to load: its shapes, and the numbers that change what the
// same weights compute (a Llama-3 resumed with the default RoPE base would train another
// model without a word).
nlohmann::json load_comparison(const transformer::TransformerConfig& c) {
  nlohmann::json j = ckpt::gpt_shape_json(c);
  const nlohmann::json all = ckpt::gpt_config_json(c);
  for (const char* key : {"norm_epsilon", "sliding_window"}) j[key] = all.at(key);
  if (c.position_embedding_type() == transformer::Positions::kRope) j["rotary_base"] = all.at("rotary_base");
  return j;
}

}  // namespace

bool Trainer::load_checkpoint() {
  if (ckpt::latest_iteration(args_.load) < 0) {
    if (is_logging_rank()) std::printf("[megatorch] no checkpoint in %s yet: starting from scratch\n", args_.load.c_str());
    return false;
  }
  const auto meta = ckpt::read_metadata(args_.load);
  bool saved_optimizer = false;
  for (const auto& t : meta.at("tensors").items()) saved_optimizer |= t.key().rfind("optim/", 0) == 0;
  // Megatron's --finetune: the weights only, as if they had been initialised so.
  const bool has_optimizer = saved_optimizer && !args_.finetune && !args_.no_load_optim;
  const bool load_rng = !args_.finetune && !args_.no_load_rng;
  auto entries = checkpoint_entries();
  if (!has_optimizer) {
    entries.erase(std::remove_if(entries.begin(), entries.end(),
                                 [](const ckpt::ShardedEntry& e) { return e.key.rfind("optim/", 0) == 0; }),
                  entries.end());
  }
  for (int64_t u = 0; u < optimizer_->num_units(); ++u) optimizer_->gather_unit(u);
  const auto loaded = ckpt::load_checkpoint(
      args_.load, entries,
      ckpt::LoadOptions().model_config(load_comparison(model_config(args_))).group(state_->group_name(GroupKind::kWorld)));
  if (has_optimizer) {
    optimizer_->copy_master_to_params();  // the fp32 masters are the exact values
  } else {
    optimizer_->copy_params_to_master();  // e.g. imported from HuggingFace
  }
  for (int64_t u = 0; u < optimizer_->num_units(); ++u) optimizer_->release_unit(u);
  const auto& st = loaded.state.state;
  if (!args_.finetune) {
    iteration_ = st.value("iteration", int64_t{0});
    lr_step_ = st.value("lr_step", iteration_);
  }
  if (has_optimizer) {
    optimizer_->set_step_count(st.value("optimizer_step", iteration_));
    if (scaler_ && st.contains("loss_scaler")) scaler_->load_state_dict(st.at("loss_scaler").get<std::map<std::string, double>>());
  }
  const auto& rank_state = loaded.state.rank_state;  // null unless the layout is the same
  if (load_rng && !rank_state.is_null() && rank_state.contains("cpu_rng")) {
    tp::set_default_generator_state(c10::kCPU, state_tensor(rank_state.at("cpu_rng")));
    // A run saved on another kind of device has no state for this one: its masks restart.
    if (state_->device().is_cuda() && rank_state.contains("cuda_rng")) {
      tp::set_default_generator_state(state_->device(), state_tensor(rank_state.at("cuda_rng")));
    }
    const auto& tracker = stage_->chunk(0)->options.rng();
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
                args_.finetune ? ": weights only (--finetune), starting at iteration 0"
                : has_optimizer ? "" : " without optimizer state",
                !args_.finetune && !load_rng ? ", random generators not restored" : "");
    std::fflush(stdout);
  }
  return true;
}

}  // namespace megatorch::train
