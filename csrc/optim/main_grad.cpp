#include "megatorch/optim/main_grad.h"

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "megatorch/check.h"

namespace megatorch::optim {
namespace {

struct Registry {
  std::shared_mutex mutex;
  std::unordered_map<const c10::TensorImpl*, MainGrad> entries;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_main_grad(const at::Tensor& param, MainGradSink* sink, int64_t index) {
  MEGATORCH_CHECK(param.defined() && sink != nullptr, "register_main_grad: expected a parameter and a sink, got ",
                  param.defined() ? "a null sink" : "an undefined parameter");
  auto& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mutex);
  r.entries[param.unsafeGetTensorImpl()] = MainGrad{sink, index};
}

void unregister_main_grad(const at::Tensor& param) {
  auto& r = registry();
  std::unique_lock<std::shared_mutex> lock(r.mutex);
  r.entries.erase(param.unsafeGetTensorImpl());
}

std::optional<MainGrad> find_main_grad(const at::Tensor& param) {
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mutex);
  if (r.entries.empty()) return std::nullopt;
  const auto it = r.entries.find(param.unsafeGetTensorImpl());
  if (it == r.entries.end()) return std::nullopt;
  return it->second;
}

bool backward_accumulates_into(const at::Tensor& param) {
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(param);
  if (!accumulator) return false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return true;  // every node runs
  const auto it = exec_info->find(accumulator.get());
  return it != exec_info->end() && it->second.needed_ && !it->second.captures_;
}

}  // namespace megatorch::optim
