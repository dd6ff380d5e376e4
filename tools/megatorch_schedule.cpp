// megatorch-schedule: builds a pipeline schedule, simulates it and reports its bubble,
// makespan and activations in flight per rank; checks the executor's NCCL posting (one
// communicator per channel, p2p_channels.h) and, for the looped schedules, Megatron's
// single-communicator batches (nccl_order_model.h) against NCCL's rules; optionally draws
// its timeline as SVG. Given
// the sequence length and hidden size it also sizes the tensor sent between stages and the
// bytes each rank sends per step; under context parallelism that tensor is each rank's
// share of the sequence, [S/c (/t under SP), b, h].
//
//   megatorch-schedule --schedule interleaved --pipeline-model-parallel-size 4
//       --num-microbatches 8 --virtual-pipeline-model-parallel-size 2 --json --svg t.svg
//   megatorch-schedule -p 4 -m 8 --context-parallel-size 2 --seq-length 8192 --hidden-size 4096
//   megatorch-schedule --schedule zb-h1 -p 4 -m 8 --f-cost 2 --b-cost 2 --w-cost 1
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "megatorch/check.h"
#include "megatorch/pipeline/nccl_order_model.h"
#include "megatorch/comm/nccl_semantics.h"
#include "megatorch/pipeline/p2p_batches.h"
#include "megatorch/pipeline/p2p_channels.h"
#include "megatorch/pipeline/schedule.h"
#include "megatorch/pipeline/simulator.h"
#include "megatorch/pipeline/timeline_svg.h"
#include "megatorch/plan/model_spec.h"
#include "megatorch/util/cli_last_wins.h"

namespace mp = megatorch::pipeline;
namespace plan = megatorch::plan;

namespace {

struct Args {
  std::string schedule = "1f1b";
  int64_t p = 0, m = 0, v = 1;
  mp::SimulatorOptions costs;
  bool json = false, list_actions = false, list_steps = false;
  std::string svg;
  // The tensor between stages (optional: without seq and hidden only ticks are reported).
  int64_t cp = 1, seq = 0, hidden = 0, micro_batch = 1, tp = 1, bytes_per_element = 2;
  std::string cp_comm = "p2p";
  bool sequence_parallel = false;
  bool sized() const { return seq > 0 && hidden > 0; }
};

// What one pipeline rank sends to its neighbour per transfer: its CP share of the sequence
// (S/c tokens: chunks r and 2c-1-r), further split over TP under SP, as megatorch's
// PipelineStage shapes it ([s/t or s, b, h]).
struct StageTensor {
  int64_t tokens = 0, micro_batch = 0, hidden = 0;
  int64_t bytes = 0;
};

StageTensor stage_tensor(const Args& a) {
  StageTensor t;
  t.tokens = a.seq / a.cp / (a.sequence_parallel ? a.tp : 1);
  t.micro_batch = a.micro_batch, t.hidden = a.hidden;
  t.bytes = t.tokens * t.micro_batch * t.hidden * a.bytes_per_element;
  return t;
}

// Fails unless the CP and tensor sizes can split the sequence as megatorch does.
void check_sizes(const Args& a) {
  MEGATORCH_CHECK(a.cp >= 1 && a.tp >= 1 && a.micro_batch >= 1 && a.bytes_per_element >= 1,
                  "expected --context-parallel-size, --tensor-model-parallel-size, --micro-batch-size and "
                  "--bytes-per-element >= 1, got ", a.cp, ", ", a.tp, ", ", a.micro_batch, ", ", a.bytes_per_element);
  plan::parse_cp_comm_type(a.cp_comm);  // fails naming p2p and a2a
  MEGATORCH_CHECK((a.seq > 0) == (a.hidden > 0), "give both --seq-length and --hidden-size to size the tensor between "
                  "stages, or neither; got --seq-length ", a.seq, " and --hidden-size ", a.hidden);
  if (!a.sized()) return;
  MEGATORCH_CHECK(a.cp == 1 || a.seq % (2 * a.cp) == 0, "expected --seq-length (", a.seq, ") divisible by 2 x "
                  "--context-parallel-size (", 2 * a.cp, "): CP cuts the sequence into 2c chunks; change either");
  MEGATORCH_CHECK(!a.sequence_parallel || (a.seq / a.cp) % a.tp == 0, "expected the tokens per CP rank (", a.seq / a.cp,
                  ") divisible by --tensor-model-parallel-size (", a.tp, ") under --sequence-parallel; change the "
                  "sizes or drop --sequence-parallel");
}

// Sends of one step per rank: every send (activation or gradient) carries one stage tensor.
std::vector<int64_t> sends_per_rank(const std::vector<std::vector<mp::Action>>& lists) {
  std::vector<int64_t> sends;
  for (const auto& list : lists) {
    int64_t n = 0;
    for (const auto& action : list) n += mp::is_send(action.kind) ? 1 : 0;
    sends.push_back(n);
  }
  return sends;
}

std::string cp_share_line(const Args& a) {
  return "context parallel " + std::to_string(a.cp) + " (" + a.cp_comm + "): each pipeline rank holds S/" +
         std::to_string(a.cp) + " of every sequence (chunks r and " + std::to_string(2 * a.cp - 1) + "-r of " +
         std::to_string(2 * a.cp) + "); the tensor between stages is [S/" + std::to_string(a.cp) +
         (a.sequence_parallel ? "/t" : "") + ", b, h] per rank; the tick costs are per chunk as given (with c in them)";
}

// The published bubble, where it holds (formula_bubble_fraction's conditions).
std::optional<mp::Ratio> published_bubble(const Args& a, mp::ScheduleKind kind) {
  const auto& c = a.costs;
  try {
    return mp::formula_bubble_fraction(kind, a.p, a.m, a.v, c);
  } catch (const c10::Error&) {
    return std::nullopt;  // the costs are outside the formula's condition
  }
}

const char* formula_text(mp::ScheduleKind kind) {
  switch (kind) {
    case mp::ScheduleKind::kInterleaved: return "(p-1)/(v*m)";
    case mp::ScheduleKind::kZeroBubbleH1: return "(p-1)(F+B-W)/(m(F+B+W))";
    case mp::ScheduleKind::kZeroBubbleV: return "(p-1)F/(2m(F+B+W)) at F = B = W";
    case mp::ScheduleKind::kDualPipeV: return "(p-1)(F&B+B-3W)/(2m(F+B+W)), F&B = F+B, at B = 2W, B <= F <= B+W";
    default: return "(p-1)/m";
  }
}

nlohmann::json report_json(const Args& a, mp::ScheduleKind kind, const mp::SimulationResult& sim,
                           const megatorch::comm::NcclCheckReport& channels,
                           const std::optional<mp::NcclOrderReport>& nccl, const std::vector<int64_t>& sends) {
  const std::optional<mp::Ratio> formula = published_bubble(a, kind);
  nlohmann::json j;
  j["schedule"] = mp::schedule_kind_name(kind);
  j["pipeline_model_parallel_size"] = a.p;
  j["num_microbatches"] = a.m;
  j["virtual_pipeline_model_parallel_size"] = a.v;
  j["costs"] = {{"forward", a.costs.forward_cost}, {"backward", a.costs.backward_cost}, {"p2p", a.costs.p2p_cost}};
  if (mp::splits_backward(kind)) {
    j["costs"]["backward_input"] = a.costs.backward_input_cost;
    j["costs"]["backward_weight"] = a.costs.backward_weight_cost;
  }
  j["makespan"] = sim.makespan;
  j["bubble_fraction"] = sim.bubble_fraction.value();
  j["bubble_fraction_exact"] = sim.bubble_fraction.str();
  // null where the published formula does not hold for these costs
  j["formula_bubble_fraction"] = formula ? nlohmann::json(formula->value()) : nlohmann::json();
  j["formula_bubble_fraction_exact"] = formula ? nlohmann::json(formula->str()) : nlohmann::json();
  j["matches_formula"] = formula && sim.bubble_fraction == *formula;
  auto per_rank = [&](auto field) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& r : sim.ranks) list.push_back(field(r));
    return list;
  };
  j["peak_inflight"] = per_rank([](const mp::RankReport& r) { return r.peak_inflight; });
  j["busy"] = per_rank([](const mp::RankReport& r) { return r.busy; });
  j["idle"] = per_rank([](const mp::RankReport& r) { return r.idle; });
  j["bubble_per_rank"] = per_rank([](const mp::RankReport& r) { return r.bubble.str(); });
  // The executor's posting on NCCL: checked for every schedule (run() throws otherwise).
  j["nccl"] = {{"runs", true},
               {"deadlock_free", true},
               {"channels", mp::num_p2p_channels(a.v, mp::chunk_layout(kind))},
               {"channel_ops", channels.transfers}};
  // Megatron's single-communicator batches, for the looped schedules they can carry.
  if (nccl) {
    j["nccl"].update({{"recv_posting", mp::recv_posting_name(mp::recv_posting(kind))},
                      {"batches", nccl->batches},
                      {"ops", nccl->ops},
                      {"max_batch", nccl->max_batch},
                      {"makespan", nccl->makespan},
                      {"bubble_fraction", nccl->bubble_fraction.value()},
                      {"bubble_fraction_exact", nccl->bubble_fraction.str()}});
  }
  // Only when asked for: without CP or sizes the report is what it always was.
  if (a.cp > 1) {
    j["context_parallel_size"] = a.cp;
    j["cp_comm_type"] = a.cp_comm;
  }
  if (a.sized()) {
    const StageTensor t = stage_tensor(a);
    j["stage_tensor"] = {{"shape", {t.tokens, t.micro_batch, t.hidden}}, {"bytes", t.bytes},
                         {"sequence_parallel", a.sequence_parallel}, {"tensor_model_parallel_size", a.tp},
                         {"context_parallel_size", a.cp}};
    nlohmann::json bytes = nlohmann::json::array();
    for (int64_t n : sends) bytes.push_back(n * t.bytes);
    j["p2p_sends_per_rank"] = sends;
    j["p2p_send_bytes_per_rank"] = bytes;
  }
  return j;
}

void print_summary(const Args& a, mp::ScheduleKind kind, const mp::SimulationResult& sim,
                   const megatorch::comm::NcclCheckReport& channels,
                   const std::optional<mp::NcclOrderReport>& nccl, const std::vector<int64_t>& sends) {
  const std::optional<mp::Ratio> formula = published_bubble(a, kind);
  std::printf("schedule %s: %lld stages, %lld micro-batches, %lld chunk(s) per stage\n", mp::schedule_kind_name(kind),
              static_cast<long long>(a.p), static_cast<long long>(a.m), static_cast<long long>(a.v));
  if (mp::splits_backward(kind)) {
    std::printf("costs: forward %lld, backward input %lld, backward weight %lld, p2p %lld ticks\n",
                static_cast<long long>(a.costs.forward_cost), static_cast<long long>(a.costs.backward_input_cost),
                static_cast<long long>(a.costs.backward_weight_cost), static_cast<long long>(a.costs.p2p_cost));
  } else {
    std::printf("costs: forward %lld, backward %lld, p2p %lld ticks\n", static_cast<long long>(a.costs.forward_cost),
                static_cast<long long>(a.costs.backward_cost), static_cast<long long>(a.costs.p2p_cost));
  }
  std::printf("makespan %lld ticks\n", static_cast<long long>(sim.makespan));
  if (!formula) {
    std::printf("bubble (idle / busy) %s = %.4f; formula %s does not hold for these costs\n",
                sim.bubble_fraction.str().c_str(), sim.bubble_fraction.value(), formula_text(kind));
  } else {
    std::printf("bubble (idle / busy) %s = %.4f; formula %s %s = %.4f%s\n", sim.bubble_fraction.str().c_str(),
                sim.bubble_fraction.value(), formula_text(kind), formula->str().c_str(), formula->value(),
                sim.bubble_fraction == *formula ? " (equal)"
                : a.costs.p2p_cost > 0          ? " (differs: the formula leaves out transfer latency)"
                                                : " (differs)");
  }
  std::printf("%6s %8s %8s %10s %14s\n", "rank", "busy", "idle", "bubble", "peak in flight");
  for (size_t r = 0; r < sim.ranks.size(); ++r) {
    const auto& rep = sim.ranks[r];
    std::printf("%6zu %8lld %8lld %10s %14lld\n", r, static_cast<long long>(rep.busy),
                static_cast<long long>(rep.idle), rep.bubble.str().c_str(),
                static_cast<long long>(rep.peak_inflight));
  }
  if (a.v > 1) std::printf("(in flight counts chunk activations: one chunk is 1/%lld of a stage)\n",
                           static_cast<long long>(a.v));
  std::printf("NCCL p2p: %lld ops on %lld channel communicators: no deadlock, no mismatch\n",
              static_cast<long long>(channels.transfers), static_cast<long long>(mp::num_p2p_channels(a.v, mp::chunk_layout(kind))));
  if (nccl) {
    std::printf("on one communicator in batches (Megatron's posting): %lld batches of at most %lld ops (%lld ops, "
                "receives posted %s): no deadlock, no mismatch; bubble when sends wait for their receivers %s = "
                "%.4f\n",
                static_cast<long long>(nccl->batches), static_cast<long long>(nccl->max_batch),
                static_cast<long long>(nccl->ops), mp::recv_posting_name(mp::recv_posting(kind)),
                nccl->bubble_fraction.str().c_str(), nccl->bubble_fraction.value());
  }
  if (a.cp > 1) std::printf("%s\n", cp_share_line(a).c_str());
  if (a.sized()) {
    const StageTensor t = stage_tensor(a);
    const std::string sp = a.sequence_parallel ? " / TP " + std::to_string(a.tp) + " under SP" : "";
    std::printf("tensor between stages, per rank: [%lld, %lld, %lld] = %lld bytes (S=%lld / CP %lld%s)\n",
                static_cast<long long>(t.tokens), static_cast<long long>(t.micro_batch),
                static_cast<long long>(t.hidden), static_cast<long long>(t.bytes), static_cast<long long>(a.seq),
                static_cast<long long>(a.cp), sp.c_str());
    std::printf("%6s %8s %14s\n", "rank", "sends", "bytes sent");
    for (size_t r = 0; r < sends.size(); ++r)
      std::printf("%6zu %8lld %14lld\n", r, static_cast<long long>(sends[r]),
                  static_cast<long long>(sends[r] * t.bytes));
  }
}

int run(const Args& a) {
  const mp::ScheduleKind kind = mp::parse_schedule_kind(a.schedule);
  check_sizes(a);
  const auto lists = mp::build_schedules(kind, a.p, a.m, a.v);
  const std::vector<int64_t> sends = sends_per_rank(lists);
  mp::SimulatorOptions costs = a.costs;
  costs.record_timeline = !a.svg.empty() || a.list_actions;
  const mp::SimulationResult sim = mp::simulate(lists, a.m, a.v, costs, mp::chunk_layout(kind));
  // Throw, naming ranks and ops, if the executor's channels or the batches would deadlock
  // on NCCL. One communicator cannot carry the V's crossing streams: no batches for it.
  const megatorch::comm::NcclCheckReport channels =
      megatorch::comm::check_nccl_semantics(mp::channel_traces(kind, a.p, a.m, a.v));
  std::optional<mp::NcclOrderReport> nccl;
  if (mp::chunk_layout(kind) == mp::ChunkLayout::kLooped) nccl = mp::verify_schedule_nccl_order(kind, a.p, a.m, a.v, costs);
  if (!a.svg.empty()) {
    std::vector<mp::TimelineRecord> records;
    for (size_t r = 0; r < sim.ranks.size(); ++r)
      for (const auto& t : sim.ranks[r].timeline)
        records.push_back({static_cast<int64_t>(r), t.action, static_cast<double>(t.start),
                           static_cast<double>(t.end)});
    mp::TimelineSvgOptions svg;
    svg.title = std::string(mp::schedule_kind_name(kind)) + ": p=" + std::to_string(a.p) +
                ", m=" + std::to_string(a.m) + (a.v > 1 ? ", v=" + std::to_string(a.v) : "") + ", bubble " +
                sim.bubble_fraction.str();
    svg.time_unit = "ticks";
    svg.num_ranks = a.p;
    svg.num_chunks = a.v;
    mp::write_timeline_svg(a.svg, records, svg);
  }
  if (a.json) {
    std::cout << report_json(a, kind, sim, channels, nccl, sends).dump() << std::endl;
    return 0;
  }
  print_summary(a, kind, sim, channels, nccl, sends);
  if (a.list_actions) {
    for (size_t r = 0; r < sim.ranks.size(); ++r) {
      std::printf("rank %zu:\n", r);
      for (const auto& t : sim.ranks[r].timeline)
        std::printf("  [%lld, %lld] %s\n", static_cast<long long>(t.start), static_cast<long long>(t.end),
                    mp::to_string(t.action).c_str());
    }
  }
  if (a.list_steps) {
    for (int64_t r = 0; r < a.p; ++r) {
      std::printf("rank %lld steps:\n", static_cast<long long>(r));
      for (const auto& step : mp::schedule_p2p_steps(kind, a.p, a.m, a.v, r))
        std::printf("  %s\n", mp::to_string(step).c_str());
    }
  }
  if (!a.svg.empty()) std::printf("timeline written to %s\n", a.svg.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Build a pipeline-parallel schedule, simulate it and report its bubble and memory.",
               "megatorch-schedule"};
  Args a;
  app.add_option("--schedule", a.schedule, mp::schedule_kind_names())->capture_default_str();
  app.add_option("--pipeline-model-parallel-size,-p", a.p, "pipeline stages P")->required();
  app.add_option("--num-microbatches,-m", a.m, "micro-batches M per step")->required();
  auto* v = app.add_option("--virtual-pipeline-model-parallel-size,-v", a.v,
                           "model chunks V per stage (interleaved only)");
  app.add_option("--forward-cost,--f-cost", a.costs.forward_cost, "ticks per forward of one chunk")
      ->capture_default_str();
  auto* backward = app.add_option("--backward-cost", a.costs.backward_cost, "ticks per whole backward of one chunk")
                       ->capture_default_str();
  auto* b_cost = app.add_option("--b-cost", a.costs.backward_input_cost,
                                "ticks per input-gradient pass B of a split backward (zb-h1, zb-v, dualpipev)")
                     ->capture_default_str();
  auto* w_cost = app.add_option("--w-cost", a.costs.backward_weight_cost,
                                "ticks per weight-gradient pass W of a split backward (zb-h1, zb-v, dualpipev)")
                     ->capture_default_str();
  app.add_option("--p2p-cost", a.costs.p2p_cost, "transfer latency in ticks (overlaps compute)")->capture_default_str();
  app.add_option("--context-parallel-size", a.cp, "CP size c: each rank holds S/c of every sequence")
      ->capture_default_str();
  app.add_option("--cp-comm-type", a.cp_comm, "p2p (ring attention) or a2a (Ulysses); reported only")
      ->capture_default_str();
  app.add_option("--seq-length", a.seq, "S: with --hidden-size, size the tensor sent between stages");
  app.add_option("--hidden-size", a.hidden, "h of the tensor sent between stages");
  app.add_option("--micro-batch-size", a.micro_batch, "b of the tensor sent between stages")->capture_default_str();
  app.add_option("--tensor-model-parallel-size", a.tp, "t: splits the sent tensor under --sequence-parallel")
      ->capture_default_str();
  app.add_flag("--sequence-parallel", a.sequence_parallel, "the sent tensor is [S/c/t, b, h]");
  app.add_option("--bytes-per-element", a.bytes_per_element, "2 for bf16/fp16, 4 for fp32")->capture_default_str();
  app.add_flag("--json", a.json, "print one JSON object instead of the summary");
  app.add_flag("--actions", a.list_actions, "also print every rank's timed action list");
  app.add_flag("--p2p-steps", a.list_steps, "also print every rank's steps as the executor posts them (NCCL batches)");
  app.add_option("--svg", a.svg, "write the timeline as SVG to this file");
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = megatorch::util::parse_or_exit(app, argc, argv, "megatorch-schedule")) return *code;
  // Given B and W, an unsplit backward costs their sum (so 1f1b compares with zb-h1).
  if (backward->count() == 0 && (b_cost->count() > 0 || w_cost->count() > 0)) {
    a.costs.backward_cost = a.costs.backward_input_cost + a.costs.backward_weight_cost;
  }
  try {
    const mp::ScheduleKind kind = mp::parse_schedule_kind(a.schedule);
    // The V schedules always run two chunks per rank; -v, if given, must say so.
    if (v->count() == 0) a.v = mp::chunks_per_rank(kind, a.v);
    if (kind == mp::ScheduleKind::kInterleaved && v->count() == 0) {
      std::cerr << "megatorch-schedule: the interleaved schedule needs --virtual-pipeline-model-parallel-size V "
                   "(model chunks per stage, e.g. 2)\n";
      return 2;
    }
    return run(a);
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";  // what() would add a C++ backtrace
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "megatorch-schedule: " << e.what() << "\n";
    return 1;
  }
}
