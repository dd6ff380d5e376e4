#include "megatorch/transformer/config.h"

#include <cmath>

#include "megatorch/check.h"
#include "megatorch/util/enum_names.h"

namespace megatorch::transformer {

int64_t TransformerConfig::ffn() const {
  if (ffn_hidden_size_ > 0) return ffn_hidden_size_;
  if (activation_ == Activation::kSwiGLU) return (8 * hidden_size_ / 3 + 63) / 64 * 64;
  return 4 * hidden_size_;
}

int64_t TransformerConfig::attention_window(int64_t layer) const {
  if (sliding_window_ == 0) return 0;
  if (layer_types_.empty()) return sliding_window_;
  MEGATORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layer_types_.size()), "attention_window: expected a layer "
                  "in [0, ", layer_types_.size(), "), got ", layer);
  return layer_types_[layer] == "sliding_attention" ? sliding_window_ : 0;
}

void TransformerConfig::validate(int64_t tp, int64_t cp, int64_t ep, int64_t etp) const {
  const int64_t heads = num_attention_heads_, groups = query_groups();
  MEGATORCH_CHECK(tp >= 1, "expected a tensor-parallel size >= 1 to validate against, got ", tp);
  MEGATORCH_CHECK(hidden_size_ >= 1 && heads >= 1 && num_layers_ >= 1 && seq_length_ >= 1 && vocab_size_ >= 1,
                  "expected positive hidden_size, num_attention_heads, num_layers, seq_length and vocab_size, got ",
                  hidden_size_, ", ", heads, ", ", num_layers_, ", ", seq_length_, ", ", vocab_size_);
  // 0 means "derived" for these three; a negative value would silently read as that default.
  MEGATORCH_CHECK(ffn_hidden_size_ >= 0, "expected ffn_hidden_size >= 0 (0: derived from hidden_size), got ",
                  ffn_hidden_size_);
  MEGATORCH_CHECK(num_query_groups_ >= 0, "expected num_query_groups >= 0 (0: one per attention head), got ",
                  num_query_groups_);
  MEGATORCH_CHECK(max_position_embeddings_ >= 0, "expected max_position_embeddings >= 0 (0: seq_length), got ",
                  max_position_embeddings_);
  MEGATORCH_CHECK(make_vocab_size_divisible_by_ >= 1, "expected make_vocab_size_divisible_by >= 1, got ",
                  make_vocab_size_divisible_by_);
  MEGATORCH_CHECK(std::isfinite(norm_epsilon_) && norm_epsilon_ > 0, "expected a finite norm_epsilon > 0, got ",
                  norm_epsilon_);
  MEGATORCH_CHECK(std::isfinite(rotary_base_) && rotary_base_ > 0, "expected a finite rotary_base > 0, got ",
                  rotary_base_);
  MEGATORCH_CHECK(std::isfinite(init_std_) && init_std_ >= 0, "expected a finite init_std >= 0, got ", init_std_);
  MEGATORCH_CHECK(num_layers_at_start_in_bf16_ >= 0 && num_layers_at_end_in_bf16_ >= 0,
                  "expected num_layers_at_start_in_bf16 and num_layers_at_end_in_bf16 >= 0, got ",
                  num_layers_at_start_in_bf16_, " and ", num_layers_at_end_in_bf16_);
  if (fp8_.enabled()) fp8_.validate("TransformerConfig");
  MEGATORCH_CHECK(kv_channels_ >= 0, "expected kv_channels >= 0 (0: hidden_size / num_attention_heads), got ",
                  kv_channels_);
  MEGATORCH_CHECK(kv_channels_ > 0 || hidden_size_ % heads == 0, "expected hidden_size (", hidden_size_,
                  ") to be divisible by num_attention_heads (", heads, "), or kv_channels (--kv-channels) set");
  MEGATORCH_CHECK(heads % groups == 0, "expected num_attention_heads (", heads,
                  ") to be divisible by num_query_groups (", groups, ")");
  MEGATORCH_CHECK(heads % tp == 0, "expected num_attention_heads (", heads,
                  ") to be divisible by the tensor-parallel size (", tp, "); pick a tp that divides the heads");
  MEGATORCH_CHECK(groups % tp == 0, "expected num_query_groups (", groups,
                  ") to be divisible by the tensor-parallel size (", tp, "); GQA shards whole key/value heads");
  MEGATORCH_CHECK(hidden_size_ % tp == 0, "expected hidden_size (", hidden_size_,
                  ") to be divisible by the tensor-parallel size (", tp, ")");
  MEGATORCH_CHECK(ffn() % tp == 0, "expected ffn_hidden_size (", ffn(), ") to be divisible by the tensor-parallel size (",
                  tp, ")");
  MEGATORCH_CHECK(!sequence_parallel_ || seq_length_ % tp == 0, "expected seq_length (", seq_length_,
                  ") to be divisible by the tensor-parallel size (", tp, ") with sequence parallelism");
  MEGATORCH_CHECK(position_embedding_type_ != Positions::kRope || head_dim() % 2 == 0,
                  "expected an even head dim for RoPE, got ", head_dim());
  MEGATORCH_CHECK(max_positions() >= seq_length_, "expected max_position_embeddings (", max_positions(),
                  ") >= seq_length (", seq_length_, ")");
  MEGATORCH_CHECK(sliding_window_ >= 0, "expected sliding_window >= 0 (0: no window), got ", sliding_window_);
  if (!layer_types_.empty()) {
    MEGATORCH_CHECK(static_cast<int64_t>(layer_types_.size()) == num_layers_, "expected layer_types to name each of the ",
                    num_layers_, " layers, got ", layer_types_.size(), " entries");
    for (const auto& t : layer_types_) {
      MEGATORCH_CHECK(t == "sliding_attention" || t == "full_attention",
                      "expected each of layer_types to be 'sliding_attention' or 'full_attention', got '", t, "'");
    }
  }
  if (position_embedding_type_ == Positions::kRope) {
    MEGATORCH_CHECK(rotary_percent_ > 0 && rotary_percent_ <= 1 && rotary_dim() >= 2 && rotary_dim() % 2 == 0,
                    "expected --rotary-percent in (0, 1] giving an even number of rotary channels >= 2, got ",
                    rotary_percent_, " of head dim ", head_dim(), " = ", rotary_dim(), " channels");
    rope_scaling_.validate();
  }
  MEGATORCH_CHECK(attention_dropout_ >= 0 && attention_dropout_ < 1 && hidden_dropout_ >= 0 && hidden_dropout_ < 1,
                  "expected dropout probabilities in [0, 1), got attention ", attention_dropout_, ", hidden ",
                  hidden_dropout_);
  validate_context_parallel(tp, cp);
  validate_moe(tp, ep, etp);
}

void TransformerConfig::validate_context_parallel(int64_t tp, int64_t cp) const {
  MEGATORCH_CHECK(cp >= 1, "expected a context-parallel size >= 1 to validate against, got ", cp);
  if (cp == 1) return;
  MEGATORCH_CHECK(seq_length_ % (2 * cp) == 0, "expected seq_length (", seq_length_,
                  ") to be divisible by 2 x the context-parallel size (2 x ", cp, " = ", 2 * cp,
                  "): each CP rank holds two chunks of seq_length / 2c tokens; change --seq-length or "
                  "--context-parallel-size");
  MEGATORCH_CHECK(!sequence_parallel_ || (seq_length_ / cp) % tp == 0, "expected each CP rank's tokens (seq_length / cp = ",
                  seq_length_ / cp, ") to be divisible by the tensor-parallel size (", tp,
                  ") with sequence parallelism");
  if (cp_comm_type_ == CpCommType::kA2A) {
    const int64_t heads = num_attention_heads_ / tp, groups = query_groups() / tp;
    MEGATORCH_CHECK(heads % cp == 0 && groups % cp == 0, "Ulysses (--cp-comm-type a2a) splits the heads over the ",
                    "context-parallel ranks: expected the attention heads (", heads, ") and key/value heads (", groups,
                    ") per tensor-parallel rank to be divisible by --context-parallel-size ", cp,
                    "; use --cp-comm-type p2p or a context-parallel size that divides both");
  }
}

tp::ParamInitOptions param_init(const TransformerConfig& c, const std::string& name) {
  return tp::ParamInitOptions()
      .name(name)
      .seed(c.seed())
      .std(c.init_std())
      .shard_local(c.shard_local_init())
      .dtype(c.params_dtype())
      .device(c.device());
}

const char* to_string(Normalization n) { return n == Normalization::kLayerNorm ? "LayerNorm" : "RMSNorm"; }
const char* to_string(Activation a) { return a == Activation::kGeluTanh ? "gelu_tanh" : "swiglu"; }
const char* to_string(Positions p) { return p == Positions::kLearned ? "learned_absolute" : "rope"; }
const char* to_string(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

Normalization parse_normalization(const std::string& s) {
  return util::parse_enum(s, {Normalization::kLayerNorm, Normalization::kRMSNorm}, "normalization");
}
Activation parse_activation(const std::string& s) {
  return util::parse_enum(s, {Activation::kGeluTanh, Activation::kSwiGLU}, "activation");
}
Positions parse_positions(const std::string& s) {
  return util::parse_enum(s, {Positions::kLearned, Positions::kRope}, "position_embedding_type");
}
Recompute parse_recompute(const std::string& s) {
  return util::parse_enum(s, {Recompute::kNone, Recompute::kSelective, Recompute::kFull}, "recompute granularity");
}

}  // namespace megatorch::transformer
