#pragma once
// Private to the library: what model_config (arguments.cpp) asks of gpt_pretrain's RoPE flags.
#include "megatorch/train/arguments.h"
#include "megatorch/transformer/rope.h"

namespace megatorch::train::detail {

// The RoPE scaling the flags ask for; under --use-checkpoint-args the checkpoint's, which
// flags may only repeat (fails naming both otherwise).
transformer::RopeScaling rope_scaling_of(const TrainArguments& a);

}  // namespace megatorch::train::detail
