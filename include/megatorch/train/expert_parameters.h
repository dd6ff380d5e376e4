#pragma once
// Mixture-of-experts parameters apart from the dense ones: the experts of a rank are its
// own (expert parallelism), replicated only over the expert-data-parallel group, so they
// get an optimizer of their own over that group (Megatron's expert DDP buffers): their
// gradients summed over expert-DP and divided by DP x CP, counted in the gradient norm
// (reduced over EP and expert-TP; an expert-TP-replicated one on etp rank 0 only), none
// summed over TP.
#include <string>
#include <vector>

#include "megatorch/pipeline/stage.h"
#include "megatorch/train/model_parameters.h"

namespace megatorch::train {

struct SplitParameters {
  ModelParameters dense;    // as given, without the experts (same units, chunk_units)
  ModelParameters experts;  // one unit per unit that had experts, in order
};

// The stage's expert parameters (moe::GroupedExperts) taken out of `all`.
SplitParameters split_expert_parameters(const ModelParameters& all, pipeline::Stage& stage);

}  // namespace megatorch::train
