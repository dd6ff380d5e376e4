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

#include <memory>
#include <string>
#include <vector>

#include "../common/example_support.h"
#include "bert.h"

using namespace megatorch;

namespace {

constexpr int64_t kCls = 0, kMarker = 1, kFirstWord = 3;  // 2 is left unused (padding)

// The layout and training flags (examples::LoopFlags: --tp, --pp, --zero, --iters, --lr,
// ...) and this model's own.
struct Args : examples::LoopFlags {
  int64_t hidden = 32, layers = 2, heads = 4, seq = 16, vocab = 32, save_interval = 0;
  double dropout = 0.0, min_accuracy = 0.75;
  std::string save, load;
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

// This DP rank's micro-batches of global batch `step` (Megatron's sampler order, see
// examples::labelled_batches): token ids [b, s] as "tokens", labels [b] as "label".
train::BatchSource batches(const Args& a, const std::string& split, const train::TrainingLoop& loop) {
  return examples::labelled_batches(a, loop, "tokens",
                                    [&a, split](int64_t index) { return make_sample(a, split, index); });
}

int run(const Args& a) {
  auto rng = std::make_shared<tp::RngTracker>();
  // The flags' layout, batch and LR schedule (examples::loop_options), and what depends on
  // this model: tokens per sample, checkpoints and the configuration they are checked by.
  train::TrainingLoop loop(examples::loop_options(a, "bert")
                               .tokens_per_sample(a.seq)
                               .save(a.save)
                               .save_interval(a.save_interval)
                               .load(a.load)
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

  // This rank's chunks, each built for its global layer range (examples::chunk_layers);
  // the first virtual stage adds the embeddings, the last the pooler and head.
  std::vector<torch::nn::AnyModule> chunks;
  for (const examples::ChunkLayers& r : examples::chunk_layers(a.layers, a, ps.pp_rank())) {
    chunks.emplace_back(bert::BertChunk(bert::BertChunkOptions(config)
                                            .group(loop.tp_group())
                                            .layer_begin(r.begin)
                                            .layer_end(r.end)
                                            .pre_process(r.first)
                                            .post_process(r.last)
                                            .rng(rng)));
  }

  auto accuracy = std::make_shared<examples::Accuracy>();
  auto loss = [accuracy](const at::Tensor& logits, const pipeline::MicroBatch& mb) {
    const at::Tensor& label = mb.get("label");
    accuracy->count(logits, label);  // while evaluating only
    return at::cross_entropy_loss(logits.to(at::kFloat), label);
  };
  // The activation between stages ([s, b, h]) is inferred: no `activation` option.
  pipeline::ModuleStage stage(chunks, pipeline::ModuleStageOptions()
                                          .pp_group(loop.pp_group())
                                          .tp_group(loop.tp_group())
                                          .input("tokens")
                                          .chunk_layout(examples::chunk_layout(a))
                                          .loss(loss)
                                          .rng(rng)  // saved and restored with checkpoints
                                          .device(loop.device()));
  loop.set_model(stage.ptr(), train::ParameterGroupingOptions().tp_group(loop.tp_group()));

  loop.train(batches(a, "train", loop));

  const examples::HeldOut held_out =
      examples::evaluate_accuracy(loop, *accuracy, batches(a, "test", loop), a.eval_iters);
  return examples::report_accuracy(loop, held_out, "samples", /*chance=*/0.5, a.min_accuracy);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megatorch example: a BERT-style classifier trained with train::TrainingLoop"};
  Args a;
  examples::add_loop_flags(app, a, "samples");
  app.add_option("--hidden", a.hidden, "hidden size");
  app.add_option("--layers", a.layers, "transformer layers");
  app.add_option("--heads", a.heads, "attention heads");
  app.add_option("--seq-length", a.seq, "tokens per sample, [CLS] included");
  app.add_option("--dropout", a.dropout, "hidden and attention dropout");
  app.add_option("--min-accuracy", a.min_accuracy, "exit 1 below this held-out accuracy");
  app.add_option("--save", a.save, "checkpoint directory to save to (at the end)");
  app.add_option("--save-interval", a.save_interval, "also save every this many iterations");
  app.add_option("--load", a.load, "checkpoint directory to resume from (any layout)");
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = megatorch::util::parse_or_exit(app, argc, argv, "bert_classifier")) return *code;
  at::set_num_threads(1);  // several ranks share the cores
  return examples::run_main("bert_classifier", [&] { return run(a); });
}
