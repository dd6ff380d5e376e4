#include "megatorch/plan/planner.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "megatorch/check.h"
#include "megatorch/plan/moe.h"

namespace megatorch::plan {

MemoryOptions memory_options(const PlanRequest& r) {
  MemoryOptions o;
  o.precision = r.precision;
  o.activations = r.activations;
  o.activations.activation_bytes = static_cast<double>(activation_dtype_bytes(r.precision));
  o.reserved_bytes = r.reserved_gb * 1e9;
  return o;
}

namespace {

using pipeline::ScheduleKind;
// The schedule, p, m, v and the F, B + W, B and W ticks: all a simulation depends on.
using SimKey = std::tuple<ScheduleKind, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

const pipeline::SimulationResult& simulate_cached(std::map<SimKey, pipeline::SimulationResult>& cache,
                                                  const Layout& l, int64_t m, const PipelineCosts& pc) {
  const pipeline::SimulatorOptions& o = pc.options;
  const SimKey key{schedule_of(l), l.pp, m, model_chunks(l), o.forward_cost, o.backward_cost, o.backward_input_cost,
                   o.backward_weight_cost};
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  return cache.emplace(key, pipeline::simulate_schedule(schedule_of(l), l.pp, m, model_chunks(l), o)).first->second;
}

CostOptions cost_options(const PlanRequest& r) {
  CostOptions co;
  co.precision = r.precision;
  co.fp8 = r.fp8;
  return co;
}

// Why the search leaves out a valid layout ("" when it does not): a split backward (zb-h1,
// zb-v, dualpipev) with no W to defer. zb-h1 then runs 1F1B's timeline with every stage
// holding min(p, m) micro-batches; the V's order is built around deferred W's that full
// recompute does not have (it would be simulated with W as 1 tick taken from B).
std::string without_gain(const Layout& l, const PipelineCosts& pc) {
  const ScheduleKind kind = schedule_of(l);
  if (!pipeline::splits_backward(kind) || pc.backward_weight_ticks > 0) return "";
  if (kind == ScheduleKind::kZeroBubbleH1)
    return "no weight gradients to defer (W = 0 ticks: full recompute computes them inside B), so 1f1b's time with "
           "more activations in flight; use --schedule 1f1b";
  return std::string("no weight gradients to defer (W = 0 ticks: full recompute computes them inside B), which ") +
         pipeline::schedule_kind_name(kind) + "'s order is built on; use --schedule 1f1b or interleaved, or fix " +
         "--schedule " + pipeline::schedule_kind_name(kind) + " to plan it with W as 1 tick";
}

// The schedules the planner models, in the order ties are broken and --explain lists them:
// plain 1F1B (interleaved at VP > 1) first, the split backwards after it, the V last.
std::vector<ScheduleKind> modelled_schedules() {
  return {ScheduleKind::kOneFOneB, ScheduleKind::kInterleaved, ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleV,
          ScheduleKind::kDualPipeV};
}
int schedule_order(ScheduleKind kind) {
  if (kind == ScheduleKind::kInterleaved) kind = ScheduleKind::kOneFOneB;  // one schedule, told apart by VP
  const auto all = modelled_schedules();
  return static_cast<int>(std::find(all.begin(), all.end(), kind) - all.begin());
}

Candidate evaluate_cached(const PlanRequest& r, const Layout& l, std::map<SimKey, pipeline::SimulationResult>& cache) {
  validate_layout(r.model, l, r.cluster.gpus(), r.global_batch);
  const CostOptions co = cost_options(r);
  const PipelineCosts pc = pipeline_costs(r.model, l, r.cluster, r.calibration, co);
  const auto& sim = simulate_cached(cache, l, l.num_microbatches(r.global_batch), pc);
  Candidate c;
  c.layout = l;
  c.memory = predict_memory(r.model, l, sim, memory_options(r));
  c.time = predict_time(r.model, l, r.global_batch, r.cluster, r.calibration, co, pc, sim);
  return c;
}

std::vector<int64_t> choices(const std::optional<int64_t>& fixed, std::vector<int64_t> all) {
  return fixed ? std::vector<int64_t>{*fixed} : all;
}

// Searched ETP sizes: each expert's shards over divisors of the ranks an EP rank's experts
// fold into (TP*CP*DP / EP) that split the expert FFN size; 1 for dense models.
std::vector<int64_t> expert_tp_sizes(const ModelSpec& m, int64_t stage, int64_t ep) {
  std::vector<int64_t> out{1};
  if (!m.is_moe() || ep < 1 || stage % ep) return out;
  for (int64_t e = 2; e <= stage / ep; ++e)
    if ((stage / ep) % e == 0 && m.moe_ffn() % e == 0) out.push_back(e);
  return out;
}

std::string gb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  return buf;
}

}  // namespace

Candidate evaluate(const PlanRequest& r, const Layout& l) {
  std::map<SimKey, pipeline::SimulationResult> cache;
  return evaluate_cached(r, l, cache);
}

PlanResult plan(const PlanRequest& r) {
  r.model.validate();
  const Cluster& c = r.cluster;
  const int64_t n = c.gpus();
  MEGATORCH_CHECK(n >= 1 && r.global_batch >= 1, "expected at least one GPU and a global batch >= 1, got ", n, " GPUs and ",
                  r.global_batch);
  MEGATORCH_CHECK(!r.cp || *r.cp >= 1, "expected --context-parallel-size >= 1, got ", r.cp.value_or(0),
                  "; give 1 for no context parallelism or leave it out to search it");
  const bool moe = r.model.is_moe();
  MEGATORCH_CHECK(!r.ep || *r.ep >= 1, "expected --expert-model-parallel-size >= 1, got ", r.ep.value_or(0),
                  "; give 1 for no expert parallelism or leave it out to search it");
  MEGATORCH_CHECK(moe || r.ep.value_or(1) == 1, "expected --expert-model-parallel-size 1 for a dense model, got ",
                  r.ep.value_or(1), "; give --num-experts to plan a mixture of experts");
  MEGATORCH_CHECK(!r.etp || *r.etp >= 1, "expected --expert-tensor-parallel-size >= 1, got ", r.etp.value_or(0),
                  "; give 1 to keep every expert whole, or a size dividing TP*CP*DP/EP and the expert FFN size");
  MEGATORCH_CHECK(moe || r.etp.value_or(1) == 1, "expected --expert-tensor-parallel-size 1 for a dense model, got ",
                  r.etp.value_or(1), "; give --num-experts to plan a mixture of experts");
  if (r.tp && r.pp && r.dp && (r.cp.value_or(1) == 1)) {
    // Without a fixed CP the rest of the GPUs may go to CP: the product must divide them.
    const int64_t prod = *r.tp * *r.pp * *r.dp;
    MEGATORCH_CHECK(r.cp ? prod == n : n % prod == 0, "TP*PP*DP = ", *r.tp, "*", *r.pp, "*", *r.dp, " = ", prod,
                    " does not equal the ", n, " GPUs (", c.nodes, " nodes x ", c.gpus_per_node, ")",
                    r.cp ? "" : " nor divide them into a context-parallel size",
                    "; fix at most two of them or pick sizes whose product is ", n);
  }
  if (r.tp && r.pp && r.dp && r.cp && *r.cp > 1) {
    const int64_t prod = *r.tp * *r.cp * *r.pp * *r.dp;
    MEGATORCH_CHECK(prod == n, "TP*CP*PP*DP = ", *r.tp, "*", *r.cp, "*", *r.pp, "*", *r.dp, " = ", prod,
                    " does not equal the ", n, " GPUs (", c.nodes, " nodes x ", c.gpus_per_node, "); fix at most "
                    "three of them or pick sizes whose product is ", n);
  }
  std::vector<int64_t> tps, cps, pps, vpps, mbs;
  for (int64_t t = 1; t <= std::min(c.gpus_per_node, n); ++t)
    if (c.gpus_per_node % t == 0) tps.push_back(t);
  // Powers of two whose 2c chunks split the sequence; the GPU count and the heads are checked
  // per layout (they depend on TP and PP).
  for (int64_t cp = 1; cp <= n; cp *= 2)
    if (cp == 1 || r.model.seq_length % (2 * cp) == 0) cps.push_back(cp);
  for (int64_t p = 1; p <= r.model.num_layers; ++p)
    if (r.model.num_layers % p == 0 && n % p == 0) pps.push_back(p);
  for (int64_t v = 1; v <= r.max_vpp; ++v) vpps.push_back(v);
  if (r.schedule) {
    // A fixed schedule against the fixed knobs, named before any layout is tried; the searched
    // VP sizes are those it runs with (2 stages stand in for an unfixed PP).
    const auto conflict = [&](int64_t v) {
      return schedule_error(*r.schedule, r.pp.value_or(2), v);
    };
    vpps.erase(std::remove_if(vpps.begin(), vpps.end(), [&](int64_t v) { return !conflict(v).empty(); }), vpps.end());
    const std::string e = conflict(r.vpp.value_or(vpps.empty() ? 1 : vpps.front()));
    MEGATORCH_CHECK(e.empty(), "--schedule ", pipeline::schedule_kind_name(*r.schedule),
                    " does not run with the fixed settings: ", e);
  }
  for (int64_t b = 1; b <= r.max_micro_batch; b *= 2) mbs.push_back(b);
  const std::vector<int> zeros = r.zero_stage ? std::vector<int>{*r.zero_stage} : std::vector<int>{0, 1, 2, 3};
  const std::vector<Recompute> recomputes =
      r.recompute ? std::vector<Recompute>{*r.recompute}
                  : std::vector<Recompute>{Recompute::kNone, Recompute::kSelective, Recompute::kFull};

  // Searched: 1F1B (interleaved at VP > 1, schedule_of) and next to it zb-h1, zb-v and
  // dualpipev, on either backend.
  std::vector<ScheduleKind> kinds{ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1, ScheduleKind::kZeroBubbleV,
                                  ScheduleKind::kDualPipeV};
  if (r.schedule) kinds = {*r.schedule};
  PlanResult result;
  std::map<SimKey, pipeline::SimulationResult> cache;
  const MemoryOptions mo = memory_options(r);
  const double capacity = c.memory_bytes();
  std::optional<Layout> smallest;  // least memory among valid layouts, for the error message
  double smallest_bound = 0;
  // One layout: refused (kept as an example of why), or screened and simulated against the
  // memory, and ranked if it fits.
  // `optional`: a searched zb-h1, zb-v or dualpipev next to its 1F1B layout, left out
  // silently where it cannot run or gains nothing.
  const auto consider = [&](const Layout& l, bool example, bool optional) {
    const std::string err = layout_error(r.model, l, n, r.global_batch);
    if (!err.empty()) {
      if (result.invalid_examples.size() < 3 && example && !optional)
        result.invalid_examples.push_back(l.str() + ": " + err);
      return;
    }
    if (optional && !without_gain(l, pipeline_costs(r.model, l, c, r.calibration, cost_options(r))).empty()) return;
    ++result.considered;
    // Screen before simulating: the exact static bytes plus the 1F1B in-flight
    // activations are a lower bound (interleaving, zb-h1 and the V only add to them: the V
    // holds 2p or 2p+1 chunks of half a stage on every rank).
    double per_layer = activation_bytes_per_layer(r.model, l, mo.activations);
    if (moe && num_moe_layers(r.model) == r.model.num_layers)
      per_layer = moe_activation_bytes_per_layer(r.model, l, mo.activations);
    else if (moe && num_moe_layers(r.model) > 0)
      per_layer = std::min(per_layer, moe_activation_bytes_per_layer(r.model, l, mo.activations));
    const double bound = zero_bytes_per_rank(r.model, l, r.precision, 0).total() + mo.reserved_bytes +
                         per_layer * static_cast<double>(r.model.num_layers / l.pp) *
                             static_cast<double>(std::min<int64_t>(l.pp, l.num_microbatches(r.global_batch)));
    if (bound > capacity) {
      ++result.too_big;
      if (!smallest || bound < smallest_bound) smallest = l, smallest_bound = bound;
      return;
    }
    Candidate cand = evaluate_cached(r, l, cache);
    if (cand.memory.total() > capacity) {
      ++result.too_big;
      if (!smallest || cand.memory.total() < smallest_bound) smallest = l, smallest_bound = cand.memory.total();
      return;
    }
    result.ranked.push_back(std::move(cand));
  };
  for (int64_t tp : choices(r.tp, tps))
    for (int64_t pp : choices(r.pp, pps))
      for (int64_t cp : choices(r.cp, cps)) {
        // Names as before CP when cp = 1, so the messages read as they always did.
        const std::string tcp = cp == 1 ? "TP*PP = " + std::to_string(tp * pp)
                                        : "TP*CP*PP = " + std::to_string(tp * cp * pp);
        if (n % (tp * cp * pp)) {
          // A searched CP that does not divide is no example of what the user fixed.
          if (result.invalid_examples.size() < 3 && (r.tp || r.pp || r.cp) && (cp == 1 || r.cp))
            result.invalid_examples.push_back(tcp + " does not divide " + std::to_string(n) + " GPUs");
          continue;
        }
        const int64_t dp = n / (tp * cp * pp);
        if (r.dp && *r.dp != dp) {
          if (result.invalid_examples.size() < 3 && (cp == 1 || r.cp))
            result.invalid_examples.push_back("TP=" + std::to_string(tp) + (cp > 1 ? " CP=" + std::to_string(cp) : "") +
                                              " PP=" + std::to_string(pp) + " leaves DP=" + std::to_string(dp) +
                                              ", not " + std::to_string(*r.dp));
          continue;
        }
        // The experts spread over divisors of the stage's TP*CP*DP ranks that divide them.
        std::vector<int64_t> eps{1};
        if (moe) {
          eps.clear();
          for (int64_t e = 1; e <= tp * cp * dp; ++e)
            if ((tp * cp * dp) % e == 0 && r.model.num_experts % e == 0) eps.push_back(e);
        }
        for (int64_t ep : choices(r.ep, eps))
          for (int64_t etp : choices(r.etp, expert_tp_sizes(r.model, tp * cp * dp, ep)))
            for (int64_t v : choices(r.vpp, vpps))
              for (int64_t b : choices(r.micro_batch, mbs))
                for (int zero : zeros)
                  for (Recompute rc : recomputes)
                    for (bool sp : {false, true})
                      for (ScheduleKind kind : kinds) {
                        if (r.sequence_parallel ? sp != *r.sequence_parallel : (sp && tp == 1)) continue;
                        // What the trainer refuses with experts is no example of what was fixed.
                        if (moe && zero == 3 && !r.zero_stage) continue;
                        Layout l{tp, pp, dp, v, zero, b, rc, sp, cp, r.cp_comm_type, ep, etp};
                        l.schedule = kind;
                        l.backend = r.backend;
                        // A searched CP > 1 that does not fit the model is no example of what was fixed.
                        consider(l, cp == 1 || r.cp, !r.schedule && kind != ScheduleKind::kOneFOneB);
                      }
      }
  if (result.considered == 0) {
    std::string why;
    for (const auto& e : result.invalid_examples) why += "\n  " + e;
    MEGATORCH_FAIL("no valid layout of ", r.model.name, " on ", n, " GPUs with the fixed settings; for example:", why);
  }
  if (result.ranked.empty()) {
    const double need = evaluate_cached(r, *smallest, cache).memory.total(), short_by = need - capacity;
    const double whole = static_cast<double>(total_params(r.model)) * precision_bytes(r.precision).total();
    MEGATORCH_FAIL("no layout fits in ", gb(capacity), " per GPU: the smallest (", smallest->str(), ") needs ",
                   gb(need), " per GPU, short by ", gb(short_by), " per GPU (", gb(short_by * n), " over ", n,
                   " GPUs). The model's weights and optimizer states alone are ", gb(whole), " (",
                   precision_bytes(r.precision).total(), " bytes x ", total_params(r.model), " parameters) against ",
                   gb(capacity * n), " in all ", n, " GPUs. Add GPUs (--nodes), memory (--gpu-memory-gb), ZeRO, "
                   "recomputation", r.cp ? ", context parallelism (a larger --context-parallel-size)" : "",
                   moe && r.ep ? ", expert parallelism (a larger --expert-model-parallel-size)" : "",
                   moe && r.etp.value_or(1) > 1 ? ", expert tensor parallelism (a larger --expert-tensor-parallel-size)"
                                                : "",
                   " or a smaller micro-batch.");
  }
  std::stable_sort(result.ranked.begin(), result.ranked.end(), [](const Candidate& a, const Candidate& b) {
    if (a.time.step != b.time.step) return a.time.step < b.time.step;
    if (a.memory.total() != b.memory.total()) return a.memory.total() < b.memory.total();
    // The same time and memory: the schedule without split backward passes, then zb-h1
    // before the V.
    return schedule_order(schedule_of(a.layout)) < schedule_order(schedule_of(b.layout));
  });
  return result;
}

std::string why_lost(const Candidate& c, const Candidate& best) {
  const TimeBreakdown &a = c.time, &b = best.time;
  if (&c == &best || a.step <= b.step) return "best";
  const std::pair<const char*, double> kinds[] = {{"compute", a.compute - a.recompute - (b.compute - b.recompute)},
                                                  {"recompute", a.recompute - b.recompute},
                                                  {"TP comm", a.tp_comm - b.tp_comm},
                                                  {"CP comm", a.cp_comm - b.cp_comm},
                                                  {"EP comm", a.ep_comm - b.ep_comm},
                                                  {"p2p", a.p2p - b.p2p},
                                                  {"bubble", a.bubble - b.bubble},
                                                  {"DP comm", a.dp_comm - b.dp_comm}};
  std::vector<std::pair<const char*, double>> grew;
  for (const auto& k : kinds)
    if (k.second > 0.005 * b.step) grew.push_back(k);
  std::sort(grew.begin(), grew.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  std::ostringstream os;
  char buf[64];
  std::snprintf(buf, sizeof buf, "+%.1f%% step time", 100 * (a.step / b.step - 1));
  os << buf;
  for (size_t i = 0; i < grew.size() && i < 2; ++i) {
    std::snprintf(buf, sizeof buf, "%s %s +%.3f s", i == 0 ? ":" : ",", grew[i].first, grew[i].second);
    os << buf;
  }
  return os.str();
}

std::vector<ScheduleChoice> schedule_choices(const PlanRequest& r, const Layout& chosen) {
  std::vector<ScheduleChoice> out;
  for (ScheduleKind kind : modelled_schedules()) {
    ScheduleChoice c;
    c.kind = kind;
    c.layout = chosen;
    c.layout.schedule = kind;
    // The V's two chunks come with the schedule: VP 1 as for 1f1b and zb-h1.
    c.layout.vpp = kind == ScheduleKind::kInterleaved ? std::max<int64_t>(chosen.vpp, 2) : 1;
    c.error = layout_error(r.model, c.layout, r.cluster.gpus(), r.global_batch);
    if (c.error.empty()) {
      c.costs = pipeline_costs(r.model, c.layout, r.cluster, r.calibration, cost_options(r));
      // What the search left out; a layout the user fixed there is evaluated all the same.
      if (kind != schedule_of(chosen)) c.error = without_gain(c.layout, c.costs);
    }
    if (c.error.empty()) c.candidate = evaluate(r, c.layout);
    out.push_back(std::move(c));
  }
  return out;
}

std::string gpt_pretrain_flags(const PlanRequest& r, const Layout& l) {
  std::ostringstream os;
  os << "--tensor-model-parallel-size " << l.tp << " --pipeline-model-parallel-size " << l.pp;
  if (l.cp > 1) os << " --context-parallel-size " << l.cp << " --cp-comm-type " << to_string(l.cp_comm);
  if (l.ep > 1) os << " --expert-model-parallel-size " << l.ep;
  if (l.etp > 1) os << " --expert-tensor-parallel-size " << l.etp;
  // gpt_pretrain takes virtual stages as layers per virtual stage, and runs them interleaved.
  if (l.vpp > 1) os << " --num-layers-per-virtual-pipeline-stage " << r.model.num_layers / (l.pp * l.vpp);
  os << " --micro-batch-size " << l.micro_batch << " --global-batch-size " << r.global_batch << " --zero-stage "
     << l.zero_stage;
  if (l.recompute != Recompute::kNone) os << " --recompute-granularity " << transformer::to_string(l.recompute);
  if (l.sequence_parallel) os << " --sequence-parallel";
  if (!schedule_implied(l)) os << " --schedule " << pipeline::schedule_kind_name(schedule_of(l));
  // gpt_pretrain picks NCCL for GPU tensors unless told otherwise.
  if (l.backend == DistributedBackend::kGloo) os << " --distributed-backend gloo";
  if (r.precision == Precision::kBf16) os << " --bf16";
  if (r.precision == Precision::kFp16) os << " --fp16";
  return os.str();
}

}  // namespace megatorch::plan
