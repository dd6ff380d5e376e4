// --use-checkpoint-args: a checkpoint's model_config read into gpt_pretrain's arguments
// (arguments.h), a disagreeing flag given on the command line refused by name.
#include <sstream>
#include <string>

#include "megatorch/check.h"
#include "megatorch/ckpt/gpt_checkpoint.h"
#include "megatorch/train/arguments.h"

namespace megatorch::train {

namespace {

// One model field of --use-checkpoint-args: the checkpoint's value unless the flag was
// given with another.
template <class T>
void take_from_checkpoint(TrainArguments& a, const char* flag, T& field, const T& value) {
  if (a.given.count(flag) && field != value) {
    std::ostringstream given, saved;
    given << field;
    saved << value;
    MEGATORCH_FAIL("gpt_pretrain: --", flag, " ", given.str(), " disagrees with the checkpoint in ", a.load, " (", saved.str(),
                   ") under --use-checkpoint-args; drop the flag to train the checkpoint's model, or drop "
                   "--use-checkpoint-args to train another");
  }
  field = value;
}

}  // namespace

void apply_checkpoint_args(TrainArguments& a, const nlohmann::json& model_config) {
  // Through the checkpoint reader, so its defaults (fields older checkpoints lack) apply.
  const auto c = ckpt::gpt_config_from_json(model_config);
  take_from_checkpoint(a, "num-layers", a.num_layers, c.num_layers());
  take_from_checkpoint(a, "hidden-size", a.hidden_size, c.hidden_size());
  take_from_checkpoint(a, "ffn-hidden-size", a.ffn_hidden_size, c.ffn());
  take_from_checkpoint(a, "num-attention-heads", a.num_attention_heads, c.num_attention_heads());
  bool gqa = c.query_groups() != c.num_attention_heads();
  take_from_checkpoint(a, "group-query-attention", a.group_query_attention, gqa);
  int64_t groups = gqa ? c.query_groups() : 0;
  take_from_checkpoint(a, "num-query-groups", a.num_query_groups, groups);
  take_from_checkpoint(a, "kv-channels", a.kv_channels, c.kv_channels());
  take_from_checkpoint(a, "vocab-size", a.vocab_size, c.vocab_size());
  take_from_checkpoint(a, "make-vocab-size-divisible-by", a.make_vocab_size_divisible_by, c.make_vocab_size_divisible_by());
  std::string norm = transformer::to_string(c.normalization()), pos = transformer::to_string(c.position_embedding_type());
  take_from_checkpoint(a, "normalization", a.normalization, norm);
  take_from_checkpoint(a, "position-embedding-type", a.position_embedding_type, pos);
  bool swiglu = c.activation() == transformer::Activation::kSwiGLU;
  take_from_checkpoint(a, "swiglu", a.swiglu, swiglu);
  bool untie = !c.tie_embeddings(), no_bias = !c.add_bias_linear(), qkv_bias = c.add_qkv_bias();
  take_from_checkpoint(a, "untie-embeddings-and-output-weights", a.untie_embeddings_and_output_weights, untie);
  take_from_checkpoint(a, "disable-bias-linear", a.disable_bias_linear, no_bias);
  take_from_checkpoint(a, "add-qkv-bias", a.add_qkv_bias, qkv_bias);
  bool attention_bias = c.add_attention_bias(), mlp_bias = c.add_mlp_bias(), qk_norm = c.qk_layernorm();
  take_from_checkpoint(a, "add-attention-bias", a.add_attention_bias, attention_bias);
  take_from_checkpoint(a, "add-mlp-bias", a.add_mlp_bias, mlp_bias);
  take_from_checkpoint(a, "qk-layernorm", a.qk_layernorm, qk_norm);
  take_from_checkpoint(a, "norm-epsilon", a.norm_epsilon, c.norm_epsilon());
  take_from_checkpoint(a, "rotary-base", a.rotary_base, c.rotary_base());
  take_from_checkpoint(a, "rotary-percent", a.rotary_percent, c.rotary_percent());
  a.checkpoint_rope_scaling = c.rope_scaling();
  take_from_checkpoint(a, "init-method-std", a.init_method_std, c.init_std());
  // Learned positions size a parameter; with RoPE max positions only bounds generation.
  if (c.position_embedding_type() == transformer::Positions::kLearned) {
    take_from_checkpoint(a, "max-position-embeddings", a.max_position_embeddings, c.max_positions());
  } else if (!a.given.count("max-position-embeddings")) {
    a.max_position_embeddings = c.max_positions();
  }
  a.sliding_window = c.sliding_window();
  a.layer_types = c.layer_types();
  if (!a.given.count("seq-length")) a.seq_length = c.seq_length();
  // The experts' shapes and routing (a dense checkpoint says 0 experts).
  take_from_checkpoint(a, "num-experts", a.num_experts, c.num_experts());
  if (c.num_experts() > 0) {
    take_from_checkpoint(a, "moe-router-topk", a.moe_router_topk, c.moe_router_topk());
    take_from_checkpoint(a, "moe-ffn-hidden-size", a.moe_ffn_hidden_size, c.moe_ffn());
    take_from_checkpoint(a, "moe-layer-freq", a.moe_layer_freq, c.moe_layer_freq());
    take_from_checkpoint(a, "moe-first-k-dense", a.moe_first_k_dense, c.moe_first_k_dense());
    take_from_checkpoint(a, "moe-shared-expert-intermediate-size", a.moe_shared_expert_intermediate_size,
                         c.moe_shared_expert_intermediate_size());
    std::string score = transformer::to_string(c.moe_router_score_function());
    bool pre = c.moe_router_pre_softmax(), norm = c.moe_router_norm_topk_prob(), bias = c.moe_router_enable_expert_bias();
    take_from_checkpoint(a, "moe-router-score-function", a.moe_router_score_function, score);
    take_from_checkpoint(a, "moe-router-pre-softmax", a.moe_router_pre_softmax, pre);
    take_from_checkpoint(a, "moe-router-norm-topk-prob", a.moe_router_norm_topk_prob, norm);
    take_from_checkpoint(a, "moe-router-topk-scaling-factor", a.moe_router_topk_scaling_factor,
                         c.moe_router_topk_scaling_factor());
    take_from_checkpoint(a, "moe-router-enable-expert-bias", a.moe_router_enable_expert_bias, bias);
  }
}

}  // namespace megatorch::train
