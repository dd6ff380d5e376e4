#pragma once
// What the DistributedOptimizer needs to know about a GPT model's parameters: their
// units (for ZeRO-3) and, per parameter, whether it counts in the global gradient norm
// and takes weight decay.
#include <vector>

#include "megatorch/models/gpt_model.h"
#include "megatorch/optim/distributed_optimizer.h"

namespace megatorch::optim {

struct ModelParameters {
  std::vector<std::vector<at::Tensor>> units;
  std::vector<ParamInfo> info;  // flattened in unit order
};

// `chunks`: the model chunks of this rank's pipeline stage (one, or v when interleaved).
// Parameters replicated across TP (norms, row-parallel biases, position embeddings)
// count in the norm on TP rank 0 only, and a tied output-layer copy on the last stage not
// at all (the first stage counts the embedding). As Megatron does, 1-D parameters
// (biases, norm weights) take no weight decay.
ModelParameters gpt_model_parameters(const std::vector<models::GPTModel>& chunks);

// ZeRO-3: makes every chunk gather its units through `optimizer` (unit numbers as in
// gpt_model_parameters). A no-op for other stages.
void attach_unit_hooks(const std::vector<models::GPTModel>& chunks, DistributedOptimizer& optimizer);

}  // namespace megatorch::optim
