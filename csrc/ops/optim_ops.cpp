// Registers torch.classes.megatorch.DistributedOptimizer. Registration only: the
// optimizer lives in csrc/optim/. The class is built lazily, so Python can configure it
// (options, ZeRO-3 units) between construction and first use.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "megatorch/check.h"
#include "megatorch/optim/distributed_optimizer.h"

namespace megatorch::ops {
namespace {

class DistributedOptimizerClass : public torch::CustomClassHolder {
 public:
  DistributedOptimizerClass(std::vector<at::Tensor> params, std::string group, int64_t zero_stage, double lr, double beta1,
                            double beta2, double eps, double weight_decay)
      : params_(std::move(params)), group_(std::move(group)) {
    options_.zero_stage(zero_stage).lr(lr).beta1(beta1).beta2(beta2).eps(eps).weight_decay(weight_decay);
    MEGATORCH_CHECK(zero_stage >= 0 && zero_stage <= 3, "DistributedOptimizer: expected zero_stage in 0..3, got ",
                    zero_stage, "; use 0 (plain DP), 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)");
  }

  // Options that shape the layout, before the first use: clip_grad, bucket_size,
  // momentum, sgd (1: SGD with momentum instead of AdamW), grad_in_fp32,
  // overlap_grad_reduce, gradient_accumulation_fusion, loss_scale (>0: a dynamic loss
  // scaler starting there).
  void configure(const std::string& key, double value) {
    MEGATORCH_CHECK(!opt_, "DistributedOptimizer.configure: expected before the first step/zero_grad/gather, got '", key,
                    "' after; configure right after construction");
    if (key == "clip_grad") {
      options_.clip_grad(value);
    } else if (key == "bucket_size") {
      options_.bucket_size(static_cast<int64_t>(value));
    } else if (key == "momentum") {
      options_.momentum(value);
    } else if (key == "sgd") {
      options_.kind(value != 0 ? optim::OptimizerKind::kSGD : optim::OptimizerKind::kAdamW);
    } else if (key == "grad_in_fp32") {
      options_.grad_in_fp32(value != 0);
    } else if (key == "overlap_grad_reduce") {
      options_.overlap_grad_reduce(value != 0);
    } else if (key == "gradient_accumulation_fusion") {
      options_.gradient_accumulation_fusion(value != 0);
    } else if (key == "loss_scale") {
      options_.loss_scaler(std::make_shared<optim::DynamicLossScaler>(optim::LossScalerOptions().initial_scale(value)));
    } else {
      MEGATORCH_FAIL("DistributedOptimizer.configure: unknown option '", key,
                     "'; expected clip_grad, bucket_size, momentum, sgd, grad_in_fp32, overlap_grad_reduce, "
                     "gradient_accumulation_fusion or loss_scale");
    }
  }
  // ZeRO-3 units: the parameter list split into consecutive runs of these sizes.
  void set_units(std::vector<int64_t> sizes) {
    MEGATORCH_CHECK(!opt_, "DistributedOptimizer.set_units: expected before the first use");
    int64_t total = 0;
    for (int64_t s : sizes) total += s;
    MEGATORCH_CHECK(total == static_cast<int64_t>(params_.size()), "DistributedOptimizer.set_units: expected sizes adding up to ",
                    params_.size(), " parameters, got ", total);
    unit_sizes_ = std::move(sizes);
  }
  // Groups the model is split over (TP, PP): the overflow flag and the gradient norm are
  // reduced over them too, so every rank clips and skips alike.
  void set_model_parallel_groups(std::vector<std::string> groups) {
    MEGATORCH_CHECK(!opt_, "DistributedOptimizer.set_model_parallel_groups: expected before the first use");
    options_.model_parallel_groups(std::move(groups));
  }
  // Per parameter (in the list's order): counted in the global norm (false for a copy
  // another rank also holds: a TP-replicated norm weight on tp rank > 0, a tied copy), and
  // weight-decayed.
  void set_param_info(const c10::List<bool>& counted_in_norm, const c10::List<bool>& weight_decay) {
    MEGATORCH_CHECK(!opt_, "DistributedOptimizer.set_param_info: expected before the first use");
    MEGATORCH_CHECK(counted_in_norm.size() == params_.size() && weight_decay.size() == params_.size(),
                    "DistributedOptimizer.set_param_info: expected ", params_.size(), " flags each (one per parameter), "
                    "got ", counted_in_norm.size(), " and ", weight_decay.size());
    info_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      info_[i].counted_in_norm = counted_in_norm[i];
      info_[i].weight_decay = weight_decay[i];
    }
  }
  optim::DistributedOptimizer& get() {
    if (!opt_) {
      std::vector<std::vector<at::Tensor>> units;
      if (unit_sizes_.empty()) unit_sizes_ = {static_cast<int64_t>(params_.size())};
      size_t next = 0;
      for (int64_t s : unit_sizes_) {
        units.emplace_back(params_.begin() + next, params_.begin() + next + s);
        next += s;
      }
      opt_ = std::make_unique<optim::DistributedOptimizer>(std::move(units), group_, options_, info_);
    }
    return *opt_;
  }

  // The unit schedule of megatorch.nn.FullyShard's units (its root, then each unit), the
  // same hooks GPTModel runs: gather before forward (prefetching the next), free after,
  // gather again before backward; a no-op below ZeRO-3.
  void before_unit_forward(int64_t unit) {
    if (const auto& h = hooks()) h->before_forward(unit);
  }
  at::Tensor after_unit_forward(int64_t unit, const at::Tensor& output) {
    const auto& h = hooks();
    return h ? h->after_forward(unit, output) : output;
  }

  c10::Dict<std::string, int64_t> memory_stats() {
    c10::Dict<std::string, int64_t> out;
    for (const auto& [k, v] : get().memory_stats()) out.insert(k, v);
    return out;
  }
  c10::Dict<std::string, at::Tensor> state_dict() {
    c10::Dict<std::string, at::Tensor> out;
    for (const auto& [k, v] : get().state_dict()) out.insert(k, v);
    return out;
  }
  void load_state_dict(const c10::Dict<std::string, at::Tensor>& state) {
    std::map<std::string, at::Tensor> in;
    for (const auto& e : state) in[e.key()] = e.value();
    get().load_state_dict(in);
  }

 private:
  std::vector<at::Tensor> params_;
  std::string group_;
  optim::DistributedOptimizerOptions options_;
  std::vector<int64_t> unit_sizes_;
  std::vector<optim::ParamInfo> info_;
  const std::shared_ptr<models::UnitHooks>& hooks() {
    if (!hooks_built_) {
      hooks_ = get().unit_hooks(0, get().num_units() - 1);
      hooks_built_ = true;
    }
    return hooks_;
  }

  std::unique_ptr<optim::DistributedOptimizer> opt_;
  std::shared_ptr<models::UnitHooks> hooks_;
  bool hooks_built_ = false;
};

using Self = c10::intrusive_ptr<DistributedOptimizerClass>;

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatorch, m) {
  m.class_<DistributedOptimizerClass>("DistributedOptimizer")
      .def(torch::init<std::vector<at::Tensor>, std::string, int64_t, double, double, double, double, double>())
      .def("configure", &DistributedOptimizerClass::configure)
      .def("set_units", &DistributedOptimizerClass::set_units)
      .def("set_model_parallel_groups", &DistributedOptimizerClass::set_model_parallel_groups)
      .def("set_param_info", &DistributedOptimizerClass::set_param_info)
      .def("build", [](const Self& self) { self->get(); })
      .def("step", [](const Self& self) { return self->get().step(); })
      .def("zero_grad", [](const Self& self) { self->get().zero_grad(); })
      .def("set_grad_sync", [](const Self& self, bool on) { self->get().set_grad_sync(on); })
      .def("set_lr", [](const Self& self, double lr) { self->get().set_lr(lr); })
      .def("grad_norm", [](const Self& self) { return self->get().grad_norm(); })
      .def("loss_scale", [](const Self& self) {
        const auto& s = self->get().options().loss_scaler();
        return s ? s->scale() : 1.0;
      })
      .def("num_units", [](const Self& self) { return self->get().num_units(); })
      .def("gather_unit", [](const Self& self, int64_t u) { self->get().gather_unit(u); })
      .def("prefetch_unit", [](const Self& self, int64_t u) { self->get().prefetch_unit(u); })
      .def("release_unit", [](const Self& self, int64_t u) { self->get().release_unit(u); })
      .def("before_unit_forward", &DistributedOptimizerClass::before_unit_forward)
      .def("after_unit_forward", &DistributedOptimizerClass::after_unit_forward)
      .def("memory_stats", &DistributedOptimizerClass::memory_stats)
      .def("state_dict", &DistributedOptimizerClass::state_dict)
      .def("load_state_dict", &DistributedOptimizerClass::load_state_dict);
}

}  // namespace megatorch::ops
