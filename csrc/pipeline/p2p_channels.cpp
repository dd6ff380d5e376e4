#include "megatorch/pipeline/p2p_channels.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <deque>
#include <map>
#include <mutex>
#include <optional>

#include "megatorch/check.h"
#include "megatorch/comm/group.h"
#include "megatorch/parallel/process_group_factory.h"

namespace megatorch::pipeline {

int64_t p2p_channel(const P2PMessage& message, int64_t p, int64_t v, ChunkLayout layout) {
  const int64_t to = chunk_of_virtual_stage(message.to_stage, p, layout);
  const int64_t from = chunk_of_virtual_stage(message.to_stage + (message.gradient ? 1 : -1), p, layout);
  const int64_t g = message.gradient ? 1 : 0;
  return to == from ? 2 * to + g : 2 * v + 2 * (std::max(to, from) - 1) + g;
}

int64_t num_p2p_channels(int64_t v, ChunkLayout layout) { return layout == ChunkLayout::kV ? 2 * v : 4 * v - 2; }

namespace {

// Per PP group name: the group instance its channels were split from, and the channels.
// c10d's registry holds groups weakly: these references keep them alive while their PP
// group lives.
struct Channels {
  std::optional<c10::weak_intrusive_ptr<c10d::ProcessGroup>> parent;
  std::string parent_id;  // comm_identity of that PP group
  std::vector<std::string> names;
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
};

void unregister(const Channels& ch) {
  for (const auto& name : ch.names) {
    try {
      c10d::unregister_process_group(name);
    } catch (...) {
    }
  }
}

std::mutex& channels_mutex() {
  static std::mutex mu;
  return mu;
}
// Never destroyed: channels still alive at exit are not torn down in static destructors.
std::map<std::string, Channels>& channels_by_group() {
  static auto* m = new std::map<std::string, Channels>();
  return *m;
}

}  // namespace

std::vector<std::string> p2p_channel_groups(const std::string& pp_group, int64_t channels) {
  MEGATORCH_CHECK(channels >= 1, "p2p channels: expected at least one channel, got ", channels);
  comm::Group pp(pp_group);
  const auto& pg = pp.process_group();
  const std::string parent = comm::comm_identity(*pg, pp_group);
  std::lock_guard<std::mutex> lock(channels_mutex());
  auto& all = channels_by_group();
  // The channels of PP groups that are gone go with them.
  for (auto it = all.begin(); it != all.end();) {
    if (it->second.parent && it->second.parent->expired()) {
      unregister(it->second);
      it = all.erase(it);
    } else {
      ++it;
    }
  }
  Channels& ch = all[pp_group];
  if (ch.parent_id != parent) {
    // The PP group of this name was made anew (a new ParallelState): its old channels go.
    unregister(ch);
    ch = Channels{c10::weak_intrusive_ptr<c10d::ProcessGroup>(pg), parent, {}, {}};
  }
  const c10::Device device = pg->getBoundDeviceId().value_or(c10::Device(c10::kCPU));
  const std::string cuda_backend = device.is_cuda() ? pg->getBackend(c10::kCUDA)->getBackendName() : "gloo";
  // Made in channel order on every member: each rendezvous meets its peers.
  for (int64_t k = static_cast<int64_t>(ch.names.size()); k < channels; ++k) {
    const std::string name = pp_group + ".ch" + std::to_string(k);
    auto store = c10::make_intrusive<c10d::PrefixStore>("p2p_channel/" + std::to_string(k) + "/", pg->getStore());
    auto group = parallel::make_process_group(store, pp.rank(), pp.size(), name, device, cuda_backend, pp.timeout(),
                                              pg->getGroupDesc() + ".ch" + std::to_string(k));
    try {
      c10d::unregister_process_group(name);  // a stale one of an earlier instance
    } catch (...) {
    }
    c10d::register_process_group(name, group);
    ch.names.push_back(name);
    ch.groups.push_back(group);
  }
  return {ch.names.begin(), ch.names.begin() + channels};
}

namespace {
std::vector<std::string> channel_names(const std::string& pp_group) {
  std::lock_guard<std::mutex> lock(channels_mutex());
  const auto it = channels_by_group().find(pp_group);
  return it == channels_by_group().end() ? std::vector<std::string>{} : it->second.names;
}
}  // namespace

comm::CommStats pipeline_p2p_stats(const std::string& pp_group) {
  comm::CommStats total = comm::comm_stats(pp_group);
  for (const auto& name : channel_names(pp_group)) {
    const comm::CommStats s = comm::comm_stats(name);
    for (int i = 0; i < comm::kNumCommOps; ++i) {
      total.ops[i].calls += s.ops[i].calls;
      total.ops[i].bytes += s.ops[i].bytes;
    }
  }
  return total;
}

void reset_pipeline_p2p_stats(const std::string& pp_group) {
  comm::reset_comm_stats(pp_group);
  for (const auto& name : channel_names(pp_group)) comm::reset_comm_stats(name);
}

ChannelPlan channel_plan(const std::vector<Action>& actions, int64_t rank, int64_t p, int64_t v, ChunkLayout layout,
                         int64_t lookahead) {
  MEGATORCH_CHECK(lookahead >= 1, "p2p channels: expected a receive lookahead >= 1, got ", lookahead);
  ChannelPlan plan;
  std::map<int64_t, std::deque<Action>> queue;  // per channel: its receives not yet posted, in consumption order
  std::vector<std::vector<Action>> consumed;      // per compute: the receives listed right before it
  std::vector<std::vector<Action>> sends{{}};     // per gap: the sends listed right after a compute
  std::vector<Action> pending;
  for (const Action& a : actions) {
    if (is_compute(a.kind)) {
      plan.computes.push_back(a);
      consumed.push_back(std::move(pending));
      pending.clear();
      sends.emplace_back();
    } else if (is_recv(a.kind)) {
      queue[p2p_channel(p2p_message(a, rank, p, layout), p, v, layout)].push_back(a);
      pending.push_back(a);
    } else {
      sends.back().push_back(a);
    }
  }
  MEGATORCH_CHECK(pending.empty(), "p2p channels: rank ", rank, "'s action list ends with a receive no compute ",
                  "consumes: ", to_string(pending.front()));
  const size_t n = plan.computes.size();
  plan.posts.assign(n + 1, {});
  plan.waits.assign(n, {});
  auto post_next = [&](int64_t channel, std::vector<Action>& into) {
    auto& q = queue[channel];
    if (q.empty()) return;
    into.push_back(q.front());
    q.pop_front();
  };
  for (auto& [channel, q] : queue) {
    (void)q;
    for (int64_t i = 0; i < lookahead; ++i) post_next(channel, plan.posts[0]);
  }
  for (size_t i = 0; i < n; ++i) {
    // Sends of the previous compute first, then the receive that refills the channel the
    // coming compute consumes from (posted before that compute waits).
    plan.posts[i].insert(plan.posts[i].end(), sends[i].begin(), sends[i].end());
    for (const Action& r : consumed[i]) {
      post_next(p2p_channel(p2p_message(r, rank, p, layout), p, v, layout), plan.posts[i]);
      plan.waits[i].push_back(r);
    }
  }
  plan.posts[n].insert(plan.posts[n].end(), sends[n].begin(), sends[n].end());
  return plan;
}

std::vector<comm::RankTrace> channel_traces(ScheduleKind kind, int64_t p, int64_t m, int64_t v, int64_t lookahead,
                                            bool forward_only) {
  check_schedule_args(kind, p, m, v);
  const ChunkLayout layout = chunk_layout(kind);
  std::vector<comm::RankTrace> traces(p);
  for (int64_t r = 0; r < p; ++r) {
    const auto actions = forward_only ? build_forward_only_schedule(kind, p, m, v, r) : build_schedule(kind, p, m, v, r);
    const ChannelPlan plan = channel_plan(actions, r, p, v, layout, lookahead);
    comm::RankTrace& t = traces[r];
    t.rank = r;
    std::map<int64_t, int64_t> posted;  // a receive's tag -> its op index
    auto post = [&](const Action& a) {
      const P2PMessage msg = p2p_message(a, r, p, layout);
      comm::TracedOp op;
      op.comm = "ch" + std::to_string(p2p_channel(msg, p, v, layout));
      op.group = op.comm;
      op.group_rank = r;
      op.group_size = p;
      op.op = is_send(a.kind) ? comm::CommOp::kSend : comm::CommOp::kRecv;
      const int64_t tag = p2p_tag(msg, p, v);
      op.transfers = {{is_send(a.kind), a.peer, tag, 1}};
      op.waits_before = static_cast<int64_t>(t.waits.size());
      t.ops.push_back(op);
      if (is_recv(a.kind)) posted[tag] = static_cast<int64_t>(t.ops.size()) - 1;
    };
    for (size_t i = 0; i < plan.computes.size(); ++i) {
      for (const Action& a : plan.posts[i]) post(a);
      for (const Action& w : plan.waits[i]) t.waits.push_back(posted.at(p2p_tag(p2p_message(w, r, p, layout), p, v)));
    }
    for (const Action& a : plan.posts.back()) post(a);
  }
  return traces;
}

}  // namespace megatorch::pipeline
