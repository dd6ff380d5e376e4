// megatorch-plan: predicts per-GPU memory and step time of every TP/CP/PP/DP/EP/ETP/ZeRO/micro-batch/
// recompute/SP/schedule layout of a model on a cluster, rejects those that do not fit and ranks the rest.
//
//   megatorch-plan --model gpt3-175b --nodes 128 --global-batch-size 1536 [--json] [--explain]
//   megatorch-plan --model llama3-8b --num-experts 8 --moe-router-topk 2 --nodes 8 ...  # experts
//   megatorch-plan --calibrate calib.json          # time this machine's GEMMs (and collectives)
//   megatorch-plan --model llama3-8b --nodes 1 --calibration calib.json
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "megatorch/check.h"
#include "megatorch/plan/calibrate.h"
#include "megatorch/plan/planner.h"
#include "megatorch/util/cli_last_wins.h"

namespace mp = megatorch::plan;
using nlohmann::json;

namespace {

struct Args {
  std::string model, precision = "bf16", calibration, calibrate_out = "megatorch_calibration.json";
  std::string fp8_format;  // gpt_pretrain's --fp8-format: the layers' GEMMs at the FP8 rate
  bool bf16 = false, fp16 = false, swiglu = false, no_bias = false, untie = false, sp = false, no_sp = false;
  std::string normalization = "LayerNorm", positions = "learned_absolute", recompute, cp_comm = "p2p", schedule;
  std::string backend = "nccl";
  int64_t layers = 0, hidden = 0, heads = 0, groups = 0, ffn = 0, vocab = 0, seq = 0, divisible_by = 128;
  int64_t tp = 0, cp = 0, pp = 0, dp = 0, vpp = 0, mb = 0, top = 5;
  int zero = -1;
  bool json = false, explain = false, megatorch_activations = false, math_attention = false, flash_attention = false;
  double mask_bytes = 1;
  // Mixture of experts (Megatron's flags; 0 experts: dense).
  int64_t num_experts = 0, topk = 2, moe_ffn = 0, moe_layer_freq = 1, moe_first_k_dense = 0, moe_shared = 0;
  int64_t ep = 0, etp = 1;  // etp 0: searched
  std::string dispatcher = "alltoall";
  double imbalance_margin = 1.0;
  int64_t mean_document_length = 0;
};

double gb(double bytes) { return bytes / 1e9; }
double mb(double bytes) { return bytes / 1e6; }

json layout_json(const mp::Layout& l) {
  return {{"tensor_model_parallel_size", l.tp}, {"pipeline_model_parallel_size", l.pp}, {"data_parallel_size", l.dp},
          {"virtual_pipeline_model_parallel_size", l.vpp}, {"zero_stage", l.zero_stage}, {"micro_batch_size", l.micro_batch},
          {"recompute_granularity", megatorch::transformer::to_string(l.recompute)}, {"sequence_parallel", l.sequence_parallel},
          {"context_parallel_size", l.cp}, {"cp_comm_type", mp::to_string(l.cp_comm)},
          {"schedule", megatorch::pipeline::schedule_kind_name(mp::schedule_of(l))}};
}

json memory_json(const mp::MemoryBreakdown& m) {
  return {{"stage", m.stage}, {"param_bytes", m.states.param_bytes}, {"grad_bytes", m.states.grad_bytes},
          {"master_param_bytes", m.states.master_param_bytes}, {"master_grad_bytes", m.states.master_grad_bytes},
          {"optimizer_state_bytes", m.states.optimizer_state_bytes}, {"activation_bytes", m.activations},
          {"inflight_microbatches", m.inflight_microbatches}, {"recompute_working_bytes", m.recompute_working},
          {"logits_bytes", m.logits}, {"reserved_bytes", m.reserved}, {"total_bytes", m.total()}};
}

json time_json(const mp::TimeBreakdown& t) {
  return {{"compute_s", t.compute}, {"recompute_s", t.recompute}, {"tp_comm_s", t.tp_comm}, {"cp_comm_s", t.cp_comm}, {"p2p_s", t.p2p},
          {"bubble_s", t.bubble}, {"dp_comm_s", t.dp_comm}, {"pipeline_s", t.pipeline}, {"step_s", t.step},
          {"bubble_fraction", t.bubble_fraction}, {"simulated_bubble_fraction", t.simulated_bubble_fraction},
          {"peak_inflight_chunks", t.peak_inflight_chunks},
          {"tflops_per_gpu", t.tflops_per_gpu}, {"mfu", t.mfu}};
}

// Mixture of experts: what the model's experts are, and for each layout the expert layout,
// the rank's expert parameters and states, and its token dispatch. Dense models print none
// of it, so their output is what it was before experts existed.
json moe_model_json(const mp::ModelSpec& m) {
  return {{"num_experts", m.num_experts}, {"moe_router_topk", m.moe_router_topk}, {"moe_ffn_hidden_size", m.moe_ffn()},
          {"moe_layer_freq", m.moe_layer_freq}, {"moe_first_k_dense", m.moe_first_k_dense},
          {"moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size},
          {"moe_token_dispatcher_type", megatorch::transformer::to_string(m.moe_token_dispatcher)},
          {"moe_imbalance_margin", m.moe_imbalance_margin}, {"num_moe_layers", mp::num_moe_layers(m)},
          {"expert_parameters", mp::expert_params(m)}, {"active_parameters", mp::active_params(m)}};
}

// The MoE layers of the stage with the most of them: the dispatch per step runs on those.
int64_t most_moe_layers(const mp::ModelSpec& m, const mp::Layout& l) {
  int64_t most = 0;
  for (int64_t r = 0; r < l.pp; ++r) most = std::max(most, mp::stage_layer_counts(m, l, r).moe);
  return most;
}

void add_moe_json(json& entry, const mp::PlanRequest& r, const mp::Candidate& c) {
  const mp::Layout& l = c.layout;
  entry["layout"]["expert_model_parallel_size"] = l.ep;
  entry["layout"]["expert_tensor_parallel_size"] = l.etp;
  entry["layout"]["expert_data_parallel_size"] = l.edp();
  auto& mem = entry["memory"];
  mem["dense_parameters"] = c.memory.dense_parameters;
  mem["expert_parameters"] = c.memory.expert_parameters;
  mem["expert_param_bytes"] = c.memory.expert_states.param_bytes;
  mem["expert_grad_bytes"] = c.memory.expert_states.grad_bytes;
  mem["expert_master_param_bytes"] = c.memory.expert_states.master_param_bytes;
  mem["expert_master_grad_bytes"] = c.memory.expert_states.master_grad_bytes;
  mem["expert_optimizer_state_bytes"] = c.memory.expert_states.optimizer_state_bytes;
  entry["time"]["ep_comm_s"] = c.time.ep_comm;
  entry["time"]["expert_dp_comm_s"] = c.time.expert_dp_comm;
  const mp::MoeTraffic tr = mp::moe_traffic_per_layer(r.model, l, r.cluster, r.calibration, r.precision);
  const double per_step = static_cast<double>(most_moe_layers(r.model, l) * l.num_microbatches(r.global_batch)) *
                          (tr.dispatch.forward_bytes * (tr.dispatch.recompute_repeats ? 2 : 1) +
                           tr.dispatch.backward_bytes);
  entry["moe"] = {{"tokens_per_rank", tr.dispatch.tokens}, {"routed_rows_per_rank", tr.dispatch.routed_rows},
                  {"busiest_rank_expert_rows", tr.dispatch.expert_rows},
                  {"moe_imbalance_margin", mp::effective_imbalance_margin(r.model, l.ep)},
                  {"moe_dispatch_forward_bytes", tr.dispatch.forward_bytes},
                  {"moe_dispatch_backward_bytes", tr.dispatch.backward_bytes},
                  {"moe_dispatch_bytes_per_step", per_step}, {"moe_a2a_s", c.time.ep_comm - c.time.etp_comm},
                  {"dispatch_intra_node", tr.intra_node},
                  {"activation_bytes_per_moe_layer",
                   mp::moe_activation_bytes_per_layer(r.model, l, mp::memory_options(r).activations)}};
  if (l.etp == 1) return;  // the output as before expert tensor parallelism
  entry["time"]["etp_comm_s"] = c.time.etp_comm;
  const double etp_per_step = static_cast<double>(most_moe_layers(r.model, l) * l.num_microbatches(r.global_batch)) *
                              (tr.dispatch.etp_forward_bytes * (tr.dispatch.recompute_repeats ? 2 : 1) +
                               tr.dispatch.etp_backward_bytes);
  entry["moe"].update({{"expert_tensor_parallel_rows", tr.dispatch.etp_rows},
                       {"etp_forward_bytes", tr.dispatch.etp_forward_bytes},
                       {"etp_backward_bytes", tr.dispatch.etp_backward_bytes},
                       {"etp_bytes_per_step", etp_per_step}, {"etp_intra_node", tr.etp_intra_node}});
}

// Expert tensor parallelism's all-gather of the expert rows and reduce-scatter of the partial
// outputs over the ETP group: per MoE layer and micro-batch, and per step.
void print_etp_explain(const mp::PlanRequest& r, const mp::Candidate& c, const mp::MoeTraffic& tr) {
  const mp::Layout& l = c.layout;
  const auto& d = tr.dispatch;
  std::printf("  expert tensor parallel per MoE layer and micro-batch, one rank sends: forward %.2f MB, backward %.2f "
              "MB (all-gather of the T x k x margin expert rows + reduce-scatter of the partial outputs over ETP=%lld, "
              "(etp-1) x rows x h each), over %s; %.3f ms + %.3f ms, not overlapped\n",
              mb(d.etp_forward_bytes), mb(d.etp_backward_bytes), static_cast<long long>(l.etp),
              tr.etp_intra_node ? "NVLink" : "the network", 1e3 * tr.etp_forward_s, 1e3 * tr.etp_backward_s);
  const int64_t layers = most_moe_layers(r.model, l), micro = l.num_microbatches(r.global_batch);
  const double per = static_cast<double>(layers * micro);
  std::printf("  expert tensor parallel per step (%lld MoE layers x %lld micro-batches): forward %.2f GB, backward "
              "%.2f GB",
              static_cast<long long>(layers), static_cast<long long>(micro), gb(per * d.etp_forward_bytes),
              gb(per * d.etp_backward_bytes));
  if (d.recompute_repeats) std::printf(", recompute %.2f GB (the forward's again)", gb(per * d.etp_forward_bytes));
  std::printf("\n");
}

void print_moe_explain(const mp::PlanRequest& r, const mp::Candidate& c) {
  const mp::ModelSpec& m = r.model;
  const mp::Layout& l = c.layout;
  std::printf("mixture of experts: %lld experts, top-%lld, in %lld of %lld layers; expert FFN %lld (%s), shared "
              "expert %lld; %s dispatcher, imbalance margin %.2f (%.2f in effect at EP=%lld)\n",
              static_cast<long long>(m.num_experts), static_cast<long long>(m.moe_router_topk),
              static_cast<long long>(mp::num_moe_layers(m)), static_cast<long long>(m.num_layers),
              static_cast<long long>(m.moe_ffn()), m.swiglu ? "SwiGLU" : "GeLU",
              static_cast<long long>(m.moe_shared_expert_intermediate_size),
              megatorch::transformer::to_string(m.moe_token_dispatcher), m.moe_imbalance_margin,
              mp::effective_imbalance_margin(m, l.ep), static_cast<long long>(l.ep));
  std::printf("  parameters: %lld in all, %lld in experts, %lld active per token (6 x active = training FLOPs "
              "per token of the GEMMs)\n",
              static_cast<long long>(mp::total_params(m)), static_cast<long long>(mp::expert_params(m)),
              static_cast<long long>(mp::active_params(m)));
  if (l.etp == 1) {
    std::printf("  expert layout: EP=%lld x EDP=%lld over each stage's TP*CP*DP = %lld ranks (expert tensor parallel 1: "
                "experts whole); %lld of the %lld experts of each MoE layer per EP rank\n",
                static_cast<long long>(l.ep), static_cast<long long>(l.edp()),
                static_cast<long long>(l.tp * l.cp * l.dp), static_cast<long long>(m.num_experts / l.ep),
                static_cast<long long>(m.num_experts));
  } else {
    const long long f = m.moe_ffn(), f1 = f * (m.swiglu ? 2 : 1), etp = l.etp;
    std::printf("  expert layout: EP=%lld x ETP=%lld x EDP=%lld over each stage's TP*CP*DP = %lld ranks (expert tensor "
                "parallel %lld: each expert split as a TP MLP, fc1 %lld of %lld columns, fc2 %lld of %lld rows); %lld "
                "of the %lld experts of each MoE layer per EP rank\n",
                static_cast<long long>(l.ep), etp, static_cast<long long>(l.edp()),
                static_cast<long long>(l.tp * l.cp * l.dp), etp, f1 / etp, f1, f / etp, f,
                static_cast<long long>(m.num_experts / l.ep), static_cast<long long>(m.num_experts));
  }
  const auto& mem = c.memory;
  const mp::LayerCounts n = mp::stage_layer_counts(m, l, mem.stage);
  const std::string shard = l.etp == 1 ? "" : ", the rank's 1/" + std::to_string(l.etp) + " shard of each";
  std::printf("  parameters per rank (stage %lld): %lld dense (ZeRO over DP x CP = %lld) + %lld in experts (%lld MoE "
              "layers x %lld of %lld experts x %lld%s; ZeRO over EDP = %lld)\n",
              static_cast<long long>(mem.stage), static_cast<long long>(mem.dense_parameters),
              static_cast<long long>(l.dp_cp()), static_cast<long long>(mem.expert_parameters),
              static_cast<long long>(n.moe), static_cast<long long>(m.num_experts / l.ep),
              static_cast<long long>(m.num_experts), static_cast<long long>(mp::params_per_expert_shard(m, l.etp)),
              shard.c_str(), static_cast<long long>(l.edp()));
  std::printf("  expert states per rank: params %.2f GB, grads %.2f GB, master params %.2f GB, master grads %.2f GB, "
              "optimizer states %.2f GB\n",
              gb(mem.expert_states.param_bytes), gb(mem.expert_states.grad_bytes),
              gb(mem.expert_states.master_param_bytes), gb(mem.expert_states.master_grad_bytes),
              gb(mem.expert_states.optimizer_state_bytes));
  const mp::MoeTraffic tr = mp::moe_traffic_per_layer(m, l, r.cluster, r.calibration, r.precision);
  const auto& d = tr.dispatch;
  std::printf("  tokens per rank and micro-batch: T = %.0f; routed rows T x k = %.0f; the busiest rank's experts "
              "process T x k x margin = %.0f rows",
              d.tokens, d.routed_rows, d.expert_rows);
  if (l.etp > 1)
    std::printf(", gathered over ETP: its expert shards process ETP x that = %.0f rows at 1/%lld of the width",
                d.etp_rows, static_cast<long long>(l.etp));
  std::printf("\n");
  const mp::MemoryOptions mo = mp::memory_options(r);
  std::printf("  activations per layer and micro-batch: MoE layer %.3f GB, dense layer %.3f GB\n",
              gb(mp::moe_activation_bytes_per_layer(m, l, mo.activations)),
              gb(mp::activation_bytes_per_layer(m, l, mo.activations)));
  if (l.ep == 1) {
    std::printf("  dispatch: none (EP=1: every expert on every rank)\n");
    if (l.etp > 1) print_etp_explain(r, c, tr);
    return;
  }
  const char* link = tr.intra_node ? "NVLink" : "the network";
  std::printf("  dispatch per MoE layer and micro-batch, one rank sends: forward %.2f MB, backward %.2f MB (%s), over "
              "%s; %.3f ms + %.3f ms, not overlapped\n",
              mb(d.forward_bytes), mb(d.backward_bytes),
              m.moe_token_dispatcher == mp::TokenDispatcher::kAllToAll
                  ? "all-to-all: dispatch + combine, (ep-1)/ep of T x k x margin rows each"
                  : "all-gather of tokens, weights, selections + reduce-scatter of outputs",
              link, 1e3 * tr.forward_s, 1e3 * tr.backward_s);
  const int64_t layers = most_moe_layers(m, l), micro = l.num_microbatches(r.global_batch);
  const double per = static_cast<double>(layers * micro);
  std::printf("  dispatch per step (%lld MoE layers x %lld micro-batches): forward %.2f GB, backward %.2f GB",
              static_cast<long long>(layers), static_cast<long long>(micro), gb(per * d.forward_bytes),
              gb(per * d.backward_bytes));
  if (d.recompute_repeats) std::printf(", recompute %.2f GB (the forward's again)", gb(per * d.forward_bytes));
  std::printf("\n");
  if (l.etp > 1) print_etp_explain(r, c, tr);
}

// What context parallelism does to the best layout: each rank's share of the sequence, its
// activations against cp = 1, and the bytes it exchanges over the CP group.
void print_cp_explain(const mp::PlanRequest& r, const mp::Candidate& c) {
  const mp::Layout& l = c.layout;
  const int64_t cp = l.cp;
  const mp::CpShare share = mp::cp_share(r.model, cp);
  std::printf("context parallel: CP=%lld, %s\n", static_cast<long long>(cp),
              l.cp_comm == mp::CpCommType::kP2P ? "p2p (ring attention: K and V travel the CP ring)"
                                                : "a2a (Ulysses: all-to-alls around attention, heads split over CP)");
  std::printf("  sequence share: %lld of %lld tokens per CP rank (S/c), the sequence cut into %lld chunks of %lld "
              "(S/2c); rank r holds chunks r and %lld-r:", static_cast<long long>(share.tokens),
              static_cast<long long>(r.model.seq_length), static_cast<long long>(share.num_chunks),
              static_cast<long long>(share.chunk_tokens), static_cast<long long>(2 * cp - 1));
  for (int64_t k = 0; k < std::min<int64_t>(cp, 4); ++k)
    std::printf("%s rank %lld: %lld and %lld", k ? "," : "", static_cast<long long>(k), static_cast<long long>(k),
                static_cast<long long>(2 * cp - 1 - k));
  std::printf("%s\n", cp > 4 ? ", ..." : "");
  const mp::MemoryOptions mo = mp::memory_options(r);
  mp::Layout one = l;
  one.cp = 1;
  const bool kept_twice = mo.activations.flash_attention && l.recompute == mp::Recompute::kNone;
  std::printf("  activations per layer and micro-batch: %.3f GB per rank (%.3f GB at CP=1, / %lld: every term is "
              "proportional to the rank's tokens%s)\n",
              gb(mp::activation_bytes_per_layer(r.model, l, mo.activations)),
              gb(mp::activation_bytes_per_layer(r.model, one, mo.activations)), static_cast<long long>(cp),
              !kept_twice ? ""
              : l.cp_comm == mp::CpCommType::kA2A ? "; plus the attention output kept twice and 16*S bytes of token order"
                                                   : "; plus the attention output kept twice");
  const mp::CpTraffic tr = mp::cp_traffic_per_layer(r.model, l, r.cluster, r.calibration, r.precision);
  const char* link = tr.intra_node ? "NVLink" : "the network";
  if (l.cp_comm == mp::CpCommType::kP2P)
    std::printf("  CP traffic per layer and micro-batch, one rank sends: forward %.2f MB (K and V, c-1 = %lld hop%s), "
                "backward %.2f MB (K,V and dK,dV), over %s; %.3f ms + %.3f ms, of it exposed %.3f ms + %.3f ms\n",
                tr.forward_bytes / 1e6, static_cast<long long>(cp - 1), cp > 2 ? "s" : "", tr.backward_bytes / 1e6, link,
                1e3 * tr.forward_s, 1e3 * tr.backward_s, 1e3 * tr.exposed_forward_s, 1e3 * tr.exposed_backward_s);
  else
    std::printf("  CP traffic per layer and micro-batch, one rank sends: forward %.2f MB ((c-1)/c of Q, K, V and the "
                "output), backward %.2f MB, over %s; %.3f ms + %.3f ms, none of it hidden\n",
                tr.forward_bytes / 1e6, tr.backward_bytes / 1e6, link, 1e3 * tr.forward_s, 1e3 * tr.backward_s);
  const int64_t layers = r.model.num_layers / l.pp, micro = l.num_microbatches(r.global_batch);
  const double per = static_cast<double>(layers * micro);
  std::printf("  CP traffic per step (%lld layers x %lld micro-batches): forward %.2f GB, backward %.2f GB",
              static_cast<long long>(layers), static_cast<long long>(micro), gb(per * tr.forward_bytes),
              gb(per * tr.backward_bytes));
  if (tr.recompute_repeats) std::printf(", recompute %.2f GB (the forward's again)", gb(per * tr.forward_bytes));
  std::printf("\n");
}

// The chosen layout's PP and micro-batches under each schedule: the bubble from the F, B and
// W ticks (zb-h1's on NCCL as the executor's batches allow, next to the simulator's; the V's
// per chunk of half a stage), so the choice can be seen; and the flags that run it.
void print_schedule_explain(const mp::PlanRequest& r, const mp::Candidate& c) {
  const mp::Layout& l = c.layout;
  if (l.pp == 1) {
    std::printf("pipeline schedule: none at PP=1 (one stage, no bubble)\ngpt_pretrain flags: %s\n",
                mp::gpt_pretrain_flags(r, l).c_str());
    return;
  }
  std::printf("pipeline schedules at PP=%lld, %lld micro-batches, p2p over %s (ticks per chunk: F forward, B input "
              "gradient, W weight gradients; 1f1b and interleaved run B+W together, dualpipev some; zb-v and "
              "dualpipev hold two chunks of half a stage per rank in a V):\n",
              static_cast<long long>(l.pp), static_cast<long long>(l.num_microbatches(r.global_batch)),
              l.backend == mp::DistributedBackend::kGloo ? "Gloo" : "NCCL");
  for (const mp::ScheduleChoice& s : mp::schedule_choices(r, l)) {
    const char* name = megatorch::pipeline::schedule_kind_name(s.kind);
    const std::string vp = s.kind == megatorch::pipeline::ScheduleKind::kInterleaved
                               ? " VP=" + std::to_string(s.layout.vpp) : "";
    if (!s.error.empty()) {
      std::printf("  %-12s%s not planned: %s\n", name, vp.c_str(), s.error.c_str());
      continue;
    }
    const auto& o = s.costs.options;
    const mp::Candidate& k = s.candidate;
    // Where NCCL's rendezvous costs the schedule its simulated gain (zb-h1 on NCCL), both figures.
    char sim[64] = "";
    if (k.time.simulated_bubble_fraction != k.time.bubble_fraction)
      std::snprintf(sim, sizeof sim, " (simulated %.4f)", k.time.simulated_bubble_fraction);
    std::printf("  %-12s%s bubble %.4f%s  F %lld B %lld W %lld  step %.3f s  %.2f GB%s%s\n", name, vp.c_str(),
                k.time.bubble_fraction, sim, static_cast<long long>(o.forward_cost),
                static_cast<long long>(s.costs.backward_input_ticks),
                static_cast<long long>(s.costs.backward_weight_ticks), k.time.step, gb(k.memory.total()),
                k.memory.total() > r.cluster.memory_bytes() ? " (does not fit)" : "",
                s.kind == mp::schedule_of(l) ? "  <- chosen" : "");
  }
  std::printf("gpt_pretrain flags: %s\n", mp::gpt_pretrain_flags(r, l).c_str());
}

void print_explain(const mp::PlanRequest& r, const mp::Candidate& c) {
  const auto& m = c.memory;
  const auto& t = c.time;
  std::printf("\n%s\nmemory per GPU (pipeline stage %lld, the fullest): %.2f GB of %.2f GB\n", c.layout.str().c_str(),
              static_cast<long long>(m.stage), gb(m.total()), r.cluster.gpu_memory_gb);
  std::printf("  parameters        %9.2f GB\n  gradients         %9.2f GB\n  master params     %9.2f GB\n",
              gb(m.states.param_bytes), gb(m.states.grad_bytes), gb(m.states.master_param_bytes));
  std::printf("  master grads      %9.2f GB\n  optimizer states  %9.2f GB\n", gb(m.states.master_grad_bytes),
              gb(m.states.optimizer_state_bytes));
  std::printf("  activations       %9.2f GB  (%.2f micro-batches in flight, from the simulator)\n", gb(m.activations),
              m.inflight_microbatches);
  std::printf("  recompute working %9.2f GB\n  logits            %9.2f GB\n  reserved          %9.2f GB\n",
              gb(m.recompute_working), gb(m.logits), gb(m.reserved));
  std::printf("step time: %.3f s  (%.1f TFLOP/s per GPU, MFU %.1f%%)\n", t.step, t.tflops_per_gpu, 100 * t.mfu);
  std::printf("  compute           %9.3f s  (of which recompute %.3f s)\n  TP/SP comm        %9.3f s\n", t.compute,
              t.recompute, t.tp_comm);
  if (c.layout.cp > 1)
    std::printf("  CP comm           %9.3f s  (exposed: not hidden under attention)\n", t.cp_comm);
  if (r.model.is_moe() && c.layout.etp == 1)
    std::printf("  EP comm           %9.3f s  (token dispatch and combine, not overlapped)\n", t.ep_comm);
  else if (r.model.is_moe())
    std::printf("  EP comm           %9.3f s  (token dispatch and combine, and ETP's all-gathers and reduce-scatters "
                "%.3f s, not overlapped)\n",
                t.ep_comm, t.etp_comm);
  std::printf("  pipeline p2p      %9.3f s\n  pipeline bubble   %9.3f s  (%.4f of busy time", t.p2p, t.bubble,
              t.bubble_fraction);
  if (t.simulated_bubble_fraction != t.bubble_fraction) {
    std::printf(" under NCCL's rendezvous; simulated %.4f", t.simulated_bubble_fraction);
  }
  std::printf(")\n");
  if (r.model.is_moe()) {
    std::printf("  DP/ZeRO comm      %9.3f s  (dense gradients over DP x CP, experts' %.3f s over expert-DP)\n"
                "calibration: %s\n",
                t.dp_comm, t.expert_dp_comm, r.calibration.source.c_str());
  } else {
    std::printf("  DP/ZeRO comm      %9.3f s%s\ncalibration: %s\n", t.dp_comm,
                c.layout.cp > 1 ? "  (gradients reduced over DP x CP)" : "", r.calibration.source.c_str());
  }
  if (c.layout.cp > 1) print_cp_explain(r, c);
  if (r.model.is_moe()) print_moe_explain(r, c);
  print_schedule_explain(r, c);
}

int run_plan(const Args& a, mp::PlanRequest r) {
  const mp::PlanResult res = mp::plan(r);
  const auto& best = res.ranked.front();
  const size_t n = std::min<size_t>(res.ranked.size(), static_cast<size_t>(std::max<int64_t>(a.top, 1)));
  if (a.json) {
    json j;
    j["model"] = {{"name", r.model.name}, {"num_layers", r.model.num_layers}, {"hidden_size", r.model.hidden_size},
                  {"num_attention_heads", r.model.num_attention_heads}, {"num_query_groups", r.model.query_groups()},
                  {"ffn_hidden_size", r.model.ffn()}, {"vocab_size", r.model.vocab_size}, {"seq_length", r.model.seq_length},
                  {"parameters", mp::total_params(r.model)}};
    if (r.model.is_moe()) j["model"].update(moe_model_json(r.model));
    j["cluster"] = {{"gpus", r.cluster.gpus()}, {"gpus_per_node", r.cluster.gpus_per_node}, {"nodes", r.cluster.nodes},
                    {"gpu_memory_gb", r.cluster.gpu_memory_gb}, {"peak_tflops", r.cluster.peak_tflops}};
    j["calibration"] = mp::to_json(r.calibration);
    j["global_batch_size"] = r.global_batch;
    j["precision"] = mp::to_string(r.precision);
    j["fp8"] = r.fp8;
    j["distributed_backend"] = mp::to_string(r.backend);
    j["considered"] = res.considered;
    j["rejected_out_of_memory"] = res.too_big;
    j["fitting"] = res.ranked.size();
    j["top"] = json::array();
    for (size_t i = 0; i < n; ++i) {
      const auto& c = res.ranked[i];
      json entry = {{"rank", i + 1}, {"layout", layout_json(c.layout)}, {"memory", memory_json(c.memory)},
                    {"time", time_json(c.time)}, {"why_lost", mp::why_lost(c, best)}};
      if (r.model.is_moe()) add_moe_json(entry, r, c);
      j["top"].push_back(std::move(entry));
    }
    std::cout << j.dump() << std::endl;
    return 0;
  }
  const std::string experts =
      r.model.is_moe() ? " (" + std::to_string(mp::expert_params(r.model)) + " in experts, " +
                             std::to_string(r.model.num_experts) + " per MoE layer; " +
                             std::to_string(mp::active_params(r.model)) + " active per token)"
                       : "";
  std::printf("%s: %lld parameters%s on %lld GPUs (%lld x %lld), global batch %lld, %s\n", r.model.name.c_str(),
              static_cast<long long>(mp::total_params(r.model)), experts.c_str(), static_cast<long long>(r.cluster.gpus()),
              static_cast<long long>(r.cluster.nodes), static_cast<long long>(r.cluster.gpus_per_node),
              static_cast<long long>(r.global_batch), mp::to_string(r.precision));
  std::printf("%lld layouts considered, %lld do not fit in %.0f GB, %zu fit; the fastest %zu:\n",
              static_cast<long long>(res.considered), static_cast<long long>(res.too_big), r.cluster.gpu_memory_gb,
              res.ranked.size(), n);
  // 58 columns fit every layout without CP; a CP layout's longer name widens the column.
  int width = 58;
  for (size_t i = 0; i < n; ++i) width = std::max(width, static_cast<int>(res.ranked[i].layout.str().size()));
  std::printf("%4s  %-*s %9s %9s %8s %6s %7s  %s\n", "rank", width, "layout", "mem GB", "step s", "TFLOP/s", "MFU",
              "bubble", "why it lost");
  for (size_t i = 0; i < n; ++i) {
    const auto& c = res.ranked[i];
    std::printf("%4zu  %-*s %9.2f %9.3f %8.1f %5.1f%% %7.4f  %s\n", i + 1, width, c.layout.str().c_str(), gb(c.memory.total()),
                c.time.step, c.time.tflops_per_gpu, 100 * c.time.mfu, c.time.bubble_fraction,
                mp::why_lost(c, best).c_str());
  }
  if (a.explain) print_explain(r, best);
  return 0;
}

int run_calibrate(const Args& a, const mp::Cluster& cluster) {
  const mp::CalibrationReport rep = mp::calibrate(cluster);
  const char* rank = std::getenv("RANK");
  if (rank && std::string(rank) != "0") return 0;
  mp::save_calibration(rep.calibration, a.calibrate_out);
  json j = mp::to_json(rep.calibration);
  j["measurements"] = rep.measurements;
  j["file"] = a.calibrate_out;
  if (a.json)
    std::cout << j.dump() << std::endl;
  else
    std::printf("%s\ncalibration written to %s (use it with --calibration %s)\n", j.dump(2).c_str(),
                a.calibrate_out.c_str(), a.calibrate_out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Predict memory and step time of TP/CP/PP/DP/ZeRO layouts and rank them.", "megatorch-plan"};
  Args a;
  mp::Cluster cl;
  int64_t global_batch = 512;
  double reserved_gb = 2.0;
  app.add_option("--model", a.model, "preset: gpt3-175b, megatron-1t, llama3-8b, llama3-70b (flags below override)");
  app.add_option("--num-layers", a.layers);
  app.add_option("--hidden-size", a.hidden);
  app.add_option("--num-attention-heads", a.heads);
  app.add_option("--num-query-groups", a.groups, "key/value heads (GQA)");
  app.add_option("--ffn-hidden-size", a.ffn);
  app.add_option("--vocab-size,--padded-vocab-size", a.vocab);
  app.add_option("--make-vocab-size-divisible-by", a.divisible_by)->capture_default_str();
  app.add_option("--seq-length", a.seq);
  app.add_flag("--swiglu", a.swiglu);
  app.add_option("--mean-document-length", a.mean_document_length,
                 "packed documents' mean length (gpt_pretrain --reset-attention-mask): attention counts each "
                 "document's square; 0: one document per sequence")->capture_default_str();
  app.add_option("--normalization", a.normalization, "LayerNorm or RMSNorm")->capture_default_str();
  app.add_option("--position-embedding-type", a.positions, "learned_absolute or rope")->capture_default_str();
  app.add_flag("--disable-bias-linear", a.no_bias);
  app.add_flag("--untie-embeddings-and-output-weights", a.untie);
  app.add_option("--global-batch-size", global_batch)->capture_default_str();
  app.add_option("--precision", a.precision, "bf16, fp16, fp32 or mixed (the ZeRO paper's 16 bytes/param)")
      ->capture_default_str();
  app.add_flag("--bf16", a.bf16, "same as --precision bf16");
  app.add_flag("--fp16", a.fp16, "same as --precision fp16");
  app.add_option("--fp8-format", a.fp8_format, "e4m3 or hybrid: plan FP8 linear GEMMs (at --fp8-peak-tflops)")
      ->check(CLI::IsMember({"e4m3", "hybrid"}));
  app.add_option("--fp8-peak-tflops", cl.fp8_peak_tflops, "peak dense FP8 TFLOP/s per GPU; 0: 2 x --peak-tflops")
      ->capture_default_str();
  app.add_option("--gpus-per-node", cl.gpus_per_node)->capture_default_str();
  app.add_option("--nodes", cl.nodes)->capture_default_str();
  app.add_option("--gpu-memory-gb", cl.gpu_memory_gb)->capture_default_str();
  app.add_option("--peak-tflops", cl.peak_tflops, "peak dense 16-bit TFLOP/s per GPU")->capture_default_str();
  app.add_option("--intra-node-gbps", cl.intra_node_gbps, "NVLink GB/s per GPU, both directions")->capture_default_str();
  app.add_option("--inter-node-gbps", cl.inter_node_gbps, "network GB/s per node, all NICs")->capture_default_str();
  app.add_option("--memory-bandwidth-gbps", cl.memory_bandwidth_gbps, "HBM GB/s per GPU")->capture_default_str();
  app.add_option("--reserved-gb", reserved_gb, "per-GPU memory kept for the runtime and buffers")->capture_default_str();
  app.add_option("--tensor-model-parallel-size", a.tp);
  app.add_option("--context-parallel-size", a.cp, "CP size c: the sequence split over c ranks (default: searched)");
  app.add_option("--cp-comm-type", a.cp_comm, "p2p (ring attention) or a2a (Ulysses)")->capture_default_str();
  app.add_option("--pipeline-model-parallel-size", a.pp);
  app.add_option("--data-parallel-size", a.dp);
  app.add_option("--virtual-pipeline-model-parallel-size", a.vpp);
  app.add_option("--schedule", a.schedule,
                 "pipeline schedule: 1f1b, interleaved (VP > 1), zb-h1, zb-v or dualpipev (the V two: Gloo only) "
                 "(default: searched, zb-h1 next to 1f1b, and on Gloo zb-v and dualpipev)");
  app.add_option("--distributed-backend", a.backend,
                 "p2p backend of the pipeline, as gpt_pretrain's flag: nccl (GPUs) or gloo; zb-v and dualpipev run "
                 "on gloo only, and zb-h1 is timed with NCCL's rendezvous on nccl")
      ->capture_default_str();
  app.add_option("--zero-stage", a.zero, "0, 1, 2 or 3");
  app.add_option("--micro-batch-size", a.mb);
  app.add_option("--recompute-granularity", a.recompute, "none, selective or full");
  app.add_flag("--sequence-parallel", a.sp, "fix sequence parallelism on");
  app.add_flag("--no-sequence-parallel", a.no_sp, "fix sequence parallelism off");
  app.add_option("--mask-bytes", a.mask_bytes, "bytes per dropout-mask element (1 on CUDA, 4 on CPU, 0 without dropout)")
      ->capture_default_str();
  app.add_flag("--megatorch-activations", a.megatorch_activations,
               "count what megatorch's layer keeps beyond Korthikanti (norm statistics)");
  app.add_flag("--math-attention", a.math_attention, "attention runs SDPA's math path (CPU with dropout)");
  app.add_flag("--flash-attention", a.flash_attention,
               "attention keeps no s x s scores, as megatorch's runs without attention dropout and under CP "
               "(flash SDPA, ring attention, Ulysses): a log-sum-exp per query instead");
  app.add_option("--num-experts", a.num_experts, "experts per MoE layer; 0: a dense model")->capture_default_str();
  app.add_option("--moe-router-topk", a.topk, "experts per token")->capture_default_str();
  app.add_option("--moe-ffn-hidden-size", a.moe_ffn, "each expert's hidden size; 0: --ffn-hidden-size")
      ->capture_default_str();
  app.add_option("--moe-layer-freq", a.moe_layer_freq, "every N-th layer (0, N, 2N, ...) is an MoE layer")
      ->capture_default_str();
  app.add_option("--moe-first-k-dense", a.moe_first_k_dense, "the first K layers stay dense (DeepSeek)")
      ->capture_default_str();
  app.add_option("--moe-shared-expert-intermediate-size", a.moe_shared,
                 "hidden size of the shared expert every token passes through; 0: none")
      ->capture_default_str();
  app.add_option("--moe-token-dispatcher-type", a.dispatcher, "alltoall or allgather")->capture_default_str();
  app.add_option("--moe-imbalance-margin", a.imbalance_margin,
                 "planning assumption >= 1: the busiest expert-parallel rank receives this times the mean routed "
                 "rows (its expert compute, activations and all-to-all bytes)")
      ->capture_default_str();
  app.add_option("--expert-model-parallel-size", a.ep,
                 "EP size: ranks each MoE layer's experts are spread over, inside TP x CP x DP (default: searched)");
  app.add_option("--expert-tensor-parallel-size", a.etp,
                 "ETP size: ranks each expert is split over as a TP MLP (fc1 by columns, fc2 by rows), inside "
                 "TP x CP x DP / EP; 1: every expert whole; 0: searched")
      ->capture_default_str();
  app.add_option("--top", a.top, "layouts to list")->capture_default_str();
  app.add_flag("--json", a.json, "print one JSON object");
  app.add_flag("--explain", a.explain,
               "print the full memory and time breakdown of the best layout, its bubble under each schedule and "
               "gpt_pretrain's flags for it");
  app.add_option("--calibration", a.calibration, "calibration JSON written by --calibrate");
  auto* cal = app.add_option("--calibrate", a.calibrate_out, "time this machine and write the calibration JSON")
                  ->expected(0, 1);
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = megatorch::util::parse_or_exit(app, argc, argv, "megatorch-plan")) return *code;
  try {
    if (cal->count() > 0) return run_calibrate(a, cl);
    mp::PlanRequest r;
    if (!a.model.empty()) r.model = mp::preset(a.model);
    else if (a.layers == 0 || a.hidden == 0 || a.heads == 0)
      MEGATORCH_FAIL("give a model: --model PRESET (", "gpt3-175b, megatron-1t, llama3-8b, llama3-70b", ") or at least "
                     "--num-layers, --hidden-size and --num-attention-heads");
    auto& m = r.model;
    if (a.layers) m.num_layers = a.layers;
    if (a.hidden) m.hidden_size = a.hidden;
    if (a.heads) m.num_attention_heads = a.heads;
    if (a.groups) m.num_query_groups = a.groups;
    if (a.ffn) m.ffn_hidden_size = a.ffn;
    if (a.vocab) m.vocab_size = a.vocab;
    if (a.seq) m.seq_length = a.seq;
    m.make_vocab_size_divisible_by = a.divisible_by;
    m.num_experts = a.num_experts, m.moe_router_topk = a.topk, m.moe_ffn_hidden_size = a.moe_ffn;
    m.moe_layer_freq = a.moe_layer_freq, m.moe_first_k_dense = a.moe_first_k_dense;
    m.moe_shared_expert_intermediate_size = a.moe_shared;
    m.moe_token_dispatcher = megatorch::transformer::parse_token_dispatcher(a.dispatcher);
    m.moe_imbalance_margin = a.imbalance_margin;
    m.mean_document_length = a.mean_document_length;
    if (a.model.empty()) {
      namespace tf = megatorch::transformer;
      m.swiglu = a.swiglu, m.rms_norm = tf::parse_normalization(a.normalization) == tf::Normalization::kRMSNorm;
      m.learned_positions = tf::parse_positions(a.positions) == tf::Positions::kLearned;
      m.add_bias_linear = !a.no_bias, m.tie_embeddings = !a.untie;
    }
    r.cluster = cl;
    r.global_batch = global_batch;
    MEGATORCH_CHECK(!(a.fp16 && a.bf16), "megatorch-plan: --fp16 and --bf16 contradict each other; give one of them "
                    "(or --precision fp16|bf16)");
    r.precision = mp::parse_precision(a.fp16 ? "fp16" : a.bf16 ? "bf16" : a.precision);
    r.fp8 = !a.fp8_format.empty();
    r.reserved_gb = reserved_gb;
    r.activations.mask_bytes = a.mask_bytes;
    r.activations.megatorch_extras = a.megatorch_activations;
    r.activations.math_attention = a.math_attention;
    r.activations.flash_attention = a.flash_attention;
    if (!a.calibration.empty()) r.calibration = mp::load_calibration(a.calibration);
    if (a.tp) r.tp = a.tp;
    if (a.cp) r.cp = a.cp;
    if (a.ep) r.ep = a.ep;
    if (a.etp == 0) r.etp.reset();  // searched
    else r.etp = a.etp;
    r.cp_comm_type = mp::parse_cp_comm_type(a.cp_comm);
    if (a.pp) r.pp = a.pp;
    if (a.dp) r.dp = a.dp;
    if (a.vpp) r.vpp = a.vpp;
    if (!a.schedule.empty()) r.schedule = megatorch::pipeline::parse_schedule_kind(a.schedule);
    r.backend = mp::parse_distributed_backend(a.backend);
    if (a.mb) r.micro_batch = a.mb;
    if (a.zero >= 0) r.zero_stage = a.zero;
    if (!a.recompute.empty()) r.recompute = megatorch::transformer::parse_recompute(a.recompute);
    if (a.sp && a.no_sp) MEGATORCH_FAIL("give one of --sequence-parallel and --no-sequence-parallel, not both");
    if (a.sp) r.sequence_parallel = true;
    if (a.no_sp) r.sequence_parallel = false;
    return run_plan(a, r);
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "megatorch-plan: " << e.what() << "\n";
    return 1;
  }
}
