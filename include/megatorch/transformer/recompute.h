#pragma once
// Activation recomputation (Megatron's activation checkpointing): run `fn` without keeping its
// activations; in backward, restore the RNG state it started from, run it again with
// autograd on, and backpropagate through that replay (parameter grads accumulate as
// usual). Only the inputs are kept.
#include <ATen/Tensor.h>
#include <torch/csrc/autograd/variable.h>

#include <functional>

#include "megatorch/tp/rng_tracker.h"

namespace megatorch::transformer {

using RecomputeFn = std::function<torch::autograd::variable_list(const torch::autograd::variable_list&)>;

// `tracker` (may be null) has its streams restored as well as the default generator,
// so dropout inside TP regions replays the same masks.
torch::autograd::variable_list recompute(const RecomputeFn& fn, const torch::autograd::variable_list& inputs,
                                         tp::RngTracker* tracker = nullptr);

// Whether this thread is inside a backward replay of recompute(): a layer that counts
// what its forward saw (MoE's routing statistics) counts the first run only.
bool recompute_replaying();

}  // namespace megatorch::transformer
