// A small vision transformer trained with train::TrainingLoop, by default on 4 ranks as
// TP 2 x DP 2 with ZeRO-3 (each block's parameters gathered just before it runs), on
// synthetic images: noise with a bright square in one of the four quadrants, and the
// class is the quadrant. It then measures the accuracy on held-out images, prints it, and
// exits 1 unless it reaches --min-accuracy (chance is 0.25).
//   torchrun --nproc-per-node=4 --no-python build/bin/vit --tp 2 --zero 3
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

#include "vit.h"

using namespace megatorch;

namespace {

constexpr int64_t kClasses = 4;

struct Args {
  int64_t tp = 1, pp = 1, virtual_chunks = 1, zero = 3;
  std::string schedule = "1f1b", device = "cpu";
  int64_t iters = 60, micro_batch_size = 4, micro_batches = 2, eval_iters = 8, log_interval = 10;
  int64_t image = 8, patch = 2, square = 3, hidden = 64, layers = 2, heads = 4, seed = 1234;
  double lr = 3e-3, dropout = 0.0, noise = 0.3, min_accuracy = 0.5;
  std::string log_json;
};

// Image `index` of a split: Gaussian noise plus a square of brightness +2 at a random
// place inside quadrant `label` (0 top left, 1 top right, 2 bottom left, 3 bottom right).
// Drawn from (seed, split, index) alone: the same images at every layout.
std::pair<at::Tensor, int64_t> make_image(const Args& a, const std::string& split, int64_t index) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(tp::name_seed(a.seed, split, index));
  at::Tensor image = at::normal(0.0, a.noise, {1, a.image, a.image}, gen);
  const int64_t label = at::randint(0, kClasses, {1}, gen, at::kLong).item<int64_t>();
  const int64_t q = a.image / 2, room = q - a.square + 1;
  const int64_t row = (label / 2) * q + at::randint(0, room, {1}, gen, at::kLong).item<int64_t>();
  const int64_t col = (label % 2) * q + at::randint(0, room, {1}, gen, at::kLong).item<int64_t>();
  image.narrow(1, row, a.square).narrow(2, col, a.square).add_(2.0);
  return {image, label};
}

// This DP rank's micro-batches of global batch `step` (Megatron's sampler order).
train::BatchSource batches(const Args& a, const std::string& split, const train::TrainingLoop& loop) {
  return [&a, split, &loop](int64_t step) {
    std::vector<pipeline::MicroBatch> out;
    for (int64_t k = 0; k < a.micro_batches; ++k) {
      std::vector<at::Tensor> images;
      std::vector<int64_t> labels;
      for (int64_t i = 0; i < a.micro_batch_size; ++i) {
        const int64_t index = ((step * a.micro_batches + k) * loop.dp_size() + loop.dp_rank()) * a.micro_batch_size + i;
        auto [image, label] = make_image(a, split, index);
        images.push_back(image);
        labels.push_back(label);
      }
      pipeline::MicroBatch mb;
      mb.tensors["pixels"] = at::stack(images).to(loop.device());             // [b, 1, H, W]
      mb.tensors["label"] = at::tensor(labels, at::kLong).to(loop.device());  // [b]
      out.push_back(std::move(mb));
    }
    return out;
  };
}

struct Accuracy {
  bool counting = false;
  int64_t correct = 0, total = 0;
};

// Every DP replica's last stage counts (TP rank 0 of it: its TP ranks agree); one all-reduce.
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
  const int64_t tokens = (a.image / a.patch) * (a.image / a.patch) + 1;  // patches and the class token
  auto rng = std::make_shared<tp::RngTracker>();
  train::TrainingLoop loop(train::TrainingLoopOptions()
                               .tensor_parallel(a.tp)
                               .pipeline_parallel(a.pp)
                               .virtual_chunks(a.virtual_chunks)
                               .schedule(a.schedule)
                               .zero_stage(a.zero)
                               .name("vit")
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
                               .tokens_per_sample(tokens)
                               .eval_iters(a.eval_iters));
  const auto& ps = loop.parallel_state();
  rng->seed(a.seed, ps.tp_rank(), loop.device());

  auto config = transformer::TransformerConfig()
                    .hidden_size(a.hidden)
                    .num_attention_heads(a.heads)
                    .num_layers(a.layers)
                    .seq_length(tokens)
                    .causal_attention(false)
                    .hidden_dropout(a.dropout)
                    .attention_dropout(a.dropout)
                    .seed(a.seed)
                    .device(loop.device());

  const int64_t stages = a.pp * a.virtual_chunks;
  const std::vector<int64_t> split = pipeline::split_layers(a.layers, a.pp, a.virtual_chunks, {});
  std::vector<torch::nn::AnyModule> chunks;
  for (int64_t c = 0; c < a.virtual_chunks; ++c) {
    const int64_t vs = c * a.pp + ps.pp_rank();
    int64_t begin = 0;
    for (int64_t s = 0; s < vs; ++s) begin += split[s];
    chunks.emplace_back(vit::ViTChunk(vit::ViTChunkOptions(config)
                                          .group(loop.tp_group())
                                          .image_size(a.image)
                                          .patch_size(a.patch)
                                          .num_classes(kClasses)
                                          .block_begin(begin)
                                          .block_end(begin + split[vs])
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
  // What travels between stages, declared instead of inferred: [tokens, b, h].
  auto activation = [tokens, hidden = a.hidden](int64_t, const pipeline::MicroBatch& mb) {
    return pipeline::ActivationSpec{{tokens, mb.get("pixels").size(0), hidden}, at::kFloat};
  };
  pipeline::ModuleStage stage(chunks, pipeline::ModuleStageOptions()
                                          .pp_group(loop.pp_group())
                                          .tp_group(loop.tp_group())
                                          .input("pixels")
                                          .loss(loss)
                                          .rng(rng)  // saved and restored with checkpoints
                                          .activation(activation)
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
    std::printf("held-out: loss %.4f, accuracy %.4f over %ld images (chance 0.25, required %.2f): %s\n", test_loss,
                acc, static_cast<long>(total), a.min_accuracy, ok ? "ok" : "FAILED");
    std::fflush(stdout);
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megatorch example: a vision transformer trained with train::TrainingLoop"};
  Args a;
  app.add_option("--tp", a.tp, "tensor-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--pp", a.pp, "pipeline-parallel size (dp = world / (tp·pp))")->check(CLI::PositiveNumber);
  app.add_option("--virtual-chunks", a.virtual_chunks, "chunks per pipeline rank (with --schedule interleaved)");
  app.add_option("--schedule", a.schedule, "gpipe | 1f1b | interleaved");
  app.add_option("--zero", a.zero, "ZeRO stage 0-3")->check(CLI::Range(0, 3));
  app.add_option("--device", a.device, "cpu | cuda | auto");
  app.add_option("--iters", a.iters, "training iterations");
  app.add_option("--micro-batch-size", a.micro_batch_size, "images per micro-batch");
  app.add_option("--micro-batches", a.micro_batches, "micro-batches per step and DP rank");
  app.add_option("--eval-iters", a.eval_iters, "held-out batches for the accuracy");
  app.add_option("--image-size", a.image, "image side in pixels (even)");
  app.add_option("--patch-size", a.patch, "patch side in pixels");
  app.add_option("--square", a.square, "side of the bright square (at most image/2)");
  app.add_option("--noise", a.noise, "standard deviation of the background noise");
  app.add_option("--hidden", a.hidden, "hidden size");
  app.add_option("--layers", a.layers, "encoder blocks");
  app.add_option("--heads", a.heads, "attention heads");
  app.add_option("--lr", a.lr, "peak learning rate (warm-up, cosine decay to lr/10)");
  app.add_option("--dropout", a.dropout, "hidden and attention dropout");
  app.add_option("--seed", a.seed, "initialisation and data seed");
  app.add_option("--min-accuracy", a.min_accuracy, "exit 1 below this held-out accuracy");
  app.add_option("--log-interval", a.log_interval, "iterations between log lines");
  app.add_option("--log-json", a.log_json, "one JSON object per iteration");
  CLI11_PARSE(app, argc, argv);
  at::set_num_threads(1);  // several ranks share the cores
  try {
    MEGATORCH_CHECK(a.image % 2 == 0 && a.square >= 1 && a.square <= a.image / 2,
                    "vit: expected an even --image-size and 1 <= --square <= image/2, got ", a.image, " and ", a.square);
    return run(a);
  } catch (const std::exception& e) {
    std::cerr << "vit: " << e.what() << std::endl;
    return 1;
  }
}
