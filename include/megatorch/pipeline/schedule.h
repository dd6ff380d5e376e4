#pragma once
// Pipeline schedules as data. A schedule is a pure function of (stages p, micro-batches
// m, virtual chunks v, rank) that returns the rank's ordered action list: compute and
// the point-to-point transfers that compute implies. The simulator checks and times the
// lists of all ranks without a model; the executor runs the same lists with c10d p2p.
//
// Model layout: the model is cut into p * v virtual stages. Megatron's looped layout puts
// virtual stage s = chunk * p + rank on rank s % p as its model chunk s / p. The V
// schedules (ZB-V, DualPipeV) hold v = 2 chunks in a V: rank r holds virtual stages r
// and 2p - 1 - r, so the turn (stages p - 1 and p) stays on the last rank and the loss is
// computed on rank 0. A micro-batch goes forward through s = 0 .. p*v-1 and backward
// through s = p*v-1 .. 0.
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace megatorch::pipeline {

enum class ActionKind : uint8_t {
  kForward,
  kBackward,        // input and weight gradients in one step (GPipe, 1F1B, interleaved)
  kBackwardInput,   // zero-bubble split: input gradient only; it is what the previous stage waits for
  kBackwardWeight,  // zero-bubble split: weight gradient, free to run later to fill bubbles
  kSendActivation,  // forward output of (microbatch, chunk) to the next virtual stage
  kRecvActivation,  // forward input of (microbatch, chunk) from the previous virtual stage
  kSendGrad,        // input gradient of (microbatch, chunk) to the previous virtual stage
  kRecvGrad,        // output gradient of (microbatch, chunk) from the next virtual stage
};

// "forward", "backward", "backward_input", "backward_weight", "send_activation", ...
const char* action_kind_name(ActionKind kind);
bool is_compute(ActionKind kind);  // forward and the backward kinds
bool is_send(ActionKind kind);
bool is_recv(ActionKind kind);

struct Action {
  ActionKind kind = ActionKind::kForward;
  int64_t microbatch = 0;
  // This rank's model chunk the action belongs to, for p2p too: a send carries the output
  // of this chunk, a recv brings the input of this chunk. 0 unless interleaved.
  int64_t chunk = 0;
  int64_t peer = -1;  // the other rank of a send or recv; -1 for compute

  bool operator==(const Action& o) const {
    return kind == o.kind && microbatch == o.microbatch && chunk == o.chunk && peer == o.peer;
  }
  bool operator!=(const Action& o) const { return !(*this == o); }
};

// "forward(mb 3, chunk 1)", "send_grad(mb 0, chunk 0) to rank 2".
std::string to_string(const Action& action);
inline std::ostream& operator<<(std::ostream& os, const Action& a) { return os << to_string(a); }

enum class ScheduleKind {
  kGPipe,        // all forwards, then all backwards
  kOneFOneB,     // PipeDream-Flush: warm-up forwards, one-forward-one-backward, cool-down
  kInterleaved,  // Megatron's interleaved 1F1B over v model chunks per rank
  kZeroBubbleH1,  // Qi et al.'s ZB-H1: 1F1B with backward split into B and W, W's deferred into bubbles
  kZeroBubbleV,   // Qi et al.'s ZB-V: two chunks per rank in a V, B and W split, 1F1B's memory
  kDualPipeV,     // DeepSeek's DualPipeV: DualPipe folded into a V; F of one chunk next to B of the other
};

// "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev": the spelling of the
// command-line flag.
const char* schedule_kind_name(ScheduleKind kind);
// "gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev": the names above, for help texts
// and errors.
const char* schedule_kind_names();
// Whether the schedule splits backward into backward_input and backward_weight actions.
bool splits_backward(ScheduleKind kind);
// Accepts those names, case-insensitively, and the aliases one_f_one_b, pipedream_flush,
// interleaved_1f1b, zbh1, zero_bubble_h1, zbv, zero_bubble_v and dual_pipe_v ('-' and '_'
// alike); anything else fails
// listing the valid names.
// The one parser of schedule names: the trainer, its flags and the tools use it.
ScheduleKind parse_schedule_kind(const std::string& name);
// parse_schedule_kind without the error: nullopt for a name it refuses (e.g. to let a
// command-line parser word the message).
std::optional<ScheduleKind> find_schedule_kind(const std::string& name);

// Where virtual stages live (see the top of this file).
enum class ChunkLayout {
  kLooped,  // stage chunk * p + rank (Megatron's; v = 1 is the plain pipeline)
  kV,       // two chunks: rank r holds stages r and 2p - 1 - r
};
// kV for zb-v and dualpipev, kLooped for the others.
ChunkLayout chunk_layout(ScheduleKind kind);
const char* chunk_layout_name(ChunkLayout layout);  // "looped", "v"
// The number of model chunks per rank a schedule runs: 2 for the V schedules, else `v`.
int64_t chunks_per_rank(ScheduleKind kind, int64_t v);

// The placement of virtual stages on ranks, for p ranks (chunk < 2 under kV).
inline int64_t virtual_stage(int64_t chunk, int64_t rank, int64_t p, ChunkLayout layout = ChunkLayout::kLooped) {
  return layout == ChunkLayout::kV && chunk == 1 ? 2 * p - 1 - rank : chunk * p + rank;
}
inline int64_t rank_of_virtual_stage(int64_t stage, int64_t p, ChunkLayout layout = ChunkLayout::kLooped) {
  return layout == ChunkLayout::kV && stage >= p ? 2 * p - 1 - stage : stage % p;
}
inline int64_t chunk_of_virtual_stage(int64_t stage, int64_t p, ChunkLayout layout = ChunkLayout::kLooped) {
  return layout == ChunkLayout::kV ? (stage >= p ? 1 : 0) : stage / p;
}

// Throws unless p >= 1, m >= 1, v >= 1, v == 1 for gpipe, 1f1b and zb-h1, v == 2 for zb-v
// and dualpipev (their V), m a multiple of p for interleaved (Megatron's micro-batch
// groups of p), and m >= 2p for the V schedules (their warm-up fills the V).
void check_schedule_args(ScheduleKind kind, int64_t p, int64_t m, int64_t v);

// The ordered actions of `rank` (0 <= rank < p). A forward is preceded by the receive of
// its input and followed by the send of its output; a backward (or a split backward's
// input pass) is preceded by the receive of its output gradient and followed by the send
// of its input gradient; a weight pass needs no transfer. When
// consecutive virtual stages share a rank (p == 1, or the turn of a V) the tensor stays
// local: no p2p.
// Sends are meant to be posted asynchronously (isend): a rank never waits for its send
// to be received, only a recv waits for the matching send.
std::vector<Action> build_schedule(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t rank);

// Megatron's forward_only (evaluation): the schedule's forwards in the schedule's order,
// each with its receive and send, and no backward. For GPipe and 1F1B that is micro-batch
// order; for interleaved, the chunks in its groups of p micro-batches, so the ranks keep
// the pipeline full instead of passing one micro-batch around at a time. Posted with the
// schedule's own RecvPosting (p2p_batches.h), which the NCCL order model checks.
std::vector<Action> build_forward_only_schedule(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t rank);

// build_schedule for every rank 0 .. p-1.
std::vector<std::vector<Action>> build_schedules(ScheduleKind kind, int64_t p, int64_t m, int64_t v);

}  // namespace megatorch::pipeline
