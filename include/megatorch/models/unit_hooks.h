#pragma once
// Callbacks a model runs around the forward of each of its units (a transformer layer,
// or the rest of the model: embedding, final norm and head). ZeRO-3 uses them to gather a
// unit's parameters just in time and free them after; after_forward may return the output
// wrapped in an autograd function that acts again before the unit's backward.
#include <ATen/Tensor.h>

#include <cstdint>

namespace megatorch::models {

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(int64_t unit) = 0;
  virtual at::Tensor after_forward(int64_t unit, const at::Tensor& output) = 0;
};

}  // namespace megatorch::models
