#include "megatorch/transformer/recompute.h"

#include <torch/autograd.h>
#include <torch/custom_class.h>

#include "megatorch/check.h"

namespace megatorch::transformer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the backward needs besides tensors, carried through saved_data as a capsule.
struct Replay : torch::CustomClassHolder {
  RecomputeFn fn;
  tp::RngTracker* tracker = nullptr;
  c10::Device device{c10::kCPU};
  at::Tensor default_state;              // when there is no tracker
  tp::RngTracker::Snapshot tracker_state;  // when there is one
};

thread_local int replay_depth = 0;

// Marks the replay for recompute_replaying() (exception-safe).
struct ReplayScope {
  ReplayScope() { ++replay_depth; }
  ~ReplayScope() { --replay_depth; }
};

class Recomputation : public torch::autograd::Function<Recomputation> {
 public:
  // Inputs as a TensorList: the form autograd::Function tracks as differentiable.
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::IValue replay_capsule) {
    auto replay = c10::static_intrusive_pointer_cast<Replay>(replay_capsule.toCapsule());
    if (replay->tracker) {
      replay->tracker_state = replay->tracker->snapshot();
    } else {
      replay->default_state = tp::default_generator_state(replay->device);
    }
    ctx->saved_data["replay"] = replay_capsule;
    ctx->save_for_backward(inputs.vec());
    return replay->fn(inputs.vec());  // grad mode is off here: nothing inside is recorded
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto replay = c10::static_intrusive_pointer_cast<Replay>(ctx->saved_data["replay"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    variable_list inputs;
    for (const auto& t : saved) {
      inputs.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
    }
    // Replay from the forward's RNG state, then put the current state back.
    variable_list outputs;
    if (replay->tracker) {
      const auto now = replay->tracker->snapshot();
      replay->tracker->restore(replay->tracker_state);
      torch::AutoGradMode on(true);
      ReplayScope replaying;
      outputs = replay->fn(inputs);
      replay->tracker->restore(now);
    } else {
      const at::Tensor now = tp::default_generator_state(replay->device);
      tp::set_default_generator_state(replay->device, replay->default_state);
      torch::AutoGradMode on(true);
      ReplayScope replaying;
      outputs = replay->fn(inputs);
      tp::set_default_generator_state(replay->device, now);
    }
    variable_list outs, out_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grads[i].defined()) {
        outs.push_back(outputs[i]);
        out_grads.push_back(grads[i]);
      }
    }
    if (!outs.empty()) torch::autograd::backward(outs, out_grads);
    variable_list result;
    for (const auto& t : inputs) result.push_back(t.defined() && t.requires_grad() ? t.grad() : at::Tensor());
    result.push_back(at::Tensor());  // the capsule
    return result;
  }
};

}  // namespace

variable_list recompute(const RecomputeFn& fn, const variable_list& inputs, tp::RngTracker* tracker) {
  MEGATORCH_CHECK(static_cast<bool>(fn), "recompute: expected a function to recompute, got an empty one");
  auto replay = c10::make_intrusive<Replay>();
  replay->fn = fn;
  replay->tracker = tracker;
  for (const auto& t : inputs) {
    if (t.defined()) {
      replay->device = t.device();
      break;
    }
  }
  if (tracker) replay->device = tracker->device();
  return Recomputation::apply(at::TensorList(inputs), c10::IValue::make_capsule(replay));
}

bool recompute_replaying() { return replay_depth > 0; }

}  // namespace megatorch::transformer
