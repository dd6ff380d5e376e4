#include "megatorch/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <sstream>

#include "megatorch/check.h"

namespace megatorch::pipeline {

const char* action_kind_name(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward: return "forward";
    case ActionKind::kBackward: return "backward";
    case ActionKind::kBackwardInput: return "backward_input";
    case ActionKind::kBackwardWeight: return "backward_weight";
    case ActionKind::kSendActivation: return "send_activation";
    case ActionKind::kRecvActivation: return "recv_activation";
    case ActionKind::kSendGrad: return "send_grad";
    case ActionKind::kRecvGrad: return "recv_grad";
  }
  return "?";
}

bool is_compute(ActionKind kind) {
  return kind == ActionKind::kForward || kind == ActionKind::kBackward ||
         kind == ActionKind::kBackwardInput || kind == ActionKind::kBackwardWeight;
}
bool is_send(ActionKind kind) { return kind == ActionKind::kSendActivation || kind == ActionKind::kSendGrad; }
bool is_recv(ActionKind kind) { return kind == ActionKind::kRecvActivation || kind == ActionKind::kRecvGrad; }

std::string to_string(const Action& a) {
  std::ostringstream os;
  os << action_kind_name(a.kind) << "(mb " << a.microbatch << ", chunk " << a.chunk << ")";
  if (is_send(a.kind)) os << " to rank " << a.peer;
  if (is_recv(a.kind)) os << " from rank " << a.peer;
  return os.str();
}

const char* schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::kOneFOneB: return "1f1b";
    case ScheduleKind::kInterleaved: return "interleaved";
    case ScheduleKind::kZeroBubbleH1: return "zb-h1";
    case ScheduleKind::kZeroBubbleV: return "zb-v";
    case ScheduleKind::kDualPipeV: return "dualpipev";
  }
  return "?";
}

const char* schedule_kind_names() { return "gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev"; }

bool splits_backward(ScheduleKind kind) {
  return kind == ScheduleKind::kZeroBubbleH1 || kind == ScheduleKind::kZeroBubbleV || kind == ScheduleKind::kDualPipeV;
}

ChunkLayout chunk_layout(ScheduleKind kind) {
  return kind == ScheduleKind::kZeroBubbleV || kind == ScheduleKind::kDualPipeV ? ChunkLayout::kV
                                                                                : ChunkLayout::kLooped;
}

const char* chunk_layout_name(ChunkLayout layout) { return layout == ChunkLayout::kV ? "v" : "looped"; }

int64_t chunks_per_rank(ScheduleKind kind, int64_t v) { return chunk_layout(kind) == ChunkLayout::kV ? 2 : v; }

std::optional<ScheduleKind> find_schedule_kind(const std::string& name) {
  std::string s;
  for (char c : name) s += c == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "gpipe") return ScheduleKind::kGPipe;
  if (s == "1f1b" || s == "one_f_one_b" || s == "pipedream_flush") return ScheduleKind::kOneFOneB;
  if (s == "interleaved" || s == "interleaved_1f1b") return ScheduleKind::kInterleaved;
  if (s == "zb_h1" || s == "zbh1" || s == "zero_bubble_h1") return ScheduleKind::kZeroBubbleH1;
  if (s == "zb_v" || s == "zbv" || s == "zero_bubble_v") return ScheduleKind::kZeroBubbleV;
  if (s == "dualpipev" || s == "dualpipe_v" || s == "dual_pipe_v") return ScheduleKind::kDualPipeV;
  return std::nullopt;
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  const auto kind = find_schedule_kind(name);
  MEGATORCH_CHECK(kind, "expected a pipeline schedule named ", schedule_kind_names(), ", got '", name, "'");
  return *kind;
}

void check_schedule_args(ScheduleKind kind, int64_t p, int64_t m, int64_t v) {
  MEGATORCH_CHECK(p >= 1, "expected --pipeline-model-parallel-size >= 1, got ", p);
  MEGATORCH_CHECK(m >= 1, "expected --num-microbatches >= 1, got ", m);
  MEGATORCH_CHECK(v >= 1, "expected --virtual-pipeline-model-parallel-size >= 1, got ", v);
  if (chunk_layout(kind) == ChunkLayout::kV) {
    MEGATORCH_CHECK(v == 2, "the ", schedule_kind_name(kind), " schedule runs two model chunks per rank in a V: ",
                    "expected 2 virtual stages per rank, got ", v, "; build the stages with 2 chunks (gpt_pretrain ",
                    "does so for --schedule ", schedule_kind_name(kind), ")");
    MEGATORCH_CHECK(m >= 2 * p, "the ", schedule_kind_name(kind), " schedule fills its V with 2p micro-batches: ",
                    "expected --num-microbatches >= 2 x --pipeline-model-parallel-size = ", 2 * p, ", got ", m,
                    "; use at least ", 2 * p, " micro-batches, or --schedule zb-h1");
    return;
  }
  MEGATORCH_CHECK(kind == ScheduleKind::kInterleaved || v == 1, "the ", schedule_kind_name(kind),
                  " schedule runs one model chunk per rank: expected "
                  "--virtual-pipeline-model-parallel-size 1, got ",
                  v, "; use --schedule interleaved for ", v, " chunks per rank");
  if (kind == ScheduleKind::kInterleaved && m % p != 0) {
    const int64_t below = m / p * p, above = below + p;
    std::ostringstream nearest;
    if (below > 0) nearest << below << " or ";
    nearest << above;
    MEGATORCH_FAIL("the interleaved schedule runs micro-batches in groups of "
                   "--pipeline-model-parallel-size: expected --num-microbatches to be a multiple of ",
                   p, ", got ", m, "; use ", nearest.str(), " micro-batches, or the 1f1b schedule");
  }
}

namespace {

struct Compute {
  ActionKind kind;  // forward or one of the backward kinds
  int64_t microbatch;
  int64_t chunk;
};

constexpr ActionKind kF = ActionKind::kForward, kB = ActionKind::kBackward;

// GPipe: every forward, then every backward, both in micro-batch order.
std::vector<Compute> gpipe_order(int64_t m) {
  std::vector<Compute> order;
  for (int64_t i = 0; i < m; ++i) order.push_back({kF, i, 0});
  for (int64_t i = 0; i < m; ++i) order.push_back({kB, i, 0});
  return order;
}

// PipeDream-Flush as in Megatron's forward_backward_pipelining_without_interleaving:
// stage r runs p-r-1 warm-up forwards so that, in steady state, the backward it needs
// next arrives just as it finishes a forward; at most p-r activations are held.
std::vector<Compute> one_f_one_b_order(int64_t p, int64_t m, int64_t rank) {
  const int64_t warmup = std::min(p - rank - 1, m);
  std::vector<Compute> order;
  for (int64_t i = 0; i < warmup; ++i) order.push_back({kF, i, 0});
  for (int64_t i = 0; i < m - warmup; ++i) {
    order.push_back({kF, warmup + i, 0});
    order.push_back({kB, i, 0});
  }
  for (int64_t i = m - warmup; i < m; ++i) order.push_back({kB, i, 0});
  return order;
}

// ZB-H1 (Qi et al. 2023): 1F1B's forwards and input-gradient passes B, each followed by a
// weight-gradient pass W, except that rank r keeps its r most recent W's back (the last
// rank the most: its B's are what every earlier rank waits for) and runs them at the end,
// into the time 1F1B spends waiting in the cool-down. Each W releases its micro-batch's
// activations, so at most p micro-batches are held: 1F1B's peak. With costs W <= F and
// W <= B every rank idles (p - 1)(F + B - W) ticks instead of 1F1B's (p - 1)(F + B + W).
std::vector<Compute> zero_bubble_h1_order(int64_t p, int64_t m, int64_t rank) {
  const int64_t warmup = std::min(p - rank - 1, m), deferred = rank;
  std::vector<Compute> order;
  int64_t next_w = 0;  // the oldest micro-batch whose W has not run
  const auto backward = [&](int64_t i) {
    order.push_back({ActionKind::kBackwardInput, i, 0});
    if (i + 1 - next_w > deferred) order.push_back({ActionKind::kBackwardWeight, next_w++, 0});
  };
  for (int64_t i = 0; i < warmup; ++i) order.push_back({kF, i, 0});
  for (int64_t i = 0; i < m - warmup; ++i) {
    order.push_back({kF, warmup + i, 0});
    backward(i);
  }
  for (int64_t i = m - warmup; i < m; ++i) backward(i);
  while (next_w < m) order.push_back({ActionKind::kBackwardWeight, next_w++, 0});
  return order;
}

// Builds the compute order of a V schedule: each chunk runs its forwards, and its
// backwards, in micro-batch order, so a call names only the chunk; split backwards leave
// their W's queued until a weight() call runs one.
class VOrder {
 public:
  void forward(int64_t chunk) { order_.push_back({kF, next_forward_[chunk]++, chunk}); }
  // The chunk's next backward, whole or split (its W queued).
  void backward(int64_t chunk, bool split) {
    const int64_t mb = next_backward_[chunk]++;
    order_.push_back({split ? ActionKind::kBackwardInput : kB, mb, chunk});
    if (split) queued_w_.push_back({ActionKind::kBackwardWeight, mb, chunk});
  }
  // The oldest queued W of `chunk`, or of either chunk when chunk < 0.
  void weight(int64_t chunk = -1) {
    const auto it = std::find_if(queued_w_.begin(), queued_w_.end(),
                                 [&](const Compute& w) { return chunk < 0 || w.chunk == chunk; });
    MEGATORCH_CHECK(it != queued_w_.end(), "V schedule: no weight pass of chunk ", chunk, " is queued");
    order_.push_back(*it);
    queued_w_.erase(it);
  }
  int64_t forwards(int64_t chunk) const { return next_forward_[chunk]; }
  bool has_queued_weight(int64_t chunk) const {
    return std::any_of(queued_w_.begin(), queued_w_.end(), [&](const Compute& w) { return w.chunk == chunk; });
  }
  std::vector<Compute> take() {
    MEGATORCH_CHECK(queued_w_.empty(), "V schedule: ", queued_w_.size(), " weight passes were never run");
    return std::move(order_);
  }

 private:
  std::vector<Compute> order_;
  std::vector<Compute> queued_w_;
  int64_t next_forward_[2] = {0, 0}, next_backward_[2] = {0, 0};
};

// ZB-V (Qi et al. 2023, section 6). Chunk 0 goes down the ranks, chunk 1 comes back up,
// so the last rank turns a micro-batch around at once and the first rank, which holds
// the loss, starts backwards early. Warm-up: rank r runs 2(p - r) - 1 chunk-0 forwards,
// then r pairs of (chunk-1, chunk-0) forwards, then p - r rounds of chunk 1's F, B, W.
// Steady state: each round one F, B and W per chunk. Cool-down: r pairs of B's with
// their W's held back, then chunk 0's B, W pairs, then the held W's fill the tail. With
// F = B = W every rank idles only while the first micro-batch walks down and back; at
// most 2p chunk activations (p micro-batches of the whole rank: 1F1B's) are held.
std::vector<Compute> zero_bubble_v_order(int64_t p, int64_t m, int64_t rank) {
  VOrder o;
  for (int64_t i = 0; i < 2 * (p - rank) - 1; ++i) o.forward(0);
  for (int64_t i = 0; i < rank; ++i) {
    o.forward(1);
    o.forward(0);
  }
  for (int64_t i = 0; i < p - rank; ++i) {
    o.forward(1);
    o.backward(1, true);
    o.weight(1);
  }
  while (o.forwards(1) < m) {
    if (o.forwards(0) < m) o.forward(0);
    o.backward(0, true);
    o.weight(0);
    o.forward(1);
    o.backward(1, true);
    o.weight(1);
  }
  for (int64_t i = 0; i < rank; ++i) {
    o.backward(0, true);
    o.backward(1, true);
  }
  for (int64_t i = 0; i < p - rank; ++i) {
    o.backward(0, true);
    o.weight(0);
  }
  while (o.has_queued_weight(1)) o.weight(1);
  while (o.has_queued_weight(0)) o.weight(0);
  return o.take();
}

// DualPipeV (DeepSeek's DualPipe, folded into a V on p ranks). Warm-up: 2(p - r - 1)
// chunk-0 forwards, then r + 1 pairs (chunk 0, chunk 1); then p - r - 1 rounds of chunk
// 1's split B, a queued W and a chunk-1 forward. Steady state: pairs of a forward of one
// chunk next to a whole backward of the other (DualPipe overlaps the two to hide MoE's
// all-to-all; here they run one after the other). Cool-down: p - r - 1 rounds of B1 and
// (F1, B0); r + 1 pairs (B1, B0) whose second half is split, then the queued W's
// alternate with chunk 0's last split B's and fill the tail.
std::vector<Compute> dualpipev_order(int64_t p, int64_t m, int64_t rank) {
  VOrder o;
  const int64_t below = p - rank - 1;  // ranks after this one on the way down
  for (int64_t i = 0; i < 2 * below; ++i) o.forward(0);
  for (int64_t i = 0; i <= rank; ++i) {
    o.forward(0);
    o.forward(1);
  }
  for (int64_t i = 0; i < below; ++i) {
    o.backward(1, true);
    o.weight();
    o.forward(1);
  }
  for (int64_t i = 0; i < m - 2 * p + rank + 1; ++i) {
    o.forward(0);
    o.backward(1, false);
    o.forward(1);
    o.backward(0, false);
  }
  for (int64_t i = 0; i < below; ++i) {
    o.backward(1, false);
    o.forward(1);
    o.backward(0, false);
  }
  // The split starts half-way through the r + 1 pairs: on an odd rank with the pair's
  // B1, on an even one with its B0, so r + 1 W's are left for the tail.
  const int64_t half = (rank + 1) / 2;
  for (int64_t i = 0; i <= rank; ++i) {
    o.backward(1, i > half || (i == half && rank % 2 == 1));
    o.backward(0, i >= half);
  }
  for (int64_t i = 0; i < below; ++i) {
    o.weight();
    o.backward(0, true);
  }
  for (int64_t i = 0; i <= rank; ++i) o.weight();
  return o.take();
}

// Megatron's forward_backward_pipelining_with_interleaving. The k-th forward (of m*v) on
// a rank belongs to group k / (p*v) of p micro-batches; within a group the rank runs
// chunk 0 on the p micro-batches, then chunk 1, ...; backwards walk the chunks in reverse.
// Warm-up is 2(p-r-1) + (v-1)p forwards (all of them when m == p), then 1F1B, cool-down.
std::vector<Compute> interleaved_order(int64_t p, int64_t m, int64_t v, int64_t rank) {
  const int64_t total = m * v;
  const int64_t warmup =
      m == p ? total : std::min((p - rank - 1) * 2 + (v - 1) * p, total);
  auto at = [&](int64_t k, bool forward) {
    const int64_t in_group = k % (p * v);
    const int64_t chunk = in_group / p;
    return Compute{forward ? kF : kB, k / (p * v) * p + in_group % p, forward ? chunk : v - 1 - chunk};
  };
  std::vector<Compute> order;
  for (int64_t k = 0; k < warmup; ++k) order.push_back(at(k, true));
  for (int64_t k = 0; k < total - warmup; ++k) {
    order.push_back(at(warmup + k, true));
    order.push_back(at(k, false));
  }
  for (int64_t k = total - warmup; k < total; ++k) order.push_back(at(k, false));
  return order;
}

std::vector<Compute> compute_order(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t rank) {
  check_schedule_args(kind, p, m, v);
  MEGATORCH_CHECK(rank >= 0 && rank < p, "expected a pipeline rank in [0, ", p, "), got ", rank);
  switch (kind) {
    case ScheduleKind::kGPipe: return gpipe_order(m);
    case ScheduleKind::kOneFOneB: return one_f_one_b_order(p, m, rank);
    case ScheduleKind::kInterleaved: return interleaved_order(p, m, v, rank);
    case ScheduleKind::kZeroBubbleH1: return zero_bubble_h1_order(p, m, rank);
    case ScheduleKind::kZeroBubbleV: return zero_bubble_v_order(p, m, rank);
    case ScheduleKind::kDualPipeV: return dualpipev_order(p, m, rank);
  }
  MEGATORCH_FAIL("unknown pipeline schedule kind ", static_cast<int>(kind));
}

// The order's computes with the transfers each implies; a neighbour on this same rank needs none.
std::vector<Action> with_transfers(const std::vector<Compute>& order, int64_t p, int64_t v, int64_t rank,
                                   ChunkLayout layout) {
  const int64_t last = p * v - 1;
  std::vector<Action> actions;
  actions.reserve(order.size() * 3);
  for (const Compute& c : order) {
    const int64_t s = virtual_stage(c.chunk, rank, p, layout);
    const int64_t prev = s > 0 ? rank_of_virtual_stage(s - 1, p, layout) : rank;
    const int64_t next = s < last ? rank_of_virtual_stage(s + 1, p, layout) : rank;
    if (c.kind == kF) {
      if (prev != rank) actions.push_back({ActionKind::kRecvActivation, c.microbatch, c.chunk, prev});
      actions.push_back({kF, c.microbatch, c.chunk, -1});
      if (next != rank) actions.push_back({ActionKind::kSendActivation, c.microbatch, c.chunk, next});
    } else if (c.kind == ActionKind::kBackwardWeight) {
      actions.push_back({c.kind, c.microbatch, c.chunk, -1});  // local: no transfer
    } else {
      if (next != rank) actions.push_back({ActionKind::kRecvGrad, c.microbatch, c.chunk, next});
      actions.push_back({c.kind, c.microbatch, c.chunk, -1});
      if (prev != rank) actions.push_back({ActionKind::kSendGrad, c.microbatch, c.chunk, prev});
    }
  }
  return actions;
}

}  // namespace

std::vector<Action> build_schedule(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t rank) {
  return with_transfers(compute_order(kind, p, m, v, rank), p, v, rank, chunk_layout(kind));
}

std::vector<Action> build_forward_only_schedule(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t rank) {
  std::vector<Compute> order = compute_order(kind, p, m, v, rank);
  order.erase(std::remove_if(order.begin(), order.end(), [](const Compute& c) { return c.kind != kF; }), order.end());
  return with_transfers(order, p, v, rank, chunk_layout(kind));
}

std::vector<std::vector<Action>> build_schedules(ScheduleKind kind, int64_t p, int64_t m, int64_t v) {
  check_schedule_args(kind, p, m, v);
  std::vector<std::vector<Action>> all;
  all.reserve(p);
  for (int64_t r = 0; r < p; ++r) all.push_back(build_schedule(kind, p, m, v, r));
  return all;
}

}  // namespace megatorch::pipeline
