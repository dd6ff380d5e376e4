#pragma once
// Token dispatch: moving each token to the expert-parallel (EP) ranks that hold its
// experts and the expert outputs back (Megatron-core's token dispatchers).
//
//   alltoall   permute this rank's (token, expert) rows by expert, one all-to-all over EP
//              with per-rank split sizes from the counts (exchanged by one all-gather of
//              [E] counts), regroup the received rows by local expert; back the same way.
//              Moves only the routed rows: sum over remote experts of c_i * h elements.
//   allgather  all-gather every EP rank's tokens and routing, keep the rows of the local
//              experts, and reduce-scatter the weighted outputs back: (ep - 1) * T * h
//              elements each way whatever the routing, no count exchange.
// Both are differentiable (the backward of each collective is its transpose) and
// give the same numbers; the output is the weighted sum over each token's experts.
#include <ATen/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "megatorch/moe/router.h"
#include "megatorch/transformer/config.h"

namespace megatorch::moe {

// The expert computation: rows grouped by local expert (`counts` rows each) -> outputs.
using ExpertFn = std::function<at::Tensor(const at::Tensor& rows, const std::vector<int64_t>& counts)>;

struct DispatchOptions {
  TORCH_ARG(transformer::TokenDispatcher, type) = transformer::TokenDispatcher::kAllToAll;
  TORCH_ARG(std::string, ep_group) = "";  // "" : every expert on this rank
  TORCH_ARG(int64_t, num_experts) = 1;
};

// tokens: [T, h] this rank's tokens; routing from TopKRouter on them. Returns [T, h]:
// sum over the experts e that process token t of weights[t, e] * expert_e(token t).
at::Tensor dispatch_and_combine(const at::Tensor& tokens, const Routing& routing, const ExpertFn& experts,
                                const DispatchOptions& options);

// Differentiable uneven all-to-all along dim 0 (comm::Group::all_to_all_rows); its
// backward sends the gradients back along the same splits reversed.
at::Tensor all_to_all_rows(const at::Tensor& input, const std::string& group, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows);

// Uneven all-gather along dim 0 over `group`: every rank's rows ([rows_per_rank[r], ...]),
// by rank. Built on all_to_all_rows, so its backward returns each rank the sum of the
// gradients of its rows (a reduce-scatter).
at::Tensor all_gather_rows(const at::Tensor& rows, const std::string& group, const std::vector<int64_t>& rows_per_rank);
// The transpose: partial sums [sum of rows_per_rank, ...] by rank in, this rank's rows
// summed over the group out.
at::Tensor reduce_scatter_rows(const at::Tensor& rows, const std::string& group,
                               const std::vector<int64_t>& rows_per_rank);

// A small integer tensor's values (row counts) on the host, as int64.
std::vector<int64_t> host_counts(const at::Tensor& counts);

// Rows that arrive by source, each source's grouped by local expert, regrouped by local
// expert (sources ascending within each). count[src * local + j]: rows of source src for
// local expert j. rows.index_select(0, order) is by expert; index_select(0, inverse) of
// that is by source again.
struct ExpertRegroup {
  at::Tensor order, inverse;    // int64, on `device`
  std::vector<int64_t> counts;  // [local] rows per local expert
};
ExpertRegroup regroup_by_expert(const std::vector<int64_t>& count, int64_t sources, int64_t local,
                                const c10::Device& device);

}  // namespace megatorch::moe
