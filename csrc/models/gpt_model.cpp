#include "megatorch/models/gpt_model.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/inference/kv_cache.h"
#include "megatorch/tp/cross_entropy.h"
#include "megatorch/tp/init.h"
#include "megatorch/transformer/context_parallel.h"
#include "megatorch/transformer/cuda_graph.h"
#include "megatorch/util/strings.h"

namespace megatorch::models {
namespace {

// Dynamic NTK's angles depend on the sequence's length, not on the position alone.
bool dynamic_rope(const transformer::TransformerConfig& c) {
  return c.rope_scaling().type() == transformer::RopeType::kDynamic;
}

}  // namespace

using comm::Mapping;
using transformer::Positions;

GPTModelImpl::GPTModelImpl(GPTModelOptions options_) : options(std::move(options_)) { reset(); }

void GPTModelImpl::reset() {
  const auto& c = options.config();
  cuda_graphs_ = nullptr;  // captures read this model's parameters: a clone captures its own
  cuda_graph_fallback_.clear();
  tp = tp::tp_info(options.group());
  cp = tp::tp_info(c.context_parallel_group());
  c.validate(tp.size, cp.size, tp::tp_info(c.expert_parallel_group()).size,
             tp::tp_info(c.expert_tensor_parallel_group()).size);
  const int64_t end = options.layer_end() < 0 ? c.num_layers() : options.layer_end();
  MEGATORCH_CHECK(options.layer_begin() >= 0 && options.layer_begin() <= end && end <= c.num_layers(),
                  "GPTModel: expected a layer range inside [0, ", c.num_layers(), "], got [", options.layer_begin(),
                  ", ", end, "); a stage owns a contiguous slice of the model's layers");
  options.layer_end(end);
  if (!options.rng()) {
    options.rng(std::make_shared<tp::RngTracker>());
    options.rng()->seed(c.seed(), tp.rank, c.device());
  }
  const auto t = at::TensorOptions().dtype(c.params_dtype()).device(c.device());
  torch::NoGradGuard no_grad;
  if (options.pre_process()) {
    embedding = register_module("embedding", tp::VocabParallelEmbedding(
                                                 tp::VocabParallelEmbeddingOptions(c.vocab_size(), c.hidden_size())
                                                     .make_vocab_size_divisible_by(c.make_vocab_size_divisible_by())
                                                     .sequence_parallel(c.sequence_parallel())
                                                     .group(options.group())
                                                     .init(transformer::param_init(c, "embedding.word"))));
    if (c.position_embedding_type() == Positions::kLearned) {
      tp::ShardSpec full{{c.max_positions(), c.hidden_size()}, -1, 0, 1, 1};
      position_embedding = register_parameter(
          "position_embedding",
          tp::init_shard(full, "embedding.position.weight", c.seed(), tp::InitMethod::kNormal, c.init_std()).to(t));
    }
  }
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = options.layer_begin(); i < end; ++i) {
    layers->push_back(transformer::TransformerLayer(
        transformer::TransformerLayerOptions(c).group(options.group()).layer_number(i).rng(options.rng())));
  }
  if (options.post_process()) {
    final_norm = register_module("final_norm", transformer::make_norm(c));
    if (!c.tie_embeddings() || !options.pre_process()) {
      // Untied: its own weight. Tied on a stage without the embedding: a copy drawn
      // from the embedding's name (same numbers), kept in sync by the pipeline.
      const int64_t vp = tp::padded_vocab_size(c.vocab_size(), tp.size, c.make_vocab_size_divisible_by());
      const std::string name = c.tie_embeddings() ? "embedding.word.weight" : "output_layer.weight";
      const at::Tensor w = tp::init_vocab_shard(c.vocab_size(), c.hidden_size(), vp, tp, name,
                                                transformer::param_init(c, name));
      output_layer = register_parameter("output_layer", w.to(t));
    }
  }
  if (c.position_embedding_type() == Positions::kRope) {
    rope_freqs_ = transformer::rope_frequencies(c.seq_length(), c, c.device());
  }
}

at::Tensor GPTModelImpl::output_weight() const {
  return output_layer.defined() ? output_layer : embedding->weight;
}

std::map<std::string, tp::ParameterLayout> GPTModelImpl::parameter_layouts() const {
  const auto& c = options.config();
  std::map<std::string, tp::ParameterLayout> out;
  if (position_embedding.defined()) {
    out["position_embedding"] = tp::replicated_layout(position_embedding, c.sequence_parallel());
  }
  if (output_layer.defined()) {
    const int64_t vp = tp::padded_vocab_size(c.vocab_size(), tp.size, c.make_vocab_size_divisible_by());
    tp::ParameterLayout& l = out["output_layer"];
    l.spec = tp::ShardSpec{{vp, output_layer.size(1)}, 0, tp.rank, tp.size, 1};
    l.valid_rows = c.vocab_size();
  }
  return out;
}

at::Tensor GPTModelImpl::positions(int64_t tokens) {
  if (!positions_.defined() || positions_.size(0) != tokens) {
    const auto& c = options.config();
    positions_ = transformer::context_parallel_positions(tokens * cp.size, cp.size, cp.rank, c.device());
    cp_rope_freqs_ = at::Tensor();
  }
  return positions_;
}

at::Tensor GPTModelImpl::embed(const at::Tensor& ids, const at::Tensor& position_ids) {
  const auto& c = options.config();
  MEGATORCH_CHECK(ids.dim() == 2 && ids.size(1) * cp.size <= c.max_positions(),
                  "GPTModel: expected token ids [b, s] with s <= ", c.max_positions() / cp.size,
                  cp.size > 1 ? " (this context-parallel rank's share)" : "", ", got ", ids.sizes());
  at::Tensor h = embedding->forward(ids.t());  // [s, b, h], or [s/tp, b, h] under SP
  if (position_embedding.defined()) {
    const int64_t s = h.size(0);
    const int64_t first = c.sequence_parallel() ? tp.rank * s : 0;  // this rank's tokens
    if (position_ids.defined()) {  // packed documents: each row its own positions
      const at::Tensor pos = position_ids.narrow(1, first, s).t().reshape({-1});  // [s·b], s-major
      h = h + position_embedding.index_select(0, pos).view({s, ids.size(0), h.size(2)});
    } else if (cp.size == 1) {
      h = h + position_embedding.narrow(0, first, s).unsqueeze(1);
    } else {
      h = h + position_embedding.index_select(0, positions(ids.size(1)).narrow(0, first, s)).unsqueeze(1);
    }
  }
  return transformer::hidden_dropout(h, c, is_training(), options.rng().get());
}

at::Tensor GPTModelImpl::forward(const at::Tensor& input, const transformer::PackedSequence& packed) {
  const auto& c = options.config();
  if (unit_hooks_) unit_hooks_->before_forward(first_unit_);
  // Packed positions of this rank's tokens (under CP its two chunks, as the ids are sliced);
  // the document ids stay whole: attention reaches the other ranks' keys.
  at::Tensor position_ids = packed.position_ids;
  if (position_ids.defined() && cp.size > 1) {
    position_ids = transformer::context_parallel_slice(position_ids, 1, cp.size, cp.rank);
  }
  at::Tensor h = options.pre_process() ? embed(input, position_ids) : input;
  // RoPE angles for the positions present: attention sees the whole sequence (gathered under SP).
  at::Tensor freqs = rope_freqs_;
  const int64_t tokens = c.sequence_parallel() ? h.size(0) * tp.size : h.size(0);
  if (freqs.defined() && position_ids.defined()) {
    // Packed positions restart in each document: every row's own angles, from the table of
    // the whole sequence's positions (packed ones are smaller; under CP as well).
    const int64_t s = tokens * cp.size;
    if (s > rope_freqs_.size(0) || (dynamic_rope(c) && s != rope_freqs_.size(0))) {
      rope_freqs_ = transformer::rope_frequencies(s, c, c.device());
    }
    freqs = transformer::rope_at_positions(rope_freqs_, position_ids);
  } else if (freqs.defined() && cp.size > 1) {
    // This CP rank's positions are two chunks of the sequence: their angles.
    const at::Tensor& pos = positions(tokens);
    if (!cp_rope_freqs_.defined()) {
      const int64_t s = tokens * cp.size;
      const at::Tensor full = s == rope_freqs_.size(0) ? rope_freqs_ : transformer::rope_frequencies(s, c, c.device());
      cp_rope_freqs_ = full.index_select(0, pos);
    }
    freqs = cp_rope_freqs_;
  } else if (freqs.defined() && tokens != freqs.size(0)) {
    // A longer sequence grows the table once (each angle depends on its position alone), so
    // the angles keep one address from call to call, as a captured CUDA graph needs.
    // Dynamic NTK's angles depend on the sequence's length: its own table.
    if (tokens > freqs.size(0) || dynamic_rope(c)) rope_freqs_ = transformer::rope_frequencies(tokens, c, c.device());
    freqs = tokens < rope_freqs_.size(0) ? rope_freqs_.narrow(0, 0, tokens) : rope_freqs_;
  }
  const transformer::Documents documents = transformer::documents_of(packed);
  const auto run_layers = [&](at::Tensor x) {
    for (size_t i = 0; i < layers->size(); ++i) {
      const int64_t unit = first_unit_ + 1 + static_cast<int64_t>(i);
      if (unit_hooks_) unit_hooks_->before_forward(unit);
      x = layers[i]->as<transformer::TransformerLayer>()->forward(x, freqs, documents);
      if (unit_hooks_) x = unit_hooks_->after_forward(unit, x);
    }
    return x;
  };
  // A graph replays one shape of attention: packed documents differ from batch to batch.
  const bool graphed = c.cuda_graph() && is_training() && torch::GradMode::is_enabled() && packed.empty();
  h = graphed ? run_layers_graphed(h, freqs, run_layers) : run_layers(h);
  if (options.post_process()) {
    h = final_norm->forward(h);
    // The head is a column-parallel layer over the vocabulary that keeps its output split.
    h = tp::map_region(c.sequence_parallel() ? Mapping::kGatherFromSP : Mapping::kCopyToTP, h, options.group());
    h = at::linear(h, output_weight());
  }
  if (unit_hooks_) h = unit_hooks_->after_forward(first_unit_, h);
  return h;
}

at::Tensor GPTModelImpl::run_layers_graphed(const at::Tensor& h, const at::Tensor& freqs,
                                            const std::function<at::Tensor(at::Tensor)>& run_layers) {
  const std::string why = transformer::cuda_graph_unsupported(options.config(), h, tp.size, cp.size,
                                                              unit_hooks_ != nullptr);
  if (!why.empty()) {
    if (cuda_graph_fallback_ != why) {  // once per reason, not per micro-batch
      cuda_graph_fallback_ = why;
      std::printf("[megatorch] cuda graph: not captured, the layers run eagerly: %s\n", why.c_str());
      std::fflush(stdout);
    }
    return run_layers(h);
  }
  if (!cuda_graphs_) cuda_graphs_ = std::make_shared<transformer::LayerStackGraphs>(layers->parameters());
  return cuda_graphs_->run(h, {freqs}, run_layers);
}

int64_t GPTModelImpl::cuda_graph_captures() const { return cuda_graphs_ ? cuda_graphs_->captures() : 0; }

at::Tensor GPTModelImpl::forward_cached(const at::Tensor& input, int64_t position_offset,
                                       std::vector<inference::KVCache>& caches) {
  const auto& c = options.config();
  MEGATORCH_CHECK(!is_training() && !c.sequence_parallel(), "GPTModel::forward_cached: expected eval mode without "
                  "sequence parallelism, got training ", is_training(), ", sequence_parallel ", c.sequence_parallel(),
                  "; call eval() and build the model with sequence_parallel(false)");
  MEGATORCH_CHECK(cp.size == 1, "GPTModel::forward_cached: expected no context parallelism, got a CP group of ",
                  cp.size, " ranks; generate with a model built without context_parallel_group");
  MEGATORCH_CHECK(c.causal_attention(), "GPTModel::forward_cached: expected causal attention, got "
                  "causal_attention(false): cached keys and values assume no token sees later ones; run the whole "
                  "sequence through forward() instead");
  MEGATORCH_CHECK(caches.size() == layers->size(), "GPTModel::forward_cached: expected one KV cache per layer (",
                  layers->size(), "), got ", caches.size(), "; make them with inference::make_kv_caches");
  const int64_t s = options.pre_process() ? input.size(1) : input.size(0);
  for (const auto& cache : caches) {
    MEGATORCH_CHECK(cache.length == position_offset, "GPTModel::forward_cached: expected the tokens to follow the ",
                    cache.length, " cached ones, got position_offset ", position_offset);
  }
  const int64_t end = position_offset + s;
  inference::check_sequence_length(c, end);
  at::Tensor h;
  if (options.pre_process()) {
    MEGATORCH_CHECK(input.dim() == 2, "GPTModel::forward_cached: expected token ids [b, s], got ", input.sizes());
    h = embedding->forward(input.t());  // [s, b, h]
    if (position_embedding.defined()) h = h + position_embedding.narrow(0, position_offset, s).unsqueeze(1);
  } else {
    h = input;
  }
  at::Tensor freqs;
  if (c.position_embedding_type() == Positions::kRope) {
    // The same angles as rope_frequencies(end) (each depends on its position alone),
    // regrown by doubling so a step costs no table. Dynamic NTK scales by the length so
    // far: each step's tokens take rope_frequencies(end)'s angles, and the cached keys keep
    // the angles of their own step (as transformers' generate does).
    if (dynamic_rope(c)) {
      freqs = transformer::rope_frequencies(end, c, c.device()).narrow(0, position_offset, s);
    } else {
      if (!inference_rope_freqs_.defined() || inference_rope_freqs_.size(0) < end) {
        const int64_t n = std::max(end, 2 * (inference_rope_freqs_.defined() ? inference_rope_freqs_.size(0) : 0));
        inference_rope_freqs_ = transformer::rope_frequencies(n, c, c.device());
      }
      freqs = inference_rope_freqs_.narrow(0, position_offset, s);
    }
  }
  for (size_t i = 0; i < layers->size(); ++i) {
    h = layers[i]->as<transformer::TransformerLayer>()->forward_cached(h, freqs, caches[i]);
  }
  if (options.post_process()) {
    h = final_norm->forward(h);
    h = tp::map_region(Mapping::kCopyToTP, h, options.group());
    h = at::linear(h, output_weight());
  }
  return h;
}

std::vector<std::vector<at::Tensor>> GPTModelImpl::parameter_units() const {
  std::vector<std::vector<at::Tensor>> units(1 + layers->size());
  for (const auto& item : named_parameters()) {
    const std::string& name = item.key();
    if (const auto rest = util::strip_prefix(name, "layers.")) {  // "layers.<i>.<...>"
      const int64_t i = std::stoll(std::string(rest->substr(0, rest->find('.'))));
      units[1 + i].push_back(item.value());
    } else {
      units[0].push_back(item.value());
    }
  }
  return units;
}

void GPTModelImpl::set_unit_hooks(std::shared_ptr<UnitHooks> hooks, int64_t first_unit) {
  unit_hooks_ = std::move(hooks);
  first_unit_ = first_unit;
}

at::Tensor GPTModelImpl::per_token_loss(const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index) const {
  return tp::vocab_parallel_cross_entropy(logits, labels.t(), options.group(), 0.0, ignore_index,
                                          options.config().vocab_size(), options.config().fused_kernels());
}

at::Tensor GPTModelImpl::loss(const at::Tensor& ids, const at::Tensor& labels, int64_t ignore_index) {
  MEGATORCH_CHECK(options.pre_process() && options.post_process(),
                  "GPTModel::loss needs the whole model (pre_process and post_process); a pipeline stage calls "
                  "forward and per_token_loss instead");
  return tp::masked_mean_loss(per_token_loss(forward(ids), labels, ignore_index), labels, ignore_index);
}

std::vector<at::Tensor> GPTModelImpl::sequence_parallel_parameters() const {
  std::vector<at::Tensor> out;
  if (position_embedding.defined()) out.push_back(position_embedding);
  for (const auto& layer : *layers) {
    for (const auto& p : layer->as<transformer::TransformerLayer>()->sequence_parallel_parameters()) out.push_back(p);
  }
  if (final_norm) {
    out.push_back(final_norm->weight);
    if (final_norm->bias.defined()) out.push_back(final_norm->bias);
  }
  return out;
}

void GPTModelImpl::allreduce_sequence_parallel_grads() {
  if (!options.config().sequence_parallel() || tp.size == 1) return;
  std::vector<at::Tensor> grads;
  for (const auto& p : sequence_parallel_parameters()) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  comm::Group group(options.group());
  comm::reduce_flattened(grads, [&](at::Tensor& flat) { group.all_reduce(flat); });
}

}  // namespace megatorch::models
