#pragma once
// A small vision transformer, one pipeline chunk at a time: the image cut into P x P
// patches, each flattened patch through a linear patch embedding (column-parallel over
// TP, gathered), a learned class token and learned positions, encoder blocks (megatorch's
// TransformerLayer with bidirectional attention) and, on the last chunk, a final norm and
// a linear head on the class token. Every parameter is drawn from (seed, its global
// name), so every layout starts from the same numbers.
//
// The chunk runs ZeRO-3's unit hooks itself (models::RunsUnitHooks): its root (patch
// embedding, class token, positions, norm, head) is one unit and each block another, so
// under ZeRO-3 only one block's parameters are gathered at a time.
#include <megatorch/megatorch.h>
#include <megatorch/models/unit_hooks.h>
#include <torch/torch.h>

#include <memory>
#include <string>

namespace vit {

namespace mt = megatorch;

struct ViTChunkOptions {
  explicit ViTChunkOptions(mt::transformer::TransformerConfig config) : config_(std::move(config)) {}
  // Shape, dropout, seed, device; causal_attention(false); seq_length = patches + 1.
  TORCH_ARG(mt::transformer::TransformerConfig, config);
  TORCH_ARG(std::string, group) = "";
  TORCH_ARG(int64_t, image_size) = 8;
  TORCH_ARG(int64_t, patch_size) = 2;
  TORCH_ARG(int64_t, channels) = 1;
  TORCH_ARG(int64_t, num_classes) = 4;
  TORCH_ARG(int64_t, block_begin) = 0;  // this chunk's global blocks [begin, end)
  TORCH_ARG(int64_t, block_end) = 0;
  TORCH_ARG(bool, pre_process) = true;   // patch embedding, class token, positions
  TORCH_ARG(bool, post_process) = true;  // final norm and head
  TORCH_ARG(std::shared_ptr<mt::tp::RngTracker>, rng) = nullptr;

 public:
  int64_t num_patches() const { return (image_size_ / patch_size_) * (image_size_ / patch_size_); }
  int64_t patch_dim() const { return channels_ * patch_size_ * patch_size_; }
};

class ViTChunkImpl : public torch::nn::Cloneable<ViTChunkImpl>, public mt::models::RunsUnitHooks {
 public:
  explicit ViTChunkImpl(ViTChunkOptions options_) : options(std::move(options_)) { reset(); }

  void reset() override {
    const auto& c = options.config();
    c.validate(mt::tp::tp_info(options.group()).size);
    MEGATORCH_CHECK(options.image_size() % options.patch_size() == 0, "ViTChunk: expected the patch size (",
                    options.patch_size(), ") to divide the image size (", options.image_size(), ")");
    MEGATORCH_CHECK(c.seq_length() == options.num_patches() + 1, "ViTChunk: expected seq_length = patches + 1 = ",
                    options.num_patches() + 1, " (the class token first), got ", c.seq_length());
    const auto t = at::TensorOptions().dtype(c.params_dtype()).device(c.device());
    auto normal = [&](std::vector<int64_t> shape, const std::string& name) {
      const mt::tp::ShardSpec replicated{std::move(shape), -1, 0, 1, 1};
      return mt::tp::init_shard(replicated, name, c.seed(), mt::tp::InitMethod::kNormal, c.init_std()).to(t);
    };
    if (options.pre_process()) {
      // Column-parallel with its output gathered: each TP rank computes h/tp features and
      // every rank continues with all h.
      patch_embedding = register_module(
          "patch_embedding", mt::tp::ColumnParallelLinear(
                                 mt::tp::ColumnParallelLinearOptions(options.patch_dim(), c.hidden_size())
                                     .gather_output(true)
                                     .group(options.group())
                                     .init(mt::transformer::param_init(c, "patch_embedding"))));
      class_token = register_parameter("class_token", normal({c.hidden_size()}, "class_token"));
      position_embedding =
          register_parameter("position_embedding", normal({c.seq_length(), c.hidden_size()}, "position_embedding"));
    }
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = options.block_begin(); i < options.block_end(); ++i) {
      blocks->push_back(mt::transformer::TransformerLayer(
          mt::transformer::TransformerLayerOptions(c).group(options.group()).layer_number(i).rng(options.rng())));
    }
    if (options.post_process()) {
      final_norm = register_module("final_norm", mt::transformer::make_norm(c));
      head = register_module("head", torch::nn::Linear(c.hidden_size(), options.num_classes()));
      torch::NoGradGuard no_grad;
      head->weight.copy_(normal({options.num_classes(), c.hidden_size()}, "head.weight"));
      head->bias.zero_();
    }
  }

  void set_unit_hooks(std::shared_ptr<mt::models::UnitHooks> hooks, int64_t first_unit) override {
    hooks_ = std::move(hooks);
    first_unit_ = first_unit;
  }

  // First chunk: pixels [b, C, H, W]; later chunks: hidden states [s, b, h]. Returns
  // hidden states [patches + 1, b, h], or on the last chunk logits [b, num_classes].
  at::Tensor forward(const at::Tensor& input) {
    const auto& c = options.config();
    // Unit first_unit_ is the root: gathered before anything of it runs, and handed the
    // chunk's output last (its backward comes after every block's).
    if (hooks_) hooks_->before_forward(first_unit_);
    at::Tensor h = options.pre_process() ? embed(input) : input;
    for (size_t i = 0; i < blocks->size(); ++i) {
      const int64_t unit = first_unit_ + 1 + static_cast<int64_t>(i);
      if (hooks_) hooks_->before_forward(unit);
      h = blocks[i]->as<mt::transformer::TransformerLayer>()->forward(h);
      if (hooks_) h = hooks_->after_forward(unit, h);
    }
    if (options.post_process()) h = head->forward(final_norm->forward(h).select(0, 0));  // the class token
    if (hooks_) h = hooks_->after_forward(first_unit_, h);
    return h;
  }

  ViTChunkOptions options;
  mt::tp::ColumnParallelLinear patch_embedding{nullptr};
  at::Tensor class_token;         // [h]
  at::Tensor position_embedding;  // [patches + 1, h]
  torch::nn::ModuleList blocks{nullptr};
  mt::transformer::Norm final_norm{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  // [b, C, H, W] -> [patches + 1, b, h]: flattened patches (row-major over the grid),
  // embedded, after the class token, plus positions.
  at::Tensor embed(const at::Tensor& pixels) {
    const auto& c = options.config();
    const int64_t b = pixels.size(0), p = options.patch_size(), g = options.image_size() / p;
    MEGATORCH_CHECK(pixels.dim() == 4 && pixels.size(1) == options.channels() &&
                        pixels.size(2) == options.image_size() && pixels.size(3) == options.image_size(),
                    "ViTChunk: expected pixels [b, ", options.channels(), ", ", options.image_size(), ", ",
                    options.image_size(), "], got ", pixels.sizes());
    const at::Tensor patches = pixels.reshape({b, options.channels(), g, p, g, p})
                                   .permute({2, 4, 0, 1, 3, 5})
                                   .reshape({g * g, b, options.patch_dim()});
    const at::Tensor cls = class_token.view({1, 1, -1}).expand({1, b, c.hidden_size()});
    const at::Tensor h = at::cat({cls, patch_embedding->forward(patches)}, 0) + position_embedding.unsqueeze(1);
    return mt::transformer::hidden_dropout(h, c, is_training(), options.rng().get());
  }

  std::shared_ptr<mt::models::UnitHooks> hooks_;
  int64_t first_unit_ = 0;
};
TORCH_MODULE(ViTChunk);

}  // namespace vit
