// gpt_pretrain: GPT pretraining with TP, SP, PP and DP/ZeRO, launched by torchrun:
//   torchrun --nproc-per-node=4 --no-python build/bin/gpt_pretrain \
//     --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --data-path data/default/... ...
// Flags follow Megatron-LM's names (--help lists them).
#include <torch/torch.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "megatorch/train/trainer.h"

int main(int argc, char** argv) {
  // A file size limit fails a write with EFBIG, which the checkpoint writers report by
  // file name (the previous checkpoint stays), instead of killing the rank silently.
  std::signal(SIGXFSZ, SIG_IGN);
  try {
    bool help = false;
    auto args = megatorch::train::parse_arguments(argc, argv, &help);
    if (help) return 0;
    // With the other startup lines: on the logging rank (the last, TrainingLoop::is_logging_rank),
    // told by torchrun's environment since nothing is connected yet.
    const char* rank = std::getenv("RANK");
    const char* world = std::getenv("WORLD_SIZE");
    if (rank == nullptr || world == nullptr || std::atoll(rank) == std::atoll(world) - 1) {
      for (const std::string& line : args.overrides) std::printf("[megatorch] %s\n", line.c_str());
      std::fflush(stdout);
    }
    megatorch::train::Trainer trainer(std::move(args));
    trainer.train();
    return 0;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {  // e.g. a malformed JSON file from a checkpoint
    std::fprintf(stderr, "megatorch: gpt_pretrain: %s\n", e.what());
    return 1;
  }
}
