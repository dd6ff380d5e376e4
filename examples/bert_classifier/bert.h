#pragma once
// A BERT-style encoder classifier, built one pipeline chunk at a time: word embeddings
// split over the vocabulary across TP + learned positions, megatorch's TransformerLayers
// with bidirectional attention, and on the last chunk a final norm, BERT's pooler (first
// token -> dense -> tanh) and a classification head. A chunk knows its global layer
// range, and every parameter is drawn from (seed, its global name), so the model starts
// from the same numbers at every TP x PP layout.
#include <megatorch/megatorch.h>
#include <torch/torch.h>

#include <memory>
#include <string>

namespace bert {

namespace mt = megatorch;

struct BertChunkOptions {
  explicit BertChunkOptions(mt::transformer::TransformerConfig config) : config_(std::move(config)) {}
  // Shape, dropout, seed and device; causal_attention(false) for an encoder.
  TORCH_ARG(mt::transformer::TransformerConfig, config);
  TORCH_ARG(std::string, group) = "";  // the TP group ("" without TP)
  TORCH_ARG(int64_t, layer_begin) = 0;  // this chunk's global layers [begin, end)
  TORCH_ARG(int64_t, layer_end) = 0;
  TORCH_ARG(bool, pre_process) = true;   // the embeddings: the first virtual stage
  TORCH_ARG(bool, post_process) = true;  // norm, pooler and head: the last virtual stage
  TORCH_ARG(int64_t, num_classes) = 2;
  // Dropout streams inside TP regions (the training loop saves and restores them).
  TORCH_ARG(std::shared_ptr<mt::tp::RngTracker>, rng) = nullptr;
};

// A replicated dense layer (every TP rank holds all of it) drawn from (seed, name), so its
// numbers do not depend on which rank builds it or on what was drawn before.
inline torch::nn::Linear named_linear(int64_t in, int64_t out, const std::string& name,
                                      const mt::transformer::TransformerConfig& c) {
  torch::nn::Linear linear(torch::nn::LinearOptions(in, out));
  torch::NoGradGuard no_grad;
  const mt::tp::ShardSpec replicated{{out, in}, /*partition_dim=*/-1, 0, 1, 1};
  linear->weight.copy_(mt::tp::init_shard(replicated, name + ".weight", c.seed(), mt::tp::InitMethod::kNormal,
                                          c.init_std()));
  linear->bias.zero_();
  linear->to(c.device(), c.params_dtype());
  return linear;
}

class BertChunkImpl : public torch::nn::Cloneable<BertChunkImpl> {
 public:
  explicit BertChunkImpl(BertChunkOptions options_) : options(std::move(options_)) { reset(); }

  void reset() override {
    const auto& c = options.config();
    c.validate(mt::tp::tp_info(options.group()).size);
    const auto t = at::TensorOptions().dtype(c.params_dtype()).device(c.device());
    if (options.pre_process()) {
      embedding = register_module(
          "embedding", mt::tp::VocabParallelEmbedding(
                           mt::tp::VocabParallelEmbeddingOptions(c.vocab_size(), c.hidden_size())
                               .make_vocab_size_divisible_by(c.make_vocab_size_divisible_by())
                               .group(options.group())
                               .init(mt::transformer::param_init(c, "embedding.word"))));
      const mt::tp::ShardSpec replicated{{c.max_positions(), c.hidden_size()}, -1, 0, 1, 1};
      position_embedding = register_parameter(
          "position_embedding", mt::tp::init_shard(replicated, "embedding.position.weight", c.seed(),
                                                   mt::tp::InitMethod::kNormal, c.init_std())
                                    .to(t));
    }
    // One ModuleList named "layers" at the top: ModuleStage numbers its elements globally
    // (checkpoint names) and ZeRO-3 makes each element a unit.
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = options.layer_begin(); i < options.layer_end(); ++i) {
      layers->push_back(mt::transformer::TransformerLayer(
          mt::transformer::TransformerLayerOptions(c).group(options.group()).layer_number(i).rng(options.rng())));
    }
    if (options.post_process()) {
      final_norm = register_module("final_norm", mt::transformer::make_norm(c));
      pooler = register_module("pooler", named_linear(c.hidden_size(), c.hidden_size(), "pooler.dense", c));
      head = register_module("head", named_linear(c.hidden_size(), options.num_classes(), "classifier", c));
    }
  }

  // First chunk: token ids [b, s]; later chunks: hidden states [s, b, h]. Returns hidden
  // states [s, b, h], or on the last chunk logits [b, num_classes].
  at::Tensor forward(const at::Tensor& input) {
    const auto& c = options.config();
    at::Tensor h = input;
    if (options.pre_process()) {
      MEGATORCH_CHECK(input.dim() == 2 && input.size(1) <= c.max_positions(),
                      "BertChunk: expected token ids [b, s] with s <= ", c.max_positions(), ", got ", input.sizes());
      h = embedding->forward(input.t()) + position_embedding.narrow(0, 0, input.size(1)).unsqueeze(1);
      h = mt::transformer::hidden_dropout(h, c, is_training(), options.rng().get());
    }
    for (const auto& layer : *layers) h = layer->as<mt::transformer::TransformerLayer>()->forward(h);
    if (options.post_process()) {
      const at::Tensor first_token = final_norm->forward(h).select(0, 0);  // [b, h]: the [CLS] position
      h = head->forward(at::tanh(pooler->forward(first_token)));
    }
    return h;
  }

  BertChunkOptions options;
  mt::tp::VocabParallelEmbedding embedding{nullptr};
  at::Tensor position_embedding;  // [max_positions, h], replicated
  torch::nn::ModuleList layers{nullptr};
  mt::transformer::Norm final_norm{nullptr};
  torch::nn::Linear pooler{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(BertChunk);

}  // namespace bert
