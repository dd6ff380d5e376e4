#include "megatorch/pipeline/pipeline_stage.h"

#include <ATen/ATen.h>

#include <numeric>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::pipeline {

std::vector<int64_t> split_layers(int64_t num_layers, int64_t p, int64_t v, const std::vector<int64_t>& split) {
  const int64_t stages = p * v;
  if (!split.empty()) {
    MEGATORCH_CHECK(static_cast<int64_t>(split.size()) == stages, "expected a layer split with one count per virtual ",
                    "stage (p x v = ", p, " x ", v, " = ", stages, "), got ", split.size(), " counts");
    for (int64_t n : split) MEGATORCH_CHECK(n >= 1, "expected every stage to own at least one layer, got ", n);
    const int64_t total = std::accumulate(split.begin(), split.end(), int64_t{0});
    MEGATORCH_CHECK(total == num_layers, "expected the layer split to sum to num_layers = ", num_layers, ", got ",
                    total);
    return split;
  }
  MEGATORCH_CHECK(num_layers % stages == 0, "expected num_layers (", num_layers,
                  ") to be divisible by pipeline stages x virtual chunks = ", p, " x ", v, " = ", stages,
                  "; change the sizes or pass an explicit layer split");
  return std::vector<int64_t>(stages, num_layers / stages);
}

PipelineStageImpl::PipelineStageImpl(PipelineStageOptions options_) : options(std::move(options_)) { reset(); }

void PipelineStageImpl::reset() {
  if (!options.pp_group().empty()) {
    comm::Group pp(options.pp_group());
    pp_rank_ = pp.rank();
    pp_size_ = pp.size();
  }
  const auto& c = options.config();
  const int64_t v = options.virtual_chunks();
  MEGATORCH_CHECK(v >= 1, "expected virtual_chunks >= 1, got ", v);
  if (pp_size_ > 1) {
    // Stages exchange [s, b, h] tensors whose shapes come from the config: compare it
    // across stages now (one small all-gather) rather than fail inside a p2p later.
    const at::Tensor mine = at::tensor({c.hidden_size(), c.seq_length(), c.num_layers(), c.vocab_size(),
                                        c.num_attention_heads(), c.query_groups(),
                                        static_cast<int64_t>(c.sequence_parallel()), v},
                                       at::kLong);
    const at::Tensor all = comm::Group(options.pp_group()).all_gather(mine.unsqueeze(0), 0);
    for (int64_t r = 0; r < pp_size_; ++r) {
      MEGATORCH_CHECK(at::equal(all[r], all[0]), "pipeline: stage ", r,
                      " was built with (hidden, seq, layers, vocab, heads, query groups, sequence_parallel, "
                      "virtual chunks) = ", all[r], " but stage 0 with ", all[0],
                      "; every stage must be built from the same model configuration");
    }
  }
  const auto split = split_layers(c.num_layers(), pp_size_, v, options.layer_split());
  chunks = register_module("chunks", torch::nn::ModuleList());
  // Every rank seeds its dropout streams the same way as a single-stage model would.
  auto rng = std::make_shared<tp::RngTracker>();
  rng->seed(c.seed(), tp::tp_info(options.tp_group()).rank, c.device());
  for (int64_t chunk = 0; chunk < v; ++chunk) {
    const int64_t s = chunk * pp_size_ + pp_rank_;
    const int64_t begin = std::accumulate(split.begin(), split.begin() + s, int64_t{0});
    chunks->push_back(models::GPTModel(models::GPTModelOptions(c)
                                           .group(options.tp_group())
                                           .layer_begin(begin)
                                           .layer_end(begin + split[s])
                                           .pre_process(s == 0)
                                           .post_process(s == pp_size_ * v - 1)
                                           .rng(rng)));
  }
}

std::vector<int64_t> PipelineStageImpl::activation_shape(int64_t micro_batch_size) const {
  const auto& c = options.config();
  const int64_t tp = tp::tp_info(options.tp_group()).size;
  return {c.sequence_parallel() ? c.seq_length() / tp : c.seq_length(), micro_batch_size, c.hidden_size()};
}

void PipelineStageImpl::allreduce_tied_embedding_grads() {
  const auto& c = options.config();
  if (!c.tie_embeddings() || (pp_size_ == 1 && num_chunks() == 1)) return;
  if (pp_size_ == 1) {  // first and last virtual stage on this rank: sum in place
    at::Tensor a = chunk(0)->embedding->weight, b = chunk(num_chunks() - 1)->output_layer;
    if (!a.grad().defined()) a.mutable_grad() = at::zeros_like(a);
    if (!b.grad().defined()) b.mutable_grad() = at::zeros_like(b);
    const at::Tensor sum = a.grad() + b.grad();
    a.mutable_grad().copy_(sum);
    b.mutable_grad().copy_(sum);
    return;
  }
  comm::Group pp(options.pp_group());
  if (pp_rank_ == 0) {
    at::Tensor w = chunk(0)->embedding->weight;
    if (!w.grad().defined()) w.mutable_grad() = at::zeros_like(w);
    at::Tensor other = at::empty_like(w.grad());
    pp.recv(other, pp_size_ - 1);
    w.mutable_grad().add_(other);
    pp.send(w.grad(), pp_size_ - 1);
  } else if (pp_rank_ == pp_size_ - 1) {
    at::Tensor w = chunk(num_chunks() - 1)->output_layer;
    if (!w.grad().defined()) w.mutable_grad() = at::zeros_like(w);
    pp.send(w.grad(), 0);
    pp.recv(w.mutable_grad(), 0);
  }
}

void PipelineStageImpl::allreduce_sequence_parallel_grads() {
  for (int64_t i = 0; i < num_chunks(); ++i) chunk(i)->allreduce_sequence_parallel_grads();
}

}  // namespace megatorch::pipeline
