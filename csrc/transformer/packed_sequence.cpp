#include "megatorch/transformer/packed_sequence.h"

#include "megatorch/check.h"
#include "megatorch/transformer/attention_mask.h"

namespace megatorch::transformer {

PackedSequence pack_documents(const at::Tensor& tokens, int64_t eod, bool reset_position_ids,
                              bool reset_attention_mask) {
  MEGATORCH_CHECK(tokens.dim() == 2 && !at::isFloatingType(tokens.scalar_type()),
                  "pack_documents: expected integer token ids [b, s], got ", tokens.sizes(), " of ",
                  tokens.scalar_type());
  PackedSequence out;
  if (!reset_position_ids && !reset_attention_mask) return out;
  const at::Tensor is_eod = (tokens == eod).to(at::kLong);
  if (reset_attention_mask) {
    // Document p: the EODs strictly before it (the EOD belongs to the document it ends).
    out.document_ids = is_eod.cumsum(1) - is_eod;
  }
  if (reset_position_ids) {
    // A document starts one past the last EOD before it: position = index - that start.
    const int64_t s = tokens.size(1);
    const at::Tensor index = at::arange(s, tokens.options().dtype(at::kLong)).unsqueeze(0);
    const at::Tensor after_eod = is_eod * (index + 1);  // where the next document starts
    const at::Tensor shifted = at::cat({at::zeros_like(after_eod.narrow(1, 0, 1)), after_eod.narrow(1, 0, s - 1)}, 1);
    out.position_ids = index - std::get<0>(shifted.cummax(1));
  }
  return out;
}

DocumentRuns document_runs(const at::Tensor& document_ids) {
  MEGATORCH_CHECK(document_ids.dim() == 2, "document_runs: expected document ids [b, s], got ",
                  document_ids.sizes());
  const at::Tensor ids = document_ids.to(at::kCPU, at::kLong).contiguous();
  const int64_t b = ids.size(0), s = ids.size(1);
  const int64_t* p = ids.data_ptr<int64_t>();
  DocumentRuns runs(b);
  for (int64_t r = 0; r < b; ++r) {
    int64_t start = 0;
    for (int64_t i = 1; i <= s; ++i) {
      if (i < s && p[r * s + i] == p[r * s + i - 1]) continue;
      MEGATORCH_CHECK(i == s || p[r * s + i] > p[r * s + i - 1], "document_runs: expected non-decreasing document "
                      "ids in each row, got ", p[r * s + i - 1], " then ", p[r * s + i], " at row ", r, ", token ", i);
      runs[r].emplace_back(start, i - start);
      start = i;
    }
  }
  return runs;
}

Documents documents_of(const PackedSequence& packed) {
  if (!packed.document_ids.defined()) return nullptr;
  return std::make_shared<const PackedDocuments>(PackedDocuments{packed.document_ids, document_runs(packed.document_ids)});
}

at::Tensor rope_at_positions(const at::Tensor& table, const at::Tensor& position_ids) {
  MEGATORCH_CHECK(table.dim() == 4 && position_ids.dim() == 2, "rope_at_positions: expected a table [n, 1, 1, r] and "
                  "position ids [b, s], got ", table.sizes(), " and ", position_ids.sizes());
  const int64_t b = position_ids.size(0), s = position_ids.size(1), r = table.size(3);
  const at::Tensor flat = position_ids.t().reshape({-1}).to(table.device(), at::kLong);
  return table.reshape({table.size(0), r}).index_select(0, flat).view({s, b, 1, r});
}

at::Tensor document_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const DocumentRuns& runs, double dropout, double scale, int64_t window) {
  MEGATORCH_CHECK(q.dim() == 4 && k.dim() == 4 && static_cast<int64_t>(runs.size()) == q.size(0),
                  "document_causal_attention: expected q [b, heads, s, d] and one list of documents per row, got ",
                  q.sizes(), " and ", runs.size(), " rows");
  const bool gqa = k.size(1) != q.size(1);
  std::vector<at::Tensor> rows;
  rows.reserve(runs.size());
  for (size_t r = 0; r < runs.size(); ++r) {
    std::vector<at::Tensor> blocks;
    blocks.reserve(runs[r].size());
    const int64_t row = static_cast<int64_t>(r);
    for (const auto& [start, length] : runs[r]) {
      const auto block = [&](const at::Tensor& t) { return t.narrow(0, row, 1).narrow(2, start, length); };
      c10::optional<at::Tensor> mask;
      if (window > 0 && window < length) {
        const at::Tensor pos = at::arange(length, q.options().dtype(at::kLong));
        mask = causal_window_mask(pos, pos, window);
      }
      blocks.push_back(at::scaled_dot_product_attention(block(q), block(k), block(v), mask, dropout,
                                                        /*is_causal=*/!mask.has_value(), scale, gqa));
    }
    rows.push_back(blocks.size() == 1 ? blocks[0] : at::cat(blocks, 2));
  }
  return rows.size() == 1 ? rows[0] : at::cat(rows, 0);
}

}  // namespace megatorch::transformer
