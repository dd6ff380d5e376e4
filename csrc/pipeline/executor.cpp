#include "megatorch/pipeline/executor.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/moe/moe_layer.h"
#include "megatorch/pipeline/compute_timer.h"
#include "megatorch/pipeline/p2p_batches.h"
#include "megatorch/pipeline/p2p_channels.h"
#include "megatorch/pipeline/split_backward.h"

namespace megatorch::pipeline {
namespace {

using Key = std::pair<int64_t, int64_t>;  // (micro-batch, chunk)
// A posted send or receive, shared by its ChunkState and the step's list; waited at most
// once (waiting again is free).
using Transfer = std::shared_ptr<comm::Work>;

// Backward from `output` with `grad` through the engine directly: the output's data
// may have been freed (deallocation), so the usual shape check must not run.
void backward_from(const at::Tensor& output, const at::Tensor& grad) {
  const auto edge = torch::autograd::impl::gradient_edge(output);
  MEGATORCH_CHECK(edge.function, "pipeline: expected a stage output attached to the autograd graph");
  torch::autograd::Engine::get_default_engine().execute({edge}, {grad}, /*keep_graph=*/false, /*create_graph=*/false,
                                                        /*accumulate_grad=*/true);
}

// A receive posted and not yet consumed by a compute.
struct PendingRecv {
  Transfer work;      // null: none posted
  at::Tensor buffer;  // filled once `work` completes
};

// Everything the step holds for one (micro-batch, chunk) between the actions that touch it.
struct ChunkState {
  PendingRecv activation;  // the forward's input, from the previous virtual stage
  PendingRecv grad;        // the backward's output gradient, from the next virtual stage
  at::Tensor input;        // the received activation (requires grad); undefined on the first stage
  at::Tensor output;       // the stage output (or the scaled loss on the last stage)
  WeightGradPass weights;  // a split backward's W, between its B and W
};

// One call of run_pipeline_step: the schedule's p2p steps (p2p_batches.h) applied in
// order, one handler per kind of step, to one ChunkState per (micro-batch, chunk).
class StepRun {
 public:
  StepRun(Stage& stage, const std::vector<MicroBatch>& mbs, const ExecutorOptions& options)
      : stage_(stage),
        mbs_(mbs),
        options_(options),
        p_(stage.pp_size()),
        rank_(stage.pp_rank()),
        v_(stage.num_chunks()),
        layout_(stage.chunk_layout()),
        m_(static_cast<int64_t>(mbs.size())),
        device_(stage.device()),
        timer_(device_) {}

  PipelineStepResult run() {
    MEGATORCH_CHECK(m_ >= 1, "pipeline: expected at least one micro-batch");
    MEGATORCH_CHECK(options_.recv_lookahead() >= 1, "pipeline: expected recv_lookahead >= 1 (receives posted ahead ",
                    "per channel), got ", options_.recv_lookahead());
    const ScheduleKind kind = options_.schedule();
    MEGATORCH_CHECK(layout_ == chunk_layout(kind), "pipeline: the ", schedule_kind_name(kind), " schedule places ",
                    "chunks in the ", chunk_layout_name(chunk_layout(kind)), " layout, but the stage was built in the ",
                    chunk_layout_name(layout_), " layout; build it with chunk_layout(ChunkLayout::k",
                    chunk_layout(kind) == ChunkLayout::kV ? "V" : "Looped", ") (gpt_pretrain does for --schedule)");
    MEGATORCH_CHECK(kind == ScheduleKind::kInterleaved || v_ == chunks_per_rank(kind, 1), "pipeline: the ",
                    schedule_kind_name(kind), " schedule runs ", chunks_per_rank(kind, 1), " chunk(s) per stage, got ",
                    v_, " virtual chunks; use the interleaved schedule for other counts");
    // MoE auxiliary losses take the gradient each micro-batch's loss takes: scale / m.
    if (!options_.forward_only()) {
      moe::set_aux_loss_backward_scale(stage_.stage_module(), options_.loss_scale() / static_cast<double>(m_));
    }
    const auto actions = options_.forward_only()
                             ? build_forward_only_schedule(options_.schedule(), p_, m_, v_, rank_)
                             : build_schedule(options_.schedule(), p_, m_, v_, rank_);
    backwards_left_ = std::count_if(actions.begin(), actions.end(), [](const Action& a) {
      return is_compute(a.kind) && a.kind != ActionKind::kForward;
    });
    // The stage refuses batches it cannot run and sizes what travels between stages,
    // before any p2p.
    stage_.prepare(mbs_);
    if (p_ > 1) {
      pp_ = std::make_unique<comm::Group>(stage_.pipeline_group());
      if (pp_->follows_nccl_rules(device_.type())) {
        for (const auto& name : p2p_channel_groups(stage_.pipeline_group(), num_p2p_channels(v_, layout_)))
          channels_.emplace_back(name);
      }
    }

    // Forward only builds no graph: nothing is kept for a backward.
    std::optional<at::NoGradGuard> no_grad;
    if (options_.forward_only()) no_grad.emplace();
    if (!channels_.empty()) {
      // NCCL's rules: each transfer alone on its channel, receives posted ahead (p2p_channels.h).
      const ChannelPlan plan = channel_plan(actions, rank_, p_, v_, layout_, options_.recv_lookahead());
      for (size_t i = 0; i < plan.computes.size(); ++i) {
        for (const Action& a : plan.posts[i]) post(a);
        compute(plan.computes[i]);
      }
      for (const Action& a : plan.posts.back()) post(a);
      return finish();
    }
    // Gloo: each transfer alone, with its tag, in the order of the schedule's p2p steps.
    for (const P2PStep& step : p2p_steps(actions, rank_, p_, recv_posting(kind), layout_)) {
      if (step.is_batch()) {
        for (const Action& a : step.batch) post(a);
      } else {
        compute(step.compute);
      }
    }
    return finish();
  }

 private:
  void compute(const Action& a) {
    if (a.kind == ActionKind::kForward) {
      forward(a);
    } else if (a.kind == ActionKind::kBackwardWeight) {
      backward_weight(a);
    } else {
      backward(a);  // whole, or a split backward's B
    }
  }

  // Posts one send or receive (on its channel where NCCL's rules apply, else on the PP
  // group with its tag); a receive's buffer waits in its ChunkState.
  void post(const Action& a) {
    const P2PMessage msg = p2p_message(a, rank_, p_, layout_);
    comm::P2POp op;
    op.peer = a.peer;
    op.tag = p2p_tag(msg, p_, v_);
    switch (a.kind) {
      case ActionKind::kRecvActivation:
      case ActionKind::kRecvGrad: {
        // An activation comes from the virtual stage before ours; a gradient is of our output.
        const int64_t vs = stage_.virtual_stage(a.chunk);
        const ActivationSpec spec = stage_.activation_spec(a.kind == ActionKind::kRecvActivation ? vs - 1 : vs);
        op.kind = comm::P2POp::Kind::kRecv;
        op.tensor = at::empty(spec.shape, at::TensorOptions().dtype(spec.dtype).device(device_));
        break;
      }
      case ActionKind::kSendActivation:
        op.tensor = chunks_.at(key_of(a)).output.detach();
        break;
      case ActionKind::kSendGrad: {
        const at::Tensor& input = chunks_.at(key_of(a)).input;
        MEGATORCH_CHECK(input.grad().defined(), "pipeline: no input gradient for micro-batch ", a.microbatch,
                        " chunk ", a.chunk, "; the stage's output does not depend on its input");
        op.tensor = input.grad();  // the Work keeps it alive until sent
        break;
      }
      default:
        MEGATORCH_FAIL("pipeline: expected a send or a receive, got ", to_string(a));
    }
    // Alone, not in a batch_p2p group: on NCCL c10d then runs it on its pair's own stream.
    comm::Group& group = channels_.empty() ? *pp_ : channels_[p2p_channel(msg, p_, v_, layout_)];
    const Transfer work = std::make_shared<comm::Work>(op.kind == comm::P2POp::Kind::kSend
                                                           ? group.send_async(op.tensor, op.peer, op.tag)
                                                           : group.recv_async(op.tensor, op.peer, op.tag));
    transfers_.push_back(work);
    if (is_recv(a.kind)) {
      ChunkState& st = state(a);
      (a.kind == ActionKind::kRecvActivation ? st.activation : st.grad) = PendingRecv{work, op.tensor};
    } else if (a.kind == ActionKind::kSendActivation) {
      if (options_.forward_only()) {
        chunks_.erase(key_of(a));  // no backward needs it; the Work holds the tensor until sent
      } else {
        pending_sends_.emplace_back(work, key_of(a));
      }
    }
  }

  void forward(const Action& a) {
    const bool keep_graph = !options_.forward_only();
    ChunkState& st = state(a);
    at::Tensor input;  // undefined on the first virtual stage, which reads the micro-batch
    if (!stage_.is_first_virtual_stage(a.chunk)) {
      if (const int64_t c = local_neighbour(a.chunk, -1); c >= 0) {  // the previous chunk's output, in place
        const Key prev{a.microbatch, c};
        input = chunks_.at(prev).output.detach();
        if (!keep_graph) chunks_.erase(prev);
      } else {
        input = take(st.activation, a);
      }
      // Kept for its gradient, which the backward sends to the previous virtual stage.
      if (keep_graph) st.input = input.requires_grad_(true);
    }
    // Compute starts once the input is here: waiting on the receive is bubble, not work.
    const int64_t interval = start_timing(a);
    const MicroBatch& mb = mbs_[a.microbatch];
    at::Tensor out = stage_.forward_chunk(a.chunk, input, mb);
    const bool last = stage_.is_last_virtual_stage(a.chunk);
    if (last) {
      const at::Tensor mb_loss = stage_.micro_batch_loss(out, mb);
      loss_sum_ = loss_sum_.defined() ? loss_sum_ + mb_loss.detach() : mb_loss.detach();
      if (keep_graph) out = mb_loss / static_cast<double>(m_);  // micro-batch losses averaged
    }
    if (keep_graph) {
      st.output = out;
      stashed_ += 1;
      result_.peak_stashed = std::max(result_.peak_stashed, stashed_);
      stashed_bytes_ += stash_bytes(a.chunk);
      result_.peak_stashed_bytes = std::max(result_.peak_stashed_bytes, stashed_bytes_);
    } else if (last) {
      chunks_.erase(key_of(a));  // the loss is all forward-only keeps of the last stage
    } else {
      st.output = out;  // until sent, or read by the next chunk on this rank
    }
    stop_timing(interval);
  }

  // A whole backward, or a split backward's B (the input gradient; W kept for later).
  void backward(const Action& a) {
    free_sent_outputs(false);
    ChunkState& st = chunks_.at(key_of(a));
    before_backward();
    at::Tensor grad;
    if (stage_.is_last_virtual_stage(a.chunk)) {
      grad = at::full_like(st.output, options_.loss_scale());
    } else if (const int64_t c = local_neighbour(a.chunk, +1); c >= 0) {  // the next chunk's input gradient
      grad = chunks_.at({a.microbatch, c}).input.grad();
    } else {
      grad = take(st.grad, a);
    }
    const bool whole = a.kind == ActionKind::kBackward;
    const int64_t interval = start_timing(a);
    if (whole) {
      backward_from(st.output, grad);
    } else {
      st.weights = backward_input(st.output, grad, st.input);
    }
    stop_timing(interval);
    st.output = at::Tensor();  // W holds what it needs of the graph
    if (whole) unstash(a.chunk);
  }

  // A split backward's W: the weight gradients its B left. The micro-batch's activations
  // are held until here (the layer inputs W multiplies with).
  void backward_weight(const Action& a) {
    ChunkState& st = chunks_.at(key_of(a));
    before_backward();
    const int64_t interval = start_timing(a);
    st.weights.run();
    stop_timing(interval);
    unstash(a.chunk);
  }

  // Tells the caller a pass that produces weight gradients is next, and whether it is the
  // step's last on this rank (B's too: recomputed layers' weight gradients come in B).
  void before_backward() {
    --backwards_left_;
    if (options_.before_backward()) options_.before_backward()(backwards_left_ == 0);
  }

  void unstash(int64_t chunk) {
    stashed_ -= 1;
    stashed_bytes_ -= stash_bytes(chunk);
  }

  // The input a compute consumes: wait for the batch that brings it.
  at::Tensor take(PendingRecv& recv, const Action& a) {
    MEGATORCH_CHECK(recv.work, "pipeline: rank ", rank_, " runs ", to_string(a),
                    " but no batch posted its receive; the schedule's steps must receive before they compute");
    recv.work->wait();
    at::Tensor buffer = std::move(recv.buffer);
    recv = PendingRecv{};
    return buffer;
  }

  // Megatron's deallocation: a sent output keeps only its autograd graph, for backward.
  void free_sent_outputs(bool all) {
    for (auto it = pending_sends_.begin(); it != pending_sends_.end();) {
      if (!all && !it->first->is_completed()) {
        ++it;
        continue;
      }
      it->first->wait();
      auto st = chunks_.find(it->second);
      if (options_.deallocate_outputs() && st != chunks_.end() && st->second.output.defined()) {
        st->second.output.set_data(at::empty({0}, st->second.output.options()));
      }
      it = pending_sends_.erase(it);
    }
  }

  // A compute action's interval, when the caller asked for timings (-1 when not).
  int64_t start_timing(const Action& a) {
    if (!options_.time_compute()) return -1;
    timed_.push_back(a);
    return timer_.start();
  }
  void stop_timing(int64_t interval) {
    if (interval >= 0) timer_.stop(interval);
  }

  PipelineStepResult finish() {
    free_sent_outputs(true);
    for (auto& transfer : transfers_) transfer->wait();
    if (options_.time_compute()) {  // reading device events waits for the device
      const auto spans = timer_.finish();
      for (size_t i = 0; i < timed_.size(); ++i)
        result_.timeline.push_back({rank_, timed_[i], spans[i].first, spans[i].second});
    }
    // Chunks that hand over in place keep their inputs for the other chunk's backward until the end.
    chunks_.clear();
    for (const auto& r : result_.timeline) result_.busy_s += r.end - r.start;
    result_.makespan_s =
        result_.timeline.empty() ? 0 : result_.timeline.back().end - result_.timeline.front().start;
    if (loss_sum_.defined()) result_.loss = loss_sum_ / static_cast<double>(m_);
    return std::move(result_);
  }

  // What a stashed micro-batch is counted as: the activation its chunk exchanges (its
  // output; the last virtual stage's input). A single stage exchanges none.
  int64_t stash_bytes(int64_t chunk) const {
    const int64_t stages = p_ * v_;
    if (stages == 1) return 0;
    const ActivationSpec spec = stage_.activation_spec(std::min(stage_.virtual_stage(chunk), stages - 2));
    int64_t bytes = static_cast<int64_t>(c10::elementSize(spec.dtype));
    for (int64_t d : spec.shape) bytes *= d;
    return bytes;
  }

  // This rank's chunk that holds the virtual stage `step` (+1 or -1) away from `chunk`'s,
  // or -1 when another rank holds it (or there is none). Interleaved on one rank, and the
  // turn of a V, hand tensors over in place.
  int64_t local_neighbour(int64_t chunk, int64_t step) const {
    const int64_t s = stage_.virtual_stage(chunk) + step;
    if (s < 0 || s >= p_ * v_ || rank_of_virtual_stage(s, p_, layout_) != rank_) return -1;
    return chunk_of_virtual_stage(s, p_, layout_);
  }

  static Key key_of(const Action& a) { return {a.microbatch, a.chunk}; }
  ChunkState& state(const Action& a) { return chunks_[key_of(a)]; }

  Stage& stage_;
  const std::vector<MicroBatch>& mbs_;
  const ExecutorOptions& options_;
  const int64_t p_, rank_, v_;
  const ChunkLayout layout_;
  const int64_t m_;
  const c10::Device device_;
  std::unique_ptr<comm::Group> pp_;
  std::map<Key, ChunkState> chunks_;
  std::vector<comm::Group> channels_;                     // where NCCL's rules apply: one per channel
  std::vector<Transfer> transfers_;                       // all of them, waited at the end of the step
  std::vector<std::pair<Transfer, Key>> pending_sends_;  // outputs freed once their send is done
  at::Tensor loss_sum_;
  int64_t backwards_left_ = 0;
  int64_t stashed_ = 0;  // outputs held for a backward
  int64_t stashed_bytes_ = 0;
  // Monotonic-clock seconds (one clock for every process of a machine, so the ranks'
  // timelines line up when gathered); device events on a GPU (compute_timer.h).
  ComputeTimer timer_;
  std::vector<Action> timed_;  // the compute actions, in the timer's interval order
  PipelineStepResult result_;
};

}  // namespace

PipelineStepResult run_pipeline_step(Stage& stage, const std::vector<MicroBatch>& mbs, const ExecutorOptions& options) {
  return StepRun(stage, mbs, options).run();
}

std::vector<TimelineRecord> gather_timeline(const PipelineStepResult& result, const std::string& pp_group) {
  // Ranks run different numbers of compute actions where a schedule splits only some
  // backwards (DualPipeV): each pads its [n, 5] doubles (kind, micro-batch, chunk, start,
  // end) to the longest with kind -1, and one all-gather brings them all.
  const int64_t n = static_cast<int64_t>(result.timeline.size());
  comm::Group pp(pp_group);
  at::Tensor longest = at::tensor({n}, at::kLong);
  if (pp.size() > 1) pp.all_reduce(longest, comm::ReduceOp::kMax);
  const int64_t rows = longest.item<int64_t>();
  at::Tensor mine = at::full({rows, 5}, -1.0, at::kDouble);
  for (int64_t i = 0; i < n; ++i) {
    const auto& r = result.timeline[i];
    mine[i] = at::tensor({static_cast<double>(r.action.kind), static_cast<double>(r.action.microbatch),
                          static_cast<double>(r.action.chunk), r.start, r.end},
                         at::kDouble);
  }
  const at::Tensor all = pp.size() > 1 ? pp.all_gather(mine, 0) : mine;
  const at::Tensor real = all.select(1, 0) >= 0;
  const double t0 = real.any().item<bool>() ? all.select(1, 3).masked_select(real).min().item<double>() : 0;
  std::vector<TimelineRecord> out;
  for (int64_t i = 0; i < all.size(0); ++i) {
    const auto row = all[i];
    if (row[0].item<double>() < 0) continue;  // padding
    Action a;
    a.kind = static_cast<ActionKind>(row[0].item<int64_t>());
    a.microbatch = row[1].item<int64_t>();
    a.chunk = row[2].item<int64_t>();
    out.push_back({i / std::max<int64_t>(rows, 1), a, row[3].item<double>() - t0, row[4].item<double>() - t0});
  }
  return out;
}

double measured_bubble(const std::vector<TimelineRecord>& timeline) {
  if (timeline.empty()) return 0;
  double start = timeline.front().start, end = timeline.front().end;
  std::map<int64_t, double> busy;
  for (const auto& r : timeline) {
    start = std::min(start, r.start);
    end = std::max(end, r.end);
    busy[r.rank] += r.end - r.start;
  }
  double idle_sum = 0, busy_sum = 0;
  for (const auto& [rank, b] : busy) {
    idle_sum += (end - start) - b;
    busy_sum += b;
  }
  return idle_sum / busy_sum;
}

}  // namespace megatorch::pipeline
