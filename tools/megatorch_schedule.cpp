// megatorch-schedule: builds a pipeline schedule, simulates it and reports its bubble,
// makespan and activations in flight per rank; checks the executor's p2p batches
// against NCCL's rules (nccl_order_model.h); optionally draws its timeline as SVG.
//
//   megatorch-schedule --schedule interleaved --pipeline-model-parallel-size 4
//       --num-microbatches 8 --virtual-pipeline-model-parallel-size 2 --json --svg t.svg
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "megatorch/check.h"
#include "megatorch/pipeline/nccl_order_model.h"
#include "megatorch/pipeline/p2p_batches.h"
#include "megatorch/pipeline/schedule.h"
#include "megatorch/pipeline/simulator.h"
#include "megatorch/pipeline/timeline_svg.h"

namespace mp = megatorch::pipeline;

namespace {

struct Args {
  std::string schedule = "1f1b";
  int64_t p = 0, m = 0, v = 1;
  mp::SimulatorOptions costs;
  bool json = false, list_actions = false, list_steps = false;
  std::string svg;
};

nlohmann::json report_json(const Args& a, mp::ScheduleKind kind, const mp::SimulationResult& sim,
                           const mp::NcclOrderReport& nccl) {
  const mp::Ratio formula = mp::formula_bubble_fraction(kind, a.p, a.m, a.v);
  nlohmann::json j;
  j["schedule"] = mp::schedule_kind_name(kind);
  j["pipeline_model_parallel_size"] = a.p;
  j["num_microbatches"] = a.m;
  j["virtual_pipeline_model_parallel_size"] = a.v;
  j["costs"] = {{"forward", a.costs.forward_cost}, {"backward", a.costs.backward_cost}, {"p2p", a.costs.p2p_cost}};
  j["makespan"] = sim.makespan;
  j["bubble_fraction"] = sim.bubble_fraction.value();
  j["bubble_fraction_exact"] = sim.bubble_fraction.str();
  j["formula_bubble_fraction"] = formula.value();
  j["formula_bubble_fraction_exact"] = formula.str();
  j["matches_formula"] = sim.bubble_fraction == formula;
  auto per_rank = [&](auto field) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& r : sim.ranks) list.push_back(field(r));
    return list;
  };
  j["peak_inflight"] = per_rank([](const mp::RankReport& r) { return r.peak_inflight; });
  j["busy"] = per_rank([](const mp::RankReport& r) { return r.busy; });
  j["idle"] = per_rank([](const mp::RankReport& r) { return r.idle; });
  j["bubble_per_rank"] = per_rank([](const mp::RankReport& r) { return r.bubble.str(); });
  j["nccl"] = {{"recv_posting", mp::recv_posting_name(mp::recv_posting(kind))},
               {"batches", nccl.batches},
               {"ops", nccl.ops},
               {"max_batch", nccl.max_batch},
               {"deadlock_free", true},
               {"makespan", nccl.makespan},
               {"bubble_fraction", nccl.bubble_fraction.value()},
               {"bubble_fraction_exact", nccl.bubble_fraction.str()}};
  return j;
}

void print_summary(const Args& a, mp::ScheduleKind kind, const mp::SimulationResult& sim,
                   const mp::NcclOrderReport& nccl) {
  const mp::Ratio formula = mp::formula_bubble_fraction(kind, a.p, a.m, a.v);
  std::printf("schedule %s: %lld stages, %lld micro-batches, %lld chunk(s) per stage\n", mp::schedule_kind_name(kind),
              static_cast<long long>(a.p), static_cast<long long>(a.m), static_cast<long long>(a.v));
  std::printf("costs: forward %lld, backward %lld, p2p %lld ticks\n", static_cast<long long>(a.costs.forward_cost),
              static_cast<long long>(a.costs.backward_cost), static_cast<long long>(a.costs.p2p_cost));
  std::printf("makespan %lld ticks\n", static_cast<long long>(sim.makespan));
  std::printf("bubble (idle / busy) %s = %.4f; formula %s %s = %.4f%s\n", sim.bubble_fraction.str().c_str(),
              sim.bubble_fraction.value(), kind == mp::ScheduleKind::kInterleaved ? "(p-1)/(v*m)" : "(p-1)/m",
              formula.str().c_str(), formula.value(),
              sim.bubble_fraction == formula ? " (equal)"
              : a.costs.p2p_cost > 0         ? " (differs: the formula leaves out transfer latency)"
                                             : " (differs)");
  std::printf("%6s %8s %8s %10s %14s\n", "rank", "busy", "idle", "bubble", "peak in flight");
  for (size_t r = 0; r < sim.ranks.size(); ++r) {
    const auto& rep = sim.ranks[r];
    std::printf("%6zu %8lld %8lld %10s %14lld\n", r, static_cast<long long>(rep.busy),
                static_cast<long long>(rep.idle), rep.bubble.str().c_str(),
                static_cast<long long>(rep.peak_inflight));
  }
  if (a.v > 1) std::printf("(in flight counts chunk activations: one chunk is 1/%lld of a stage)\n",
                           static_cast<long long>(a.v));
  std::printf("NCCL p2p: %lld batches of at most %lld ops (%lld ops, receives posted %s): no deadlock, no "
              "mismatch; bubble when sends wait for their receivers %s = %.4f\n",
              static_cast<long long>(nccl.batches), static_cast<long long>(nccl.max_batch),
              static_cast<long long>(nccl.ops), mp::recv_posting_name(mp::recv_posting(kind)),
              nccl.bubble_fraction.str().c_str(), nccl.bubble_fraction.value());
}

int run(const Args& a) {
  const mp::ScheduleKind kind = mp::parse_schedule_kind(a.schedule);
  const auto lists = mp::build_schedules(kind, a.p, a.m, a.v);
  mp::SimulatorOptions costs = a.costs;
  costs.record_timeline = !a.svg.empty() || a.list_actions;
  const mp::SimulationResult sim = mp::simulate(lists, a.m, a.v, costs);
  // Throws, naming ranks and actions, if the executor's batches would deadlock on NCCL.
  const mp::NcclOrderReport nccl = mp::verify_schedule_nccl_order(kind, a.p, a.m, a.v, costs);
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
    std::cout << report_json(a, kind, sim, nccl).dump() << std::endl;
    return 0;
  }
  print_summary(a, kind, sim, nccl);
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
  app.add_option("--forward-cost", a.costs.forward_cost, "ticks per forward of one chunk")->capture_default_str();
  app.add_option("--backward-cost", a.costs.backward_cost, "ticks per backward of one chunk")->capture_default_str();
  app.add_option("--p2p-cost", a.costs.p2p_cost, "transfer latency in ticks (overlaps compute)")->capture_default_str();
  app.add_flag("--json", a.json, "print one JSON object instead of the summary");
  app.add_flag("--actions", a.list_actions, "also print every rank's timed action list");
  app.add_flag("--p2p-steps", a.list_steps, "also print every rank's steps as the executor posts them (NCCL batches)");
  app.add_option("--svg", a.svg, "write the timeline as SVG to this file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (mp::parse_schedule_kind(a.schedule) == mp::ScheduleKind::kInterleaved && v->count() == 0) {
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
