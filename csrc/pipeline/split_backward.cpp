#include "megatorch/pipeline/split_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
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

// Keeps the gradients a split node is given the first time it runs (in B).
struct CaptureGrads : torch::autograd::FunctionPreHook {
  explicit CaptureGrads(std::shared_ptr<variable_list> into) : into(std::move(into)) {}
  variable_list operator()(const variable_list& grads) override {
    if (into->empty()) *into = grads;
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

// Where B and W part. `path`: the nodes B runs (those from which the input's gradient
// is reachable), children first; `split[i]` reaches the parameters `weights[i]` through
// edges that leave the path. `clean` is false where a parameter is reached from two
// split nodes: one W per split node would then count it twice.
struct Cut {
  std::vector<Node*> path;
  std::vector<Node*> split;
  std::vector<edge_list> weights;
  bool clean = true;
};

Cut find_cut(Node* root, Node* input_leaf) {
  Cut cut;
  std::unordered_set<Node*> on_path{input_leaf};
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
  std::unordered_map<Node*, Node*> owner;  // a parameter's AccumulateGrad -> the split node reaching it
  for (Node* n : cut.path) {
    edge_list weights;
    std::unordered_set<Node*> seen;
    std::vector<Edge> stack;
    for (const Edge& e : n->next_edges()) {
      if (e.function && !on_path.count(e.function.get())) stack.push_back(e);
    }
    while (!stack.empty()) {
      const Edge e = stack.back();
      stack.pop_back();
      Node* node = e.function.get();
      if (!seen.insert(node).second) continue;
      if (is_leaf(node)) {
        const auto [it, fresh] = owner.emplace(node, n);
        if (fresh) weights.emplace_back(e.function, 0);
        else if (it->second != n) cut.clean = false;
        continue;
      }
      for (const Edge& next : node->next_edges()) {
        if (next.function) stack.push_back(next);
      }
    }
    if (!weights.empty()) {
      cut.split.push_back(n);
      cut.weights.push_back(std::move(weights));
    }
  }
  return cut;
}

}  // namespace

void WeightGradPass::run() {
  auto roots = std::move(roots_);
  roots_.clear();
  for (const Root& r : roots) run_engine(r.edges, r.grads, /*keep_graph=*/false, r.weights);
}

WeightGradPass backward_input(const at::Tensor& output, const at::Tensor& grad, const at::Tensor& input) {
  const Edge root = torch::autograd::impl::gradient_edge(output);
  MEGATORCH_CHECK(root.function, "split backward: expected a stage output attached to the autograd graph, got one "
                  "that does not require grad; run the chunk's forward with grad mode on");
  WeightGradPass pass;
  if (!input.defined()) {  // the first stage: no input gradient, W is the whole backward
    pass.roots_.push_back({{root}, {grad}, {}});
    return pass;
  }
  MEGATORCH_CHECK(input.is_leaf() && input.requires_grad(), "split backward: expected the stage input as a leaf "
                  "that requires grad (the executor's received activation), got one that ",
                  input.is_leaf() ? "does not require grad" : "is not a leaf");
  const Edge input_edge = torch::autograd::impl::gradient_edge(input);
  Cut cut = find_cut(root.function.get(), input_edge.function.get());
  // The output does not depend on the input (the caller reports the missing gradient),
  // or one W per split node would count a parameter twice: everything in B.
  if (cut.path.empty() || !cut.clean) {
    run_engine({root}, {grad}, /*keep_graph=*/false, {});
    return pass;
  }
  std::vector<std::shared_ptr<variable_list>> captured;
  {
    CaptureScope scope;
    for (Node* n : cut.split) captured.push_back(scope.add(n));
    run_engine({root}, {grad}, /*keep_graph=*/true, {input_edge});
  }
  // W runs only the split nodes and what lies off the path: the rest of the path's saved
  // activations are free now.
  const std::unordered_set<Node*> split(cut.split.begin(), cut.split.end());
  for (Node* n : cut.path) {
    if (!split.count(n)) n->release_variables();
  }
  for (size_t i = 0; i < cut.split.size(); ++i) {
    WeightGradPass::Root r;
    r.weights = std::move(cut.weights[i]);
    const variable_list& grads = *captured[i];
    for (size_t j = 0; j < grads.size(); ++j) {
      if (!grads[j].defined()) continue;
      r.edges.emplace_back(cut.split[i]->getptr(), static_cast<uint32_t>(j));
      r.grads.push_back(grads[j]);
    }
    if (!r.edges.empty()) pass.roots_.push_back(std::move(r));
  }
  return pass;
}

}  // namespace megatorch::pipeline
