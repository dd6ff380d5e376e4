#pragma once
// How the executor moves activations and gradients where NCCL's rules apply (NCCL, or the
// NCCL check on Gloo): one communicator per channel, every op posted alone.
//
// A channel is (chunk of the receiving virtual stage, activation or gradient), and for the
// looped layout's wrap from the last rank's chunk k-1 to the first rank's chunk k a channel
// of its own per boundary (at p = 2 it would otherwise share a pair with chunk k's other
// messages, the opposite way): each a communicator over the pipeline ranks split from the
// PP group. Within a channel, between two ranks, messages flow one way and in increasing
// micro-batch order on both ends (a chunk runs its forwards, and its backwards, in
// micro-batch order), so NCCL's
// issue-order pairing delivers every tensor where it belongs, for every schedule:
// the V schedules' crossing streams (chunk 0's activations and chunk 1's gradients go
// down a pair while the others come up) no longer share a connection. Each send and
// receive is posted alone, with its own Work, which c10d runs on its pair's own stream:
// a send waits for nothing but its receiver, and a rank's compute waits only for the
// receive it consumes. Receives are posted ahead, `lookahead` per channel, so a sender
// rarely waits for its receiver to get there.
//
// What it costs on GPUs: num_p2p_channels more communicators per pipeline rank (each with NCCL's
// buffers per peer it talks to: two per channel), `lookahead` received buffers per
// channel, and more streams in flight (with CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron
// sets for TP overlap, kernels of different streams are launched in issue order).
#include <cstdint>
#include <string>
#include <vector>

#include "megatorch/comm/comm_stats.h"
#include "megatorch/comm/nccl_trace.h"
#include "megatorch/pipeline/p2p_batches.h"

namespace megatorch::pipeline {

// The channel of a message in [0, num_p2p_channels): 2 * (chunk of its receiving virtual
// stage) + (gradient ? 1 : 0), or past those 2 * (boundary - 1) + (gradient ? 1 : 0) for a
// looped wrap across chunk boundary `boundary` (1 .. v-1).
int64_t p2p_channel(const P2PMessage& message, int64_t p, int64_t v, ChunkLayout layout);
// 2v in a V (its turn is local), 4v - 2 looped (2v, and 2 per chunk boundary).
int64_t num_p2p_channels(int64_t v, ChunkLayout layout);

// The names of `channels` communicators with the members of `pp_group`, made on first use
// (a collective over the PP group: every member calls it with the same count) and kept
// while that group instance lives: "<pp_group>.ch<k>".
std::vector<std::string> p2p_channel_groups(const std::string& pp_group, int64_t channels);

// The pipeline's transfers as the executor counts them: the PP group's counters (Gloo)
// plus those of its channels (NCCL's rules); and their reset.
comm::CommStats pipeline_p2p_stats(const std::string& pp_group);
void reset_pipeline_p2p_stats(const std::string& pp_group);

// One rank's posting plan in channel mode, derived from its action list: the transfers
// each compute is followed by (its sends) and the receives posted before it (the next of
// each channel once its lookahead frees up, as the computes consume them). Both the
// executor and the NCCL check's schedule model (channel_traces) walk it.
struct ChannelPlan {
  std::vector<Action> computes;
  // posts[i]: sends and receives posted right before computes[i] (posts[n]: after the last).
  std::vector<std::vector<Action>> posts;
  // waits[i]: the receives computes[i] waits for (at most one).
  std::vector<std::vector<Action>> waits;
};
ChannelPlan channel_plan(const std::vector<Action>& actions, int64_t rank, int64_t p, int64_t v, ChunkLayout layout,
                         int64_t lookahead);

// Every rank's ops of (kind, p, m, v) as the executor posts them in channel mode (the
// receives each compute consumes waited right before it), for comm::check_nccl_semantics:
// the proof, without running anything, that every schedule pairs and completes on NCCL.
std::vector<comm::RankTrace> channel_traces(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t lookahead = 1,
                                            bool forward_only = false);

}  // namespace megatorch::pipeline
