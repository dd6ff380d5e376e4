#include "megatorch/moe/token_dispatcher.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/comm/mappings.h"

namespace megatorch::moe {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class AllToAllRows : public torch::autograd::Function<AllToAllRows> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const std::string& group,
                            const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send_rows;
    ctx->saved_data["recv"] = recv_rows;
    return comm::Group(group).all_to_all_rows(input, send_rows, recv_rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const std::string group = ctx->saved_data["group"].toStringRef();
    const auto send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    return {comm::Group(group).all_to_all_rows(grads[0], recv, send), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The (expert, token) rows of a selection [G, T], grouped by expert (tokens ascending in
// each), with their weights from weights [T, E] (column = first_expert + g).
struct Rows {
  at::Tensor token;               // [N] int64
  at::Tensor weight;              // [N], differentiable
  std::vector<int64_t> counts;    // [G] rows per expert
};

Rows select_rows(const at::Tensor& selection, const at::Tensor& weights, int64_t first_expert) {
  Rows r;
  const at::Tensor rows = selection.nonzero();  // row-major: by expert, then token
  const at::Tensor expert = rows.select(1, 0) + first_expert;
  r.token = rows.select(1, 1).contiguous();
  r.weight = weights.reshape({-1}).index_select(0, r.token * weights.size(1) + expert);
  r.counts = host_counts(selection.sum(1));
  return r;
}

// sum over rows of weight * output, scattered back to `tokens` token slots.
at::Tensor combine_rows(const at::Tensor& out, const Rows& rows, int64_t tokens) {
  const at::Tensor weighted = out * rows.weight.unsqueeze(1).to(out.scalar_type());
  return at::zeros({tokens, out.size(1)}, out.options()).index_add(0, rows.token, weighted);
}

// Every expert on this rank: permute, compute, combine.
at::Tensor on_this_rank(const at::Tensor& tokens, const Routing& routing, const ExpertFn& experts) {
  const Rows rows = select_rows(routing.selection, routing.weights, 0);
  return combine_rows(experts(tokens.index_select(0, rows.token), rows.counts), rows, tokens.size(0));
}

at::Tensor via_all_to_all(const at::Tensor& tokens, const Routing& routing, const ExpertFn& experts,
                          const DispatchOptions& o, const comm::Group& ep) {
  const int64_t e = o.num_experts(), p = ep.size(), local = e / p, me = ep.rank();
  const Rows rows = select_rows(routing.selection, routing.weights, 0);
  const at::Tensor permuted = tokens.index_select(0, rows.token);
  // Every rank's rows per expert: c(src, expert) = all[src * E + expert].
  const std::vector<int64_t> all =
      host_counts(comm::Group(ep).all_gather(at::tensor(rows.counts, at::kLong).to(tokens.device()), 0));
  const auto c = [&](int64_t src, int64_t expert) { return all[src * e + expert]; };
  std::vector<int64_t> send(p, 0), recv(p, 0), mine(p * local);  // mine: each source's rows per local expert
  for (int64_t r = 0; r < p; ++r) {
    for (int64_t j = 0; j < local; ++j) {
      send[r] += c(me, r * local + j);
      recv[r] += mine[r * local + j] = c(r, me * local + j);
    }
  }
  const at::Tensor received = all_to_all_rows(permuted, ep.name(), send, recv);
  const ExpertRegroup g = regroup_by_expert(mine, p, local, tokens.device());
  const at::Tensor out = experts(received.index_select(0, g.order), g.counts);
  const at::Tensor by_source = out.index_select(0, g.inverse);
  return combine_rows(all_to_all_rows(by_source, ep.name(), recv, send), rows, tokens.size(0));
}

at::Tensor via_all_gather(const at::Tensor& tokens, const Routing& routing, const ExpertFn& experts,
                          const DispatchOptions& o, const comm::Group& ep) {
  const int64_t e = o.num_experts(), p = ep.size(), local = e / p, me = ep.rank();
  const at::Tensor all_tokens = comm::gather_from_sp_region(tokens, ep.name());           // [P T, h]
  const at::Tensor all_weights = comm::gather_from_sp_region(routing.weights, ep.name());  // [P T, E]
  // Which of every rank's tokens the local experts take (bytes: Gloo has no bool).
  const at::Tensor all_selection =
      comm::Group(ep).all_gather(routing.selection.t().to(at::kByte).contiguous(), 0).to(at::kBool);  // [P T, E]
  const at::Tensor mine = all_selection.narrow(1, me * local, local).t();
  const Rows rows = select_rows(mine, all_weights, me * local);
  const at::Tensor out = experts(all_tokens.index_select(0, rows.token), rows.counts);
  return comm::reduce_scatter_to_sp_region(combine_rows(out, rows, all_tokens.size(0)), ep.name());
}

}  // namespace

at::Tensor all_to_all_rows(const at::Tensor& input, const std::string& group, const std::vector<int64_t>& send_rows,
                           const std::vector<int64_t>& recv_rows) {
  return AllToAllRows::apply(input, group, send_rows, recv_rows);
}

std::vector<int64_t> host_counts(const at::Tensor& counts) {
  const at::Tensor c = counts.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

at::Tensor all_gather_rows(const at::Tensor& rows, const std::string& group, const std::vector<int64_t>& rows_per_rank) {
  const comm::Group g(group);
  // The same rows to every rank; the copies' gradients add up in repeat's backward.
  std::vector<int64_t> times(rows.dim(), 1);
  times[0] = g.size();
  return all_to_all_rows(rows.repeat(times), group, std::vector<int64_t>(g.size(), rows.size(0)), rows_per_rank);
}

at::Tensor reduce_scatter_rows(const at::Tensor& rows, const std::string& group,
                               const std::vector<int64_t>& rows_per_rank) {
  const comm::Group g(group);
  const int64_t mine = rows_per_rank.at(g.rank());
  const at::Tensor received = all_to_all_rows(rows, group, rows_per_rank, std::vector<int64_t>(g.size(), mine));
  std::vector<int64_t> shape = received.sizes().vec();
  shape[0] = mine;
  shape.insert(shape.begin(), g.size());
  return received.view(shape).sum(0);
}

ExpertRegroup regroup_by_expert(const std::vector<int64_t>& count, int64_t sources, int64_t local,
                                const c10::Device& device) {
  MEGATORCH_CHECK(static_cast<int64_t>(count.size()) == sources * local, "regroup_by_expert: expected ",
                  sources, " x ", local, " counts, got ", count.size());
  ExpertRegroup out;
  out.counts.assign(local, 0);
  std::vector<int64_t> start(sources, 0);  // the first row of each source
  for (int64_t r = 0; r + 1 < sources; ++r) {
    start[r + 1] = start[r];
    for (int64_t j = 0; j < local; ++j) start[r + 1] += count[r * local + j];
  }
  std::vector<int64_t> order;
  for (int64_t j = 0; j < local; ++j) {
    for (int64_t r = 0; r < sources; ++r) {
      int64_t first = start[r];
      for (int64_t i = 0; i < j; ++i) first += count[r * local + i];
      for (int64_t i = 0; i < count[r * local + j]; ++i) order.push_back(first + i);
      out.counts[j] += count[r * local + j];
    }
  }
  std::vector<int64_t> inverse(order.size());
  for (size_t i = 0; i < order.size(); ++i) inverse[order[i]] = static_cast<int64_t>(i);
  const auto t = at::TensorOptions().dtype(at::kLong);
  out.order = at::tensor(order, t).to(device);
  out.inverse = at::tensor(inverse, t).to(device);
  return out;
}

at::Tensor dispatch_and_combine(const at::Tensor& tokens, const Routing& routing, const ExpertFn& experts,
                                const DispatchOptions& o) {
  MEGATORCH_CHECK(tokens.dim() == 2 && routing.selection.dim() == 2 && routing.selection.size(0) == o.num_experts() &&
                      routing.selection.size(1) == tokens.size(0),
                  "dispatch_and_combine: expected tokens [T, h] and a selection [", o.num_experts(), ", T], got ",
                  tokens.sizes(), " and ", routing.selection.sizes());
  if (o.ep_group().empty()) return on_this_rank(tokens, routing, experts);
  const comm::Group ep(o.ep_group());
  if (ep.size() == 1) return on_this_rank(tokens, routing, experts);
  MEGATORCH_CHECK(o.num_experts() % ep.size() == 0, "dispatch_and_combine: expected the ", o.num_experts(),
                  " experts to be divisible by the expert-parallel size ", ep.size());
  return o.type() == transformer::TokenDispatcher::kAllGather ? via_all_gather(tokens, routing, experts, o, ep)
                                                              : via_all_to_all(tokens, routing, experts, o, ep);
}

}  // namespace megatorch::moe
