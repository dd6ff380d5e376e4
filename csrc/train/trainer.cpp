#include "megatorch/train/trainer.h"

#include <ATen/ATen.h>

#include <cstdio>

#include "megatorch/check.h"
#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/gpt_checkpoint.h"
#include "megatorch/data/token_stats.h"

namespace megatorch::train {
namespace {

// What a checkpoint must match to load: its shapes, and the numbers that change what the
// same weights compute (a Llama-3 resumed with the default RoPE base would train another
// model without a word).
nlohmann::json load_comparison(const transformer::TransformerConfig& c) {
  nlohmann::json j = ckpt::gpt_shape_json(c);
  const nlohmann::json all = ckpt::gpt_config_json(c);
  for (const char* key : {"norm_epsilon", "sliding_window"}) j[key] = all.at(key);
  j["layer_types"] = all.value("layer_types", nlohmann::json::array());
  if (c.position_embedding_type() == transformer::Positions::kRope) {
    for (const char* key : {"rotary_base", "rotary_percent", "rope_scaling"}) j[key] = all.at(key);
  }
  return j;
}

TrainingLoopOptions loop_options(const TrainArguments& a) {
  auto o = TrainingLoopOptions()
               .tensor_parallel(a.tensor_model_parallel_size)
               .pipeline_parallel(a.pipeline_model_parallel_size)
               .context_parallel(a.context_parallel_size)
               .expert_parallel(a.expert_model_parallel_size)
               .expert_tensor_parallel(a.expert_tensor_parallel_size)
               .virtual_chunks(a.virtual_chunks)
               .schedule(a.schedule)
               .zero_stage(a.zero_stage)
               .name("gpt")
               .device(a.device)
               .backend(a.distributed_backend)
               .seed(a.seed)
               .micro_batch_size(a.micro_batch_size)
               .num_micro_batches(a.num_micro_batches)
               .train_iters(a.train_iters)
               .lr(a.lr)
               .min_lr(a.min_lr)
               .lr_warmup_iters(a.lr_warmup_iters)
               .lr_decay_iters(a.lr_decay_iters)
               .lr_decay_style(a.lr_decay_style)
               .weight_decay(a.weight_decay)
               .adam_beta1(a.adam_beta1)
               .adam_beta2(a.adam_beta2)
               .adam_eps(a.adam_eps)
               .clip_grad(a.clip_grad)
               .fp16(a.fp16)
               .initial_loss_scale(a.initial_loss_scale)
               .loss_scale_window(a.loss_scale_window)
               .hysteresis(a.hysteresis)
               .log_interval(a.log_interval)
               .log_json(a.log_json)
               .loss_name("lm loss")
               .log_perplexity(true)
               .tokens_per_sample(a.seq_length)
               .timeline(a.timeline)
               .print_summary(false)  // the Trainer prints gpt_pretrain's own lines
               .eval_interval(a.eval_interval)
               .eval_iters(a.eval_iters)
               .save(a.save)
               .save_interval(a.save_interval)
               .save_grads(a.save_grads)
               .load(a.load)
               .load_iteration(a.ckpt_step)
               .finetune(a.finetune)
               .load_optimizer(!a.no_load_optim)
               .load_rng(!a.no_load_rng)
               .async_save(a.async_save)
               .exit_signal_handler(a.exit_signal_handler)
               .exit_interval(a.exit_interval)
               .exit_duration_in_mins(a.exit_duration_in_mins)
               .check_for_nan_in_loss_and_grad(a.check_for_nan_in_loss_and_grad)
               .skip_nan_steps(a.skip_nan_steps)
               .log_straggler(a.log_straggler)
               .rerun_mode(a.rerun_mode)
               .spike_threshold(a.spike_threshold)
               .gradient_accumulation_fusion(a.gradient_accumulation_fusion)
               .sync_debug_iterations({a.sync_debug_first, a.sync_debug_last})
               .model_config(ckpt::gpt_config_json(model_config(a)))
               .load_comparison(load_comparison(model_config(a)));
  // PaLM appendix B: 6Ψ + 12·L·h·s per token (attention counted in full, not halved for causal).
  const double attention = 12.0 * a.num_layers * a.hidden_size * a.seq_length;
  // With experts Ψ is what one token meets: each MoE layer's E - k idle experts leave it.
  const auto c = model_config(a);
  double idle = 0;
  if (c.num_experts() > 0) {
    const double g = c.activation() == transformer::Activation::kSwiGLU ? 2.0 : 1.0;
    const double bias = c.mlp_bias() ? g * c.moe_ffn() + c.hidden_size() : 0.0;
    const double expert = (g + 1.0) * c.hidden_size() * c.moe_ffn() + bias;
    for (int64_t l = 0; l < c.num_layers(); ++l) {
      if (c.is_moe_layer(l)) idle += static_cast<double>(c.num_experts() - c.moe_router_topk()) * expert;
    }
  }
  o.flops_per_token([attention, idle](int64_t params) {
    return 6.0 * (static_cast<double>(params) - idle) + attention;
  });
  if (a.distributed_timeout_minutes > 0) {
    o.timeout(std::chrono::milliseconds(static_cast<int64_t>(a.distributed_timeout_minutes * 60e3)));
  }
  return o;
}

}  // namespace

Trainer::Trainer(TrainArguments args) : args_(std::move(args)) {
  const auto env = parallel::LaunchEnv::from_environment();
  const bool has_checkpoint = !args_.load.empty() && (args_.ckpt_step >= 0 || ckpt::latest_iteration(args_.load) >= 0);
  MEGATORCH_CHECK(!args_.use_checkpoint_args || has_checkpoint, "gpt_pretrain: --use-checkpoint-args needs a checkpoint "
                  "in --load, found none in '", args_.load, "'");
  MEGATORCH_CHECK(!args_.finetune || has_checkpoint, "gpt_pretrain: --finetune starts from a checkpoint's weights but "
                  "'", args_.load, "' holds none; check the --load path");
  // Evaluating a freshly initialised model would report a loss that looks real.
  MEGATORCH_CHECK(!args_.eval_only || has_checkpoint, "gpt_pretrain: --eval-only evaluates the checkpoint in --load, "
                  "found none in '", args_.load, "'; pass --load DIR of a saved run (its latest_checkpointed_iteration.txt)");
  if (has_checkpoint) {
    const auto saved = ckpt::read_metadata(args_.load, args_.ckpt_step).at("model_config");
    if (args_.use_checkpoint_args) apply_checkpoint_args(args_, saved);
    // Not a shape (loading does not compare it) but a property of the model: a Mistral's
    // window bounds the sequences it may train on (validate() refuses longer ones).
    args_.sliding_window = saved.value("sliding_window", int64_t{0});
    args_.layer_types = saved.value("layer_types", std::vector<std::string>{});
    // RoPE's max positions size no parameter; kept so an export writes the model's own.
    if (saved.value("position_embedding_type", "") == "rope" && !args_.given.count("max-position-embeddings")) {
      args_.max_position_embeddings = std::max(saved.value("max_positions", int64_t{0}), args_.seq_length);
    }
  }
  eod_ = resolve_vocab_size(args_);
  validate(args_, env.world_size);
  // The device is chosen (and a launch that cannot work refused, on every rank) before
  // anything connects.
  loop_ = std::make_unique<TrainingLoop>(loop_options(args_));
  auto config = model_config(args_);
  config.device(loop_->device()).context_parallel_group(loop_->cp_group());
  if (args_.expert_model_parallel_size > 1) config.expert_parallel_group(loop_->ep_group());
  if (args_.expert_tensor_parallel_size > 1) config.expert_tensor_parallel_group(loop_->etp_group());
  stage_ = pipeline::PipelineStage(pipeline::PipelineStageOptions(config)
                                       .tp_group(loop_->tp_group())
                                       .pp_group(loop_->pp_group())
                                       .virtual_chunks(args_.virtual_chunks)
                                       .chunk_layout(pipeline::chunk_layout(pipeline::parse_schedule_kind(args_.schedule))));
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
  // Builds the optimizer over the stage's parameters and loads --load.
  loop_->set_model(stage_.ptr());
  if (is_logging_rank()) {
    const std::string cp = args_.context_parallel_size > 1
                               ? " x cp " + std::to_string(args_.context_parallel_size) + " (" + args_.cp_comm_type + ")"
                               : "";
    const std::string experts =
        args_.num_experts > 0 ? ", " + std::to_string(args_.num_experts) + " experts (top-" +
                                    std::to_string(args_.moe_router_topk) + ") over ep " +
                                    std::to_string(args_.expert_model_parallel_size) + ", " + args_.moe_token_dispatcher_type
                              : "";
    std::printf("[megatorch] gpt_pretrain: world %ld = tp %ld%s x pp %ld (v %ld) x dp %ld%s, ZeRO-%ld, %s, %ld parameters\n",
                args_.world_size, args_.tensor_model_parallel_size, cp.c_str(), args_.pipeline_model_parallel_size,
                args_.virtual_chunks, args_.data_parallel_size, experts.c_str(), args_.zero_stage,
                args_.bf16 ? "bf16" : args_.fp16 ? "fp16" : "fp32", loop_->num_parameters());
    std::printf("[megatorch] global batch %ld = micro-batch %ld x %ld micro-batches x dp %ld; train samples %ld, "
                "valid %ld\n",
                args_.global_batch_size, args_.micro_batch_size, args_.num_micro_batches, args_.data_parallel_size,
                data_.train->size(), data_.valid->size());
    std::printf("[megatorch] tokenizer %s: vocabulary %ld (padded to %ld), end of document %ld\n",
                args_.tokenizer.tokenizer_type().c_str(), args_.vocab_size,
                tp::padded_vocab_size(args_.vocab_size, args_.tensor_model_parallel_size, args_.make_vocab_size_divisible_by),
                eod_);
    std::fflush(stdout);
  }
}

Trainer::~Trainer() = default;

MicroBatchLoaderOptions Trainer::loader_options() const {
  return MicroBatchLoaderOptions()
      .micro_batch_size(args_.micro_batch_size)
      .num_micro_batches(args_.num_micro_batches)
      .data_parallel_size(args_.data_parallel_size)
      .data_parallel_rank(loop_->dp_rank())
      .seq_length(args_.seq_length)
      .device(loop_->device())
      .eod(eod_)
      .reset_position_ids(args_.reset_position_ids)
      .reset_attention_mask(args_.reset_attention_mask)
      .eod_mask_loss(args_.eod_mask_loss);
}

IterationStats Trainer::train_step() {
  return loop_->train_step(train_batches_->load(loop_->iteration() * args_.global_batch_size));
}

BatchSource Trainer::eval_source(data::Split split) const {
  // Each evaluation walks the split from its start, so every evaluation sees the same data.
  auto loader = std::make_shared<std::unique_ptr<MicroBatchLoader>>();
  return [this, split, loader](int64_t i) -> std::vector<pipeline::MicroBatch> {
    const auto& ds = *data_[split];
    if (ds.size() < args_.global_batch_size) return {};
    if (i == 0 || !*loader) *loader = std::make_unique<MicroBatchLoader>(ds, loader_options());
    return (*loader)->load(i * args_.global_batch_size);
  };
}

double Trainer::evaluate(data::Split split, int64_t iters) { return loop_->evaluate(eval_source(split), iters); }

IterationStats Trainer::train() {
  if (args_.eval_only) {
    const double loss = evaluate(data::Split::kValid, args_.eval_iters);
    if (is_logging_rank()) {
      // Full precision: resharded checkpoints are compared by this number.
      std::printf("[megatorch] validation loss at iteration %ld: %.12E\n", iteration(), loss);
      std::fflush(stdout);
    }
    loop_->write_log_json({{"iteration", iteration()}, {"val_loss", loss}});
    return {};
  }
  return loop_->train([this](int64_t step) { return train_batches_->load(step * args_.global_batch_size); },
                      eval_source(data::Split::kValid));
}

}  // namespace megatorch::train
