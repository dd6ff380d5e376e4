#include "megatorch/pipeline/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "megatorch/check.h"

namespace megatorch::pipeline {
namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

void run_engine(const edge_list& roots, const variable_list& grads, bool keep_graph, const edge_list& outputs) {
  torch::autograd::Engine::get_default_engine().execute(roots, grads, keep_graph, /*create_graph=*/false,
                                                        /*accumulate_grad=*/true, outputs);
}

bool is_leaf(const Node* n) { return dynamic_cast<const torch::autograd::AccumulateGrad*>(n) != nullptr; }

// Keeps the gradients a split node is given in B (it runs once there; the hook is gone after).
struct CaptureGrads : torch::autograd::FunctionPreHook {
  explicit CaptureGrads(std::shared_ptr<variable_list> into) : into(std::move(into)) {}
  variable_list operator()(const variable_list& grads) override {
    *into = grads;
    return grads;
  }
  std::shared_ptr<variable_list> into;
};

// The capture hooks, removed again however B ends (W must not see them, nor a later step).
class CaptureScope {
 public:
  std::shared_ptr<variable_list> add(Node* node) {
    auto into = std::make_shared<variable_list>();
    auto hook = std::make_unique<CaptureGrads>(into);
    hooks_.emplace_back(node, hook.get());
    node->add_pre_hook(std::move(hook));
    return into;
  }
  ~CaptureScope() {
    for (auto [node, hook] : hooks_) {
      auto& list = node->pre_hooks();
      list.erase(std::remove_if(list.begin(), list.end(), [h = hook](const auto& p) { return p.get() == h; }),
                 list.end());
    }
  }

 private:
  std::vector<std::pair<Node*, torch::autograd::FunctionPreHook*>> hooks_;
};

// The nodes reachable from `root`, children before parents (iteratively: a deep model's
// graph is thousands of nodes long).
std::vector<Node*> post_order(Node* root) {
  std::vector<Node*> order;
  std::unordered_set<Node*> seen{root};
  std::vector<std::pair<Node*, size_t>> stack{{root, 0}};
  while (!stack.empty()) {
    Node* n = stack.back().first;
    const size_t i = stack.back().second;
    if (i < n->next_edges().size()) {
      ++stack.back().second;
      Node* child = n->next_edges()[i].function.get();
      if (child && seen.insert(child).second) stack.emplace_back(child, 0);
    } else {
      order.push_back(n);
      stack.pop_back();
    }
  }
  return order;
}

// Whether W should take a node's parameter gradients: a matrix product's weight GEMM
// (torch's MmBackward, AddmmBackward, BmmBackward, GroupedMmBackward..., a linear layer's or
// a GEMM's own autograd function) is the work worth moving into a bubble. A norm's or a
// bias's gradient is a cheap reduction whose node W would have to run a second time (its
// input gradient again, for a fused kernel): those stay in B.
bool defers_weight_grad(const Node& n) {
  std::string name = n.name();
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const char* gemm : {"mmbackward", "matmul", "linear", "gemm"}) {
    if (name.find(gemm) != std::string::npos) return true;
  }
  return false;
}

// Where B and W part. `path`: the nodes B runs (those from which the input's gradient is
// reachable); `split`: the nodes of the path whose edges leaving it lead to parameters
// whose gradients W computes; `eager`: the parameters B computes (the others' and any
// that a deferred node shares with them, which must not be counted in both). Nothing off
// the path leads back onto it (it would then reach the input), so cutting the split
// nodes' edges into the path leaves W exactly the split nodes and the parameter-side
// graph below them.
struct Cut {
  std::unordered_set<Node*> on_path;  // the path and the input's AccumulateGrad
  std::vector<Node*> path;
  std::vector<Node*> split;
  edge_list eager;
};

Cut find_cut(Node* root, Node* input_leaf) {
  Cut cut;
  std::unordered_set<Node*>& on_path = cut.on_path;
  on_path.insert(input_leaf);
  for (Node* n : post_order(root)) {
    if (n == input_leaf) continue;
    for (const Edge& e : n->next_edges()) {
      if (e.function && on_path.count(e.function.get())) {
        on_path.insert(n);
        cut.path.push_back(n);
        break;
      }
    }
  }
  // Each path node's parameters off the path (their AccumulateGrad edges).
  struct Candidate {
    Node* node;
    edge_list weights;
    bool eager;
  };
  std::vector<Candidate> candidates;
  for (Node* n : cut.path) {
    Candidate c{n, {}, !defers_weight_grad(*n)};
    std::unordered_set<Node*> seen;
    std::vector<Edge> stack;
    for (const Edge& e : n->next_edges()) {
      if (e.function && !on_path.count(e.function.get())) stack.push_back(e);
    }
    while (!stack.empty()) {
      const Edge e = stack.back();
      stack.pop_back();
      if (!seen.insert(e.function.get()).second) continue;
      if (is_leaf(e.function.get())) c.weights.emplace_back(e.function, 0);
      for (const Edge& next : e.function->next_edges()) {
        if (next.function) stack.push_back(next);
      }
    }
    if (!c.weights.empty()) candidates.push_back(std::move(c));
  }
  // A parameter B computes is computed whole in B: every node reaching it runs there.
  std::unordered_set<Node*> eager;
  for (bool changed = true; changed;) {
    changed = false;
    for (Candidate& c : candidates) {
      const bool shares = std::any_of(c.weights.begin(), c.weights.end(),
                                      [&](const Edge& w) { return eager.count(w.function.get()) > 0; });
      if (!c.eager && shares) c.eager = changed = true;
      if (!c.eager) continue;
      for (const Edge& w : c.weights) changed |= eager.insert(w.function.get()).second;
    }
  }
  for (const Candidate& c : candidates) {
    if (!c.eager) cut.split.push_back(c.node);
  }
  for (Node* w : eager) cut.eager.emplace_back(w->getptr(), 0);
  return cut;
}

}  // namespace

void WeightGradPass::run() {
  if (roots_.empty()) return;
  const auto roots = std::move(roots_);
  const auto grads = std::move(grads_);
  roots_.clear();
  grads_.clear();
  run_engine(roots, grads, /*keep_graph=*/false, {});
}

WeightGradPass backward_input(const at::Tensor& output, const at::Tensor& grad, const at::Tensor& input) {
  const Edge root = torch::autograd::impl::gradient_edge(output);
  MEGATORCH_CHECK(root.function, "split backward: expected a stage output attached to the autograd graph, got one "
                  "that does not require grad; run the chunk's forward with grad mode on");
  WeightGradPass pass;
  if (!input.defined()) {  // the first stage: no input gradient, W is the whole backward
    pass.roots_ = {root};
    pass.grads_ = {grad};
    pass.split_nodes_ = 1;
    return pass;
  }
  MEGATORCH_CHECK(input.is_leaf() && input.requires_grad(), "split backward: expected the stage input as a leaf "
                  "that requires grad (the executor's received activation), got one that ",
                  input.is_leaf() ? "does not require grad" : "is not a leaf");
  const Edge input_edge = torch::autograd::impl::gradient_edge(input);
  const Cut cut = find_cut(root.function.get(), input_edge.function.get());
  if (cut.path.empty()) {  // the output does not depend on the input: the caller reports it
    run_engine({root}, {grad}, /*keep_graph=*/false, {});
    return pass;
  }
  std::vector<std::shared_ptr<variable_list>> captured;
  {
    CaptureScope scope;
    for (Node* n : cut.split) captured.push_back(scope.add(n));
    edge_list outputs{input_edge};
    outputs.insert(outputs.end(), cut.eager.begin(), cut.eager.end());
    run_engine({root}, {grad}, /*keep_graph=*/true, outputs);
  }
  // W is one engine run from the split nodes, which no longer lead into the path; the
  // path's other saved activations are free now.
  const std::unordered_set<Node*> split(cut.split.begin(), cut.split.end());
  for (Node* n : cut.path) {
    if (!split.count(n)) n->release_variables();
  }
  for (size_t i = 0; i < cut.split.size(); ++i) {
    Node* n = cut.split[i];
    for (Edge& e : n->next_edges()) {
      if (e.function && cut.on_path.count(e.function.get())) e = Edge();
    }
    const variable_list& grads = *captured[i];
    for (size_t j = 0; j < grads.size(); ++j) {
      if (!grads[j].defined()) continue;
      pass.roots_.emplace_back(n->getptr(), static_cast<uint32_t>(j));
      pass.grads_.push_back(grads[j]);
    }
  }
  pass.split_nodes_ = static_cast<int64_t>(cut.split.size());
  return pass;
}

}  // namespace megatorch::pipeline
