#include "megatorch/inference/text_generator.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "megatorch/check.h"
#include "megatorch/inference/kv_cache.h"

namespace megatorch::inference {

TextGenerator::TextGenerator(models::GPTModel model, TextGeneratorOptions options)
    : model_(std::move(model)), options_(std::move(options)) {
  MEGATORCH_CHECK(!model_->options.config().sequence_parallel(), "TextGenerator: expected a model without sequence "
                  "parallelism (a generation step has one token to split); build it with sequence_parallel(false)");
  model_->eval();
  if (model_->tp.size > 1) tp_ = std::make_unique<comm::Group>(model_->options.group());
  if (!options_.pp_group().empty()) {
    pp_ = std::make_unique<comm::Group>(options_.pp_group());
    if (pp_->size() == 1) pp_.reset();
  }
  const bool first = !pp_ || pp_->rank() == 0, last = !pp_ || pp_->rank() == pp_->size() - 1;
  MEGATORCH_CHECK(model_->options.pre_process() == first && model_->options.post_process() == last,
                  "TextGenerator: expected the embedding on the first pipeline stage only and the output layer on the "
                  "last only; pipeline rank ", pp_ ? pp_->rank() : 0, " of ", pp_ ? pp_->size() : 1,
                  " has pre_process ", model_->options.pre_process(), ", post_process ", model_->options.post_process());
}

at::Tensor TextGenerator::last_position_logits(const at::Tensor& shard) {
  at::Tensor local = shard.select(0, shard.size(0) - 1).select(0, 0).contiguous();  // [Vp/tp]
  at::Tensor full = tp_ ? tp_->all_gather(local, 0) : local;                          // [Vp], rank order
  return full.narrow(0, 0, model_->options.config().vocab_size()).to(at::kFloat);
}

std::vector<int64_t> TextGenerator::generate(const std::vector<int64_t>& prompt, const GenerationOptions& options,
                                             at::Generator& generator) {
  const auto& c = model_->options.config();
  MEGATORCH_CHECK(!prompt.empty(), "generate: expected a prompt of at least one token, got none");
  MEGATORCH_CHECK(options.max_new_tokens() >= 1, "generate: expected --max-new-tokens >= 1, got ",
                  options.max_new_tokens());
  for (int64_t id : prompt) {
    MEGATORCH_CHECK(id >= 0 && id < c.vocab_size(), "generate: expected prompt ids in [0, ", c.vocab_size(),
                    ") (the model's vocabulary), got ", id);
  }
  options.sampling().validate();
  const int64_t n = static_cast<int64_t>(prompt.size());
  check_sequence_length(c, n + options.max_new_tokens());
  torch::NoGradGuard no_grad;
  // The last new token is never fed back: n + max_new - 1 positions at most.
  auto caches = make_kv_caches(*model_, n + options.max_new_tokens() - 1);
  const auto ids_options = at::TensorOptions().dtype(at::kLong).device(c.device());
  const auto hidden_options = at::TensorOptions().dtype(c.params_dtype()).device(c.device());
  const int64_t pp_rank = pp_ ? pp_->rank() : 0, pp_size = pp_ ? pp_->size() : 1;
  std::vector<int64_t> out;
  at::Tensor step_ids = at::tensor(prompt, at::TensorOptions().dtype(at::kLong)).to(c.device()).unsqueeze(0);
  int64_t offset = 0;
  while (true) {
    const int64_t s = step_ids.size(1);
    at::Tensor input = step_ids;
    if (pp_rank > 0) {
      input = at::empty({s, 1, c.hidden_size()}, hidden_options);
      pp_->recv(input, pp_rank - 1);
    }
    const at::Tensor result = model_->forward_cached(input, offset, caches);
    if (pp_rank < pp_size - 1) pp_->send(result.contiguous(), pp_rank + 1);
    at::Tensor token = at::empty({1}, ids_options);
    if (pp_rank == pp_size - 1) token.fill_(sample_token(last_position_logits(result), options.sampling(), generator));
    if (pp_) pp_->broadcast(token, pp_size - 1);
    const int64_t id = token.item<int64_t>();
    out.push_back(id);
    offset += s;
    if (id == options.stop_token() || static_cast<int64_t>(out.size()) == options.max_new_tokens()) break;
    step_ids = token.view({1, 1});
  }
  return out;
}

}  // namespace megatorch::inference
