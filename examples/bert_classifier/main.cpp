// A BERT-style classifier trained with train::TrainingLoop at any TP x PP x DP layout, on
// a synthetic task: does the sequence contain the marker token? (half of the samples
// hold it 1-3 times among random words). It then measures the accuracy on held-out
// samples, prints it, and exits 1 unless it reaches --min-accuracy (chance is 0.5).
//   torchrun --nproc-per-node=4 --no-python build/bin/bert_classifier --tp 2 --pp 2
// The walk-through is docs/custom_models.md.
#include <ATen/CPUGeneratorImpl.h>
#include <CLI/CLI.hpp>
#include <megatorch/megatorch.h>
#include <megatorch/pipeline/module_stage.h>
#include <megatorch/train/training_loop.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "bert.h"

using namespace megatorch;

namespace {

constexpr int64_t kCls = 0, kMarker = 1, kFirstWord = 3;  // 2 is left unused (padding)

struct Args {
  int64_t tp = 1, pp = 1, virtual_chunks = 1, zero = 0;
  std::string schedule = "1f1b", device = "cpu";
  int64_t iters = 60, micro_batch_size = 4, micro_batches = 4, eval_iters = 8, log_interval = 10, save_interval = 0;
  int64_t hidden = 32, layers = 2, heads = 4, seq = 16, vocab = 32, seed = 1234;
  double lr = 3e-3, dropout = 0.0, min_accuracy = 0.75;
  std::string log_json, save, load;
};

// Sample `index` of a split ("train" or "test"): [CLS] and seq-1 random words; label 1
// puts the marker at 1-3 random positions. Drawn from (seed, split, index) alone, so
// every layout sees the same samples.
std::pair<at::Tensor, int64_t> make_sample(const Args& a, const std::string& split, int64_t index) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(tp::name_seed(a.seed, split, index));
  at::Tensor tokens = at::randint(kFirstWord, a.vocab, {a.seq}, gen, at::kLong);
  tokens[0] = kCls;
  const int64_t label = at::randint(0, 2, {1}, gen, at::kLong).item<int64_t>();
  if (label == 1) {
    const int64_t markers = at::randint(1, 4, {1}, gen, at::kLong).item<int64_t>();
    tokens.index_fill_(0, at::randperm(a.seq - 1, gen, at::kLong).narrow(0, 0, markers) + 1, kMarker);
  }
  return {tokens, label};
}

// This DP rank's micro-batches of global batch `step`, in Megatron's sampler order:
// global micro-batch k holds b·dp samples and DP rank r takes b of them.
train::BatchSource batches(const Args& a, const std::string& split, const train::TrainingLoop& loop) {
  return [&a, split, &loop](int64_t step) {
    std::vector<pipeline::MicroBatch> out;
    for (int64_t k = 0; k < a.micro_batches; ++k) {
      std::vector<at::Tensor> tokens;
      std::vector<int64_t> labels;
      for (int64_t i = 0; i < a.micro_batch_size; ++i) {
        const int64_t index = ((step * a.micro_batches + k) * loop.dp_size() + loop.dp_rank()) * a.micro_batch_size + i;
        auto [t, label] = make_sample(a, split, index);
        tokens.push_back(t);
        labels.push_back(label);
      }
      pipeline::MicroBatch mb;
      mb.tensors["tokens"] = at::stack(tokens).to(loop.device());                 // [b, s]
      mb.tensors["label"] = at::tensor(labels, at::kLong).to(loop.device());      // [b]
      out.push_back(std::move(mb));
    }
    return out;
  };
}

// Counted by the loss function on the last stage while `counting` (evaluation only).
struct Accuracy {
  bool counting = false;
  int64_t correct = 0, total = 0;
};

// Held-out accuracy over every DP replica: each replica's last pipeline stage counts (its
// TP ranks all see the same logits, so TP rank 0 alone reports), one all-reduce.
double reduce_accuracy(const Accuracy& acc, const train::TrainingLoop& loop, int64_t* total) {
  const auto& ps = loop.parallel_state();
  const bool reports = ps.pp_rank() == ps.pp_size() - 1 && ps.tp_rank() == 0;
  at::Tensor counts = at::tensor({reports ? static_cast<double>(acc.correct) : 0.0,
                                  reports ? static_cast<double>(acc.total) : 0.0}, at::kDouble);
  comm::Group(ps, parallel::GroupKind::kWorld).all_reduce(counts);
  *total = static_cast<int64_t>(counts[1].item<double>());
  return counts[0].item<double>() / std::max(1.0, counts[1].item<double>());
}

int run(const Args& a) {
  auto rng = std::make_shared<tp::RngTracker>();
  train::TrainingLoop loop(train::TrainingLoopOptions()
                               .tensor_parallel(a.tp)
                               .pipeline_parallel(a.pp)
                               .virtual_chunks(a.virtual_chunks)
                               .schedule(a.schedule)
                               .zero_stage(a.zero)
                               .name("bert")
                               .device(a.device)
                               .seed(a.seed)
                               .micro_batch_size(a.micro_batch_size)
                               .num_micro_batches(a.micro_batches)
                               .train_iters(a.iters)
                               .lr(a.lr)
                               .min_lr(a.lr / 10)
                               .lr_warmup_iters(std::min<int64_t>(5, a.iters / 10))
                               .log_interval(a.log_interval)
                               .log_json(a.log_json)
                               .tokens_per_sample(a.seq)
                               .save(a.save)
                               .save_interval(a.save_interval)
                               .load(a.load)
                               .eval_iters(a.eval_iters)
                               .model_config({{"model", "bert_classifier"}, {"hidden_size", a.hidden},
                                              {"num_layers", a.layers}, {"num_attention_heads", a.heads},
                                              {"vocab_size", a.vocab}, {"seq_length", a.seq}, {"num_classes", 2}}));
  const auto& ps = loop.parallel_state();
  rng->seed(a.seed, ps.tp_rank(), loop.device());

  auto config = transformer::TransformerConfig()
                    .hidden_size(a.hidden)
                    .num_attention_heads(a.heads)
                    .num_layers(a.layers)
                    .seq_length(a.seq)
                    .vocab_size(a.vocab)
                    .make_vocab_size_divisible_by(8)
                    .causal_attention(false)  // an encoder: every token sees every other
                    .hidden_dropout(a.dropout)
                    .attention_dropout(a.dropout)
                    .seed(a.seed)
                    .device(loop.device());

  // This rank's chunks: chunk c is virtual stage c·p + r and owns a contiguous slice of
  // the layers; the first virtual stage adds the embeddings, the last the pooler and head.
  const int64_t stages = a.pp * a.virtual_chunks;
  const std::vector<int64_t> split = pipeline::split_layers(a.layers, a.pp, a.virtual_chunks, {});
  std::vector<torch::nn::AnyModule> chunks;
  for (int64_t c = 0; c < a.virtual_chunks; ++c) {
    const int64_t vs = c * a.pp + ps.pp_rank();
    int64_t begin = 0;
    for (int64_t s = 0; s < vs; ++s) begin += split[s];
    chunks.emplace_back(bert::BertChunk(bert::BertChunkOptions(config)
                                            .group(loop.tp_group())
                                            .layer_begin(begin)
                                            .layer_end(begin + split[vs])
                                            .pre_process(vs == 0)
                                            .post_process(vs == stages - 1)
                                            .rng(rng)));
  }

  auto accuracy = std::make_shared<Accuracy>();
  auto loss = [accuracy](const at::Tensor& logits, const pipeline::MicroBatch& mb) {
    const at::Tensor& label = mb.get("label");
    if (accuracy->counting) {
      accuracy->correct += logits.argmax(-1).eq(label).sum().item<int64_t>();
      accuracy->total += label.numel();
    }
    return at::cross_entropy_loss(logits.to(at::kFloat), label);
  };
  // The activation between stages ([s, b, h]) is inferred: no `activation` option.
  pipeline::ModuleStage stage(chunks, pipeline::ModuleStageOptions()
                                          .pp_group(loop.pp_group())
                                          .tp_group(loop.tp_group())
                                          .input("tokens")
                                          .loss(loss)
                                          .rng(rng)  // saved and restored with checkpoints
                                          .device(loop.device()));
  loop.set_model(stage.ptr(), train::ParameterGroupingOptions().tp_group(loop.tp_group()));

  loop.train(batches(a, "train", loop));

  accuracy->counting = true;
  const double test_loss = loop.evaluate(batches(a, "test", loop), a.eval_iters);
  accuracy->counting = false;
  int64_t total = 0;
  const double acc = reduce_accuracy(*accuracy, loop, &total);
  const bool ok = acc >= a.min_accuracy;
  if (loop.is_logging_rank()) {
    std::printf("held-out: loss %.4f, accuracy %.4f over %ld samples (chance 0.5, required %.2f): %s\n", test_loss,
                acc, static_cast<long>(total), a.min_accuracy, ok ? "ok" : "FAILED");
    std::fflush(stdout);
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megatorch example: a BERT-style classifier trained with train::TrainingLoop"};
  Args a;
  app.add_option("--tp", a.tp, "tensor-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--pp", a.pp, "pipeline-parallel size (dp = world / (tp·pp))")->check(CLI::PositiveNumber);
  app.add_option("--virtual-chunks", a.virtual_chunks, "chunks per pipeline rank (with --schedule interleaved)");
  app.add_option("--schedule", a.schedule, "gpipe | 1f1b | interleaved");
  app.add_option("--zero", a.zero, "ZeRO stage 0-3")->check(CLI::Range(0, 3));
  app.add_option("--device", a.device, "cpu | cuda | auto");
  app.add_option("--iters", a.iters, "training iterations");
  app.add_option("--micro-batch-size", a.micro_batch_size, "samples per micro-batch");
  app.add_option("--micro-batches", a.micro_batches, "micro-batches per step and DP rank");
  app.add_option("--eval-iters", a.eval_iters, "held-out batches for the accuracy");
  app.add_option("--hidden", a.hidden, "hidden size");
  app.add_option("--layers", a.layers, "transformer layers");
  app.add_option("--heads", a.heads, "attention heads");
  app.add_option("--seq-length", a.seq, "tokens per sample, [CLS] included");
  app.add_option("--lr", a.lr, "peak learning rate (warm-up, cosine decay to lr/10)");
  app.add_option("--dropout", a.dropout, "hidden and attention dropout");
  app.add_option("--seed", a.seed, "initialisation and data seed");
  app.add_option("--min-accuracy", a.min_accuracy, "exit 1 below this held-out accuracy");
  app.add_option("--log-interval", a.log_interval, "iterations between log lines");
  app.add_option("--log-json", a.log_json, "one JSON object per iteration");
  app.add_option("--save", a.save, "checkpoint directory to save to (at the end)");
  app.add_option("--save-interval", a.save_interval, "also save every this many iterations");
  app.add_option("--load", a.load, "checkpoint directory to resume from (any layout)");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);  // several ranks share the cores
  try {
    return run(a);
  } catch (const std::exception& e) {
    std::cerr << "bert_classifier: " << e.what() << std::endl;
    return 1;
  }
}
