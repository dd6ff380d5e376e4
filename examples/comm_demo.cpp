// What the foundation does, on N ranks under torchrun: the rank layout, then one
// tensor-parallel all-reduce through the f/g mappings with its byte count.
//   torchrun --nproc-per-node=4 --no-python build/bin/comm_demo \
//       --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
#include <CLI/CLI.hpp>
#include <megatorch/megatorch.h>
#include <megatorch/util/cli_last_wins.h>
#include <torch/torch.h>

#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"megatorch communication demo: rank layout and a TP all-reduce"};
  int64_t tp = 1, pp = 1, hidden = 1024, seq = 64, batch = 2;
  app.add_option("--tensor-model-parallel-size", tp, "tensor-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--pipeline-model-parallel-size", pp, "pipeline-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--hidden-size", hidden, "h of the [s, b, h] activation")->check(CLI::PositiveNumber);
  app.add_option("--seq-length", seq, "s")->check(CLI::PositiveNumber);
  app.add_option("--micro-batch-size", batch, "b")->check(CLI::PositiveNumber);
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = megatorch::util::parse_or_exit(app, argc, argv, "comm_demo")) return *code;
  torch::set_num_threads(1);

  const char* rank_env = std::getenv("RANK");
  const std::string who = std::string("[rank ") + (rank_env ? rank_env : "?") + "] ";
  try {
    using megatorch::parallel::GroupKind;
    megatorch::parallel::ParallelState state(megatorch::parallel::ParallelStateOptions(tp, pp).device("cpu"));
    megatorch::comm::Group world(state, GroupKind::kWorld);
    megatorch::comm::Group tp_group(state, GroupKind::kTensor);

    // Print the layout in rank order.
    for (int64_t r = 0; r < state.world_size(); ++r) {
      if (r == state.rank()) std::cout << state.describe() << std::endl;
      world.barrier();
    }

    // f then g around a "layer": input = rank, so the all-reduced value is known by hand.
    megatorch::comm::reset_comm_stats();
    auto x = torch::full({seq, batch, hidden}, static_cast<double>(state.tp_rank()), torch::requires_grad());
    auto y = megatorch::comm::copy_to_tp_region(x, tp_group.name());
    auto z = megatorch::comm::reduce_from_tp_region(y * 1.0, tp_group.name());
    z.sum().backward();
    const double expected = tp * (tp - 1) / 2.0;
    const auto stats = tp_group.stats();
    if (state.rank() == 0) {
      std::cout << "\nTP all-reduce of a [s, b, h] = [" << seq << ", " << batch << ", " << hidden
                << "] fp32 activation over " << tp << " ranks:\n  forward value " << z[0][0][0].item<double>()
                << " (expected sum of tp ranks = " << expected << ")\n  grad of input "
                << x.grad()[0][0][0].item<double>() << " (expected " << tp << ")\n  all_reduce calls "
                << stats[megatorch::comm::CommOp::kAllReduce].calls << ", bytes "
                << stats[megatorch::comm::CommOp::kAllReduce].bytes << " (expected 2 x b*s*h*4 = "
                << (tp > 1 ? 2 * seq * batch * hidden * 4 : 0) << ")" << std::endl;
    }
    world.barrier();
  } catch (const std::exception& e) {
    std::cerr << who << e.what() << std::endl;
    return 1;
  }
  return 0;
}
