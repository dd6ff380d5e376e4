// GPT pretraining on the bundled data with train::TrainingLoop instead of gpt_pretrain:
// the model is today's pipeline::PipelineStage, the batches come from
// data::build_gpt_datasets through train::MicroBatchLoader, and the loop does the rest
// (schedule, reductions, ZeRO, clipping, LR schedule, logs, evaluation). From the
// repository root, on 4 ranks as TP 2 x PP 2:
//   torchrun --nproc-per-node=4 --no-python build/bin/custom_loop --tp 2 --pp 2
#include <CLI/CLI.hpp>
#include <megatorch/megatorch.h>
#include <megatorch/train/batch_loader.h>
#include <megatorch/train/training_loop.h>
#include <megatorch/util/cli_last_wins.h>

#include <iostream>

using namespace megatorch;

int main(int argc, char** argv) {
  CLI::App app{"megatorch example: GPT on data/default with train::TrainingLoop"};
  int64_t tp = 1, pp = 1, zero = 0, iters = 20, mbs = 2, micro_batches = 4, hidden = 64, layers = 2, seq = 64;
  double lr = 3e-3, dropout = 0.1;
  std::string data = "data/default/stdlib_docs_text_document", log_json, device = "cpu";
  app.add_option("--tp", tp, "tensor-parallel size");
  app.add_option("--pp", pp, "pipeline-parallel size (dp = world / (tp·pp))");
  app.add_option("--zero", zero, "ZeRO stage 0-3");
  app.add_option("--iters", iters, "training iterations");
  app.add_option("--micro-batch-size", mbs, "sequences per micro-batch");
  app.add_option("--micro-batches", micro_batches, "micro-batches per step and DP rank");
  app.add_option("--hidden", hidden, "hidden size");
  app.add_option("--layers", layers, "transformer layers");
  app.add_option("--seq-length", seq, "tokens per sequence");
  app.add_option("--lr", lr, "peak learning rate");
  app.add_option("--dropout", dropout, "hidden and attention dropout");
  app.add_option("--data-path", data, "Megatron .bin/.idx prefix of ByteLevel tokens");
  app.add_option("--log-json", log_json, "one JSON object per iteration");
  app.add_option("--device", device, "cpu | cuda | auto");
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = util::parse_or_exit(app, argc, argv, "custom_loop")) return *code;
  at::set_num_threads(1);  // several ranks share the cores
  try {
    train::TrainingLoop loop(train::TrainingLoopOptions().tensor_parallel(tp).pipeline_parallel(pp).zero_stage(zero)
                                 .name("gpt").device(device).micro_batch_size(mbs).num_micro_batches(micro_batches)
                                 .train_iters(iters).lr(lr).min_lr(lr / 10).lr_warmup_iters(2).log_interval(5)
                                 .log_json(log_json).loss_name("lm loss").log_perplexity(true).tokens_per_sample(seq));
    auto config = transformer::TransformerConfig().hidden_size(hidden).num_attention_heads(4).num_layers(layers)
                      .seq_length(seq).vocab_size(257).hidden_dropout(dropout).attention_dropout(dropout)
                      .device(loop.device());
    pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config).tp_group(loop.tp_group())
                                      .pp_group(loop.pp_group()));
    loop.set_model(stage.ptr());

    const int64_t global_batch = mbs * micro_batches * loop.dp_size(), eval_iters = loop.options().eval_iters();
    const auto datasets = data::build_gpt_datasets(data::GPTDataOptions().blend(data::parse_data_path({data}))
                              .seq_length(seq).split("98,2,0").num_samples({iters * global_batch,
                                                                             eval_iters * global_batch, 0}));
    const auto loader = train::MicroBatchLoaderOptions().micro_batch_size(mbs).num_micro_batches(micro_batches)
                            .data_parallel_size(loop.dp_size()).data_parallel_rank(loop.dp_rank())
                            .seq_length(seq).device(loop.device());
    train::MicroBatchLoader train_batches(*datasets.train, loader), valid_batches(*datasets.valid, loader);
    loop.train([&](int64_t step) { return train_batches.load(step * global_batch); },
               [&](int64_t step) { return valid_batches.load(step * global_batch); });
  } catch (const std::exception& e) {
    std::cerr << "custom_loop: " << e.what() << std::endl;
    return 1;
  }
}
