#include "megatorch/transformer/cuda_graph.h"

#include <torch/autograd.h>
#include <torch/custom_class.h>

#include <exception>
#include <map>
#include <sstream>
#include <tuple>

#include "megatorch/check.h"

#ifdef MEGATORCH_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace megatorch::transformer {

std::string cuda_graph_unsupported(const TransformerConfig& c, const at::Tensor& input, int64_t tp_size, int64_t cp_size,
                                   bool has_layer_hooks) {
  std::ostringstream why;
  if (tp_size > 1 || c.sequence_parallel()) {
    why << "tensor parallelism (TP " << tp_size << (c.sequence_parallel() ? ", sequence parallel" : "")
        << ") puts collectives between the layers' kernels";
  } else if (cp_size > 1) {
    why << "context parallelism (CP " << cp_size << ") puts collectives between the layers' kernels";
  } else if (c.num_experts() > 0) {
    why << "mixture-of-experts layers route a data-dependent number of tokens to each expert";
  } else if (c.hidden_dropout() > 0 || c.attention_dropout() > 0) {
    why << "dropout (hidden " << c.hidden_dropout() << ", attention " << c.attention_dropout()
        << ") draws masks from generators a replay does not advance";
  } else if (c.recompute() != Recompute::kNone) {
    why << "activation recomputation replays the forward from saved generator states inside the backward";
  } else if (has_layer_hooks) {
    why << "per-layer hooks (ZeRO-3's parameter gathers) run host work between the layers";
  } else if (!input.is_cuda()) {
    why << "the layers run on " << input.device() << ", and CUDA graphs capture CUDA work only";
  }
#ifndef MEGATORCH_WITH_CUDA
  if (why.tellp() == 0) why << "this build of megatorch has no CUDA (torch without CUDA)";
#endif
  return why.str();
}

#ifdef MEGATORCH_WITH_CUDA
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One capture: the graphs and every tensor they read or write.
struct Capture {
  at::Tensor input, output, grad_output;  // the static input, output and output gradient
  std::vector<at::Tensor> constants;
  std::vector<at::Tensor> grads;  // of the input (when it wants one), then of each parameter
  at::cuda::CUDAGraph forward, backward;
  uint64_t generation = 0;  // forward replays so far; a lease names the one it holds
  bool busy = false;        // replayed forward, backward not yet run (or its graph not yet dropped)
};

// Held by the autograd node of one forward replay: frees the capture for the next
// forward when the backward has run or the node is dropped without one.
struct Lease : torch::CustomClassHolder {
  std::shared_ptr<Capture> capture;
  uint64_t generation = 0;
  ~Lease() override {
    if (capture->generation == generation) capture->busy = false;
  }
};

class ReplayStack : public torch::autograd::Function<ReplayStack> {
 public:
  // inputs: the stack's input, then its parameters (so that autograd routes their grads).
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::IValue lease_capsule) {
    auto lease = c10::static_intrusive_pointer_cast<Lease>(lease_capsule.toCapsule());
    Capture& g = *lease->capture;
    g.input.detach().copy_(inputs[0]);
    g.forward.replay();
    ctx->saved_data["lease"] = lease_capsule;
    ctx->saved_data["input_grad"] = inputs[0].requires_grad();
    return {g.output.detach().clone()};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto lease = c10::static_intrusive_pointer_cast<Lease>(ctx->saved_data["lease"].toCapsule());
    Capture& g = *lease->capture;
    MEGATORCH_CHECK(g.generation == lease->generation && g.busy, "cuda graph: expected this backward to follow its ",
                    "own forward replay, got a capture replayed again since (a second backward through the same "
                    "forward, retain_graph=True?); a CUDA-graphed layer stack runs each backward once; train without "
                    "--cuda-graph to backpropagate twice");
    if (grads[0].defined()) {
      g.grad_output.copy_(grads[0]);
    } else {
      g.grad_output.zero_();
    }
    g.backward.replay();
    g.busy = false;  // the graph's outputs are copied below: the next forward may replay it
    variable_list result;
    size_t next = 0;
    if (ctx->saved_data["input_grad"].toBool()) {
      const at::Tensor& d = g.grads[next++];
      result.push_back(d.defined() ? d.clone() : d);
    } else {
      result.emplace_back();
    }
    for (; next < g.grads.size(); ++next) result.push_back(g.grads[next].defined() ? g.grads[next].clone() : at::Tensor());
    result.emplace_back();  // the capsule
    return result;
  }
};

// Captures `body` into `graph` (in `pool`); a body that throws has its capture ended before
// the error goes on, as torch.cuda.graph's __exit__ does, so the stream leaves capture mode
// and the allocator stops routing allocations to the graph's pool.
template <typename Body>
void capture_into(at::cuda::CUDAGraph& graph, c10::MempoolId_t pool, const char* what, const Body& body) {
  graph.capture_begin(pool);
  try {
    body();
  } catch (const std::exception& e) {
    try {
      graph.capture_end();
    } catch (const std::exception&) {  // the capture was invalidated: ending it reports that again
    }
    MEGATORCH_FAIL("cuda graph: capturing the layer stack's ", what, " failed: ", e.what(),
                   "; run without --cuda-graph (TransformerConfig::cuda_graph) to train these layers eagerly");
  }
  graph.capture_end();
}

}  // namespace

struct LayerStackGraphs::Impl {
  std::vector<at::Tensor> params;
  int64_t warmup = 2;
  // (shape, dtype, whether the input wants a gradient, the constants' addresses) -> captures
  using Key = std::tuple<std::vector<int64_t>, c10::ScalarType, bool, std::vector<const void*>>;
  std::map<Key, std::vector<std::shared_ptr<Capture>>> captures;
  std::vector<const void*> param_addresses;  // where the captures read the parameters
  int64_t num_captures = 0, num_replays = 0;
  // The stream captures run on: one of its own (the pool's streams are shared, e.g. with
  // NCCL's), made on first use.
  cudaStream_t stream = nullptr;
  c10::DeviceIndex stream_device = -1;

  ~Impl() {
    if (stream) cudaStreamDestroy(stream);
  }

  c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device) {
    if (!stream) {
      c10::cuda::CUDAGuard on(device);
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      stream_device = device;
    }
    MEGATORCH_CHECK(stream_device == device, "cuda graph: expected the layers on cuda:", stream_device,
                    " where they were first captured, got cuda:", device, "; keep a model on one GPU");
    return c10::cuda::getStreamFromExternal(stream, device);
  }

  std::vector<const void*> current_param_addresses() const {
    std::vector<const void*> out;
    out.reserve(params.size());
    for (const auto& p : params) out.push_back(p.data_ptr());
    return out;
  }

  std::shared_ptr<Capture> capture(const at::Tensor& input, const std::vector<at::Tensor>& constants,
                                   const Stack& stack) {
    auto g = std::make_shared<Capture>();
    g->constants = constants;
    g->input = input.detach().clone().requires_grad_(input.requires_grad());
    std::vector<at::Tensor> wrt;
    if (input.requires_grad()) wrt.push_back(g->input);
    wrt.insert(wrt.end(), params.begin(), params.end());
    const auto current = c10::cuda::getCurrentCUDAStream(input.device().index());
    auto side = capture_stream(input.device().index());
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(side);
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      // Eager runs first: what happens once (cuBLAS handles and workspaces, autotuning,
      // lazily built tables) must not happen inside the capture.
      for (int64_t i = 0; i < warmup; ++i) {
        const at::Tensor out = stack(g->input);
        torch::autograd::grad({out}, wrt, {at::ones_like(out)}, /*retain_graph=*/false, /*create_graph=*/false,
                              /*allow_unused=*/true);
      }
      side.synchronize();  // as torch.cuda.graph: nothing of the warm-up still queued
      capture_into(g->forward, {0, 0}, "forward", [&] { g->output = stack(g->input); });
      {
        // Written by every replay on the caller's stream: allocated there.
        c10::cuda::CUDAStreamGuard on_current(current);
        g->grad_output = at::empty_like(g->output);
      }
      // The backward shares the forward's memory pool: it reads the activations there.
      capture_into(g->backward, g->forward.pool(), "backward", [&] {
        g->grads = torch::autograd::grad({g->output}, wrt, {g->grad_output}, /*retain_graph=*/false,
                                         /*create_graph=*/false, /*allow_unused=*/true);
      });
    }
    at::cuda::CUDAEvent captured;
    captured.record(side);
    captured.block(current);
    ++num_captures;
    return g;
  }
};

LayerStackGraphs::LayerStackGraphs(std::vector<at::Tensor> params, int64_t warmup) : impl_(std::make_unique<Impl>()) {
  for (auto& p : params) {
    if (p.requires_grad()) impl_->params.push_back(std::move(p));
  }
  impl_->warmup = warmup;
}

at::Tensor LayerStackGraphs::run(const at::Tensor& input, const std::vector<at::Tensor>& constants,
                                 const Stack& stack) {
  MEGATORCH_CHECK(input.is_cuda() && torch::GradMode::is_enabled(), "cuda graph: expected a CUDA input with grad "
                  "mode on, got ", input.device(), " with grad mode ", torch::GradMode::is_enabled() ? "on" : "off",
                  "; run the layers eagerly there");
  // The graphs read the parameters where they were at capture: if they have moved since
  // (Module::to, a gradient buffer taking them over), every capture is stale.
  std::vector<const void*> param_addresses = impl_->current_param_addresses();
  if (param_addresses != impl_->param_addresses) {
    for (const auto& [key, list] : impl_->captures) {
      for (const auto& c : list) {
        MEGATORCH_CHECK(!c->busy, "cuda graph: expected the parameters where the captured layers read them while "
                        "a micro-batch is between its forward and backward, got parameters moved to new memory; "
                        "move or re-wrap a model's parameters only between steps");
      }
    }
    impl_->captures.clear();  // captured again on use, reading the parameters where they are now
    impl_->param_addresses = std::move(param_addresses);
  }
  std::vector<const void*> addresses;
  for (const auto& t : constants) addresses.push_back(t.defined() ? t.data_ptr() : nullptr);
  Impl::Key key{input.sizes().vec(), input.scalar_type(), input.requires_grad(), addresses};
  auto& list = impl_->captures[key];
  std::shared_ptr<Capture> g;
  for (auto& c : list) {
    if (!c->busy) {
      g = c;
      break;
    }
  }
  if (!g) {
    g = impl_->capture(input, constants, stack);
    list.push_back(g);
  }
  g->busy = true;
  auto lease = c10::make_intrusive<Lease>();
  lease->capture = g;
  lease->generation = ++g->generation;
  ++impl_->num_replays;
  std::vector<at::Tensor> inputs{input};
  inputs.insert(inputs.end(), impl_->params.begin(), impl_->params.end());
  return ReplayStack::apply(at::TensorList(inputs), c10::IValue::make_capsule(lease))[0];
}

#else  // no CUDA: nothing can be captured; run() is never reached (cuda_graph_unsupported says why)

struct LayerStackGraphs::Impl {
  int64_t num_captures = 0, num_replays = 0;
};

LayerStackGraphs::LayerStackGraphs(std::vector<at::Tensor>, int64_t) : impl_(std::make_unique<Impl>()) {}

at::Tensor LayerStackGraphs::run(const at::Tensor&, const std::vector<at::Tensor>&, const Stack&) {
  MEGATORCH_FAIL("cuda graph: this build of megatorch has no CUDA; run the layers eagerly");
}

#endif

LayerStackGraphs::~LayerStackGraphs() = default;
int64_t LayerStackGraphs::captures() const { return impl_->num_captures; }
int64_t LayerStackGraphs::replays() const { return impl_->num_replays; }

}  // namespace megatorch::transformer
