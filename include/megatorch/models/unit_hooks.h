#pragma once
// Callbacks a model runs around the forward of each of its units (a transformer layer,
// or the rest of the model: embedding, final norm and head). ZeRO-3 uses them to gather a
// unit's parameters just in time and free them after; after_forward may return the output
// wrapped in an autograd function that acts again before the unit's backward.
#include <ATen/Tensor.h>

#include <cstdint>
#include <memory>

namespace megatorch::models {

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(int64_t unit) = 0;
  virtual at::Tensor after_forward(int64_t unit, const at::Tensor& output) = 0;
};

// A module that runs UnitHooks itself around each of its units, numbered from
// `first_unit` (its root) in the order train::module_parameters groups them: the root,
// then each element of its top-level ModuleLists. GPTModel is one; a user's chunk that
// is one has its layers gathered one at a time under ZeRO-3 (pipeline::ModuleStage).
class RunsUnitHooks {
 public:
  virtual ~RunsUnitHooks() = default;
  virtual void set_unit_hooks(std::shared_ptr<UnitHooks> hooks, int64_t first_unit) = 0;
};

}  // namespace megatorch::models
