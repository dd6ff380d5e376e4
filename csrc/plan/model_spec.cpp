#include "megatorch/plan/model_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>

#include "megatorch/check.h"
#include "megatorch/pipeline/p2p_batches.h"
#include "megatorch/plan/moe.h"
#include "megatorch/util/enum_names.h"

namespace megatorch::plan {

int64_t ModelSpec::ffn() const {
  if (ffn_hidden_size > 0) return ffn_hidden_size;
  if (swiglu) return (8 * hidden_size / 3 + 63) / 64 * 64;  // same rule as TransformerConfig::ffn
  return 4 * hidden_size;
}

double ModelSpec::attention_keys_per_query() const {
  const double s = static_cast<double>(seq_length);
  const double span = mean_document_length > 0 ? std::min<double>(s, mean_document_length) : s;
  if (sliding_window <= 0 || sliding_layers <= 0) return span;
  const double sliding = static_cast<double>(std::min(sliding_layers, num_layers)) / num_layers;
  return sliding * std::min<double>(span, sliding_window) + (1 - sliding) * span;
}

void ModelSpec::validate() const {
  MEGATORCH_CHECK(num_layers >= 1 && hidden_size >= 1 && num_attention_heads >= 1 && vocab_size >= 1 &&
                      seq_length >= 1 && make_vocab_size_divisible_by >= 1,
                  "model '", name, "': expected positive num_layers, hidden_size, num_attention_heads, vocab_size, "
                  "seq_length, got ", num_layers, ", ", hidden_size, ", ", num_attention_heads, ", ", vocab_size, ", ",
                  seq_length);
  MEGATORCH_CHECK(kv_channels > 0 || hidden_size % num_attention_heads == 0, "model '", name,
                  "': expected hidden_size (", hidden_size, ") divisible by num_attention_heads (", num_attention_heads,
                  ") or kv_channels set");
  MEGATORCH_CHECK(mean_document_length >= 0 && sliding_window >= 0, "model '", name, "': expected "
                  "--mean-document-length and the sliding window >= 0 (0: none), got ", mean_document_length, " and ",
                  sliding_window);
  MEGATORCH_CHECK(num_attention_heads % query_groups() == 0, "model '", name, "': expected num_attention_heads (",
                  num_attention_heads, ") divisible by num_query_groups (", query_groups(), ")");
  MEGATORCH_CHECK(num_experts >= 0, "model '", name, "': expected --num-experts >= 0 (0: a dense model), got ",
                  num_experts);
  if (!is_moe()) return;
  // The checks TransformerConfig::validate_moe makes of the same fields.
  MEGATORCH_CHECK(moe_router_topk >= 1 && moe_router_topk <= num_experts, "model '", name,
                  "': expected --moe-router-topk in [1, ", num_experts, "] (--num-experts), got ", moe_router_topk);
  MEGATORCH_CHECK(moe_ffn_hidden_size >= 0, "model '", name, "': expected --moe-ffn-hidden-size >= 0 (0: ",
                  "--ffn-hidden-size), got ", moe_ffn_hidden_size);
  MEGATORCH_CHECK(moe_layer_freq >= 1, "model '", name, "': expected --moe-layer-freq >= 1 (every N-th layer is an ",
                  "MoE layer), got ", moe_layer_freq);
  MEGATORCH_CHECK(moe_first_k_dense >= 0, "model '", name, "': expected --moe-first-k-dense >= 0, got ",
                  moe_first_k_dense);
  MEGATORCH_CHECK(moe_shared_expert_intermediate_size >= 0, "model '", name, "': expected ",
                  "--moe-shared-expert-intermediate-size >= 0 (0: no shared expert), got ",
                  moe_shared_expert_intermediate_size);
  MEGATORCH_CHECK(std::isfinite(moe_imbalance_margin) && moe_imbalance_margin >= 1, "model '", name,
                  "': expected --moe-imbalance-margin >= 1 (the busiest expert-parallel rank receives margin x the "
                  "mean routed rows; 1: balanced), got ", moe_imbalance_margin);
}

ModelSpec preset(const std::string& name) {
  ModelSpec m;
  m.name = name;
  if (name == "gpt3-175b") {  // Brown et al. 2020 with Megatron's padded GPT-2 vocabulary
    m.num_layers = 96, m.hidden_size = 12288, m.num_attention_heads = 96, m.vocab_size = 50257, m.seq_length = 2048;
  } else if (name == "megatron-1t") {  // Narayanan et al. 2021, Table 1's last row
    m.num_layers = 128, m.hidden_size = 25600, m.num_attention_heads = 160, m.vocab_size = 51200, m.seq_length = 2048;
  } else if (name == "llama3-8b" || name == "llama3-70b") {
    const bool big = name == "llama3-70b";
    m.num_layers = big ? 80 : 32, m.hidden_size = big ? 8192 : 4096, m.num_attention_heads = big ? 64 : 32;
    m.num_query_groups = 8, m.ffn_hidden_size = big ? 28672 : 14336, m.vocab_size = 128256, m.seq_length = 8192;
    m.swiglu = m.rms_norm = true, m.learned_positions = m.add_bias_linear = m.tie_embeddings = false;
  } else {
    std::string names;
    for (const auto& n : preset_names()) names += (names.empty() ? "" : ", ") + n;
    MEGATORCH_FAIL("unknown model preset '", name, "'; expected one of ", names,
                   ", or give the shape with --num-layers, --hidden-size, --num-attention-heads, ...");
  }
  return m;
}

std::vector<std::string> preset_names() { return {"gpt3-175b", "megatron-1t", "llama3-8b", "llama3-70b"}; }

ModelSpec from_transformer_config(const transformer::TransformerConfig& c) {
  ModelSpec m;
  m.num_layers = c.num_layers(), m.hidden_size = c.hidden_size(), m.num_attention_heads = c.num_attention_heads();
  m.num_query_groups = c.num_query_groups(), m.kv_channels = c.kv_channels(), m.ffn_hidden_size = c.ffn(), m.vocab_size = c.vocab_size();
  m.make_vocab_size_divisible_by = c.make_vocab_size_divisible_by(), m.seq_length = c.seq_length();
  m.swiglu = c.activation() == transformer::Activation::kSwiGLU;
  m.rms_norm = c.normalization() == transformer::Normalization::kRMSNorm;
  m.learned_positions = c.position_embedding_type() == transformer::Positions::kLearned;
  m.add_bias_linear = c.add_bias_linear(), m.add_qkv_bias = c.add_qkv_bias(), m.tie_embeddings = c.tie_embeddings();
  m.add_attention_bias = c.add_attention_bias(), m.add_mlp_bias = c.add_mlp_bias(), m.qk_layernorm = c.qk_layernorm();
  m.sliding_window = c.sliding_window();
  for (int64_t i = 0; i < c.num_layers(); ++i) m.sliding_layers += c.attention_window(i) > 0;
  m.num_experts = c.num_experts(), m.moe_router_topk = c.moe_router_topk(), m.moe_ffn_hidden_size = c.moe_ffn();
  m.moe_layer_freq = c.moe_layer_freq(), m.moe_first_k_dense = c.moe_first_k_dense();
  m.moe_shared_expert_intermediate_size = c.moe_shared_expert_intermediate_size();
  m.moe_token_dispatcher = c.moe_token_dispatcher_type();
  return m;
}

const char* to_string(Precision p) {
  switch (p) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp32: return "fp32";
    case Precision::kMixed: return "mixed";
  }
  return "?";
}

Precision parse_precision(const std::string& s) {
  // mixed: the ZeRO paper's 16 bytes a parameter.
  return util::parse_enum(s, {Precision::kBf16, Precision::kFp16, Precision::kFp32, Precision::kMixed}, "precision");
}

const char* to_string(DistributedBackend b) { return b == DistributedBackend::kGloo ? "gloo" : "nccl"; }

DistributedBackend parse_distributed_backend(const std::string& s) {
  return util::parse_enum(s, {DistributedBackend::kNccl, DistributedBackend::kGloo}, "--distributed-backend");
}

int64_t activation_dtype_bytes(Precision p) { return p == Precision::kFp32 ? 4 : 2; }

CpShare cp_share(const ModelSpec& m, int64_t cp) {
  MEGATORCH_CHECK(cp >= 1 && (cp == 1 || m.seq_length % (2 * cp) == 0), "context parallelism: expected the sequence "
                  "length (", m.seq_length, ") divisible by 2 x CP (2 x ", cp, "), got a remainder of ",
                  cp >= 1 ? m.seq_length % (2 * cp) : -1, "; change --seq-length or --context-parallel-size");
  CpShare share;
  share.tokens = m.seq_length / cp;
  share.num_chunks = cp == 1 ? 1 : 2 * cp;
  share.chunk_tokens = m.seq_length / share.num_chunks;
  return share;
}

std::string Layout::str() const {
  std::ostringstream os;
  os << "TP=" << tp;
  if (cp > 1) os << " CP=" << cp << "(" << to_string(cp_comm) << ")";
  os << " PP=" << pp << " DP=" << dp;
  if (ep > 1) os << " EP=" << ep;
  if (etp > 1) os << " ETP=" << etp;
  if (vpp > 1) os << " VP=" << vpp;
  os << " ZeRO-" << zero_stage << " mb=" << micro_batch << " recompute=" << transformer::to_string(recompute);
  if (sequence_parallel) os << " SP";
  // Only what vpp does not imply, so that 1F1B and interleaved layouts print as they always did.
  if (!schedule_implied(*this)) os << " sched=" << pipeline::schedule_kind_name(schedule_of(*this));
  return os.str();
}

pipeline::ScheduleKind schedule_of(const Layout& l) {
  return l.vpp > 1 && l.schedule == pipeline::ScheduleKind::kOneFOneB ? pipeline::ScheduleKind::kInterleaved
                                                                       : l.schedule;
}

bool schedule_implied(const Layout& l) {
  Layout plain = l;
  plain.schedule = pipeline::ScheduleKind::kOneFOneB;
  return schedule_of(l) == schedule_of(plain);
}

int64_t model_chunks(const Layout& l) { return pipeline::chunks_per_rank(schedule_of(l), l.vpp); }

pipeline::ChunkLayout chunk_layout_of(const Layout& l) { return pipeline::chunk_layout(schedule_of(l)); }

int64_t head_rank(const Layout& l) {
  return pipeline::rank_of_virtual_stage(l.pp * model_chunks(l) - 1, l.pp, chunk_layout_of(l));
}

std::string schedule_error(pipeline::ScheduleKind kind, int64_t pp, int64_t vpp) {
  using pipeline::ScheduleKind;
  const bool split = pipeline::splits_backward(kind);
  const bool v_shape = pipeline::chunk_layout(kind) == pipeline::ChunkLayout::kV;
  const char* name = pipeline::schedule_kind_name(kind);
  std::ostringstream os;
  if (kind == ScheduleKind::kGPipe)
    os << "the planner models the 1f1b, interleaved, zb-h1, zb-v and dualpipev schedules, got gpipe (it holds every "
          "micro-batch's activations for 1f1b's bubble); use --schedule 1f1b";
  else if ((kind == ScheduleKind::kOneFOneB || kind == ScheduleKind::kZeroBubbleH1) && vpp > 1)
    os << "the " << name << " schedule runs one model chunk per stage: expected VP=1, "
       << "got VP=" << vpp << "; use --schedule interleaved for virtual stages, or "
       << "--virtual-pipeline-model-parallel-size 1";
  else if (v_shape && vpp > 1)
    os << "the " << name << " schedule runs two model chunks per stage in a V, which the schedule implies: expected "
       << "VP=1, got VP=" << vpp << "; give --virtual-pipeline-model-parallel-size 1 (or leave it out), or use "
       << "--schedule interleaved for virtual stages";
  else if (kind == ScheduleKind::kInterleaved && vpp == 1)
    os << "the interleaved schedule runs several model chunks per stage: expected VP > 1, got VP=1; give "
          "--virtual-pipeline-model-parallel-size 2 or more, or use --schedule 1f1b";
  else if (split && pp == 1)
    os << "the " << name << " schedule fills the bubbles of a pipeline: expected PP > 1, got PP=1; use --schedule "
       << "1f1b or a --pipeline-model-parallel-size > 1";
  return os.str();
}

std::string layout_error(const ModelSpec& m, const Layout& l, int64_t gpus, int64_t global_batch) {
  std::ostringstream os;
  if (l.tp < 1 || l.cp < 1 || l.pp < 1 || l.dp < 1 || l.vpp < 1 || l.micro_batch < 1)
    os << "expected TP, CP, PP, DP, VP and the micro-batch size >= 1, got " << l.str();
  else if (l.gpus() != gpus && l.cp == 1)
    os << "TP*PP*DP = " << l.tp << "*" << l.pp << "*" << l.dp << " = " << l.gpus() << " does not equal the " << gpus
       << " GPUs of the cluster; pick sizes whose product is " << gpus;
  else if (l.gpus() != gpus)
    os << "TP*CP*PP*DP = " << l.tp << "*" << l.cp << "*" << l.pp << "*" << l.dp << " = " << l.gpus()
       << " does not equal the " << gpus << " GPUs of the cluster; pick sizes whose product is " << gpus;
  else if (l.zero_stage < 0 || l.zero_stage > 3)
    os << "expected a ZeRO stage 0..3, got " << l.zero_stage;
  else if (m.num_attention_heads % l.tp || m.query_groups() % l.tp || m.ffn() % l.tp)
    os << "TP=" << l.tp << " does not divide the attention heads (" << m.num_attention_heads << "), query groups ("
       << m.query_groups() << ") and FFN size (" << m.ffn() << ")";
  else if (l.cp > 1 && m.seq_length % (2 * l.cp))
    os << "context parallelism cuts the sequence into 2*CP chunks: the sequence length (" << m.seq_length
       << ") is not divisible by 2*CP = " << 2 * l.cp;
  else if (l.sequence_parallel && (l.tp == 1 || (m.seq_length / l.cp) % l.tp))
    os << "sequence parallelism needs TP > 1 dividing the sequence length" << (l.cp > 1 ? " per CP rank (" : " (")
       << m.seq_length / l.cp << "), got TP=" << l.tp;
  else if (l.cp > 1 && l.cp_comm == CpCommType::kA2A &&
           ((m.num_attention_heads / l.tp) % l.cp || (m.query_groups() / l.tp) % l.cp))
    os << "--cp-comm-type a2a splits the heads over the CP ranks: the attention heads (" << m.num_attention_heads / l.tp
       << ") and key/value heads (" << m.query_groups() / l.tp << ") per TP rank are not both divisible by CP="
       << l.cp << "; use --cp-comm-type p2p or a CP size dividing both";
  else if (m.num_layers % (l.pp * l.vpp))
    os << "PP*VP = " << l.pp * l.vpp << " does not divide the " << m.num_layers << " layers";
  else if (l.vpp > 1 && l.pp == 1)
    os << "virtual pipeline stages need PP > 1";
  else if (const std::string e = schedule_error(schedule_of(l), l.pp, l.vpp); !e.empty())
    os << e;
  else if (chunk_layout_of(l) == pipeline::ChunkLayout::kV && m.num_layers % (2 * l.pp))
    os << "the " << pipeline::schedule_kind_name(schedule_of(l)) << " schedule splits the model into 2 x PP = "
       << 2 * l.pp << " virtual stages (two chunks per rank in a V): expected the " << m.num_layers
       << " layers divisible by " << 2 * l.pp << ", got a remainder of " << m.num_layers % (2 * l.pp)
       << "; pick a PP with 2 x PP dividing the layers, or --schedule zb-h1";
  else if (!m.is_moe() && l.ep != 1)
    os << "expected --expert-model-parallel-size 1 for a dense model, got EP=" << l.ep
       << "; give --num-experts to plan a mixture of experts";
  else if (!m.is_moe() && l.etp != 1)
    os << "expected --expert-tensor-parallel-size 1 for a dense model, got ETP=" << l.etp
       << "; give --num-experts to plan a mixture of experts";
  else if (m.is_moe() && (l.ep < 1 || (l.tp * l.cp * l.dp) % l.ep))
    os << "EP=" << l.ep << " does not divide the TP*CP*DP = " << l.tp * l.cp * l.dp
       << " ranks of a pipeline stage, which the experts are spread over; pick an --expert-model-parallel-size "
          "dividing "
       << l.tp * l.cp * l.dp;
  else if (m.is_moe() && m.num_experts % l.ep)
    os << "EP=" << l.ep << " does not divide the " << m.num_experts
       << " experts (each EP rank holds num_experts / EP whole experts); pick an --expert-model-parallel-size "
          "dividing --num-experts";
  else if (m.is_moe() && (l.etp < 1 || (l.tp * l.cp * l.dp) % (l.ep * l.etp)))
    os << "EP*ETP = " << l.ep << "*" << l.etp << " = " << l.ep * l.etp << " does not divide the TP*CP*DP = "
       << l.tp * l.cp * l.dp << " ranks of a pipeline stage, which the expert shards are spread over "
       << "(EDP = TP*CP*DP / (EP*ETP)); pick an --expert-tensor-parallel-size >= 1 dividing "
       << l.tp * l.cp * l.dp / l.ep;
  else if (m.is_moe() && m.moe_ffn() % l.etp)
    os << "ETP=" << l.etp << " does not divide the expert FFN size (--moe-ffn-hidden-size " << m.moe_ffn()
       << "): each expert's fc1 columns and fc2 rows are split over the ETP ranks; pick an "
       << "--expert-tensor-parallel-size dividing " << m.moe_ffn() << " or an FFN size divisible by " << l.etp;
  else if (m.is_moe() && l.zero_stage == 3)
    os << "ZeRO-3 does not shard expert parameters (TrainingLoop refuses it with experts); use --zero-stage 1 or 2";
  else if (m.is_moe() && m.moe_shared_expert_intermediate_size % l.tp)
    os << "TP=" << l.tp << " does not divide --moe-shared-expert-intermediate-size ("
       << m.moe_shared_expert_intermediate_size << "): the shared expert is a tensor-parallel MLP";
  else if (global_batch % (l.micro_batch * l.dp))
    os << "the global batch " << global_batch << " is not divisible by micro-batch * DP = " << l.micro_batch << "*"
       << l.dp;
  else if (chunk_layout_of(l) == pipeline::ChunkLayout::kV && l.num_microbatches(global_batch) < 2 * l.pp)
    os << "the " << pipeline::schedule_kind_name(schedule_of(l)) << " schedule fills its V with 2 x PP micro-batches: "
       << "expected at least " << 2 * l.pp << " micro-batches per step, got " << l.num_microbatches(global_batch)
       << " (global batch " << global_batch << " / (micro-batch " << l.micro_batch << " x DP " << l.dp
       << ")); raise --global-batch-size to " << 2 * l.pp * l.micro_batch * l.dp << " or more, or use --schedule zb-h1";
  else if (l.vpp > 1 && l.num_microbatches(global_batch) % l.pp)
    os << "the interleaved schedule needs the micro-batches per step (" << l.num_microbatches(global_batch)
       << ") to be a multiple of PP (" << l.pp << ")";
  return os.str();
}

void validate_layout(const ModelSpec& m, const Layout& l, int64_t gpus, int64_t global_batch) {
  const std::string e = layout_error(m, l, gpus, global_batch);
  MEGATORCH_CHECK(e.empty(), "layout ", l.str(), " is not valid: ", e);
}

int64_t padded_vocab(const ModelSpec& m, int64_t tp) {
  const int64_t multiple = tp * m.make_vocab_size_divisible_by;
  return (m.vocab_size + multiple - 1) / multiple * multiple;
}

namespace {
struct LayerShapes {
  int64_t column_weights, column_biases, row_weights, row_biases, norms;
  int64_t per_tp_rank(int64_t tp) const { return (column_weights + column_biases + row_weights) / tp + row_biases + norms; }
};
// The attention half (QKV column, output projection row, both norms) and an MLP of width
// `ffn` (fc1 column, fc2 row): a dense layer is both, an MoE layer's shared expert the second.
LayerShapes attention_shapes(const ModelSpec& m) {
  const int64_t h = m.hidden_size, qkv = (m.num_attention_heads + 2 * m.query_groups()) * m.head_dim();
  const int64_t bias = m.add_bias_linear || m.add_attention_bias ? 1 : 0;
  const int64_t qkv_bias = bias || m.add_qkv_bias ? 1 : 0;
  const int64_t beta = (m.rms_norm || !m.add_bias_linear) ? 1 : 2;  // LayerNorm's beta follows the biases
  const int64_t qk_norms = m.qk_layernorm ? 2 * beta * m.head_dim() : 0;  // replicated over TP
  return {h * qkv, qkv_bias * qkv, m.num_attention_heads * m.head_dim() * h, bias * h, 2 * beta * h + qk_norms};
}
LayerShapes mlp_shapes(const ModelSpec& m, int64_t ffn) {
  const int64_t h = m.hidden_size, fc1 = ffn * (m.swiglu ? 2 : 1), bias = m.mlp_bias() ? 1 : 0;
  return {h * fc1, bias * fc1, ffn * h, bias * h, 0};
}
LayerShapes layer_shapes(const ModelSpec& m) {
  const LayerShapes a = attention_shapes(m), f = mlp_shapes(m, m.ffn());
  return {a.column_weights + f.column_weights, a.column_biases + f.column_biases, a.row_weights + f.row_weights,
          a.row_biases + f.row_biases, a.norms};
}
int64_t final_norm_params(const ModelSpec& m) { return (m.rms_norm || !m.add_bias_linear) ? m.hidden_size : 2 * m.hidden_size; }
}  // namespace

int64_t layer_params(const ModelSpec& m) { return layer_params_per_tp_rank(m, 1); }

int64_t layer_params_per_tp_rank(const ModelSpec& m, int64_t tp) { return layer_shapes(m).per_tp_rank(tp); }

int64_t moe_layer_dense_params_per_tp_rank(const ModelSpec& m, int64_t tp) {
  const int64_t shared = m.moe_shared_expert_intermediate_size;
  return attention_shapes(m).per_tp_rank(tp) + m.num_experts * m.hidden_size +
         (shared > 0 ? mlp_shapes(m, shared).per_tp_rank(tp) : 0);
}

int64_t total_params(const ModelSpec& m) {
  const int64_t v = padded_vocab(m, 1), h = m.hidden_size, moe = num_moe_layers(m);
  return (m.num_layers - moe) * layer_params(m) + moe * (moe_layer_dense_params_per_tp_rank(m, 1) + m.num_experts * params_per_expert(m)) +
         v * h * (m.tie_embeddings ? 1 : 2) + (m.learned_positions ? m.seq_length * h : 0) + final_norm_params(m);
}

int64_t dense_params_per_rank(const ModelSpec& m, const Layout& l, int64_t pp_rank) {
  const int64_t tp = l.tp, pp = l.pp;
  const int64_t chunks = l.vpp >= 1 ? model_chunks(l) : 0;
  MEGATORCH_CHECK(tp >= 1 && pp >= 1 && chunks >= 1 && pp_rank >= 0 && pp_rank < pp &&
                      m.num_layers % (pp * chunks) == 0,
                  "params_per_rank: expected 0 <= pp_rank < pp and pp x (chunks per rank) dividing the layers, got tp=",
                  tp, " pp=", pp, " chunks=", chunks, " pp_rank=", pp_rank, " layers=", m.num_layers);
  const int64_t h = m.hidden_size, vocab_shard = padded_vocab(m, tp) / tp * h;
  const LayerCounts layers = stage_layer_counts(m, l, pp_rank);
  int64_t n = layers.dense * layer_params_per_tp_rank(m, tp) + layers.moe * moe_layer_dense_params_per_tp_rank(m, tp);
  // Virtual stage 0 (the embedding) is rank 0's whatever the layout; the last one (final
  // norm, output layer) is head_rank's: the last rank, or rank 0 again in a V.
  if (pp_rank == 0) n += vocab_shard + (m.learned_positions ? m.seq_length * h : 0);
  if (pp_rank == head_rank(l)) {
    n += final_norm_params(m);
    // Untied, or tied across chunks: PipelineStage builds the head as its own copy of the
    // embedding whenever they are different chunks, on one rank (a V) or two.
    if (!m.tie_embeddings || pp * chunks > 1) n += vocab_shard;
  }
  return n;
}

int64_t params_per_rank(const ModelSpec& m, const Layout& l, int64_t pp_rank) {
  return dense_params_per_rank(m, l, pp_rank) + expert_params_per_rank(m, l, pp_rank);
}

int64_t params_per_rank(const ModelSpec& m, int64_t tp, int64_t pp, int64_t pp_rank) {
  Layout l;
  l.tp = tp, l.pp = pp;
  return params_per_rank(m, l, pp_rank);
}

double narayanan_params(const ModelSpec& m) {
  const double L = m.num_layers, h = m.hidden_size, V = m.vocab_size, s = m.seq_length;
  return 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h));
}

LayerFlops layer_forward_flops(const ModelSpec& m, int64_t b) {
  const double tokens = static_cast<double>(b) * m.seq_length, h = m.hidden_size;
  const double qkv = (m.num_attention_heads + 2.0 * m.query_groups()) * m.head_dim();
  const double ffn = m.ffn(), attn_width = static_cast<double>(m.num_attention_heads) * m.head_dim();
  LayerFlops f;
  f.weights = 2 * tokens * (h * qkv + attn_width * h + h * ffn * (m.swiglu ? 2 : 1) + ffn * h);
  // Q K^T and P V over the full (non-causal) square, or the documents' and windows' share of it.
  f.attention = 2 * 2 * tokens * m.attention_keys_per_query() * attn_width;
  return f;
}

LayerFlops moe_layer_forward_flops(const ModelSpec& m, int64_t b) {
  const double tokens = static_cast<double>(b) * m.seq_length, h = m.hidden_size;
  const double qkv = (m.num_attention_heads + 2.0 * m.query_groups()) * m.head_dim();
  const double attn_width = static_cast<double>(m.num_attention_heads) * m.head_dim();
  const double g = m.swiglu ? 2 : 1, shared = static_cast<double>(m.moe_shared_expert_intermediate_size);
  const double f = static_cast<double>(m.moe_ffn()), experts = static_cast<double>(m.num_experts);
  LayerFlops fl;
  // Attention as in a dense layer; the router [h, E] and the shared expert for every token.
  fl.weights = 2 * tokens * (h * qkv + attn_width * h + h * experts + h * shared * g + shared * h);
  fl.attention = 2 * 2 * tokens * m.attention_keys_per_query() * attn_width;
  fl.experts = 2 * tokens * static_cast<double>(m.moe_router_topk) * (h * f * g + f * h);  // k experts a token
  return fl;
}

double head_forward_flops(const ModelSpec& m, int64_t b) {
  return 2.0 * b * m.seq_length * m.hidden_size * static_cast<double>(m.vocab_size);
}

double flops_per_iteration(const ModelSpec& m, int64_t global_batch, Recompute r) {
  const auto layer_flops = [r](const LayerFlops& f) {
    double layer = 3 * f.total();  // forward + backward (twice the forward)
    if (r == Recompute::kFull) layer += f.total();
    if (r == Recompute::kSelective) layer += f.attention;
    return layer;
  };
  const double layer = layer_flops(layer_forward_flops(m, global_batch));
  if (!m.is_moe()) return m.num_layers * layer + 3 * head_forward_flops(m, global_batch);
  const int64_t moe = num_moe_layers(m);
  return (m.num_layers - moe) * layer + moe * layer_flops(moe_layer_forward_flops(m, global_batch)) +
         3 * head_forward_flops(m, global_batch);
}

}  // namespace megatorch::plan
