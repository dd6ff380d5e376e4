#include "megatorch/pipeline/tied_parameters.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/util/fnv1a.h"

namespace megatorch::pipeline {
namespace {

int64_t fingerprint(const std::string& name) {
  util::Fnv1a h;
  h.mix_bytes(name);
  return static_cast<int64_t>(h.value() >> 1);  // non-negative: -1 pads the exchange below
}

at::Tensor& grad_of(const at::Tensor& t) {
  at::Tensor& g = const_cast<at::Tensor&>(t).mutable_grad();
  if (!g.defined()) g = at::zeros_like(t);
  return g;
}

}  // namespace

TiedParameters::TiedParameters(std::vector<TiedCopy> copies, const std::string& pp_group, int64_t num_chunks,
                               ChunkLayout layout)
    : copies_(std::move(copies)), pp_group_(pp_group), layout_(layout) {
  if (!pp_group_.empty()) {
    comm::Group pp(pp_group_);
    pp_rank_ = pp.rank();
    pp_size_ = pp.size();
  }
  for (const auto& c : copies_) {
    MEGATORCH_CHECK(c.tensor.defined() && c.chunk >= 0 && c.chunk < num_chunks, "tied parameters: copy of '", c.name,
                    "' in chunk ", c.chunk, " expected a defined tensor in a chunk of [0, ", num_chunks, ")");
    for (const auto& o : copies_) {
      MEGATORCH_CHECK(&o == &c || !(o.name == c.name && o.chunk == c.chunk), "tied parameters: tie '", c.name,
                      "' declared twice in chunk ", c.chunk, "; a chunk holds at most one copy of a tie");
      MEGATORCH_CHECK(o.name != c.name || o.tensor.sizes() == c.tensor.sizes(), "tied parameters: copies of '", c.name,
                      "' have shapes ", o.tensor.sizes(), " and ", c.tensor.sizes(), "; tied copies must be alike");
    }
  }
  // (fingerprint, virtual stage) per local copy; one all-gather tells every rank the rest.
  std::vector<int64_t> mine;
  for (const auto& c : copies_) {
    mine.push_back(fingerprint(c.name));
    mine.push_back(virtual_stage(c.chunk, pp_rank_, pp_size_, layout_));
  }
  at::Tensor all = at::tensor(mine, at::kLong).view({-1, 2});
  if (pp_size_ > 1) {
    comm::Group pp(pp_group_);
    at::Tensor count = at::tensor({static_cast<int64_t>(copies_.size())}, at::kLong);
    pp.all_reduce(count, comm::ReduceOp::kMax);
    const int64_t n = count.item<int64_t>();
    if (n == 0) return;
    at::Tensor padded = at::full({n, 2}, -1, at::kLong);
    if (!copies_.empty()) padded.narrow(0, 0, all.size(0)).copy_(all);
    all = pp.all_gather(padded.unsqueeze(0), 0).view({-1, 2});
  }
  for (int64_t i = 0; i < all.size(0); ++i) {
    const int64_t key = all[i][0].item<int64_t>(), stage = all[i][1].item<int64_t>();
    if (key < 0) continue;
    Tie& t = ties_[key];
    const int64_t rank = rank_of_virtual_stage(stage, pp_size_, layout_);
    if (std::find(t.holders.begin(), t.holders.end(), rank) == t.holders.end()) t.holders.push_back(rank);
    std::sort(t.holders.begin(), t.holders.end());
    t.first_virtual_stage = t.first_virtual_stage < 0 ? stage : std::min(t.first_virtual_stage, stage);
    t.copies += 1;
  }
  // Checked on every rank (all know every tie), so all fail together rather than some
  // waiting in a later exchange.
  for (const auto& [key, t] : ties_) {
    if (t.copies >= 2) continue;
    std::string name = "declared by pipeline rank " + std::to_string(t.holders.front());
    for (const auto& c : copies_) {
      if (fingerprint(c.name) == key) name = "'" + c.name + "'";
    }
    MEGATORCH_FAIL("tied parameters: the tie ", name, " has a single copy over the whole pipeline; name the same ",
                   "tie on every stage that holds a copy (or drop the tie)");
  }
}

const TiedParameters::Tie& TiedParameters::tie(const std::string& name) const {
  const auto it = ties_.find(fingerprint(name));
  MEGATORCH_CHECK(it != ties_.end(), "tied parameters: no stage declared a tie named '", name, "'");
  return it->second;
}

const std::vector<int64_t>& TiedParameters::holders(const std::string& name) const { return tie(name).holders; }

bool TiedParameters::is_primary(const TiedCopy& copy) const {
  return tie(copy.name).first_virtual_stage == virtual_stage(copy.chunk, pp_rank_, pp_size_, layout_);
}

bool TiedParameters::optimizer_can_sum() const {
  for (const auto& [key, t] : ties_) {
    if (t.copies != 2 || t.holders.size() != 2) return false;
  }
  return true;
}

void TiedParameters::allreduce_grads() {
  for (const auto& [key, t] : ties_) {
    std::vector<const TiedCopy*> local;
    for (const auto& c : copies_) {
      if (fingerprint(c.name) == key) local.push_back(&c);
    }
    if (local.empty()) continue;
    // This rank's copies first (in chunk order: the same sum on every run).
    at::Tensor sum = grad_of(local[0]->tensor).clone();
    for (size_t i = 1; i < local.size(); ++i) sum.add_(grad_of(local[i]->tensor));
    if (t.holders.size() > 1) {
      // The lowest holder adds the others' sums in rank order and sends the total back,
      // so every copy ends bitwise equal.
      comm::Group pp(pp_group_);
      const int64_t root = t.holders.front();
      if (pp_rank_ == root) {
        at::Tensor other = at::empty_like(sum);
        for (size_t i = 1; i < t.holders.size(); ++i) {
          pp.recv(other, t.holders[i]);
          sum.add_(other);
        }
        for (size_t i = 1; i < t.holders.size(); ++i) pp.send(sum, t.holders[i]);
      } else {
        pp.send(sum, root);
        pp.recv(sum, root);
      }
    }
    for (const auto* c : local) grad_of(c->tensor).copy_(sum);
  }
}

}  // namespace megatorch::pipeline
