#pragma once
// TiedParameters: parameters that several virtual stages hold a copy of and that must
// stay equal (GPT's embedding and output layer; a user's shared table). Every copy gets
// the sum of all copies' gradients. Ties are named: each rank declares the copies it
// holds, one all-gather over the pipeline group at construction tells every rank who
// holds what, and the sums follow one global order, so no pair of ranks can wait on
// each other.
#include <ATen/Tensor.h>

#include "megatorch/pipeline/schedule.h"

#include <map>
#include <string>
#include <vector>

namespace megatorch::pipeline {

// One local copy: tie `name`, held by chunk `chunk` of this rank.
struct TiedCopy {
  std::string name;
  int64_t chunk = 0;
  at::Tensor tensor;
};

class TiedParameters {
 public:
  TiedParameters() = default;
  // `copies`: this rank's; `pp_group` "" for one pipeline rank. A collective over the
  // pipeline group when it has more than one rank.
  TiedParameters(std::vector<TiedCopy> copies, const std::string& pp_group, int64_t num_chunks,
                 ChunkLayout layout = ChunkLayout::kLooped);

  bool empty() const { return copies_.empty() && ties_.empty(); }
  const std::vector<TiedCopy>& local_copies() const { return copies_; }
  // The pipeline ranks holding a copy of `name`, ascending.
  const std::vector<int64_t>& holders(const std::string& name) const;
  // Whether this copy is the tie's first (lowest virtual stage): the one a checkpoint writes
  // and the gradient norm counts.
  bool is_primary(const TiedCopy& copy) const;
  // Whether every tie of the pipeline (not only this rank's: the answer is the same on
  // every rank) is two copies on two pipeline ranks, one each: then the optimizer can sum
  // them after its DP reduction (ParamInfo::grad_sum_ranks) instead of allreduce_grads().
  bool optimizer_can_sum() const;

  // Every copy's .grad set to the sum of all copies' gradients (missing ones count as zero).
  void allreduce_grads();

 private:
  struct Tie {
    std::vector<int64_t> holders;  // pipeline ranks, ascending
    int64_t first_virtual_stage = -1;
    int64_t copies = 0;            // over all ranks
  };
  const Tie& tie(const std::string& name) const;
  std::vector<TiedCopy> copies_;
  // Every tie any rank declared, by its name's fingerprint: the map's order is the one
  // global order in which all ranks sum.
  std::map<int64_t, Tie> ties_;
  std::string pp_group_;
  int64_t pp_rank_ = 0, pp_size_ = 1;
  ChunkLayout layout_ = ChunkLayout::kLooped;
};

}  // namespace megatorch::pipeline
