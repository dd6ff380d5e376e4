#include "megatorch/tp/vocab_parallel_embedding.h"

#include <ATen/ATen.h>

#include "megatorch/check.h"
#include "megatorch/tp/init.h"

namespace megatorch::tp {

int64_t padded_vocab_size(int64_t vocab, int64_t tp_size, int64_t divisible_by) {
  MEGATORCH_CHECK(vocab >= 1 && tp_size >= 1 && divisible_by >= 1, "expected vocab, tp and divisible_by >= 1, got ",
                  vocab, ", ", tp_size, ", ", divisible_by);
  const int64_t multiple = tp_size * divisible_by;
  return (vocab + multiple - 1) / multiple * multiple;
}

at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& weight, const std::string& group,
                                    bool sequence_parallel) {
  const TPInfo tp = tp_info(group);
  const int64_t rows = weight.size(0);
  const int64_t start = tp.rank * rows;
  at::Tensor out;
  if (tp.size == 1) {
    out = at::embedding(weight, ids);
  } else {
    // Ids of other shards look up row 0 and are zeroed before the reduction.
    const at::Tensor outside = (ids < start).logical_or(ids >= start + rows);
    const at::Tensor local = (ids - start).masked_fill(outside, 0);
    out = at::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0);
  }
  return map_region(sequence_parallel ? comm::Mapping::kReduceScatterToSP : comm::Mapping::kReduceFromTP, out, group);
}

at::Tensor init_vocab_shard(int64_t vocab, int64_t hidden, int64_t padded_vocab, const TPInfo& tp,
                            const std::string& name, const ParamInitOptions& init) {
  const int64_t rows = padded_vocab / tp.size, start = tp.rank * rows;
  at::Tensor shard = at::zeros({rows, hidden}, at::kFloat);
  const int64_t real = std::max<int64_t>(0, std::min(rows, vocab - start));
  if (real == 0) return shard;
  if (init.shard_local()) {
    ShardSpec spec{{tp.size * rows, hidden}, 0, tp.rank, tp.size, 1};
    shard.narrow(0, 0, real).copy_(init_shard(spec, name, init.seed(), InitMethod::kNormal, init.std(), true)
                                       .narrow(0, 0, real));
    return shard;
  }
  ShardSpec full{{vocab, hidden}, -1, 0, 1, 1};
  shard.narrow(0, 0, real).copy_(
      init_shard(full, name, init.seed(), InitMethod::kNormal, init.std()).narrow(0, start, real));
  return shard;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options_)
    : options(std::move(options_)) {
  reset();
}

void VocabParallelEmbeddingImpl::reset() {
  tp = tp_info(options.group());
  padded_vocab_ = padded_vocab_size(options.num_embeddings(), tp.size, options.make_vocab_size_divisible_by());
  const auto t = at::TensorOptions().dtype(options.init().dtype()).device(options.init().device());
  weight = register_parameter("weight", at::empty({padded_vocab_ / tp.size, options.embedding_dim()}, t));
  reset_parameters();
}

void VocabParallelEmbeddingImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  weight.copy_(init_vocab_shard(options.num_embeddings(), options.embedding_dim(), padded_vocab_, tp,
                                options.init().name() + ".weight", options.init()));
}

std::map<std::string, ParameterLayout> VocabParallelEmbeddingImpl::parameter_layouts() const {
  ParameterLayout w;
  w.spec = ShardSpec{{padded_vocab_, options.embedding_dim()}, 0, tp.rank, tp.size, 1};
  w.valid_rows = options.num_embeddings();
  return {{"weight", w}};
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "megatorch::tp::VocabParallelEmbedding(num_embeddings=" << options.num_embeddings()
         << ", padded=" << padded_vocab_ << ", embedding_dim=" << options.embedding_dim() << ", tp=" << tp.size << ")";
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  return vocab_parallel_embedding(ids, weight, options.group(), options.sequence_parallel());
}

}  // namespace megatorch::tp
