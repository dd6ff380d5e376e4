#include "megatorch/pipeline/executor.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <chrono>
#include <map>
#include <memory>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/pipeline/compute_timer.h"
#include "megatorch/pipeline/p2p_batches.h"

namespace megatorch::pipeline {
namespace {

using Key = std::pair<int64_t, int64_t>;  // (micro-batch, chunk)

// A distinct tag per message (kind, micro-batch, receiving virtual stage: p2p_message,
// which sender and receiver compute alike), so Gloo, which pairs by tag, can never pair
// the wrong send and receive between two ranks. NCCL ignores tags and pairs by issue
// order, which the batches' order guarantees (nccl_order_model.h).
int64_t tag_of(const Action& a, int64_t rank, int64_t p, int64_t v) {
  const P2PMessage msg = p2p_message(a, rank, p);
  return (msg.microbatch * p * v + msg.to_stage) * 2 + (msg.gradient ? 1 : 0);
}

// Backward from `output` with `grad` through the engine directly: the output's data
// may have been freed (deallocation), so the usual shape check must not run.
void backward_from(const at::Tensor& output, const at::Tensor& grad) {
  const auto edge = torch::autograd::impl::gradient_edge(output);
  MEGATORCH_CHECK(edge.function, "pipeline: expected a stage output attached to the autograd graph");
  torch::autograd::Engine::get_default_engine().execute({edge}, {grad}, /*keep_graph=*/false, /*create_graph=*/false,
                                                        /*accumulate_grad=*/true);
}

struct Stash {
  at::Tensor input;   // the received activation (requires grad), undefined on the first stage
  at::Tensor output;  // the stage output (or the scaled loss on the last stage)
};

}  // namespace

PipelineStepResult run_pipeline_step(PipelineStage& stage, const std::vector<MicroBatch>& mbs,
                                     const ExecutorOptions& options) {
  const int64_t p = stage->pp_size(), rank = stage->pp_rank(), v = stage->num_chunks();
  const int64_t m = static_cast<int64_t>(mbs.size());
  MEGATORCH_CHECK(m >= 1, "pipeline: expected at least one micro-batch");
  MEGATORCH_CHECK(options.schedule() == ScheduleKind::kInterleaved || v == 1, "pipeline: the ",
                  schedule_kind_name(options.schedule()), " schedule runs one chunk per stage, got ", v,
                  " virtual chunks; use the interleaved schedule");
  const auto actions = build_schedule(options.schedule(), p, m, v, rank);
  int64_t backwards_left = std::count_if(actions.begin(), actions.end(),
                                         [](const Action& a) { return a.kind == ActionKind::kBackward; });
  std::unique_ptr<comm::Group> pp;
  if (p > 1) pp = std::make_unique<comm::Group>(stage->options.pp_group());
  const auto& cfg = stage->options.config();
  for (int64_t i = 0; i < m; ++i) {
    // Shapes between stages come from the config: check the batch before any p2p.
    MEGATORCH_CHECK(mbs[i].ids.dim() == 2 && mbs[i].ids.size(1) == cfg.seq_length() &&
                        mbs[i].ids.sizes() == mbs[0].ids.sizes() && mbs[i].labels.sizes() == mbs[i].ids.sizes(),
                    "pipeline: expected every micro-batch's ids and labels to be [b, ", cfg.seq_length(),
                    "] with one b, got ids ", mbs[i].ids.sizes(), " and labels ", mbs[i].labels.sizes(),
                    " for micro-batch ", i);
  }
  const auto act_shape = stage->activation_shape(mbs[0].ids.size(0));
  const auto act_opts = at::TensorOptions().dtype(stage->options.config().params_dtype()).device(
      stage->options.config().device());

  PipelineStepResult result;
  std::map<Key, Stash> stash;
  // A posted batch, shared by the receives it brings and the sends it carries; waited at
  // most once (waiting again is free).
  using Batch = std::shared_ptr<comm::Work>;
  std::vector<Batch> batches;  // all of them, waited at the end of the step
  std::map<Key, Batch> recv_act, recv_grad;
  std::map<Key, at::Tensor> recv_act_buf, recv_grad_buf;
  std::vector<std::pair<Batch, Key>> pending_sends;  // outputs freed once their batch is done
  at::Tensor loss_sum;
  // A stashed micro-batch holds one [s, b, h] activation's worth for its backward.
  int64_t act_bytes = static_cast<int64_t>(at::empty({0}, act_opts).element_size());
  for (int64_t d : act_shape) act_bytes *= d;
  int64_t stashed = 0;
  // Monotonic-clock seconds (one clock for every process of a machine, so the ranks'
  // timelines line up when gathered); device events on a GPU (compute_timer.h).
  ComputeTimer timer(act_opts.device());
  std::vector<Action> timed;  // the compute actions, in the timer's interval order

  auto free_sent_outputs = [&](bool all) {
    for (auto it = pending_sends.begin(); it != pending_sends.end();) {
      if (!all && !it->first->is_completed()) {
        ++it;
        continue;
      }
      it->first->wait();
      auto st = stash.find(it->second);
      if (options.deallocate_outputs() && st != stash.end() && st->second.output.defined()) {
        st->second.output.set_data(at::empty({0}, st->second.output.options()));
      }
      it = pending_sends.erase(it);
    }
  };
  // The input a compute consumes: wait for the batch that brings it.
  auto take = [&](std::map<Key, Batch>& works, std::map<Key, at::Tensor>& bufs, const Key& key, const Action& a) {
    auto w = works.find(key);
    MEGATORCH_CHECK(w != works.end(), "pipeline: rank ", rank, " runs ", to_string(a),
                    " but no batch posted its receive; the schedule's steps must receive before they compute");
    w->second->wait();
    works.erase(w);
    at::Tensor buf = bufs.at(key);
    bufs.erase(key);
    return buf;
  };

  // Transfers go out in the schedule's batches (p2p_batches.h): on NCCL each batch is one
  // group, which is what keeps the 1F1B steady state and the interleaved schedule from
  // deadlocking; on Gloo the same ops are posted one by one with their tags.
  for (const P2PStep& step : p2p_steps(actions, rank, p, recv_posting(options.schedule()))) {
    if (step.is_batch()) {
      std::vector<comm::P2POp> ops;
      ops.reserve(step.batch.size());
      for (const Action& a : step.batch) {
        const Key key{a.microbatch, a.chunk};
        comm::P2POp op;
        op.peer = a.peer;
        op.tag = tag_of(a, rank, p, v);
        switch (a.kind) {
          case ActionKind::kRecvActivation:
          case ActionKind::kRecvGrad:
            op.kind = comm::P2POp::Kind::kRecv;
            op.tensor = at::empty(act_shape, act_opts);
            break;
          case ActionKind::kSendActivation:
            op.tensor = stash.at(key).output.detach();
            break;
          case ActionKind::kSendGrad: {
            const at::Tensor& input = stash.at(key).input;
            MEGATORCH_CHECK(input.grad().defined(), "pipeline: no input gradient for micro-batch ", a.microbatch,
                            " chunk ", a.chunk, "; the stage's output does not depend on its input");
            op.tensor = input.grad();  // the batch's Work keeps it alive until sent
            break;
          }
          default:
            MEGATORCH_FAIL("pipeline: expected only sends and receives in a p2p batch, got ", to_string(a));
        }
        ops.push_back(std::move(op));
      }
      // One Work per op where the backend does not coalesce (Gloo): a compute then waits
      // for its own receive only, not for the batch's sends to be taken up too.
      std::vector<Batch> works;
      if (pp->coalesces(act_opts.device().type())) {
        works.assign(ops.size(), std::make_shared<comm::Work>(pp->batch_p2p(ops)));
      } else {
        for (const auto& op : ops) works.push_back(std::make_shared<comm::Work>(pp->batch_p2p({op})));
      }
      batches.insert(batches.end(), works.begin(), works.end());
      for (size_t i = 0; i < step.batch.size(); ++i) {
        const Action& a = step.batch[i];
        const Key key{a.microbatch, a.chunk};
        if (is_recv(a.kind)) {
          const bool act = a.kind == ActionKind::kRecvActivation;
          (act ? recv_act : recv_grad).emplace(key, works[i]);
          (act ? recv_act_buf : recv_grad_buf).emplace(key, ops[i].tensor);
        } else if (a.kind == ActionKind::kSendActivation) {
          pending_sends.emplace_back(works[i], key);
        }
      }
      continue;
    }
    const Action& a = step.compute;
    const Key key{a.microbatch, a.chunk};
    switch (a.kind) {
      case ActionKind::kForward: {
        models::GPTModel model = stage->chunk(a.chunk);
        Stash s;
        at::Tensor input;
        if (stage->is_first_virtual_stage(a.chunk)) {
          input = mbs[a.microbatch].ids;
        } else if (p == 1) {  // interleaved on one rank: the previous chunk's output, in place
          const Stash& prev = stash.at({a.microbatch, a.chunk - 1});
          input = prev.output.detach().requires_grad_(true);
          s.input = input;
        } else {
          input = take(recv_act, recv_act_buf, key, a).requires_grad_(true);
          s.input = input;
        }
        // Compute starts once the input is here: waiting on the receive is bubble, not work.
        const int64_t interval = timer.start();
        timed.push_back(a);
        at::Tensor out = model->forward(input);
        if (stage->is_last_virtual_stage(a.chunk)) {
          const at::Tensor& labels = mbs[a.microbatch].labels;
          const at::Tensor per_token = model->per_token_loss(out, labels);
          const at::Tensor valid = (labels != -100).sum().clamp_min(1).to(per_token.scalar_type());
          const at::Tensor mb_loss = per_token.sum() / valid;
          loss_sum = loss_sum.defined() ? loss_sum + mb_loss.detach() : mb_loss.detach();
          out = mb_loss / static_cast<double>(m);  // micro-batch losses averaged
        }
        s.output = out;
        stashed += 1;
        result.peak_stashed = std::max(result.peak_stashed, stashed);
        result.peak_stashed_bytes = std::max(result.peak_stashed_bytes, stashed * act_bytes);
        stash[key] = std::move(s);
        timer.stop(interval);
        break;
      }
      case ActionKind::kBackward: {
        free_sent_outputs(false);
        Stash& s = stash.at(key);
        if (options.before_backward()) options.before_backward()(--backwards_left == 0);
        at::Tensor grad;
        if (stage->is_last_virtual_stage(a.chunk)) {
          grad = at::full_like(s.output, options.loss_scale());
        } else if (p == 1) {  // interleaved on one rank: the next chunk's input gradient
          grad = stash.at({a.microbatch, a.chunk + 1}).input.grad();
        } else {
          grad = take(recv_grad, recv_grad_buf, key, a);
        }
        const int64_t interval = timer.start();
        timed.push_back(a);
        backward_from(s.output, grad);
        timer.stop(interval);
        stashed -= 1;
        s.output = at::Tensor();
        break;
      }
      default:
        MEGATORCH_FAIL("pipeline: the executor does not run ", action_kind_name(a.kind), " actions yet");
    }
  }
  free_sent_outputs(true);
  for (auto& batch : batches) batch->wait();
  const auto spans = timer.finish();
  for (size_t i = 0; i < timed.size(); ++i) result.timeline.push_back({rank, timed[i], spans[i].first, spans[i].second});
  // Interleaved on one rank keeps inputs for the next chunk's backward until the end.
  stash.clear();
  for (const auto& r : result.timeline) result.busy_s += r.end - r.start;
  result.makespan_s = result.timeline.empty() ? 0 : result.timeline.back().end - result.timeline.front().start;
  if (loss_sum.defined()) result.loss = loss_sum / static_cast<double>(m);
  return result;
}

std::vector<TimelineRecord> gather_timeline(const PipelineStepResult& result, const std::string& pp_group) {
  // Every rank runs the same number of compute actions (2·m·v): one all-gather of
  // [n, 5] doubles (kind, micro-batch, chunk, start, end) brings them all.
  const int64_t n = static_cast<int64_t>(result.timeline.size());
  at::Tensor mine = at::empty({n, 5}, at::kDouble);
  for (int64_t i = 0; i < n; ++i) {
    const auto& r = result.timeline[i];
    mine[i] = at::tensor({static_cast<double>(r.action.kind), static_cast<double>(r.action.microbatch),
                          static_cast<double>(r.action.chunk), r.start, r.end},
                         at::kDouble);
  }
  comm::Group pp(pp_group);
  const at::Tensor all = pp.size() > 1 ? pp.all_gather(mine, 0) : mine;
  const double t0 = n ? all.select(1, 3).min().item<double>() : 0;
  std::vector<TimelineRecord> out;
  for (int64_t i = 0; i < all.size(0); ++i) {
    const auto row = all[i];
    Action a;
    a.kind = static_cast<ActionKind>(row[0].item<int64_t>());
    a.microbatch = row[1].item<int64_t>();
    a.chunk = row[2].item<int64_t>();
    out.push_back({i / std::max<int64_t>(n, 1), a, row[3].item<double>() - t0, row[4].item<double>() - t0});
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
