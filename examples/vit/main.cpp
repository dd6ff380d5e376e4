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

#include <memory>
#include <string>
#include <vector>

#include "../common/example_support.h"
#include "vit.h"

using namespace megatorch;

namespace {

constexpr int64_t kClasses = 4;

// The layout and training flags (examples::LoopFlags) with ZeRO-3 and 2 micro-batches by
// default, and this model's own.
struct Args : examples::LoopFlags {
  Args() {
    zero = 3;
    micro_batches = 2;
  }
  int64_t image = 8, patch = 2, square = 3, hidden = 64, layers = 2, heads = 4;
  double dropout = 0.0, noise = 0.3, min_accuracy = 0.5;
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

// This DP rank's micro-batches of global batch `step` (Megatron's sampler order):
// pixels [b, 1, H, W] as "pixels", labels [b] as "label".
train::BatchSource batches(const Args& a, const std::string& split, const train::TrainingLoop& loop) {
  return examples::labelled_batches(a, loop, "pixels",
                                    [&a, split](int64_t index) { return make_image(a, split, index); });
}

int run(const Args& a) {
  MEGATORCH_CHECK(a.image % 2 == 0 && a.square >= 1 && a.square <= a.image / 2,
                  "vit: expected an even --image-size and 1 <= --square <= image/2, got ", a.image, " and ", a.square);
  const int64_t tokens = (a.image / a.patch) * (a.image / a.patch) + 1;  // patches and the class token
  auto rng = std::make_shared<tp::RngTracker>();
  train::TrainingLoop loop(examples::loop_options(a, "vit").tokens_per_sample(tokens));
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

  std::vector<torch::nn::AnyModule> chunks;
  for (const examples::ChunkLayers& r : examples::chunk_layers(a.layers, a, ps.pp_rank())) {
    chunks.emplace_back(vit::ViTChunk(vit::ViTChunkOptions(config)
                                          .group(loop.tp_group())
                                          .image_size(a.image)
                                          .patch_size(a.patch)
                                          .num_classes(kClasses)
                                          .block_begin(r.begin)
                                          .block_end(r.end)
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
  // What travels between stages, declared instead of inferred: [tokens, b, h].
  auto activation = [tokens, hidden = a.hidden](int64_t, const pipeline::MicroBatch& mb) {
    return pipeline::ActivationSpec{{tokens, mb.get("pixels").size(0), hidden}, at::kFloat};
  };
  pipeline::ModuleStage stage(chunks, pipeline::ModuleStageOptions()
                                          .pp_group(loop.pp_group())
                                          .tp_group(loop.tp_group())
                                          .input("pixels")
                                          .chunk_layout(examples::chunk_layout(a))
                                          .loss(loss)
                                          .rng(rng)  // saved and restored with checkpoints
                                          .activation(activation)
                                          .device(loop.device()));
  loop.set_model(stage.ptr(), train::ParameterGroupingOptions().tp_group(loop.tp_group()));

  loop.train(batches(a, "train", loop));

  const examples::HeldOut held_out =
      examples::evaluate_accuracy(loop, *accuracy, batches(a, "test", loop), a.eval_iters);
  return examples::report_accuracy(loop, held_out, "images", /*chance=*/0.25, a.min_accuracy);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megatorch example: a vision transformer trained with train::TrainingLoop"};
  Args a;
  examples::add_loop_flags(app, a, "images");
  app.add_option("--image-size", a.image, "image side in pixels (even)");
  app.add_option("--patch-size", a.patch, "patch side in pixels");
  app.add_option("--square", a.square, "side of the bright square (at most image/2)");
  app.add_option("--noise", a.noise, "standard deviation of the background noise");
  app.add_option("--hidden", a.hidden, "hidden size");
  app.add_option("--layers", a.layers, "encoder blocks");
  app.add_option("--heads", a.heads, "attention heads");
  app.add_option("--dropout", a.dropout, "hidden and attention dropout");
  app.add_option("--min-accuracy", a.min_accuracy, "exit 1 below this held-out accuracy");
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = megatorch::util::parse_or_exit(app, argc, argv, "vit")) return *code;
  at::set_num_threads(1);  // several ranks share the cores
  return examples::run_main("vit", [&] { return run(a); });
}
