#include "megatorch/train/arguments.h"

#include <CLI/CLI.hpp>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "megatorch/check.h"
#include "megatorch/ckpt/gpt_checkpoint.h"
#include "rope_flags.h"
#include "megatorch/data/gpt_datasets.h"
#include "megatorch/data/preprocess.h"
#include "megatorch/data/tokenizer_flags.h"
#include "megatorch/pipeline/schedule.h"
#include "megatorch/util/cli_last_wins.h"

namespace megatorch::train {

TrainArguments parse_arguments(int argc, char** argv, bool* help_printed) {
  TrainArguments a;
  CLI::App app{"gpt_pretrain: GPT pretraining with tensor, sequence, pipeline and data parallelism (ZeRO 0-3).\n"
               "Launch with torchrun --no-python; flags follow Megatron-LM's names."};
  app.option_defaults()->always_capture_default();
  // Device and communication
  app.add_option("--device", a.device,
                 "auto: cuda:LOCAL_RANK when CUDA is available, else cpu; cuda:N puts every rank of a node on GPU N "
                 "(with --distributed-backend gloo)");
  app.add_option("--distributed-backend", a.distributed_backend, "backend of device tensors: auto (NCCL on CUDA), nccl, gloo")
      ->check(CLI::IsMember({"auto", "nccl", "gloo"}));
  app.add_option("--distributed-timeout-minutes", a.distributed_timeout_minutes,
                 "timeout of every collective; 0: MEGATORCH_COMM_TIMEOUT_S if set, else 10");
  // Parallelism
  app.add_option("--tensor-model-parallel-size", a.tensor_model_parallel_size, "TP size");
  app.add_option("--pipeline-model-parallel-size", a.pipeline_model_parallel_size, "PP size");
  app.add_option("--context-parallel-size", a.context_parallel_size,
                 "CP size: ranks that split each sequence, attention included");
  app.add_option("--cp-comm-type", a.cp_comm_type,
                 "how attention crosses the CP ranks: p2p (ring attention, causal load balancing) or a2a (Ulysses)")
      ->check(CLI::IsMember({"p2p", "a2a"}));
  app.add_option("--expert-model-parallel-size", a.expert_model_parallel_size,
                 "EP size: ranks the experts are spread over, inside tp x cp x dp (Megatron's parallel folding)");
  app.add_option("--expert-tensor-parallel-size", a.expert_tensor_parallel_size,
                 "TP size inside each expert: each expert's FFN columns split over this many ranks (default 1: every "
                 "expert whole on its rank; Megatron defaults it to --tensor-model-parallel-size)");
  app.add_option("--num-layers-per-virtual-pipeline-stage", a.num_layers_per_virtual_pipeline_stage,
                 "layers per virtual stage (interleaved 1F1B)");
  app.add_flag("--sequence-parallel", a.sequence_parallel, "sequence parallelism (needs TP > 1)");
  // The pipeline's own parser (its aliases too); the name kept is its canonical spelling.
  auto* schedule = app.add_option("--schedule", a.schedule,
                                  std::string("pipeline schedule: ") + pipeline::schedule_kind_names())
                       ->transform(CLI::Validator(
                           [](std::string& name) {
                             const auto kind = pipeline::find_schedule_kind(name);
                             if (!kind) {
                               return "expected " + std::string(pipeline::schedule_kind_names()) + ", got '" + name +
                                      "'";
                             }
                             name = pipeline::schedule_kind_name(*kind);
                             return std::string();
                           },
                           "SCHEDULE"));
  app.add_option("--zero-stage", a.zero_stage, "ZeRO stage 0-3 (default: 1 with --use-distributed-optimizer, else 0)")
      ->check(CLI::Range(0, 3));
  app.add_flag("--use-distributed-optimizer", a.use_distributed_optimizer, "shard optimizer states (ZeRO-1)");
  // Model
  app.add_option("--num-layers", a.num_layers);
  app.add_option("--hidden-size", a.hidden_size);
  app.add_option("--ffn-hidden-size", a.ffn_hidden_size, "0: 4 x hidden");
  app.add_option("--num-attention-heads", a.num_attention_heads);
  app.add_flag("--group-query-attention", a.group_query_attention);
  app.add_option("--num-query-groups", a.num_query_groups);
  app.add_option("--kv-channels", a.kv_channels, "each attention head's channels (0: hidden size / heads)");
  app.add_option("--seq-length", a.seq_length);
  app.add_option("--max-position-embeddings", a.max_position_embeddings, "0: seq-length");
  app.add_option("--position-embedding-type", a.position_embedding_type)
      ->check(CLI::IsMember({"learned_absolute", "rope"}));
  app.add_option("--normalization", a.normalization)->check(CLI::IsMember({"LayerNorm", "RMSNorm"}));
  app.add_flag("--swiglu", a.swiglu);
  app.add_flag("--untie-embeddings-and-output-weights", a.untie_embeddings_and_output_weights);
  app.add_flag("--disable-bias-linear", a.disable_bias_linear, "no biases on the linear layers (Llama, Mistral, Qwen2)");
  app.add_flag("--add-qkv-bias", a.add_qkv_bias, "biases on the QKV projection even with --disable-bias-linear (Qwen2)");
  app.add_flag("--add-attention-bias", a.add_attention_bias,
               "biases on q, k, v and the output projection even with --disable-bias-linear (HF attention_bias)");
  app.add_flag("--add-mlp-bias", a.add_mlp_bias, "biases on the MLP even with --disable-bias-linear (HF mlp_bias)");
  app.add_flag("--qk-layernorm", a.qk_layernorm, "normalise each query and key head before RoPE (Qwen3)");
  app.add_option("--rotary-base", a.rotary_base, "RoPE base (HF rope_theta)");
  app.add_option("--rotary-percent", a.rotary_percent, "fraction of each head's channels RoPE rotates");
  app.add_option("--rope-type", a.rope_type, "RoPE scaling: default, linear, dynamic, yarn or llama3 (HF's rope_type)");
  app.add_option("--rope-scaling-factor", a.rope_scaling_factor, "RoPE scaling factor (default 8, Megatron's)");
  app.add_flag("--use-rope-scaling", a.use_rope_scaling,
               "Llama 3.1's RoPE scaling: llama3 with --rope-scaling-factor, frequency factors 1 and 4, context 8192");
  app.add_option("--original-max-position-embeddings", a.original_max_position_embeddings,
                 "the context RoPE scaling extends (llama3, yarn; dynamic scales above it)");
  app.add_option("--norm-epsilon", a.norm_epsilon, "epsilon of LayerNorm / RMSNorm");
  app.add_option("--init-method-std", a.init_method_std, "standard deviation of the weights' normal initialisation");
  app.add_option("--make-vocab-size-divisible-by", a.make_vocab_size_divisible_by,
                 "pad the vocabulary to a multiple of this x TP size");
  app.add_option("--vocab-size", a.vocab_size,
                 "model vocabulary; 0: the tokenizer's (257 for ByteLevel; PreTokenized data needs it)");
  megatorch::data::add_tokenizer_options(app, a.tokenizer);
  app.add_option("--hidden-dropout", a.hidden_dropout);
  app.add_option("--attention-dropout", a.attention_dropout);
  app.add_option("--recompute-granularity", a.recompute_granularity)->check(CLI::IsMember({"", "selective", "full"}));
  // Mixture of experts
  app.add_option("--num-experts", a.num_experts, "experts per MoE layer; 0: a dense model");
  app.add_option("--moe-router-topk", a.moe_router_topk, "experts per token");
  app.add_option("--moe-ffn-hidden-size", a.moe_ffn_hidden_size, "each expert's hidden size; 0: --ffn-hidden-size");
  app.add_option("--moe-layer-freq", a.moe_layer_freq, "every N-th layer (0, N, 2N, ...) is an MoE layer");
  app.add_option("--moe-first-k-dense", a.moe_first_k_dense, "the first K layers stay dense (DeepSeek)");
  app.add_option("--moe-shared-expert-intermediate-size", a.moe_shared_expert_intermediate_size,
                 "hidden size of the shared expert every token passes through; 0: none");
  app.add_option("--moe-router-score-function", a.moe_router_score_function)->check(CLI::IsMember({"softmax", "sigmoid"}));
  app.add_flag("--moe-router-pre-softmax", a.moe_router_pre_softmax,
               "softmax over all experts before the top-k (Mixtral); default: top-k logits, then softmax");
  app.add_flag("--moe-router-norm-topk-prob", a.moe_router_norm_topk_prob, "renormalise the k weights to sum to 1");
  app.add_option("--moe-router-topk-scaling-factor", a.moe_router_topk_scaling_factor, "multiplies the k weights");
  app.add_option("--moe-aux-loss-coeff", a.moe_aux_loss_coeff, "Switch load-balancing loss coefficient");
  app.add_option("--moe-z-loss-coeff", a.moe_z_loss_coeff, "router z-loss coefficient");
  app.add_flag("--moe-router-enable-expert-bias", a.moe_router_enable_expert_bias,
               "auxiliary-loss-free balancing (DeepSeek-V3): a bias on the choice, moved after each step");
  app.add_option("--moe-router-bias-update-rate", a.moe_router_bias_update_rate);
  app.add_option("--moe-expert-capacity-factor", a.moe_expert_capacity_factor, "<= 0: dropless");
  app.add_flag("--moe-pad-expert-input-to-capacity", a.moe_pad_expert_input_to_capacity);
  app.add_option("--moe-token-dispatcher-type", a.moe_token_dispatcher_type)
      ->check(CLI::IsMember({"alltoall", "allgather"}));
  app.add_flag("--moe-grouped-gemm,!--no-moe-grouped-gemm", a.moe_grouped_gemm,
               "one grouped GEMM over the local experts (default); --no-moe-grouped-gemm: one GEMM per expert");
  // Batches
  app.add_option("--micro-batch-size", a.micro_batch_size);
  app.add_option("--global-batch-size", a.global_batch_size, "0: micro-batch-size x DP");
  app.add_option("--train-iters", a.train_iters);
  // Optimizer and learning rate
  app.add_option("--lr", a.lr);
  app.add_option("--min-lr", a.min_lr);
  app.add_option("--lr-warmup-iters", a.lr_warmup_iters);
  app.add_option("--lr-decay-style", a.lr_decay_style)->check(CLI::IsMember({"constant", "linear", "cosine"}));
  app.add_option("--lr-decay-iters", a.lr_decay_iters, "0: train-iters");
  app.add_option("--weight-decay", a.weight_decay);
  app.add_option("--adam-beta1", a.adam_beta1);
  app.add_option("--adam-beta2", a.adam_beta2);
  app.add_option("--adam-eps", a.adam_eps);
  app.add_option("--clip-grad", a.clip_grad, "max global gradient L2 norm; 0: off");
  app.add_flag("--gradient-accumulation-fusion,!--no-gradient-accumulation-fusion", a.gradient_accumulation_fusion,
               "the tensor-parallel layers' weight-gradient GEMMs accumulate into the gradient buffer (default); "
               "--no-gradient-accumulation-fusion: each weight gradient added in a pass of its own");
  app.add_flag("--cuda-graph,--enable-cuda-graph", a.cuda_graph,
               "run the layers' forward and backward as captured CUDA graphs where they can be (one GPU per "
               "stage, no dropout or recomputation); elsewhere they run eagerly and the model says why");
  app.add_option("--sync-debug-iters", a.sync_debug_iters,
                 "FIRST[-LAST]: these iterations' steps run under CUDA's sync debug mode 'error', so a "
                 "device-to-host synchronisation inside the step fails the run naming it (a check; CPU: nothing to do)");
  // Mixed precision
  app.add_flag("--bf16", a.bf16);
  app.add_flag("--fp16", a.fp16);
  app.add_option("--initial-loss-scale", a.initial_loss_scale);
  app.add_option("--loss-scale-window", a.loss_scale_window);
  app.add_option("--hysteresis", a.hysteresis);
  app.add_option("--fp8-format", a.fp8_format,
                 "FP8 GEMMs in the transformer layers: e4m3 (every operand), hybrid (E5M2 output gradients)");
  app.add_option("--fp8-recipe", a.fp8_recipe, "tensorwise (current scaling) | delayed (amax history; default)");
  app.add_option("--fp8-amax-history-len", a.fp8_amax_history_len, "delayed: amaxes kept per tensor");
  app.add_option("--fp8-amax-compute-algo", a.fp8_amax_compute_algo, "delayed: most_recent | max of the history");
  app.add_option("--fp8-margin", a.fp8_margin, "delayed: scale = fp8_max / amax / 2^margin");
  app.add_flag("--first-last-layers-bf16", a.first_last_layers_bf16,
               "keep the first and last layers' GEMMs in bf16 under --fp8-format");
  app.add_option("--num-layers-at-start-in-bf16", a.num_layers_at_start_in_bf16, "with --first-last-layers-bf16");
  app.add_option("--num-layers-at-end-in-bf16", a.num_layers_at_end_in_bf16, "with --first-last-layers-bf16");
  // Data
  app.add_option("--data-path", a.data_path, "[weight] prefix [weight prefix ...] of .bin/.idx datasets");
  app.add_option("--split", a.split, "train,valid,test weights");
  app.add_flag("--reset-position-ids", a.reset_position_ids, "positions restart after each end-of-document token");
  app.add_flag("--reset-attention-mask", a.reset_attention_mask, "attention stays inside each packed document");
  app.add_flag("--eod-mask-loss", a.eod_mask_loss, "no loss on predicting the token after an end of document");
  // Checkpoints
  app.add_option("--save", a.save);
  app.add_option("--load", a.load);
  app.add_option("--ckpt-step", a.ckpt_step,
                 "load this iteration of --load instead of the one latest_checkpointed_iteration.txt names (e.g. the "
                 "save before a damaged one)");
  app.add_option("--save-interval", a.save_interval);
  app.add_flag("--save-grads", a.save_grads,
               "also save the gradients each checkpoint's last step applied (optim/grad/<name>, never loaded)");
  app.add_flag("--use-checkpoint-args", a.use_checkpoint_args,
               "take the model's shape from the checkpoint in --load (a disagreeing flag is an error)");
  app.add_flag("--finetune", a.finetune,
               "load the weights only: iteration 0, fresh optimizer, data from the start, RNG not restored");
  app.add_flag("--no-load-optim", a.no_load_optim, "do not load the optimizer state (nor the loss scaler)");
  app.add_flag("--no-load-rng", a.no_load_rng, "do not restore the random generators' states");
  app.add_flag("--async-save", a.async_save,
               "write checkpoints in the background (copied to host memory first); latest moves when every rank's "
               "files are complete");
  // Fault tolerance
  app.add_flag("--exit-signal-handler", a.exit_signal_handler,
               "on SIGTERM or SIGINT finish the iteration, save (--save) and exit 0");
  app.add_option("--exit-interval", a.exit_interval, "save and exit 0 after every this many iterations (0: never)");
  app.add_option("--exit-duration-in-mins", a.exit_duration_in_mins,
                 "save and exit 0 once this many minutes have passed (0: never)");
  app.add_flag("--check-for-nan-in-loss-and-grad,!--no-check-for-nan-in-loss-and-grad", a.check_for_nan_in_loss_and_grad,
               "stop before the optimizer step when the loss or the reduced gradients hold NaN or Inf (default on)");
  app.add_option("--skip-nan-steps", a.skip_nan_steps,
                 "skip up to this many steps whose loss or gradients are NaN / Inf (each logged), then stop");
  app.add_option("--rerun-mode", a.rerun_mode,
                 "validate_results: rerun a step whose loss is NaN / Inf or spikes, to tell a transient fault from "
                 "a data fault (default: disabled)")
      ->check(CLI::IsMember({"disabled", "validate_results"}));
  app.add_option("--spike-threshold", a.spike_threshold,
                 "--rerun-mode validate_results: a loss above this times the mean of the last 20 is rerun (default 10)");
  app.add_flag("--log-straggler", a.log_straggler,
               "each log interval: every rank's compute time, min/median/max and the slowest rank");
  // Evaluation and logging
  app.add_option("--eval-interval", a.eval_interval);
  app.add_option("--eval-iters", a.eval_iters);
  app.add_flag("--eval-only", a.eval_only, "load, evaluate, exit");
  app.add_option("--seed", a.seed);
  app.add_option("--log-interval", a.log_interval);
  app.add_option("--log-json", a.log_json, "one JSON object per iteration");
  app.add_option("--timeline", a.timeline, "SVG of one iteration's pipeline schedule");
  try {
    a.overrides = util::parse_last_wins(app, argc, argv, "gpt_pretrain");
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    if (help_printed) *help_printed = true;
    return a;
  } catch (const CLI::ParseError& e) {
    MEGATORCH_FAIL("gpt_pretrain: ", e.what(), " (run with --help for the flags)");
  }
  if (schedule->count() == 0 && a.num_layers_per_virtual_pipeline_stage > 0) a.schedule = "interleaved";
  for (const CLI::Option* o : app.get_options()) {
    if (o->count() > 0 && !o->get_lnames().empty()) a.given.insert(o->get_lnames().front());
  }
  return a;
}

int64_t resolve_vocab_size(TrainArguments& a) {
  const auto& t = a.tokenizer;
  const bool library = t.tokenizer_type() != "ByteLevel" && t.tokenizer_type() != "PreTokenized";
  if (!library) {
    if (t.tokenizer_type() == "ByteLevel" && a.vocab_size == 0) a.vocab_size = data::kByteLevelVocabSize;
    MEGATORCH_CHECK(t.tokenizer_type() != "ByteLevel" || a.vocab_size >= data::kByteLevelVocabSize,
                    "gpt_pretrain: the model's vocabulary (", a.vocab_size, a.use_checkpoint_args ? ", from the checkpoint"
                    : ", --vocab-size", ") is smaller than the ByteLevel tokenizer's ", data::kByteLevelVocabSize,
                    " ids; give the model's tokenizer with --tokenizer-type, or a larger --vocab-size");
    MEGATORCH_CHECK(a.vocab_size > 0, "gpt_pretrain: --tokenizer-type PreTokenized needs --vocab-size (the ids' "
                    "vocabulary), got ", a.vocab_size);
    return t.tokenizer_type() == "ByteLevel" ? data::kByteLevelEod : t.eod_id();
  }
  const auto tokenizer = data::build_tokenizer(t);
  const int64_t need = tokenizer->vocab_size();
  if (a.vocab_size == 0) a.vocab_size = need;
  // A model may have more rows than its tokenizer has ids (HF checkpoints often do), never fewer.
  MEGATORCH_CHECK(a.vocab_size >= need, "gpt_pretrain: the model's vocabulary (", a.vocab_size,
                  a.use_checkpoint_args ? ", from the checkpoint" : ", --vocab-size", ") is smaller than the ",
                  tokenizer->name(), " tokenizer's ", need, " ids; use the tokenizer the model was trained with");
  return tokenizer->eod();
}

namespace {

// The largest --distributed-timeout-minutes (about two years): far beyond any real wait,
// and small enough that the timeout in nanoseconds (as NCCL's watchdog keeps it) fits int64.
constexpr double kMaxTimeoutMinutes = 1e6;

// Range checks written so that NaN fails them (every comparison with NaN is false).
void check_at_least(const char* flag, int64_t v, int64_t least) {
  MEGATORCH_CHECK(v >= least, "gpt_pretrain: expected --", flag, " >= ", least, ", got ", v);
}
void check_non_negative(const char* flag, double v) {
  MEGATORCH_CHECK(std::isfinite(v) && v >= 0, "gpt_pretrain: expected --", flag, " to be a finite number >= 0, got ", v);
}
void check_positive(const char* flag, double v) {
  MEGATORCH_CHECK(std::isfinite(v) && v > 0, "gpt_pretrain: expected --", flag, " to be a finite number > 0, got ", v);
}
void check_unit_interval(const char* flag, double v) {
  MEGATORCH_CHECK(v >= 0 && v < 1, "gpt_pretrain: expected --", flag, " in [0, 1), got ", v);
}

// "FIRST" or "FIRST-LAST", iterations counted from 1 as the log counts them.
std::pair<int64_t, int64_t> parse_iteration_range(const std::string& text, const char* flag) {
  int64_t first = 0, last = 0;
  char dash = 0;
  std::istringstream in(text);
  bool ok = static_cast<bool>(in >> first);
  if (ok && in >> dash) {
    ok = dash == '-' && static_cast<bool>(in >> last) && (in >> std::ws).eof();
  } else {
    last = first;
  }
  MEGATORCH_CHECK(ok && first >= 1 && last >= first, "gpt_pretrain: expected --", flag,
                  " to be an iteration or a range FIRST-LAST of them (1 <= FIRST <= LAST), e.g. 4-6, got '", text, "'");
  return {first, last};
}

// Each flag on its own, by name, before anything combines them (a product of garbage
// overflows, and a message naming two flags leaves the user to guess which was wrong).
void check_each_flag(const TrainArguments& a) {
  check_at_least("tensor-model-parallel-size", a.tensor_model_parallel_size, 1);
  check_at_least("pipeline-model-parallel-size", a.pipeline_model_parallel_size, 1);
  check_at_least("context-parallel-size", a.context_parallel_size, 1);
  check_at_least("expert-model-parallel-size", a.expert_model_parallel_size, 1);
  check_at_least("expert-tensor-parallel-size", a.expert_tensor_parallel_size, 1);
  check_at_least("num-layers-per-virtual-pipeline-stage", a.num_layers_per_virtual_pipeline_stage, 0);
  check_at_least("num-layers", a.num_layers, 1);
  check_at_least("hidden-size", a.hidden_size, 1);
  check_at_least("ffn-hidden-size", a.ffn_hidden_size, 0);
  check_at_least("num-attention-heads", a.num_attention_heads, 1);
  check_at_least("num-query-groups", a.num_query_groups, 0);
  check_at_least("seq-length", a.seq_length, 1);
  check_at_least("max-position-embeddings", a.max_position_embeddings, 0);
  check_at_least("make-vocab-size-divisible-by", a.make_vocab_size_divisible_by, 1);
  check_positive("rotary-base", a.rotary_base);
  check_positive("norm-epsilon", a.norm_epsilon);
  check_non_negative("init-method-std", a.init_method_std);
  check_unit_interval("hidden-dropout", a.hidden_dropout);
  check_unit_interval("attention-dropout", a.attention_dropout);
  check_at_least("micro-batch-size", a.micro_batch_size, 1);
  MEGATORCH_CHECK(a.global_batch_size >= 0, "gpt_pretrain: expected --global-batch-size >= 1 (or 0: --micro-batch-size x "
                  "data-parallel size), got ", a.global_batch_size);
  check_at_least("train-iters", a.train_iters, 0);
  check_non_negative("lr", a.lr);
  check_non_negative("min-lr", a.min_lr);
  check_at_least("lr-warmup-iters", a.lr_warmup_iters, 0);
  MEGATORCH_CHECK(a.lr_decay_iters >= 0, "gpt_pretrain: expected --lr-decay-iters >= 1 (or 0: --train-iters), got ",
                  a.lr_decay_iters);
  check_non_negative("weight-decay", a.weight_decay);
  check_unit_interval("adam-beta1", a.adam_beta1);
  check_unit_interval("adam-beta2", a.adam_beta2);
  check_positive("adam-eps", a.adam_eps);
  MEGATORCH_CHECK(std::isfinite(a.clip_grad) && a.clip_grad >= 0, "gpt_pretrain: expected --clip-grad to be a finite "
                  "number >= 0 (0: no clipping), got ", a.clip_grad);
  check_positive("initial-loss-scale", a.initial_loss_scale);
  check_at_least("loss-scale-window", a.loss_scale_window, 1);
  check_at_least("hysteresis", a.hysteresis, 1);
  check_at_least("save-interval", a.save_interval, 0);
  check_at_least("exit-interval", a.exit_interval, 0);
  check_at_least("skip-nan-steps", a.skip_nan_steps, 0);
  check_non_negative("exit-duration-in-mins", a.exit_duration_in_mins);
  MEGATORCH_CHECK(std::isfinite(a.spike_threshold) && a.spike_threshold > 1, "gpt_pretrain: expected "
                  "--spike-threshold to be a finite number > 1, got ", a.spike_threshold);
  check_at_least("eval-interval", a.eval_interval, 0);
  check_at_least("eval-iters", a.eval_iters, 0);
  check_at_least("log-interval", a.log_interval, 1);
  // 0 means "the default"; otherwise at least a millisecond, the timeout's resolution (a
  // smaller one truncates to 0 ms, which the backends read as "no timeout" or "now").
  const double t = a.distributed_timeout_minutes;
  MEGATORCH_CHECK(t == 0 || (t * 60e3 >= 1 && t <= kMaxTimeoutMinutes),
                  "gpt_pretrain: expected --distributed-timeout-minutes to be 0 (MEGATORCH_COMM_TIMEOUT_S, else 10) or a "
                  "finite number of minutes in [1 ms = ", 1.0 / 60e3, ", ", kMaxTimeoutMinutes, "], got ", t);
  // The shares' syntax, here rather than when the datasets are built (after connecting).
  data::parse_split(a.split);
}

// The FP8 flags: a known format and recipe (with the valid lists), a dtype FP8 GEMMs
// accept, and the bf16 layer counts leaving at least one layer in FP8.
void validate_fp8_arguments(const TrainArguments& a) {
  if (a.fp8_format.empty()) return;
  fp8::parse_format(a.fp8_format);
  fp8::parse_recipe(a.fp8_recipe);
  fp8::parse_amax_algo(a.fp8_amax_compute_algo);
  check_at_least("fp8-amax-history-len", a.fp8_amax_history_len, 1);
  check_at_least("fp8-margin", a.fp8_margin, 0);
  MEGATORCH_CHECK(!a.fp16, "gpt_pretrain: --fp8-format with --fp16 is refused: FP8 GEMMs keep their own per-tensor "
                  "scales, and fp16's dynamic loss scale would rescale the gradients they quantise between steps. "
                  "Use --bf16 (or fp32 params) with --fp8-format");
  if (a.first_last_layers_bf16) {
    check_at_least("num-layers-at-start-in-bf16", a.num_layers_at_start_in_bf16, 0);
    check_at_least("num-layers-at-end-in-bf16", a.num_layers_at_end_in_bf16, 0);
    MEGATORCH_CHECK(a.num_layers_at_start_in_bf16 + a.num_layers_at_end_in_bf16 < a.num_layers,
                    "gpt_pretrain: --num-layers-at-start-in-bf16 ", a.num_layers_at_start_in_bf16,
                    " + --num-layers-at-end-in-bf16 ", a.num_layers_at_end_in_bf16, " leave none of the ", a.num_layers,
                    " layers in FP8; lower them or drop --fp8-format");
  }
}

fp8::Fp8Options fp8_options(const TrainArguments& a) {
  if (a.fp8_format.empty()) return {};
  return fp8::Fp8Options()
      .format(fp8::parse_format(a.fp8_format))
      .recipe(fp8::parse_recipe(a.fp8_recipe))
      .amax_history_len(a.fp8_amax_history_len)
      .amax_compute_algo(fp8::parse_amax_algo(a.fp8_amax_compute_algo))
      .margin(a.fp8_margin);
}

}  // namespace

void validate(TrainArguments& a, int64_t world) {
  check_each_flag(a);
  if (!a.sync_debug_iters.empty()) {
    std::tie(a.sync_debug_first, a.sync_debug_last) = parse_iteration_range(a.sync_debug_iters, "sync-debug-iters");
  }
  const int64_t tp = a.tensor_model_parallel_size, pp = a.pipeline_model_parallel_size, cp = a.context_parallel_size;
  // Divided rather than multiplied: tp x pp of two huge sizes overflows int64.
  const bool fits = tp <= world && pp <= world / tp && cp <= world / (tp * pp);
  // Without CP the message names only the sizes the user set.
  const std::string kinds = cp == 1 ? "tensor x pipeline" : "tensor x context x pipeline";
  const std::string sizes = std::to_string(tp) + (cp == 1 ? "" : " x " + std::to_string(cp)) + " x " + std::to_string(pp);
  MEGATORCH_CHECK(fits && world % (tp * cp * pp) == 0, "gpt_pretrain: expected ", kinds, " parallel size (", sizes,
                  fits ? " = " + std::to_string(tp * cp * pp) : std::string(" > world size"), ") to divide the world size ",
                  world, "; change --tensor-model-parallel-size", cp == 1 ? "" : " / --context-parallel-size",
                  " / --pipeline-model-parallel-size or the number of processes");
  a.world_size = world;
  MEGATORCH_CHECK(!a.use_checkpoint_args || !a.load.empty(), "gpt_pretrain: --use-checkpoint-args needs --load DIR");
  MEGATORCH_CHECK(!a.finetune || !a.load.empty(), "gpt_pretrain: --finetune needs --load DIR (the weights to start from)");
  MEGATORCH_CHECK(a.vocab_size >= 1, "gpt_pretrain: expected --vocab-size >= 1, got ", a.vocab_size);
  a.data_parallel_size = world / (tp * cp * pp);
  const int64_t dp = a.data_parallel_size;
  MEGATORCH_CHECK(!(a.bf16 && a.fp16), "gpt_pretrain: --bf16 and --fp16 contradict each other; pick one");
  validate_fp8_arguments(a);
  MEGATORCH_CHECK(!a.sequence_parallel || tp > 1,
                  "gpt_pretrain: --sequence-parallel needs --tensor-model-parallel-size > 1, got ", tp);
  // micro x dp below cannot overflow: dp <= world, and the check keeps the product in range.
  MEGATORCH_CHECK(a.micro_batch_size <= std::numeric_limits<int64_t>::max() / dp, "gpt_pretrain: --micro-batch-size ",
                  a.micro_batch_size, " x data-parallel size ", dp, " overflows; expected a batch that fits in memory");
  if (a.global_batch_size == 0) a.global_batch_size = a.micro_batch_size * dp;
  MEGATORCH_CHECK(a.global_batch_size % (a.micro_batch_size * dp) == 0, "gpt_pretrain: expected --global-batch-size (",
                  a.global_batch_size, ") to be a multiple of --micro-batch-size x data-parallel size (", a.micro_batch_size,
                  " x ", dp, " = ", a.micro_batch_size * dp, "); change one of them");
  a.num_micro_batches = a.global_batch_size / (a.micro_batch_size * dp);
  MEGATORCH_CHECK(a.num_layers >= pp, "gpt_pretrain: expected at least one layer per pipeline stage; got --num-layers ",
                  a.num_layers, " over ", pp, " stages");
  if (a.num_layers_per_virtual_pipeline_stage > 0) {
    const int64_t per_stage = a.num_layers / pp;
    MEGATORCH_CHECK(a.num_layers % pp == 0 && per_stage % a.num_layers_per_virtual_pipeline_stage == 0 &&
                        per_stage / a.num_layers_per_virtual_pipeline_stage >= 1,
                    "gpt_pretrain: expected --num-layers-per-virtual-pipeline-stage (", a.num_layers_per_virtual_pipeline_stage,
                    ") to divide the layers per stage (", a.num_layers, " / ", pp, ")");
    a.virtual_chunks = per_stage / a.num_layers_per_virtual_pipeline_stage;
    MEGATORCH_CHECK(pp > 1, "gpt_pretrain: --num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1");
  }
  const pipeline::ScheduleKind kind = pipeline::parse_schedule_kind(a.schedule);
  if (pipeline::chunk_layout(kind) == pipeline::ChunkLayout::kV) {
    // The V's two chunks per rank: each holds half of the rank's layers.
    MEGATORCH_CHECK(a.num_layers_per_virtual_pipeline_stage == 0, "gpt_pretrain: --schedule ", a.schedule,
                    " runs two chunks per stage in a V; drop --num-layers-per-virtual-pipeline-stage");
    MEGATORCH_CHECK(a.num_layers % (2 * pp) == 0, "gpt_pretrain: --schedule ", a.schedule, " splits the model into 2 x ",
                    pp, " = ", 2 * pp, " virtual stages; expected --num-layers to be a multiple of ", 2 * pp, ", got ",
                    a.num_layers);
    MEGATORCH_CHECK(a.num_micro_batches >= 2 * pp, "gpt_pretrain: --schedule ", a.schedule, " fills its V with 2 x ",
                    "--pipeline-model-parallel-size micro-batches per step: expected at least ", 2 * pp, ", got ",
                    a.num_micro_batches, "; raise --global-batch-size to ", 2 * pp * a.micro_batch_size * dp,
                    " or more");
    a.virtual_chunks = 2;
  }
  MEGATORCH_CHECK(a.schedule != "interleaved" || a.virtual_chunks > 1,
                  "gpt_pretrain: --schedule interleaved needs --num-layers-per-virtual-pipeline-stage (v > 1 chunks per stage)");
  MEGATORCH_CHECK(a.virtual_chunks == 1 || a.schedule == "interleaved" || pipeline::chunk_layout(kind) == pipeline::ChunkLayout::kV,
                  "gpt_pretrain: virtual pipeline stages run with --schedule interleaved, got --schedule ", a.schedule);
  MEGATORCH_CHECK(a.schedule != "interleaved" || a.num_micro_batches % pp == 0,
                  "gpt_pretrain: the interleaved schedule needs the micro-batches per step (", a.num_micro_batches,
                  ") to be a multiple of the pipeline size ", pp, "; change --global-batch-size");
  if (a.zero_stage < 0) a.zero_stage = a.use_distributed_optimizer ? 1 : 0;
  MEGATORCH_CHECK(!a.use_distributed_optimizer || a.zero_stage >= 1,
                  "gpt_pretrain: --use-distributed-optimizer shards the optimizer (ZeRO >= 1) but --zero-stage 0 was given");
  MEGATORCH_CHECK(a.group_query_attention || a.num_query_groups == 0,
                  "gpt_pretrain: --num-query-groups needs --group-query-attention");
  MEGATORCH_CHECK(!a.group_query_attention || a.num_query_groups >= 1,
                  "gpt_pretrain: --group-query-attention needs --num-query-groups");
  MEGATORCH_CHECK(a.lr >= 0 && a.min_lr >= 0 && a.min_lr <= a.lr, "gpt_pretrain: expected 0 <= --min-lr <= --lr, got ",
                  a.min_lr, " and ", a.lr);
  MEGATORCH_CHECK(!a.eval_only || !a.load.empty(), "gpt_pretrain: --eval-only needs --load");
  MEGATORCH_CHECK(!a.eval_only || a.eval_iters > 0, "gpt_pretrain: --eval-only needs --eval-iters > 0, got ",
                  a.eval_iters);
  MEGATORCH_CHECK(a.save_interval == 0 || !a.save.empty(), "gpt_pretrain: --save-interval needs --save DIR");
  MEGATORCH_CHECK(!a.async_save || !a.save.empty(), "gpt_pretrain: --async-save needs --save DIR");
  MEGATORCH_CHECK(a.ckpt_step == -1 || (a.ckpt_step >= 0 && !a.load.empty()), "gpt_pretrain: --ckpt-step needs "
                  "--load DIR and an iteration >= 0, got ", a.ckpt_step, a.load.empty() ? " without --load" : "");
  MEGATORCH_CHECK(!a.save_grads || !a.save.empty(), "gpt_pretrain: --save-grads needs --save DIR");
  if (a.lr_decay_iters == 0) a.lr_decay_iters = a.train_iters;
  MEGATORCH_CHECK(a.lr_warmup_iters >= 0 && a.lr_warmup_iters < a.lr_decay_iters,
                  "gpt_pretrain: expected 0 <= --lr-warmup-iters < --lr-decay-iters (or --train-iters), got ",
                  a.lr_warmup_iters, " and ", a.lr_decay_iters);
  const int64_t ep = a.expert_model_parallel_size, etp = a.expert_tensor_parallel_size;
  MEGATORCH_CHECK(ep <= tp * cp * dp && etp <= tp * cp * dp && (tp * cp * dp) % (ep * etp) == 0,
                  "gpt_pretrain: expected --expert-model-parallel-size x --expert-tensor-parallel-size (", ep, " x ", etp,
                  ") to divide the ranks of a pipeline stage, tensor x context x data parallel = ", tp, " x ", cp, " x ",
                  dp, " = ", tp * cp * dp, "; the experts are spread inside them");
  // The model's own checks (heads, hidden, ffn, seq divisible by tp...) with the same clarity.
  model_config(a).validate(tp, cp, ep, etp);
}

transformer::TransformerConfig model_config(const TrainArguments& a) {
  using namespace transformer;
  TransformerConfig c;
  c.num_layers(a.num_layers)
      .hidden_size(a.hidden_size)
      .ffn_hidden_size(a.ffn_hidden_size)
      .num_attention_heads(a.num_attention_heads)
      .num_query_groups(a.group_query_attention ? a.num_query_groups : 0)
      .kv_channels(a.kv_channels)
      .seq_length(a.seq_length)
      .max_position_embeddings(a.max_position_embeddings)
      .vocab_size(a.vocab_size)
      .make_vocab_size_divisible_by(a.make_vocab_size_divisible_by)
      .norm_epsilon(a.norm_epsilon)
      .rotary_base(a.rotary_base)
      .rotary_percent(a.rotary_percent)
      .rope_scaling(detail::rope_scaling_of(a))
      .init_std(a.init_method_std)
      .add_bias_linear(!a.disable_bias_linear)
      .add_qkv_bias(a.add_qkv_bias)
      .add_attention_bias(a.add_attention_bias)
      .add_mlp_bias(a.add_mlp_bias)
      .qk_layernorm(a.qk_layernorm)
      .sliding_window(a.sliding_window)
      .layer_types(a.layer_types)
      .normalization(parse_normalization(a.normalization))
      .activation(a.swiglu ? Activation::kSwiGLU : Activation::kGeluTanh)
      .position_embedding_type(parse_positions(a.position_embedding_type))
      .tie_embeddings(!a.untie_embeddings_and_output_weights)
      .hidden_dropout(a.hidden_dropout)
      .attention_dropout(a.attention_dropout)
      .sequence_parallel(a.sequence_parallel)
      .cp_comm_type(parse_cp_comm_type(a.cp_comm_type))
      .recompute(parse_recompute(a.recompute_granularity.empty() ? "none" : a.recompute_granularity))
      .num_experts(a.num_experts)
      .moe_router_topk(a.moe_router_topk)
      .moe_ffn_hidden_size(a.moe_ffn_hidden_size)
      .moe_layer_freq(a.moe_layer_freq)
      .moe_first_k_dense(a.moe_first_k_dense)
      .moe_shared_expert_intermediate_size(a.moe_shared_expert_intermediate_size)
      .moe_router_score_function(parse_router_score(a.moe_router_score_function))
      .moe_router_pre_softmax(a.moe_router_pre_softmax)
      .moe_router_norm_topk_prob(a.moe_router_norm_topk_prob)
      .moe_router_topk_scaling_factor(a.moe_router_topk_scaling_factor)
      .moe_aux_loss_coeff(a.moe_aux_loss_coeff)
      .moe_z_loss_coeff(a.moe_z_loss_coeff)
      .moe_router_enable_expert_bias(a.moe_router_enable_expert_bias)
      .moe_router_bias_update_rate(a.moe_router_bias_update_rate)
      .moe_expert_capacity_factor(a.moe_expert_capacity_factor)
      .moe_pad_expert_input_to_capacity(a.moe_pad_expert_input_to_capacity)
      .moe_token_dispatcher_type(parse_token_dispatcher(a.moe_token_dispatcher_type))
      .moe_grouped_gemm(a.moe_grouped_gemm)
      .cuda_graph(a.cuda_graph)
      .fp8(fp8_options(a))
      .num_layers_at_start_in_bf16(a.fp8_format.empty() || !a.first_last_layers_bf16 ? 0 : a.num_layers_at_start_in_bf16)
      .num_layers_at_end_in_bf16(a.fp8_format.empty() || !a.first_last_layers_bf16 ? 0 : a.num_layers_at_end_in_bf16)
      .params_dtype(a.bf16 ? c10::kBFloat16 : a.fp16 ? c10::kHalf : c10::kFloat)
      .seed(a.seed);
  return c;
}

}  // namespace megatorch::train
