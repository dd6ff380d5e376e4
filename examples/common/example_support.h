#pragma once
// What the classifier examples (bert_classifier, vit) share and nothing of either model:
// the layout and training flags and their TrainingLoopOptions, labelled micro-batches in
// Megatron's sampler order, this pipeline rank's layer ranges, the held-out accuracy and
// main()'s flag parsing (a repeated flag takes its last value) and error handling. Included as "../common/example_support.h", so it needs no
// include path of its own.
#include <CLI/CLI.hpp>
#include <megatorch/megatorch.h>
#include <megatorch/train/training_loop.h>
#include <megatorch/util/cli_last_wins.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <iostream>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace examples {

namespace mt = megatorch;

// The flags every classifier example takes; an example's Args derives from this and
// changes the defaults it wants in its constructor.
struct LoopFlags {
  int64_t tp = 1, pp = 1, virtual_chunks = 1, zero = 0;
  std::string schedule = "1f1b", device = "cpu";
  int64_t iters = 60, micro_batch_size = 4, micro_batches = 4, eval_iters = 8, log_interval = 10, seed = 1234;
  double lr = 3e-3;
  std::string log_json;
};

// `samples` names what a micro-batch holds in --micro-batch-size's help ("samples", "images").
inline void add_loop_flags(CLI::App& app, LoopFlags& f, const std::string& samples) {
  app.add_option("--tp", f.tp, "tensor-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--pp", f.pp, "pipeline-parallel size (dp = world / (tp·pp))")->check(CLI::PositiveNumber);
  app.add_option("--virtual-chunks", f.virtual_chunks,
                 "chunks per pipeline rank (with --schedule interleaved; zb-v and dualpipev run 2 in a V)");
  app.add_option("--schedule", f.schedule, mt::pipeline::schedule_kind_names());
  app.add_option("--zero", f.zero, "ZeRO stage 0-3")->check(CLI::Range(0, 3));
  app.add_option("--device", f.device, "cpu | cuda | auto");
  app.add_option("--iters", f.iters, "training iterations");
  app.add_option("--micro-batch-size", f.micro_batch_size, samples + " per micro-batch");
  app.add_option("--micro-batches", f.micro_batches, "micro-batches per step and DP rank");
  app.add_option("--eval-iters", f.eval_iters, "held-out batches for the accuracy");
  app.add_option("--lr", f.lr, "peak learning rate (warm-up, cosine decay to lr/10)");
  app.add_option("--seed", f.seed, "initialisation and data seed");
  app.add_option("--log-interval", f.log_interval, "iterations between log lines");
  app.add_option("--log-json", f.log_json, "one JSON object per iteration");
}

// How the schedule places chunks on ranks, and how many each rank holds.
inline mt::pipeline::ChunkLayout chunk_layout(const LoopFlags& f) {
  return mt::pipeline::chunk_layout(mt::pipeline::parse_schedule_kind(f.schedule));
}
inline int64_t chunks_per_rank(const LoopFlags& f) {
  return mt::pipeline::chunks_per_rank(mt::pipeline::parse_schedule_kind(f.schedule), f.virtual_chunks);
}

// The flags as loop options: the layout, the batch, and an LR warm-up over the first tenth
// of the iterations (5 at most) followed by cosine decay to lr/10. The example adds what
// depends on its model (tokens_per_sample, model_config, checkpoints).
inline mt::train::TrainingLoopOptions loop_options(const LoopFlags& f, const std::string& name) {
  return mt::train::TrainingLoopOptions()
      .tensor_parallel(f.tp)
      .pipeline_parallel(f.pp)
      .virtual_chunks(chunks_per_rank(f))
      .schedule(f.schedule)
      .zero_stage(f.zero)
      .name(name)
      .device(f.device)
      .seed(f.seed)
      .micro_batch_size(f.micro_batch_size)
      .num_micro_batches(f.micro_batches)
      .train_iters(f.iters)
      .lr(f.lr)
      .min_lr(f.lr / 10)
      .lr_warmup_iters(std::min<int64_t>(5, f.iters / 10))
      .log_interval(f.log_interval)
      .log_json(f.log_json)
      .eval_iters(f.eval_iters);
}

// This DP rank's micro-batches of global batch `step`, in Megatron's sampler order: global
// micro-batch k holds b·dp samples and DP rank r takes b of them. `sample(index)` gives
// (input, label); each micro-batch holds the stacked inputs under `input` and the labels
// [b] under "label". `f` and `loop` must outlive the source.
inline mt::train::BatchSource labelled_batches(const LoopFlags& f, const mt::train::TrainingLoop& loop,
                                               std::string input,
                                               std::function<std::pair<at::Tensor, int64_t>(int64_t index)> sample) {
  return [&f, &loop, input = std::move(input), sample = std::move(sample)](int64_t step) {
    std::vector<mt::pipeline::MicroBatch> out;
    for (int64_t k = 0; k < f.micro_batches; ++k) {
      std::vector<at::Tensor> inputs;
      std::vector<int64_t> labels;
      for (int64_t i = 0; i < f.micro_batch_size; ++i) {
        const int64_t index = ((step * f.micro_batches + k) * loop.dp_size() + loop.dp_rank()) * f.micro_batch_size + i;
        auto [x, label] = sample(index);
        inputs.push_back(x);
        labels.push_back(label);
      }
      mt::pipeline::MicroBatch mb;
      mb.tensors[input] = at::stack(inputs).to(loop.device());               // [b, ...]
      mb.tensors["label"] = at::tensor(labels, at::kLong).to(loop.device());  // [b]
      out.push_back(std::move(mb));
    }
    return out;
  };
}

// One chunk of this pipeline rank: its global layer range [begin, end).
struct ChunkLayers {
  int64_t begin = 0, end = 0;
  bool first = false, last = false;  // the first / last virtual stage (embeddings / head)
};

// This rank's chunks under the flags' schedule: with p pipeline ranks and v chunks each,
// chunk c of rank r is virtual stage c·p + r (in a V: r and 2p-1-r) and owns the layers
// pipeline::split_layers (GPT's even split) gives that stage.
inline std::vector<ChunkLayers> chunk_layers(int64_t layers, const LoopFlags& f, int64_t pp_rank) {
  const int64_t pp = f.pp, virtual_chunks = chunks_per_rank(f);
  const std::vector<int64_t> split = mt::pipeline::split_layers(layers, pp, virtual_chunks, {});
  std::vector<ChunkLayers> chunks;
  for (int64_t c = 0; c < virtual_chunks; ++c) {
    const int64_t vs = mt::pipeline::virtual_stage(c, pp_rank, pp, chunk_layout(f));
    const int64_t begin = std::accumulate(split.begin(), split.begin() + vs, int64_t{0});
    chunks.push_back({begin, begin + split[vs], vs == 0, vs == pp * virtual_chunks - 1});
  }
  return chunks;
}

// Counted by the loss function on the last stage, while evaluate_accuracy runs.
struct Accuracy {
  bool counting = false;
  int64_t correct = 0, total = 0;

  void count(const at::Tensor& logits, const at::Tensor& label) {
    if (!counting) return;
    correct += logits.argmax(-1).eq(label).sum().item<int64_t>();
    total += label.numel();
  }
};

struct HeldOut {
  double loss = 0.0, accuracy = 0.0;
  int64_t samples = 0;
};

// loop.evaluate over `iters` batches of `source` with `acc` counting, then the accuracy
// over every DP replica: each replica's last virtual stage counts (the only rank whose
// loss runs; its TP ranks all see the same logits, so TP rank 0 alone reports), one
// all-reduce. Collective.
inline HeldOut evaluate_accuracy(mt::train::TrainingLoop& loop, Accuracy& acc, const mt::train::BatchSource& source,
                                 int64_t iters) {
  HeldOut out;
  acc.counting = true;
  out.loss = loop.evaluate(source, iters);
  acc.counting = false;
  const auto& ps = loop.parallel_state();
  const bool reports = ps.tp_rank() == 0;  // the other stages counted nothing
  at::Tensor counts = at::tensor({reports ? static_cast<double>(acc.correct) : 0.0,
                                  reports ? static_cast<double>(acc.total) : 0.0}, at::kDouble);
  mt::comm::Group(ps, mt::parallel::GroupKind::kWorld).all_reduce(counts);
  out.samples = static_cast<int64_t>(counts[1].item<double>());
  out.accuracy = counts[0].item<double>() / std::max(1.0, counts[1].item<double>());
  return out;
}

// Prints the held-out line on the logging rank (tests/python/examples/check_example.py
// parses it) and returns the exit code: 1 below `min_accuracy`.
inline int report_accuracy(const mt::train::TrainingLoop& loop, const HeldOut& h, const char* samples, double chance,
                           double min_accuracy) {
  const bool ok = h.accuracy >= min_accuracy;
  if (loop.is_logging_rank()) {
    std::printf("held-out: loss %.4f, accuracy %.4f over %ld %s (chance %g, required %.2f): %s\n", h.loss, h.accuracy,
                static_cast<long>(h.samples), samples, chance, min_accuracy, ok ? "ok" : "FAILED");
    std::fflush(stdout);
  }
  return ok ? 0 : 1;
}

// main()'s body: an error ends this rank with "name: what" on stderr and exit code 1.
template <typename Body>
int run_main(const char* name, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    std::cerr << name << ": " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace examples
