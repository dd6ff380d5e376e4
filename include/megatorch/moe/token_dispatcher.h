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

}  // namespace megatorch::moe
