// Runs pipeline steps (forward and backward, no optimizer step) of a small GPT on P CPU
// ranks and reports the measured bubble and step time next to the formula and to the
// simulator's prediction from the compute costs measured in the same run, with the
// timeline of the last step as SVG and, with --json, all of it as one JSON object:
//   torchrun --nproc-per-node=4 --no-python build/bin/pipeline_timeline \
//       --pipeline-model-parallel-size 4 --num-microbatches 8 --schedule zb-h1 --svg t.svg
#include <CLI/CLI.hpp>
#include <megatorch/megatorch.h>
#include <megatorch/util/cli_last_wins.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>

using namespace megatorch;

namespace {

// Mean seconds per compute kind over `records` (every rank, every measured step).
std::map<pipeline::ActionKind, double> mean_costs(const std::vector<pipeline::TimelineRecord>& records) {
  std::map<pipeline::ActionKind, std::pair<double, int64_t>> sum;
  for (const auto& r : records) {
    auto& [s, n] = sum[r.action.kind];
    s += r.end - r.start;
    ++n;
  }
  std::map<pipeline::ActionKind, double> mean;
  for (const auto& [kind, sn] : sum) mean[kind] = sn.first / static_cast<double>(sn.second);
  return mean;
}

std::string costs_json(const std::map<pipeline::ActionKind, double>& costs) {
  std::string s = "{";
  for (const auto& [k, sec] : costs) {
    s += (s.size() > 1 ? ", \"" : "\"") + std::string(pipeline::action_kind_name(k)) + "\": " + std::to_string(sec);
  }
  return s + "}";
}

// The simulator's integer costs from measured seconds: a forward is 100 ticks.
pipeline::SimulatorOptions ticks_of(const std::map<pipeline::ActionKind, double>& cost, bool split) {
  const double tick = cost.at(pipeline::ActionKind::kForward) / 100.0;
  auto ticks = [&](pipeline::ActionKind k) { return std::max<int64_t>(1, std::llround(cost.at(k) / tick)); };
  pipeline::SimulatorOptions o;
  o.forward_cost = 100;
  if (split) {
    o.backward_input_cost = ticks(pipeline::ActionKind::kBackwardInput);
    o.backward_weight_cost = ticks(pipeline::ActionKind::kBackwardWeight);
    // DualPipeV runs some backwards whole: those are measured as they are.
    o.backward_cost = cost.count(pipeline::ActionKind::kBackward) ? ticks(pipeline::ActionKind::kBackward)
                                                                  : o.backward_input_cost + o.backward_weight_cost;
  } else {
    o.backward_cost = ticks(pipeline::ActionKind::kBackward);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megatorch pipeline timeline: measured bubble vs the formula and the simulator"};
  int64_t tp = 1, pp = 1, m = 8, v = 1, steps = 3, layers = 8, hidden = 256, seq = 128, batch = 2, data_seed = 1;
  std::string schedule = "1f1b", svg, json;
  app.add_option("--tensor-model-parallel-size", tp)->check(CLI::PositiveNumber);
  app.add_option("--pipeline-model-parallel-size", pp)->check(CLI::PositiveNumber);
  app.add_option("--num-microbatches", m)->check(CLI::PositiveNumber);
  app.add_option("--virtual-pipeline-model-parallel-size", v)->check(CLI::PositiveNumber);
  app.add_option("--schedule", schedule, pipeline::schedule_kind_names());
  app.add_option("--num-layers", layers)->check(CLI::PositiveNumber);
  app.add_option("--hidden-size", hidden)->check(CLI::PositiveNumber);
  app.add_option("--seq-length", seq)->check(CLI::PositiveNumber);
  app.add_option("--micro-batch-size", batch)->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "measured steps after one warm-up step")->check(CLI::PositiveNumber);
  app.add_option("--data-seed", data_seed, "seed of the random token ids (a CPU generator, as torch.Generator)");
  app.add_option("--svg", svg, "write the last step's timeline here (rank 0)");
  app.add_option("--json", json, "write the results here as one JSON object (rank 0)");
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = megatorch::util::parse_or_exit(app, argc, argv, "pipeline_timeline")) return *code;
  torch::set_num_threads(1);
  try {
    const auto kind = pipeline::parse_schedule_kind(schedule);
    if (app.count("--virtual-pipeline-model-parallel-size") == 0) v = pipeline::chunks_per_rank(kind, v);  // the V's 2
    parallel::ParallelState state(parallel::ParallelStateOptions(tp, pp).device("cpu"));
    const std::string pp_group = state.group_name(parallel::GroupKind::kPipeline);
    auto config = transformer::TransformerConfig()
                      .hidden_size(hidden)
                      .num_attention_heads(8)
                      .num_layers(layers)
                      .seq_length(seq)
                      .vocab_size(1024);
    pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config)
                                      .tp_group(state.group_name(parallel::GroupKind::kTensor))
                                      .pp_group(pp_group)
                                      .virtual_chunks(v)
                                      .chunk_layout(pipeline::chunk_layout(kind)));
    std::vector<pipeline::MicroBatch> mbs;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(data_seed);
    for (int64_t i = 0; i < m; ++i) {
      auto d = at::randint(config.vocab_size(), {batch, seq + 1}, gen, at::TensorOptions().dtype(at::kLong));
      mbs.push_back({d.narrow(1, 0, seq), d.narrow(1, 1, seq)});
    }
    comm::Group world(state.group_name(parallel::GroupKind::kWorld));
    double bubble_sum = 0, step_sum = 0, loss = 0;
    std::vector<pipeline::TimelineRecord> last, measured;
    for (int64_t step = 0; step <= steps; ++step) {
      world.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      auto result = pipeline::run_pipeline_step(stage, mbs, pipeline::ExecutorOptions().schedule(kind));
      world.barrier();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      stage->zero_grad();
      last = pipeline::gather_timeline(result, pp_group);
      // The slowest rank's wall time is the step's; the loss lives on the last virtual stage's rank.
      const auto all = world.all_gather(at::tensor({seconds, result.loss.defined() ? result.loss.item<double>() : 0.0},
                                                   at::kDouble).view({1, 2}),
                                        0);
      if (step == 0) continue;  // warm-up
      bubble_sum += pipeline::measured_bubble(last);
      step_sum += all.select(1, 0).max().item<double>();
      loss = all.select(1, 1).abs().max().item<double>();
      measured.insert(measured.end(), last.begin(), last.end());
    }
    // MEGATORCH_NCCL_CHECK=1 (the transfers on channel communicators): every step's ops
    // replayed under NCCL's rules (megatorch/comm/nccl_semantics.h).
    if (comm::nccl_check_enabled())
      comm::check_nccl_semantics_across_ranks(state.store(), "pipeline_timeline", state.rank(), state.world_size());
    const auto costs = mean_costs(measured);
    const auto ticks = ticks_of(costs, pipeline::splits_backward(kind));
    const auto predicted = pipeline::simulate_schedule(kind, pp, m, v, ticks).bubble_fraction;
    // The zero-bubble formulas hold only for some costs (formula_bubble_fraction says
    // which); otherwise only the simulation predicts.
    bool formula_holds = true;
    double formula = std::nan("");
    try {
      formula = pipeline::formula_bubble_fraction(kind, pp, m, v, ticks).value();
    } catch (const c10::Error&) {
      formula_holds = false;
    }
    // Per rank too: the first stage has no input gradient (its B is empty, its W the whole
    // backward) and the last adds the head and the loss.
    std::vector<std::map<pipeline::ActionKind, double>> rank_costs;
    for (int64_t r = 0; r < pp; ++r) {
      std::vector<pipeline::TimelineRecord> mine;
      for (const auto& rec : measured)
        if (rec.rank == r) mine.push_back(rec);
      rank_costs.push_back(mean_costs(mine));
    }
    if (state.rank() == 0) {
      const double bubble = bubble_sum / steps, step_s = step_sum / steps;
      std::cout << "schedule " << schedule << " p=" << pp << " m=" << m << " v=" << v << ": measured bubble " << bubble
                << ", step " << step_s << " s (mean of " << steps << " steps); simulated from the measured costs (F="
                << ticks.forward_cost << " B=" << ticks.backward_input_cost << " W=" << ticks.backward_weight_cost
                << " backward=" << ticks.backward_cost << " ticks) " << predicted.value() << ", formula "
                << formula << "; loss " << loss << std::endl;
      for (int64_t r = 0; r < pp; ++r) {
        std::cout << "  rank " << r << " ms per action:";
        for (const auto& [k, sec] : rank_costs[r]) std::cout << " " << pipeline::action_kind_name(k) << " " << sec * 1e3;
        std::cout << std::endl;
      }
      if (!json.empty()) {
        std::ofstream out(json);
        out.precision(9);
        out << "{\"schedule\": \"" << pipeline::schedule_kind_name(kind) << "\", \"p\": " << pp << ", \"m\": " << m
            << ", \"v\": " << v << ", \"steps\": " << steps << ", \"measured_bubble\": " << bubble
            << ", \"step_s\": " << step_s << ", \"predicted_bubble\": " << predicted.value()
            << ", \"formula_bubble\": " << (formula_holds ? std::to_string(formula) : "null")
            << ", \"loss\": " << loss << ", \"cost_s\": " << costs_json(costs) << ", \"rank_cost_s\": [";
        for (int64_t r = 0; r < pp; ++r) out << (r ? ", " : "") << costs_json(rank_costs[r]);
        out << "]}\n";
      }
      if (!svg.empty()) {
        pipeline::TimelineSvgOptions o;
        o.title = schedule + ", p=" + std::to_string(pp) + ", m=" + std::to_string(m) + " (measured on CPU)";
        o.time_unit = "s";
        pipeline::write_timeline_svg(svg, last, o);
        std::cout << "timeline written to " << svg << std::endl;
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "[rank " << (std::getenv("RANK") ? std::getenv("RANK") : "?") << "] " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
