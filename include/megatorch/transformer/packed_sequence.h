#pragma once
// Documents packed into one training sequence, as Megatron-LM's --reset-position-ids and
// --reset-attention-mask make them (megatron-core's _get_ltor_masks_and_position_ids): a
// document ends with its end-of-document token, positions restart after it, and attention
// stays inside each document. The attention runs document by document (each block
// causal through SDPA), so its cost is the sum of the squared document lengths and no
// s x s mask is made.
#include <ATen/ATen.h>

#include <memory>
#include <utility>
#include <vector>

namespace megatorch::transformer {

// One micro-batch's packing; undefined tensors: one document per row, positions 0..s-1.
struct PackedSequence {
  at::Tensor position_ids;  // [b, s] int64: each token's position in its document
  at::Tensor document_ids;  // [b, s] int64: each token's document in its row, 0, 1, ... (non-decreasing)
  bool empty() const { return !position_ids.defined() && !document_ids.defined(); }
};

// From token ids [b, s] and the end-of-document id: positions restart after each EOD when
// reset_position_ids, documents split after each EOD when reset_attention_mask.
PackedSequence pack_documents(const at::Tensor& tokens, int64_t eod, bool reset_position_ids,
                              bool reset_attention_mask);

// Per row, its documents as (start, length), read on the host from document_ids [b, s].
using DocumentRuns = std::vector<std::vector<std::pair<int64_t, int64_t>>>;
DocumentRuns document_runs(const at::Tensor& document_ids);
// What the layers take: a micro-batch's document ids over the whole sequence (under context
// parallelism every rank holds all of them) and their runs, read once per forward.
struct PackedDocuments {
  at::Tensor ids;  // [b, S] int64, on the model's device
  DocumentRuns runs;
};
using Documents = std::shared_ptr<const PackedDocuments>;  // null: no documents
Documents documents_of(const PackedSequence& packed);
// RoPE angles at packed positions: `table` [n, 1, 1, r] (positions 0..n-1), position_ids
// [b, s] -> [s, b, 1, r].
at::Tensor rope_at_positions(const at::Tensor& table, const at::Tensor& position_ids);

// Causal attention inside each document: q [b, heads, s, d], k and v [b, groups, s, d]
// (groups dividing heads) -> [b, heads, s, d]. With window > 0 a query sees at most the
// last `window` keys of its document. Dropout p as SDPA draws it.
at::Tensor document_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const DocumentRuns& runs, double dropout, double scale, int64_t window);

}  // namespace megatorch::transformer
