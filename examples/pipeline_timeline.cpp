// Runs pipeline steps of a small GPT on P CPU ranks and reports the measured bubble
// next to the formula, with the timeline of the last step as SVG:
//   torchrun --nproc-per-node=4 --no-python build/bin/pipeline_timeline \
//       --pipeline-model-parallel-size 4 --num-microbatches 8 --schedule 1f1b --svg t.svg
#include <CLI/CLI.hpp>
#include <megatorch/megatorch.h>
#include <torch/torch.h>

#include <iostream>

using namespace megatorch;

int main(int argc, char** argv) {
  CLI::App app{"megatorch pipeline timeline: measured bubble vs (p-1)/m"};
  int64_t tp = 1, pp = 1, m = 8, v = 1, steps = 3, layers = 8, hidden = 256, seq = 128, batch = 2;
  std::string schedule = "1f1b", svg;
  app.add_option("--tensor-model-parallel-size", tp)->check(CLI::PositiveNumber);
  app.add_option("--pipeline-model-parallel-size", pp)->check(CLI::PositiveNumber);
  app.add_option("--num-microbatches", m)->check(CLI::PositiveNumber);
  app.add_option("--virtual-pipeline-model-parallel-size", v)->check(CLI::PositiveNumber);
  app.add_option("--schedule", schedule)->check(CLI::IsMember({"gpipe", "1f1b", "interleaved"}));
  app.add_option("--num-layers", layers)->check(CLI::PositiveNumber);
  app.add_option("--hidden-size", hidden)->check(CLI::PositiveNumber);
  app.add_option("--seq-length", seq)->check(CLI::PositiveNumber);
  app.add_option("--micro-batch-size", batch)->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "measured steps after one warm-up step")->check(CLI::PositiveNumber);
  app.add_option("--svg", svg, "write the last step's timeline here (rank 0)");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  try {
    parallel::ParallelState state(parallel::ParallelStateOptions(tp, pp).device("cpu"));
    const auto kind = pipeline::parse_schedule_kind(schedule);
    auto config = transformer::TransformerConfig()
                      .hidden_size(hidden)
                      .num_attention_heads(8)
                      .num_layers(layers)
                      .seq_length(seq)
                      .vocab_size(1024);
    pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config)
                                      .tp_group(state.group_name(parallel::GroupKind::kTensor))
                                      .pp_group(state.group_name(parallel::GroupKind::kPipeline))
                                      .virtual_chunks(v));
    std::vector<pipeline::MicroBatch> mbs;
    for (int64_t i = 0; i < m; ++i) {
      auto d = torch::randint(config.vocab_size(), {batch, seq + 1});
      mbs.push_back({d.narrow(1, 0, seq), d.narrow(1, 1, seq)});
    }
    double sum = 0;
    std::vector<pipeline::TimelineRecord> last;
    for (int64_t step = 0; step <= steps; ++step) {
      auto result = pipeline::run_pipeline_step(stage, mbs, pipeline::ExecutorOptions().schedule(kind));
      stage->zero_grad();
      last = pipeline::gather_timeline(result, state.group_name(parallel::GroupKind::kPipeline));
      if (step > 0) sum += pipeline::measured_bubble(last);
    }
    const auto formula = pipeline::formula_bubble_fraction(kind, pp, m, v);
    const auto sim = pipeline::simulate_schedule(kind, pp, m, v);
    if (state.rank() == 0) {
      std::cout << "schedule " << schedule << " p=" << pp << " m=" << m << " v=" << v << ": measured bubble "
                << sum / steps << " (mean of " << steps << " steps), formula " << formula.value()
                << ", simulated with measured-like costs F=1 B=2: " << sim.bubble_fraction.value() << std::endl;
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
