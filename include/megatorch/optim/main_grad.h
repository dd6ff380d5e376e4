#pragma once
// Gradient-accumulation fusion (Megatron's --gradient-accumulation-fusion): a linear
// layer's weight-gradient GEMM adds its product straight into the parameter's gradient
// buffer (at::addmm_ with beta = 1) instead of returning a gradient that autograd's
// AccumulateGrad then adds in, a second pass over the weight's size per micro-batch.
//
// A ParamAndGradBuffer built with gradient_accumulation_fusion registers a MainGradSink for
// each of its parameters; tp::linear (csrc/tp/fused_linear.cpp) looks the weight up here.
// The GEMM's node then hands autograd a placeholder for the weight, which AccumulateGrad
// stores without adding (the parameter's .grad is cleared first) and the sink's
// post-accumulate hook discards, as Megatron does with its main_grad. Every use of a fused
// weight in one backward must go through tp::linear: a placeholder summed with another
// op's real gradient would discard that gradient.
#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>

namespace megatorch::optim {

class MainGradSink {
 public:
  virtual ~MainGradSink() = default;
  // The buffer slice, shaped like parameter `index`, its gradient accumulates into.
  virtual at::Tensor main_grad(int64_t index) = 0;
  // The GEMM has added this backward's product into main_grad(index): the parameter's
  // next accumulated gradient is a placeholder, not a value.
  virtual void mark_added(int64_t index) = 0;
};

struct MainGrad {
  MainGradSink* sink = nullptr;
  int64_t index = 0;
};

// Keyed by the parameter's TensorImpl (stable across set_data). The sink must outlive the
// registration: unregister before destroying it.
void register_main_grad(const at::Tensor& param, MainGradSink* sink, int64_t index);
void unregister_main_grad(const at::Tensor& param);
std::optional<MainGrad> find_main_grad(const at::Tensor& param);

// Whether the backward running now accumulates `param`'s gradient into param.grad (a
// plain backward(), or backward(inputs) naming it): not when autograd::grad captures it
// or the graph task does not reach it. Outside a backward: whether one would.
bool backward_accumulates_into(const at::Tensor& param);

}  // namespace megatorch::optim
