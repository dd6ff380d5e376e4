#pragma once
// TextGenerator: autoregressive decoding of a GPTModel (this rank's pipeline stage of
// it) with a KV cache. The prompt runs once (prefill), then each new token runs through
// the model as one position. Under TP the layers' usual collectives run and the last
// stage's logits shards are gathered to the full vocabulary; under PP the stages run
// in turn each step, hidden states passed by p2p and the chosen token broadcast from
// the last stage. Every rank of the model calls generate() with the same arguments.
#include <ATen/core/Generator.h>
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/comm/group.h"
#include "megatorch/inference/sampling.h"
#include "megatorch/models/gpt_model.h"

namespace megatorch::inference {

struct GenerationOptions {
  TORCH_ARG(int64_t, max_new_tokens) = 32;
  TORCH_ARG(SamplingOptions, sampling) = {};
  // Generation stops after this token (the tokenizer's end of document); -1: never.
  TORCH_ARG(int64_t, stop_token) = -1;
};

struct TextGeneratorOptions {
  TORCH_ARG(std::string, pp_group) = "";  // "" for a single stage; the TP group is the model's
};

class TextGenerator {
 public:
  // Puts `model` in eval mode. Its configuration must not use sequence parallelism.
  explicit TextGenerator(models::GPTModel model, TextGeneratorOptions options = {});

  // The generated ids (without the prompt; ending with stop_token when it was drawn).
  // `generator` (CPU) draws the samples; on the last stage every TP rank holds the same
  // logits and the same generator state, so they choose alike. Collective.
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, const GenerationOptions& options,
                                at::Generator& generator);

  // The logits of the last position over the whole (unpadded) vocabulary [V], fp32, from
  // this rank's shard [s, b, Vp/tp] (collective over TP).
  at::Tensor last_position_logits(const at::Tensor& shard);

  const models::GPTModel& model() const { return model_; }

 private:
  models::GPTModel model_;
  TextGeneratorOptions options_;
  std::unique_ptr<comm::Group> tp_, pp_;
};

}  // namespace megatorch::inference
