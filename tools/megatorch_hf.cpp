// megatorch-hf: HuggingFace interchange for GPT-2, Llama, Mistral, Qwen2 and Mixtral.
//
//   megatorch-hf import --hf-dir tiny-llama/ --save ckpt/ [--iteration 0]
//       config.json + model.safetensors (as transformers' save_pretrained writes them)
//       -> a megatorch checkpoint, loadable at any TP x PP (gpt_pretrain --load ckpt/)
//   megatorch-hf export --load ckpt/ --hf-dir out/ [--iteration N]
//       a megatorch checkpoint saved at any layout -> out/config.json + out/model.safetensors,
//       for AutoModelForCausalLM.from_pretrained("out/")
#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>

#include "megatorch/check.h"
#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/hf_convert.h"
#include "megatorch/util/cli_last_wins.h"

namespace ckpt = megatorch::ckpt;

int main(int argc, char** argv) {
  CLI::App app{"megatorch-hf: import a HuggingFace GPT-2/Llama/Mistral/Qwen2/Mixtral checkpoint into megatorch's format, or export one"};
  app.require_subcommand(1);
  std::string hf_dir, ckpt_dir;
  int64_t iteration = 0;
  auto* imp = app.add_subcommand("import", "HuggingFace directory -> megatorch checkpoint");
  imp->add_option("--hf-dir", hf_dir, "directory with config.json and model.safetensors")->required();
  imp->add_option("--save", ckpt_dir, "megatorch checkpoint directory to write")->required();
  imp->add_option("--iteration", iteration, "iteration number to save it as")->capture_default_str();
  int64_t export_iteration = -1;
  auto* exp = app.add_subcommand("export", "megatorch checkpoint -> HuggingFace directory");
  exp->add_option("--load", ckpt_dir, "megatorch checkpoint directory")->required();
  exp->add_option("--hf-dir", hf_dir, "directory to write config.json and model.safetensors to")->required();
  exp->add_option("--iteration", export_iteration, "iteration to export (-1: the latest)")->capture_default_str();
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = megatorch::util::parse_or_exit(app, argc, argv, "megatorch-hf")) return *code;
  try {
    if (*imp) {
      const auto [c, arch] = ckpt::import_hf(hf_dir, ckpt_dir, iteration);
      std::printf("imported %s (%s, %lld layers, hidden %lld, vocab %lld) into %s, iteration %lld\n", hf_dir.c_str(),
                  ckpt::to_string(arch), static_cast<long long>(c.num_layers()),
                  static_cast<long long>(c.hidden_size()), static_cast<long long>(c.vocab_size()), ckpt_dir.c_str(),
                  static_cast<long long>(iteration));
    } else {
      const auto arch = ckpt::export_hf(ckpt_dir, hf_dir, export_iteration).arch;
      std::printf("exported %s (iteration %lld) as %s to %s\n", ckpt_dir.c_str(),
                  static_cast<long long>(export_iteration < 0 ? ckpt::latest_iteration(ckpt_dir) : export_iteration),
                  ckpt::to_string(arch), hf_dir.c_str());
    }
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "megatorch-hf: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
