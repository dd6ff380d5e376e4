#include "megatorch/pipeline/pipeline_stage.h"

#include <ATen/ATen.h>

#include <numeric>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/tp/cross_entropy.h"
#include "megatorch/tp/tp_group.h"
#include "megatorch/transformer/context_parallel.h"

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
  const ChunkLayout layout = options.chunk_layout();
  MEGATORCH_CHECK(layout == ChunkLayout::kLooped || v == 2, "pipeline: the V chunk layout holds 2 chunks per rank, ",
                  "got virtual_chunks ", v, "; pass virtual_chunks(2)");
  if (pp_size_ > 1) {
    // Stages exchange [s, b, h] tensors whose shapes come from the config: compare it
    // across stages now (one small all-gather) rather than fail inside a p2p later.
    const at::Tensor mine = at::tensor({c.hidden_size(), c.seq_length(), c.num_layers(), c.vocab_size(),
                                        c.num_attention_heads(), c.query_groups(),
                                        static_cast<int64_t>(c.sequence_parallel()), v,
                                        static_cast<int64_t>(layout)},
                                       at::kLong);
    const at::Tensor all = comm::Group(options.pp_group()).all_gather(mine.unsqueeze(0), 0);
    for (int64_t r = 0; r < pp_size_; ++r) {
      MEGATORCH_CHECK(at::equal(all[r], all[0]), "pipeline: stage ", r,
                      " was built with (hidden, seq, layers, vocab, heads, query groups, sequence_parallel, "
                      "virtual chunks, chunk layout) = ", all[r], " but stage 0 with ", all[0],
                      "; every stage must be built from the same model configuration");
    }
  }
  const auto split = split_layers(c.num_layers(), pp_size_, v, options.layer_split());
  chunks = register_module("chunks", torch::nn::ModuleList());
  // Every rank seeds its dropout streams the same way as a single-stage model would.
  auto rng = std::make_shared<tp::RngTracker>();
  rng->seed(c.seed(), tp::tp_info(options.tp_group()).rank, c.device());
  for (int64_t chunk = 0; chunk < v; ++chunk) {
    const int64_t s = virtual_stage(chunk);
    const int64_t begin = std::accumulate(split.begin(), split.begin() + s, int64_t{0});
    chunks->push_back(models::GPTModel(models::GPTModelOptions(c)
                                           .group(options.tp_group())
                                           .layer_begin(begin)
                                           .layer_end(begin + split[s])
                                           .pre_process(s == 0)
                                           .post_process(s == pp_size_ * v - 1)
                                           .rng(rng)));
  }
  // Tied embeddings: the embedding (virtual stage 0) and the head's copy of it (the last
  // virtual stage) are one tie when they are two tensors.
  std::vector<TiedCopy> copies;
  if (c.tie_embeddings() && pp_size_ * v > 1) {
    for (int64_t i = 0; i < v; ++i) {
      if (is_first_virtual_stage(i)) copies.push_back({"embedding.weight", i, chunk(i)->embedding->weight});
      if (is_last_virtual_stage(i)) copies.push_back({"embedding.weight", i, chunk(i)->output_layer});
    }
  }
  ties_ = TiedParameters(std::move(copies), options.pp_group(), v, layout);
}

void PipelineStageImpl::prepare(const std::vector<MicroBatch>& mbs) {
  const auto& cfg = options.config();
  MEGATORCH_CHECK(!mbs.empty(), "pipeline: expected at least one micro-batch");
  for (size_t i = 0; i < mbs.size(); ++i) {
    // Shapes between stages come from the config: check the batch before any p2p.
    MEGATORCH_CHECK(mbs[i].ids.defined() && mbs[i].labels.defined() && mbs[i].ids.dim() == 2 &&
                        mbs[i].ids.size(1) == cfg.seq_length() && mbs[i].ids.sizes() == mbs[0].ids.sizes() &&
                        mbs[i].labels.sizes() == mbs[i].ids.sizes(),
                    "pipeline: expected every micro-batch's ids and labels to be [b, ", cfg.seq_length(),
                    "] with one b, got ids ", mbs[i].ids.defined() ? mbs[i].ids.sizes() : at::IntArrayRef{},
                    " and labels ", mbs[i].labels.defined() ? mbs[i].labels.sizes() : at::IntArrayRef{},
                    " for micro-batch ", i);
    for (const char* name : {"position_ids", "document_ids"}) {
      MEGATORCH_CHECK(!mbs[i].has(name) || mbs[i].get(name).sizes() == mbs[i].ids.sizes(), "pipeline: expected the ",
                      "micro-batch's ", name, " to be [b, s] like its ids ", mbs[i].ids.sizes(), ", got ",
                      mbs[i].get(name).sizes(), " for micro-batch ", i);
    }
  }
  micro_batch_size_ = mbs[0].ids.size(0);
}

ActivationSpec PipelineStageImpl::activation_spec(int64_t) const {
  return {activation_shape(micro_batch_size_), options.config().params_dtype()};
}

at::Tensor PipelineStageImpl::forward_chunk(int64_t c, const at::Tensor& input, const MicroBatch& mb) {
  // Packed documents: every chunk, first or not, attends within them (the loader's names).
  transformer::PackedSequence packed;
  if (mb.has("position_ids")) packed.position_ids = mb.get("position_ids");
  if (mb.has("document_ids")) packed.document_ids = mb.get("document_ids");
  if (input.defined()) return chunk(c)->forward(input, packed);
  const auto& cp = chunk(c)->cp;
  return chunk(c)->forward(transformer::context_parallel_slice(mb.ids, 1, cp.size, cp.rank), packed);
}

at::Tensor PipelineStageImpl::micro_batch_loss(const at::Tensor& output, const MicroBatch& mb) {
  const auto& last = chunk(num_chunks() - 1);
  const auto& cp = last->cp;
  if (cp.size == 1) return tp::masked_mean_loss(last->per_token_loss(output, mb.labels), mb.labels);
  // This rank's tokens' share of the sequence's mean: its loss sum over every CP rank's
  // token count (the micro-batch holds all labels). Times c: the optimizer averages
  // gradients over DP x CP, and the CP ranks' shares must add up, not average.
  const at::Tensor labels = transformer::context_parallel_slice(mb.labels, 1, cp.size, cp.rank);
  const at::Tensor valid = (mb.labels != tp::kIgnoreIndex).sum().clamp_min(1);
  const at::Tensor sum = last->per_token_loss(output, labels).sum();
  return sum * (static_cast<double>(cp.size) / valid.to(sum.scalar_type()));
}

void PipelineStageImpl::set_unit_hooks(int64_t c, std::shared_ptr<models::UnitHooks> hooks, int64_t first_unit,
                                       int64_t) {
  chunk(c)->set_unit_hooks(std::move(hooks), first_unit);
}

std::vector<int64_t> PipelineStageImpl::activation_shape(int64_t micro_batch_size) const {
  const auto& c = options.config();
  const int64_t tp = tp::tp_info(options.tp_group()).size;
  const int64_t s = c.seq_length() / chunk(0)->cp.size;  // this CP rank's tokens
  return {c.sequence_parallel() ? s / tp : s, micro_batch_size, c.hidden_size()};
}

void PipelineStageImpl::allreduce_sequence_parallel_grads() {
  for (int64_t i = 0; i < num_chunks(); ++i) chunk(i)->allreduce_sequence_parallel_grads();
}

}  // namespace megatorch::pipeline
