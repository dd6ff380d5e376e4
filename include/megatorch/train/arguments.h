#pragma once
// gpt_pretrain's command line: Megatron-LM's flag names wherever Megatron has the
// option (so launch scripts carry over), parsed with CLI11, checked for contradictions
// against the world size before anything else happens.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <set>

#include "megatorch/data/tokenizer.h"
#include "megatorch/transformer/config.h"

namespace megatorch::train {

struct TrainArguments {
  // Device and communication
  std::string device = "auto";               // auto | cpu | cuda | cuda:N (device_selection.h)
  std::string distributed_backend = "auto";  // auto (NCCL on CUDA, Gloo on CPU) | nccl | gloo
  double distributed_timeout_minutes = 0;    // 0: MEGATORCH_COMM_TIMEOUT_S, else 10 minutes
  // Parallelism
  int64_t tensor_model_parallel_size = 1;
  int64_t pipeline_model_parallel_size = 1;
  int64_t context_parallel_size = 1;  // ranks splitting each sequence (tp-cp-dp-pp order)
  std::string cp_comm_type = "p2p";   // p2p (ring attention) | a2a (Ulysses)
  // Experts spread over this many ranks inside each stage's tp x cp x dp (parallel folding).
  int64_t expert_model_parallel_size = 1;
  int64_t expert_tensor_parallel_size = 1;  // experts split over TP: 1 only (whole experts per rank)
  int64_t num_layers_per_virtual_pipeline_stage = 0;  // 0: no interleaving
  bool sequence_parallel = false;
  std::string schedule = "1f1b";  // 1f1b | gpipe | interleaved | zb-h1 | zb-v | dualpipev
  int64_t zero_stage = -1;        // -1: 1 with --use-distributed-optimizer, else 0
  bool use_distributed_optimizer = false;
  // Model
  int64_t num_layers = 4;
  int64_t hidden_size = 128;
  int64_t ffn_hidden_size = 0;  // 0: 4h (8h/3 rounded with SwiGLU... as TransformerConfig)
  int64_t num_attention_heads = 4;
  bool group_query_attention = false;
  int64_t num_query_groups = 0;
  int64_t kv_channels = 0;  // each head's channels; 0: hidden / heads
  int64_t seq_length = 128;
  int64_t max_position_embeddings = 0;  // 0: seq_length
  std::string position_embedding_type = "learned_absolute";  // learned_absolute | rope
  std::string normalization = "LayerNorm";                   // LayerNorm | RMSNorm
  bool swiglu = false;
  bool untie_embeddings_and_output_weights = false;
  bool disable_bias_linear = false;  // no biases on the linear layers (Llama, Mistral, Qwen2)
  bool add_qkv_bias = false;         // biases on the QKV projection even so (Qwen2)
  bool add_attention_bias = false;   // and on the output projection (HF Llama's attention_bias)
  bool add_mlp_bias = false;         // biases on the MLP's linears even so (HF Llama's mlp_bias)
  bool qk_layernorm = false;         // a norm over head_dim on each query and key head (Qwen3)
  double rotary_base = 10000.0;
  double rotary_percent = 1.0;  // the fraction of each head's channels RoPE rotates
  // RoPE scaling (transformer/rope.h): HF's rope_type and factor; --use-rope-scaling is
  // Megatron's Llama 3.1 scaling (llama3, factor --rope-scaling-factor, low/high frequency
  // factors 1 and 4, original context 8192).
  std::string rope_type = "default";
  double rope_scaling_factor = 8.0;
  bool use_rope_scaling = false;
  int64_t original_max_position_embeddings = 0;  // 0: --max-position-embeddings, else --seq-length
  // The checkpoint's scaling under --use-checkpoint-args (with every field the flags lack).
  std::optional<transformer::RopeScaling> checkpoint_rope_scaling;
  double norm_epsilon = 1e-5;
  double init_method_std = 0.02;
  int64_t make_vocab_size_divisible_by = 128;
  int64_t sliding_window = 0;  // from a checkpoint (Mistral) with --use-checkpoint-args; 0: none
  std::vector<std::string> layer_types;  // from a checkpoint: which layers slide (empty: all)
  int64_t vocab_size = 0;      // 0: the tokenizer's (257 for ByteLevel); else that many ids
  data::TokenizerOptions tokenizer;
  double hidden_dropout = 0.0;
  double attention_dropout = 0.0;
  std::string recompute_granularity;  // "" | selective | full
  // Mixture of experts (0 experts: dense); TransformerConfig's moe_* fields say what each does.
  int64_t num_experts = 0;
  int64_t moe_router_topk = 2;
  int64_t moe_ffn_hidden_size = 0;
  int64_t moe_layer_freq = 1;
  int64_t moe_first_k_dense = 0;
  int64_t moe_shared_expert_intermediate_size = 0;
  std::string moe_router_score_function = "softmax";
  bool moe_router_pre_softmax = false;
  bool moe_router_norm_topk_prob = false;
  double moe_router_topk_scaling_factor = 1.0;
  double moe_aux_loss_coeff = 0.0;
  double moe_z_loss_coeff = 0.0;
  bool moe_router_enable_expert_bias = false;
  double moe_router_bias_update_rate = 1e-3;
  double moe_expert_capacity_factor = 0.0;
  bool moe_pad_expert_input_to_capacity = false;
  std::string moe_token_dispatcher_type = "alltoall";
  bool moe_grouped_gemm = true;
  // Batches and iterations
  int64_t micro_batch_size = 1;
  int64_t global_batch_size = 0;  // 0: micro_batch_size · dp
  int64_t train_iters = 100;
  // Optimizer and learning rate
  double lr = 3e-4;
  double min_lr = 0.0;
  int64_t lr_warmup_iters = 0;
  std::string lr_decay_style = "cosine";  // constant | linear | cosine
  int64_t lr_decay_iters = 0;              // 0: train_iters
  double weight_decay = 0.01;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_eps = 1e-8;
  double clip_grad = 1.0;
  bool gradient_accumulation_fusion = true;  // --no-gradient-accumulation-fusion: off
  bool cuda_graph = false;                   // --cuda-graph / --enable-cuda-graph
  // --sync-debug-iters FIRST[-LAST]: steps run under CUDA's sync debug mode "error"
  // (parsed into the two numbers; 0: none).
  std::string sync_debug_iters;
  int64_t sync_debug_first = 0, sync_debug_last = 0;
  // Mixed precision
  bool bf16 = false;
  bool fp16 = false;
  double initial_loss_scale = 4294967296.0;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  // FP8 GEMMs (fp8/recipe.h); an empty format: off.
  std::string fp8_format;
  std::string fp8_recipe = "delayed";
  int64_t fp8_amax_history_len = 1;
  std::string fp8_amax_compute_algo = "most_recent";
  int64_t fp8_margin = 0;
  bool first_last_layers_bf16 = false;
  int64_t num_layers_at_start_in_bf16 = 1;
  int64_t num_layers_at_end_in_bf16 = 1;
  // Data
  std::vector<std::string> data_path;  // Megatron's list: [w1] p1 [w2 p2 ...]
  std::string split = "969,30,1";
  // Packed documents (Megatron's flags; transformer/packed_sequence.h).
  bool reset_position_ids = false;
  bool reset_attention_mask = false;
  bool eod_mask_loss = false;
  // Checkpoints
  std::string save;
  std::string load;
  int64_t ckpt_step = -1;  // --ckpt-step: load this iteration (-1: the one `latest` names)
  int64_t save_interval = 0;
  bool save_grads = false;  // the last step's gradients in each checkpoint (optim/grad/...)
  bool use_checkpoint_args = false;  // the model's shape from --load's checkpoint
  bool finetune = false;             // weights only: iteration 0, fresh optimizer, data and RNG
  bool no_load_optim = false;
  bool no_load_rng = false;
  bool async_save = false;  // checkpoints written in the background (TrainingLoopOptions::async_save)
  // Fault tolerance (TrainingLoopOptions' fields of the same names)
  bool exit_signal_handler = false;
  int64_t exit_interval = 0;
  double exit_duration_in_mins = 0;
  bool check_for_nan_in_loss_and_grad = true;
  int64_t skip_nan_steps = 0;
  bool log_straggler = false;
  std::string rerun_mode = "disabled";  // disabled | validate_results
  double spike_threshold = 10.0;
  // Evaluation and logging
  int64_t eval_interval = 0;  // 0: only at the end
  int64_t eval_iters = 4;
  bool eval_only = false;
  int64_t seed = 1234;
  int64_t log_interval = 1;
  std::string log_json;
  std::string timeline;

  // The flags given on the command line (long names without "--"): a flag given there
  // that disagrees with the checkpoint under --use-checkpoint-args is an error.
  std::set<std::string> given;
  // A flag given more than once takes its last value, as in Megatron (launch scripts append
  // overrides); one line per such flag for the startup log.
  std::vector<std::string> overrides;

  // Derived by validate()
  int64_t world_size = 1;
  int64_t data_parallel_size = 1;
  int64_t num_micro_batches = 1;  // per DP rank and step
  int64_t virtual_chunks = 1;
};

// Parses argv (CLI11). A repeated flag takes its last value (util/cli_last_wins.h), named in
// `overrides`. Throws c10::Error with CLI11's message on unknown flags or bad values; `--help`
// prints the usage and returns with `help_printed` set.
TrainArguments parse_arguments(int argc, char** argv, bool* help_printed = nullptr);

// --use-checkpoint-args: the model fields of a checkpoint's model_config (as
// ckpt::gpt_config_json writes it) replace the defaults; a flag given on the command line
// that disagrees is an error naming both values. --seq-length given wins (it is not a
// shape: an imported model's max positions are usually far beyond what one trains at).
void apply_checkpoint_args(TrainArguments& args, const nlohmann::json& model_config);

// The model's vocabulary from --vocab-size, the tokenizer (--tokenizer-type ...) or the
// checkpoint, checked against each other; returns the tokenizer's end-of-document id
// (-1 when no tokenizer is involved).
int64_t resolve_vocab_size(TrainArguments& args);

// Checks each flag's range by name (sizes, iterations, betas, dropouts, timeouts finite
// and >= 1 ms, --split's syntax), then what only makes sense together (tp·pp dividing the
// world, the global batch, layers over stages, fp16 vs bf16, ...) and fills in the derived
// fields. Throws with one
// clear message; every rank runs it on the same input, so every rank fails alike.
void validate(TrainArguments& args, int64_t world_size);

transformer::TransformerConfig model_config(const TrainArguments& args);

}  // namespace megatorch::train
