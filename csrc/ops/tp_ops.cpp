// Registers the tensor-parallel layers and the vocab-parallel loss as
// torch.ops.megatorch.*. Registration only: the functions live in csrc/tp/.
//
// The layers are compositions of the communication mappings (operators with autograd
// and fake kernels) and ATen ops, so they register as CompositeImplicitAutograd:
// autograd, fake tensors and torch.compile all follow the decomposition. The loss has
// its own backward, split into two internal operators so that its forward
// collectives and its communication-free backward both stay on the dispatcher.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "megatorch/tp/column_parallel_linear.h"
#include "megatorch/tp/cross_entropy.h"
#include "megatorch/tp/row_parallel_linear.h"
#include "megatorch/tp/vocab_parallel_embedding.h"

namespace megatorch::ops {
namespace {

at::Tensor column_parallel_linear_op(const at::Tensor& input, const at::Tensor& weight,
                                     const std::optional<at::Tensor>& bias, c10::string_view group, bool gather_output,
                                     bool sequence_parallel) {
  return tp::column_parallel_linear(input, weight, bias, std::string(group), gather_output, sequence_parallel);
}

at::Tensor row_parallel_linear_op(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, c10::string_view group, bool input_is_parallel,
                                  bool sequence_parallel) {
  return tp::row_parallel_linear(input, weight, bias, std::string(group), input_is_parallel, sequence_parallel);
}

at::Tensor vocab_parallel_embedding_op(const at::Tensor& ids, const at::Tensor& weight, c10::string_view group) {
  return tp::vocab_parallel_embedding(ids, weight, std::string(group));
}

at::Tensor cross_entropy_autograd(const at::Tensor& logits, const at::Tensor& target, c10::string_view group,
                                  double label_smoothing, int64_t ignore_index) {
  return tp::vocab_parallel_cross_entropy(logits, target, std::string(group), label_smoothing, ignore_index);
}

at::Tensor cross_entropy_forward_only(const at::Tensor& logits, const at::Tensor& target, c10::string_view group,
                                      double label_smoothing, int64_t ignore_index) {
  return std::get<0>(
      tp::vocab_parallel_cross_entropy_forward(logits, target, std::string(group), label_smoothing, ignore_index, 0,
                                               /*fused=*/true));
}

std::tuple<at::Tensor, at::Tensor> ce_fwd(const at::Tensor& logits, const at::Tensor& target, c10::string_view group,
                                          double label_smoothing, int64_t ignore_index, int64_t vocab_size,
                                          bool fused) {
  return tp::vocab_parallel_cross_entropy_forward(logits, target, std::string(group), label_smoothing, ignore_index,
                                                  vocab_size, fused);
}

std::tuple<at::Tensor, at::Tensor> ce_fwd_meta(const at::Tensor& logits, const at::Tensor& target, c10::string_view,
                                               double, int64_t, int64_t, bool) {
  const auto opts = logits.options().dtype(at::kFloat);
  return {at::empty_symint(target.sym_sizes(), opts), at::empty_symint(target.sym_sizes(), opts)};
}

at::Tensor ce_bwd(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& target, const at::Tensor& lse,
                  c10::string_view group, double label_smoothing, int64_t ignore_index, int64_t vocab_size) {
  return tp::vocab_parallel_cross_entropy_backward(grad, logits, target, lse, std::string(group), label_smoothing,
                                                   ignore_index, vocab_size);
}

at::Tensor ce_bwd_meta(const at::Tensor&, const at::Tensor& logits, const at::Tensor&, const at::Tensor&,
                       c10::string_view, double, int64_t, int64_t) {
  return at::empty_like(logits);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatorch, m) {
  m.def("column_parallel_linear(Tensor input, Tensor weight, Tensor? bias, str group, bool gather_output=False, "
        "bool sequence_parallel=False) -> Tensor");
  m.def("row_parallel_linear(Tensor input, Tensor weight, Tensor? bias, str group, bool input_is_parallel=True, "
        "bool sequence_parallel=False) -> Tensor");
  m.def("vocab_parallel_embedding(Tensor ids, Tensor weight, str group) -> Tensor");
  // A schema is parsed text, so its default is spelled out: -100 is tp::kIgnoreIndex.
  static_assert(tp::kIgnoreIndex == -100, "the schema's ignore_index default must be tp::kIgnoreIndex");
  m.def("vocab_parallel_cross_entropy(Tensor logits, Tensor target, str group, float label_smoothing=0.0, "
        "int ignore_index=-100) -> Tensor");
  // Internal halves of the loss (vocab_size <= 0: every column is real; fused: the local
  // part through the fused kernel, vocab_parallel_cross_entropy_local).
  m.def("_vocab_parallel_cross_entropy_fwd(Tensor logits, Tensor target, str group, float label_smoothing, "
        "int ignore_index, int vocab_size, bool fused=True) -> (Tensor, Tensor)");
  m.def("_vocab_parallel_cross_entropy_bwd(Tensor grad, Tensor logits, Tensor target, Tensor log_sum_exp, str group, "
        "float label_smoothing, int ignore_index, int vocab_size) -> Tensor");

  m.impl("column_parallel_linear", c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(column_parallel_linear_op));
  m.impl("row_parallel_linear", c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(row_parallel_linear_op));
  m.impl("vocab_parallel_embedding", c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(vocab_parallel_embedding_op));
  m.impl("vocab_parallel_cross_entropy", c10::DispatchKey::Autograd, TORCH_FN(cross_entropy_autograd));
  m.impl("vocab_parallel_cross_entropy", c10::DispatchKey::CompositeExplicitAutograd,
         TORCH_FN(cross_entropy_forward_only));
}

TORCH_LIBRARY_IMPL(megatorch, CPU, m) {
  m.impl("_vocab_parallel_cross_entropy_fwd", TORCH_FN(ce_fwd));
  m.impl("_vocab_parallel_cross_entropy_bwd", TORCH_FN(ce_bwd));
}
TORCH_LIBRARY_IMPL(megatorch, CUDA, m) {
  m.impl("_vocab_parallel_cross_entropy_fwd", TORCH_FN(ce_fwd));
  m.impl("_vocab_parallel_cross_entropy_bwd", TORCH_FN(ce_bwd));
}
TORCH_LIBRARY_IMPL(megatorch, Meta, m) {
  m.impl("_vocab_parallel_cross_entropy_fwd", TORCH_FN(ce_fwd_meta));
  m.impl("_vocab_parallel_cross_entropy_bwd", TORCH_FN(ce_bwd_meta));
}

}  // namespace megatorch::ops
