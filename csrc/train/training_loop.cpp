#include "megatorch/train/training_loop.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "megatorch/check.h"
#include "megatorch/tp/fp8_layer.h"
#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/module_checkpoint.h"
#include "megatorch/comm/comm_stats.h"
#include "megatorch/comm/group.h"
#include "megatorch/moe/moe_layer.h"
#include "megatorch/comm/nccl_semantics.h"
#include "megatorch/pipeline/timeline_svg.h"
#include "megatorch/train/expert_parameters.h"
#include "megatorch/train/device_memory.h"
#include "megatorch/train/sync_debug.h"
#include "exit_signals.h"
#include "random_state.h"

namespace megatorch::train {
namespace {

using parallel::GroupKind;
using Clock = std::chrono::steady_clock;

// Every rank makes its loops in the same order: the same number names the same loop.
int64_t next_loop_id() {
  static std::atomic<int64_t> n{0};
  return n++;
}

}  // namespace

TrainingLoop::TrainingLoop(TrainingLoopOptions options) : options_(std::move(options)), nccl_check_id_(next_loop_id()) {
  const auto& o = options_;
  MEGATORCH_CHECK(o.train_iters() >= 0 && o.micro_batch_size() >= 1 && o.num_micro_batches() >= 1 &&
                      o.virtual_chunks() >= 1 && o.log_interval() >= 1 && o.eval_iters() >= 0,
                  "TrainingLoop: expected train_iters >= 0, micro_batch_size, num_micro_batches, virtual_chunks and "
                  "log_interval >= 1 and eval_iters >= 0, got ", o.train_iters(), ", ", o.micro_batch_size(), ", ",
                  o.num_micro_batches(), ", ", o.virtual_chunks(), ", ", o.log_interval(), ", ", o.eval_iters());
  MEGATORCH_CHECK(o.zero_stage() >= 0 && o.zero_stage() <= 3, "TrainingLoop: expected zero_stage in 0..3, got ",
                  o.zero_stage());
  MEGATORCH_CHECK(o.exit_interval() >= 0 && o.skip_nan_steps() >= 0 && std::isfinite(o.exit_duration_in_mins()) &&
                      o.exit_duration_in_mins() >= 0,
                  "TrainingLoop: expected exit_interval, skip_nan_steps and exit_duration_in_mins >= 0 (0: off), got ",
                  o.exit_interval(), ", ", o.skip_nan_steps(), ", ", o.exit_duration_in_mins());
  faults_ = FaultInjection::from_environment();
  MEGATORCH_CHECK(o.rerun_mode() == "disabled" || o.rerun_mode() == "validate_results",
                  "TrainingLoop: expected rerun_mode 'disabled' or 'validate_results', got '", o.rerun_mode(), "'");
  MEGATORCH_CHECK(std::isfinite(o.spike_threshold()) && o.spike_threshold() > 1, "TrainingLoop: expected "
                  "spike_threshold > 1 (a loss that many times the recent mean is rerun), got ", o.spike_threshold());
  // Names the schedules when unknown.
  schedule_kind_ = pipeline::parse_schedule_kind(o.schedule());
  if (pipeline::chunk_layout(schedule_kind_) == pipeline::ChunkLayout::kV) {
    MEGATORCH_CHECK(o.virtual_chunks() == 2, "TrainingLoop: the ", o.schedule(), " schedule runs two chunks per rank ",
                    "in a V; expected virtual_chunks 2, got ", o.virtual_chunks());
  } else {
    MEGATORCH_CHECK(o.virtual_chunks() == 1 || schedule_kind_ == pipeline::ScheduleKind::kInterleaved,
                    "TrainingLoop: virtual_chunks ", o.virtual_chunks(), " needs the interleaved schedule, got '",
                    o.schedule(), "'");
  }
  auto pstate = parallel::ParallelStateOptions(o.tensor_parallel(), o.pipeline_parallel())
                    .context_parallel_size(o.context_parallel())
                    .expert_model_parallel_size(o.expert_parallel())
                    .expert_tensor_parallel_size(o.expert_tensor_parallel())
                    .name(o.name())
                    .device(o.device())
                    .backend(o.backend());
  if (o.timeout().count() > 0 && !std::getenv("MEGATORCH_COMM_TIMEOUT_S")) pstate.timeout(o.timeout());
  state_ = std::make_unique<parallel::ParallelState>(pstate);
  at::manual_seed(o.seed());
  lr_ = LRSchedule{o.lr(), o.min_lr(), o.lr_warmup_iters(), o.lr_decay_iters() > 0 ? o.lr_decay_iters() : o.train_iters(),
                   o.lr_decay_style()};
  if (o.exit_signal_handler()) exit_signals::install();
}

TrainingLoop::~TrainingLoop() {
  // A save still being written is published when the loop ends normally (every rank
  // here together); while an exception unwinds, it is abandoned and `latest` keeps the
  // previous checkpoint.
  if (pending_save_ && std::uncaught_exceptions() == 0) {
    try {
      finish_checkpoint_save();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "megatorch: the asynchronous checkpoint save failed: %s\n", e.what());
    }
  }
  pending_save_.reset();
  if (options_.exit_signal_handler()) exit_signals::uninstall();
}

std::string TrainingLoop::tp_group() const { return state_->group_name(GroupKind::kTensor); }
std::string TrainingLoop::pp_group() const {
  return state_->pp_size() > 1 ? state_->group_name(GroupKind::kPipeline) : "";
}
std::string TrainingLoop::dp_group() const { return state_->group_name(GroupKind::kData); }
std::string TrainingLoop::cp_group() const {
  return state_->cp_size() > 1 ? state_->group_name(GroupKind::kContext) : "";
}
std::string TrainingLoop::ep_group() const { return state_->group_name(GroupKind::kExpert); }
std::string TrainingLoop::etp_group() const { return state_->group_name(GroupKind::kExpertTensor); }
std::string TrainingLoop::edp_group() const { return state_->group_name(GroupKind::kExpertData); }
std::string TrainingLoop::grad_group() const {
  return state_->group_name(state_->cp_size() > 1 ? GroupKind::kDataContext : GroupKind::kData);
}
int64_t TrainingLoop::dp_rank() const { return state_->dp_rank(); }
int64_t TrainingLoop::dp_size() const { return state_->dp_size(); }
c10::Device TrainingLoop::device() const { return state_->device(); }
bool TrainingLoop::is_logging_rank() const { return state_->rank() == state_->world_size() - 1; }

void TrainingLoop::set_model(std::shared_ptr<pipeline::Stage> stage, const ParameterGroupingOptions& grouping) {
  MEGATORCH_CHECK(stage != nullptr, "TrainingLoop::set_model: expected a stage, got null");
  MEGATORCH_CHECK(!stage_, "TrainingLoop::set_model: the model is set once per loop");
  MEGATORCH_CHECK(stage->pp_size() == state_->pp_size() && stage->num_chunks() == options_.virtual_chunks(),
                  "TrainingLoop::set_model: the loop runs pipeline size ", state_->pp_size(), " with ",
                  options_.virtual_chunks(), " chunks per rank, but the stage has ", stage->pp_size(), " and ",
                  stage->num_chunks(), "; build it on loop.pp_group() with virtual_chunks() chunks");
  const pipeline::ChunkLayout layout = pipeline::chunk_layout(schedule_kind_);
  MEGATORCH_CHECK(stage->chunk_layout() == layout, "TrainingLoop::set_model: the ", options_.schedule(),
                  " schedule places chunks in the ", pipeline::chunk_layout_name(layout), " layout, but the stage was "
                  "built in the ", pipeline::chunk_layout_name(stage->chunk_layout()), " layout; pass chunk_layout(",
                  "pipeline::chunk_layout(kind)) to the stage's options");
  MEGATORCH_CHECK(stage->context_parallel_size() == state_->cp_size(), "TrainingLoop::set_model: the loop runs "
                  "context-parallel size ", state_->cp_size(), " but the stage splits sequences over ",
                  stage->context_parallel_size(), " ranks; build GPT's PipelineStage on a config whose "
                  "context_parallel_group is loop.cp_group(), or pass ModuleStageOptions().cp_group(loop.cp_group()) "
                  "with the micro-batch's sequence_dims");
  MEGATORCH_CHECK(stage->device() == state_->device(), "TrainingLoop::set_model: the stage runs on ", stage->device(),
                  " but the loop on ", state_->device(), "; build the chunks on loop.device() and pass it to the "
                  "stage (ModuleStageOptions::device)");
  stage_ = std::move(stage);
  const auto& o = options_;
  if (faults_.any_gradient_fault()) attach_fault_hooks();
  if (o.fp8().enabled()) tp::convert_to_fp8(stage_->stage_module(), o.fp8());
  fp8_recipe_ = tp::fp8_recipe_of(stage_->stage_module());
  // A rerun must see the state the first run saw: FP8's delayed scaling and MoE's step
  // statistics change during the forward.
  MEGATORCH_CHECK(o.rerun_mode() == "disabled" || (fp8_recipe_ == "none" && moe::moe_layers(stage_->stage_module()).empty()),
                  "TrainingLoop: rerun_mode validate_results runs a step twice from the same state, which FP8 ",
                  "scaling (", fp8_recipe_, ") and MoE layers update during the forward; use --rerun-mode disabled ",
                  "with them");
  MEGATORCH_CHECK(!o.fp16() || fp8_recipe_ == "none", "TrainingLoop: FP8 layers (", fp8_recipe_, ") with fp16 are "
                  "refused: fp16's loss scale would rescale the gradients FP8 quantises. Use bf16 or fp32 params");
  if (o.fp16()) {
    scaler_ = std::make_shared<optim::DynamicLossScaler>(optim::LossScalerOptions()
                                                             .initial_scale(o.initial_loss_scale())
                                                             .growth_interval(o.loss_scale_window())
                                                             .hysteresis(o.hysteresis()));
  }
  ParameterGroupingOptions g = grouping;
  if (g.tp_group().empty()) g.tp_group(tp_group());
  // Experts apart: their own optimizer over the expert-DP group (expert_parameters.h).
  auto split = split_expert_parameters(stage_parameters(*stage_, g), *stage_);
  params_ = std::move(split.dense);
  moe_shape_ = moe::moe_shape(stage_->stage_module(), state_->group_name(GroupKind::kWorld));
  for (auto* layer : moe::moe_layers(stage_->stage_module())) {
    MEGATORCH_CHECK(layer->experts->ep.size == state_->ep_size() && layer->experts->etp.size == state_->etp_size(),
                    "TrainingLoop::set_model: the loop runs expert-parallel x expert-tensor-parallel sizes ",
                    state_->ep_size(), " x ", state_->etp_size(), " but MoE layer ", layer->options.layer_number(),
                    " splits its experts ", layer->experts->ep.size, " x ", layer->experts->etp.size, "; build the ",
                    "model on a config whose expert_parallel_group is loop.ep_group() and whose ",
                    "expert_tensor_parallel_group is loop.etp_group()");
  }
  // Decided from the model's shape, the same on every rank, before any optimizer exists.
  MEGATORCH_CHECK(moe_shape_.second == 0 || o.zero_stage() <= 2, "TrainingLoop: ZeRO-3 does not shard expert ",
                  "parameters; use --zero-stage 1 or 2 with experts (both dense and expert optimizer states are "
                  "sharded from stage 1)");
  // Ties the optimizer cannot sum (several copies on one rank) are summed on .grad after
  // the schedule, so there the reduction must wait for them.
  optimizer_sums_ties_ = optimizer_sums_ties(*stage_);
  std::vector<std::string> model_groups{tp_group()};
  if (state_->pp_size() > 1) model_groups.push_back(pp_group());
  optimizer_ = std::make_unique<optim::DistributedOptimizer>(
      params_.units, grad_group(),
      optimizer_options()
          .model_parallel_groups(model_groups)
          // SP's partial sums and two-copy ties are added by the optimizer after its DP
          // reduction (ParamInfo::grad_sum_group), so the reduction overlaps backward.
          .overlap_grad_reduce(optimizer_sums_ties_)
          // The forward's unit hooks (below) wait for each unit's gathers.
          .overlap_param_gather(true),
      params_.info);
  attach_stage_unit_hooks(*stage_, params_, *optimizer_);
  // ZeRO-3 frees a unit when B moves past it, not when its gradients are in (W brings some).
  optimizer_->set_split_backward(pipeline::splits_backward(schedule_kind_));
  if (!split.experts.units.empty()) {
    expert_params_ = std::move(split.experts);
    // Each expert is on one EP rank, its columns over ETP: the norm spans both (and PP,
    // added in step_optimizers).
    std::vector<std::string> expert_groups;
    if (state_->ep_size() > 1) expert_groups.push_back(ep_group());
    if (state_->etp_size() > 1) expert_groups.push_back(etp_group());
    // Without SP the TP ranks route the same tokens, so each expert sees each of them tp
    // times (also through ETP's all-gather): those copies average out too.
    const auto layers = moe::moe_layers(stage_->stage_module());
    const bool sp = !layers.empty() && layers.front()->options.config().sequence_parallel();
    const int64_t data_replicas = comm::Group(grad_group()).size() * (sp ? 1 : state_->tp_size());
    expert_optimizer_ = std::make_unique<optim::DistributedOptimizer>(
        expert_params_.units, edp_group(),
        optimizer_options()
            .model_parallel_groups(expert_groups)
            // Expert-DP ranks hold other tokens (other DP replicas, other TP/CP shares of
            // the same sequences): their gradients add, then average over DP x CP.
            .grad_average_over(data_replicas)
            .overlap_param_gather(false),
        expert_params_.info);
  }
  // The whole model's size, each parameter once (PaLM's FLOPs count uses it).
  at::Tensor count = at::zeros({1}, at::kDouble);
  for (size_t i = 0; i < params_.info.size(); ++i) {
    if (params_.info[i].counted_in_norm) count += static_cast<double>(optimizer_->parameters()[i].numel());
  }
  comm::Group(tp_group()).all_reduce(count);
  // Experts once over EP x ETP, whatever TP says (ETP-replicated ones on etp rank 0).
  at::Tensor experts = at::zeros({1}, at::kDouble);
  for (size_t i = 0; expert_optimizer_ && i < expert_params_.info.size(); ++i) {
    if (expert_params_.info[i].counted_in_norm) experts += static_cast<double>(expert_optimizer_->parameters()[i].numel());
  }
  comm::Group(ep_group()).all_reduce(experts);
  comm::Group(etp_group()).all_reduce(experts);
  count += experts;
  if (state_->pp_size() > 1) comm::Group(pp_group()).all_reduce(count);
  num_parameters_ = static_cast<int64_t>(count.item<double>());
  if (!o.load().empty()) load_checkpoint();
  if (is_logging_rank() && o.print_summary()) {
    const std::string cp = state_->cp_size() > 1 ? " x cp " + std::to_string(state_->cp_size()) : "";
    std::printf("[megatorch] %s: world %ld = tp %ld%s x pp %ld (v %ld) x dp %ld, ZeRO-%ld, %ld parameters, global batch "
                "%ld = micro-batch %ld x %ld micro-batches x dp %ld\n",
                o.name().c_str(), state_->world_size(), state_->tp_size(), cp.c_str(), state_->pp_size(), o.virtual_chunks(),
                state_->dp_size(), o.zero_stage(), num_parameters_, global_batch_size(), o.micro_batch_size(),
                o.num_micro_batches(), state_->dp_size());
    std::fflush(stdout);
  }
  // A resumed run appends to the log of the run it continues.
  if (is_logging_rank() && !o.log_json().empty()) {
    json_.open(o.log_json(), iteration_ > 0 ? std::ios::app : std::ios::trunc);
    MEGATORCH_CHECK(json_.is_open(), "cannot open the --log-json file '", o.log_json(), "': ", std::strerror(errno),
                    "; check that its directory exists and is writable");
  }
}

optim::DistributedOptimizerOptions TrainingLoop::optimizer_options() const {
  const auto& o = options_;
  return optim::DistributedOptimizerOptions()
      .zero_stage(o.zero_stage())
      .lr(o.lr())
      .beta1(o.adam_beta1())
      .beta2(o.adam_beta2())
      .eps(o.adam_eps())
      .weight_decay(o.weight_decay())
      .clip_grad(o.clip_grad())
      .gradient_accumulation_fusion(o.gradient_accumulation_fusion())
      .check_finite_grads(o.check_for_nan_in_loss_and_grad() || o.skip_nan_steps() > 0)
      .loss_scaler(scaler_);
}

std::vector<optim::DistributedOptimizer*> TrainingLoop::optimizers() const {
  std::vector<optim::DistributedOptimizer*> out{optimizer_.get()};
  if (expert_optimizer_) out.push_back(expert_optimizer_.get());
  return out;
}

bool TrainingLoop::step_optimizers(const at::Tensor& loss) {
  const bool check = options_.check_for_nan_in_loss_and_grad() || options_.skip_nan_steps() > 0;
  if (moe_shape_.second == 0 && !check) return optimizer_->step();
  // The check's reads (the norm here, the loss below) are its one deliberate synchronisation.
  const AllowedSync deliberate(check ? state_->device() : c10::Device(c10::kCPU));
  optim::GradStats total = optimizer_->prepare_step();
  // The experts' part spans EP inside a stage; stages without experts add zeros to the
  // sum over the pipeline, which no optimizer's groups span.
  at::Tensor experts = at::zeros({2}, at::kDouble);
  if (moe_shape_.second > 0 && expert_optimizer_) {
    const optim::GradStats e = expert_optimizer_->prepare_step();
    experts[0] = e.overflow ? 1.0 : 0.0;
    experts[1] = e.sum_of_squares;
  }
  if (moe_shape_.second > 0 && state_->pp_size() > 1) comm::Group(pp_group()).all_reduce(experts);
  total.overflow = total.overflow || experts[0].item<double>() > 0;
  total.sum_of_squares += experts[1].item<double>();
  if (check) {
    // A loss scaler owns non-finite gradients (it skips the step and lowers the scale).
    const double l = loss.item<double>();
    // Every element, counted in the norm or not (a TP-replicated copy on tp rank > 0).
    const bool bad_grads = !scaler_ && (total.overflow || !std::isfinite(total.sum_of_squares));
    if (!std::isfinite(l) || bad_grads) {
      on_nonfinite_step(l, bad_grads, total.sum_of_squares);  // throws unless the step may be skipped
      for (auto* opt : optimizers()) opt->skip_step();
      return false;
    }
  }
  return optim::finish_step_together(optimizers(), total);
}

// Mean of the last stage's loss over DP, made known on every rank. Under CP each rank's
// loss is c times its share of the sequence's (Stage::context_parallel_size), so the
// mean over DP x CP is the DP mean of whole sequences.
at::Tensor TrainingLoop::reduce_loss_on_device(const at::Tensor& loss, double injected) {
  // Only the rank that holds the last virtual stage (the last rank, or rank 0 in a V) has it.
  // A copy: the all-reduce works in place.
  at::Tensor l = loss.defined() ? loss.detach().to(at::kDouble, /*non_blocking=*/false, /*copy=*/true).reshape({1})
                                : at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(state_->device()));
  if (injected != 0) l += injected;
  if (state_->pp_size() > 1) comm::Group(pp_group()).all_reduce(l);
  comm::Group grads(grad_group());
  grads.all_reduce(l);
  return l.div_(static_cast<double>(grads.size()));
}

double TrainingLoop::reduce_loss(const at::Tensor& loss) { return reduce_loss_on_device(loss).item<double>(); }

std::vector<pipeline::MicroBatch> TrainingLoop::on_device(std::vector<pipeline::MicroBatch> mbs) const {
  const c10::Device device = state_->device();
  for (auto& mb : mbs) {
    bool elsewhere = (mb.ids.defined() && mb.ids.device() != device) ||
                     (mb.labels.defined() && mb.labels.device() != device);
    for (const auto& [name, t] : mb.tensors) elsewhere |= t.defined() && t.device() != device;
    if (elsewhere) mb = mb.to(device, /*non_blocking=*/true);
  }
  return mbs;
}

IterationStats TrainingLoop::train_step(const std::vector<pipeline::MicroBatch>& host_mbs) {
  return read_stats(run_step(host_mbs));
}

IterationStats TrainingLoop::read_stats(const PendingStats& pending) {
  IterationStats s = pending.stats;
  s.loss = pending.loss.item<double>();
  // A skipped step computed no norm worth reporting (Megatron logs none).
  s.grad_norm = s.skipped ? std::nan("") : optimizer_->grad_norm();
  return s;
}

bool TrainingLoop::reads_values(int64_t it) const {
  return it % options_.log_interval() == 0 || it == options_.train_iters() || json_.is_open() || on_iteration ||
         moe_shape_.first > 0 || scaler_ != nullptr;
}

TrainingLoop::PendingStats TrainingLoop::run_step(const std::vector<pipeline::MicroBatch>& host_mbs) {
  MEGATORCH_CHECK(stage_ != nullptr, "TrainingLoop: call set_model(stage) before training");
  MEGATORCH_CHECK(static_cast<int64_t>(host_mbs.size()) == options_.num_micro_batches(), "TrainingLoop: expected ",
                  options_.num_micro_batches(), " micro-batches per step and DP rank (num_micro_batches), got ",
                  host_mbs.size());
  const auto start = Clock::now();
  const auto [check_first, check_last] = options_.sync_debug_iterations();
  const SyncDebugScope sync_check(check_first <= iteration_ + 1 && iteration_ + 1 <= check_last, state_->device(),
                                  iteration_ + 1);
  const auto mbs = on_device(host_mbs);
  comm::reset_comm_stats();
  IterationStats s;
  s.iteration = iteration_ + 1;
  s.lr = lr_.at(lr_step_);
  const auto opts = optimizers();
  for (auto* opt : opts) opt->set_lr(s.lr);
  stage_->stage_module().train();
  for (auto* opt : opts) opt->zero_grad();
  // Timed only where the timeline is drawn: on a GPU timing waits for the device.
  const bool draw_timeline =
      !options_.timeline().empty() && iteration_ + 1 == std::min<int64_t>(2, options_.train_iters());
  // The straggler report: on logged iterations (the same on every rank, log_json or not).
  const bool report_straggler = options_.log_straggler() && ((iteration_ + 1) % options_.log_interval() == 0 ||
                                                             iteration_ + 1 == options_.train_iters());
  const auto executor = pipeline::ExecutorOptions()
                            .schedule(schedule_kind_)
                            .time_compute(draw_timeline || report_straggler)
                            .loss_scale(scaler_ ? scaler_->scale() : 1.0)
                            .before_backward([opts](bool last) {
                              for (auto* opt : opts) opt->set_grad_sync(last);
                            });
  const bool rerun_mode = options_.rerun_mode() == "validate_results";
  // The rerun mode's reads of the loss are deliberate synchronisations (sync_debug.h).
  const auto read = [this](const at::Tensor& t) {
    const AllowedSync deliberate(state_->device());
    return t.item<double>();
  };
  const RandomState random_before = rerun_mode ? RandomState::capture(*stage_, state_->device()) : RandomState{};
  // The forward and backward, and the loss reduced over the stages and DP (before the
  // step, which checks it for NaN: check_for_nan_in_loss_and_grad). `run`: 1, or 2 for a rerun.
  const auto forward_backward = [&](int run, pipeline::PipelineStepResult& result, at::Tensor& loss, double& own) {
    result = pipeline::run_pipeline_step(*stage_, mbs, executor);
    // (SP's partial sums and two-copy ties: the optimizer adds them.)
    if (!optimizer_sums_ties_) stage_->allreduce_tied_grads();
    const bool spike = faults_.loss_spike_iteration == iteration_ + 1 && faults_.loss_spike_rank == state_->rank() &&
                       (run == 1 || faults_.loss_spike_persistent);
    own = (result.loss.defined() && rerun_mode ? read(result.loss) : 0.0) + (spike ? 1000.0 : 0.0);
    loss = reduce_loss_on_device(result.loss, spike ? 1000.0 : 0.0);
  };
  pipeline::PipelineStepResult result;
  at::Tensor loss;
  double own = 0;
  forward_backward(1, result, loss, own);
  s.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  if (rerun_mode) {
    const double first = read(loss);
    if (suspicious_loss(first)) {
      // Nothing of the first run is applied: its reductions finish, the step is skipped
      // (as a loss scaler's overflow skips one), and the same step runs again.
      const AllowedSync deliberate(state_->device());  // the rerun path is the exception, not the step
      for (auto* opt : opts) opt->prepare_step();
      for (auto* opt : opts) opt->skip_step();
      random_before.restore(*stage_, state_->device());
      for (auto* opt : opts) opt->zero_grad();
      const double own_first = own;
      forward_backward(2, result, loss, own);
      s.rerun = judge_rerun(first, read(loss), own_first, own);
    }
    const double applied = read(loss);
    if (std::isfinite(applied)) {
      recent_losses_.push_back(applied);
      if (recent_losses_.size() > 20) recent_losses_.erase(recent_losses_.begin());
    }
  }
  s.skipped = !step_optimizers(loss);
  if (!s.skipped) ++lr_step_;
  if (moe_shape_.first > 0) {
    s.moe = moe::reduce_step_stats(stage_->stage_module(), state_->group_name(GroupKind::kWorld), moe_shape_,
                                   comm::Group(grad_group()).size());
    // The biases move with the step's loads, as the weights with its gradients.
    if (!s.skipped) moe::update_expert_biases(stage_->stage_module(), s.moe);
  }
  if (report_straggler) s.rank_compute_seconds = gather_compute_seconds(result.busy_s);
  ++iteration_;
  s.seconds = s.host_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (draw_timeline) {
    const auto records = pipeline::gather_timeline(result, state_->pp_size() > 1 ? pp_group() : tp_group());
    if (is_logging_rank()) {
      pipeline::TimelineSvgOptions t;
      t.title = options_.name() + " iteration " + std::to_string(iteration_) + ": " + options_.schedule() +
                ", p=" + std::to_string(state_->pp_size()) + ", m=" + std::to_string(options_.num_micro_batches());
      pipeline::write_timeline_svg(options_.timeline(), records, t);
    }
  }
  // MEGATORCH_NCCL_CHECK=1: this step's ops, and whatever ran since the last one
  // (evaluation, checkpoints), replayed under NCCL's rules on every rank.
  if (comm::nccl_check_enabled()) {
    comm::check_nccl_semantics_across_ranks(
        state_->store(), "megatorch_nccl_check/" + std::to_string(nccl_check_id_) + "/" + std::to_string(iteration_),
        state_->rank(), state_->world_size());
  }
  return {s, loss};
}

int64_t TrainingLoop::global_batch_size() const {
  return options_.micro_batch_size() * options_.num_micro_batches() * state_->dp_size();
}

IterationStats TrainingLoop::train(const BatchSource& train, const BatchSource& valid) {
  MEGATORCH_CHECK(train != nullptr, "TrainingLoop::train: expected a batch source");
  IterationStats last;
  const int64_t first = iteration_, iters = options_.train_iters();
  // Iterations run since the last one whose values were read, and since when: the mean
  // step time over them is right on a GPU too, where an unread step only queues work.
  auto since = Clock::now();
  int64_t unread = 0;
  exit_reason_.clear();
  while (iteration_ < iters) {
    const PendingStats pending = run_step(train(iteration_));
    ++unread;
    const bool eval_now = options_.eval_interval() > 0 && iteration_ % options_.eval_interval() == 0;
    const bool evaluated = valid && (eval_now || iteration_ == iters);
    const bool save_now = !options_.save().empty() &&
                          ((options_.save_interval() > 0 && iteration_ % options_.save_interval() == 0) || iteration_ == iters);
    const bool read = reads_values(iteration_) || evaluated || save_now;
    last = pending.stats;
    if (read) {
      last = read_stats(pending);
      const auto now = Clock::now();
      last.seconds = std::chrono::duration<double>(now - since).count() / static_cast<double>(unread);
      since = now;
      unread = 0;
    } else {
      last.loss = last.grad_norm = std::nan("");  // not read: not known on the host
    }
    // Megatron's memory report: once, after the run's first iteration, from every rank of
    // the first DP replica (the others hold the same).
    if (iteration_ == first + 1 && state_->dp_rank() == 0) {
      const std::string memory = device_memory_line(device_memory_stats(state_->device()));
      if (!memory.empty()) std::printf("\n[Rank %ld] (after %ld iterations) %s\n", state_->rank(), iteration_, memory.c_str());
      std::fflush(stdout);
    }
    // "dp": the gradient reduction's group (DP × CP under context parallelism).
    std::map<std::string, int64_t> comm_bytes{{"dp", comm::comm_stats(grad_group()).total().bytes}};
    for (auto [kind, key] : {std::pair{GroupKind::kTensor, "tp"}, {GroupKind::kPipeline, "pp"}, {GroupKind::kContext, "cp"},
                             {GroupKind::kExpert, "ep"}, {GroupKind::kExpertTensor, "etp"},
                             {GroupKind::kExpertData, "edp"}}) {
      comm_bytes[key] = comm::comm_stats(state_->group_name(kind)).total().bytes;
    }
    if (evaluated) last_val_loss_ = evaluate(valid, options_.eval_iters());
    if (read) log(last, comm_bytes);
    // A negative loss means nothing was evaluated (eval_iters 0, or a split too small).
    if (evaluated && last_val_loss_ >= 0 && is_logging_rank()) {
      const bool progress_line_open = iteration_ % options_.log_interval() != 0 && iteration_ != iters;
      if (progress_line_open) std::printf("\n");
      log_validation();
    }
    if (on_iteration) on_iteration(last);
    // An asynchronous save is published once every rank's writer is done (one tiny
    // all-reduce per iteration while one is in flight).
    if (pending_save_ && pending_save_->written_everywhere()) finish_checkpoint_save();
    if (save_now) save_checkpoint();
    exit_reason_ = exit_requested();
    if (!exit_reason_.empty()) {
      if (!options_.save().empty() && !save_now) save_checkpoint();
      finish_checkpoint_save();
      if (is_logging_rank()) {
        std::printf("\n[megatorch] stopping after iteration %ld of %ld (%s)%s\n", iteration_, iters, exit_reason_.c_str(),
                    options_.save().empty() ? ": no --save directory, nothing saved" : ", checkpoint saved");
        std::fflush(stdout);
      }
      break;
    }
    if (evaluated || save_now) since = Clock::now();  // neither counts as step time
    last_val_loss_ = -1;
  }
  finish_checkpoint_save();
  return last;
}

double TrainingLoop::evaluate(const BatchSource& source, int64_t iters) {
  MEGATORCH_CHECK(stage_ != nullptr, "TrainingLoop: call set_model(stage) before evaluating");
  if (iters == 0 || !source) return -1;
  stage_->stage_module().eval();
  double total = 0;
  // The training schedule's forwards through the executor's p2p (Megatron's forward_only).
  const auto options =
      pipeline::ExecutorOptions().schedule(schedule_kind_).forward_only(true).time_compute(false);
  for (int64_t i = 0; i < iters; ++i) {
    const auto mbs = source(i);
    if (mbs.empty()) {
      stage_->stage_module().train();
      return -1;
    }
    total += reduce_loss(pipeline::run_pipeline_step(*stage_, on_device(mbs), options).loss);
  }
  stage_->stage_module().train();
  return total / static_cast<double>(iters);
}

}  // namespace megatorch::train
