#include "megatorch/comm/nccl_semantics.h"

#include <algorithm>
#include <deque>
#include <map>
#include <sstream>
#include <tuple>

#include "megatorch/check.h"

namespace megatorch::comm {
namespace {

constexpr int64_t kNone = -1;

struct Node {
  int64_t trace = 0;  // index into the traces
  int64_t index = 0;  // index into its trace's ops
  int64_t prev_on_stream = kNone;
  int64_t next_on_stream = kNone;
  int64_t collective_seq = kNone;        // k: its rank's k-th collective on the communicator
  int64_t collective_match = kNone;      // index into Checker::collectives_
  std::vector<int64_t> transfer_seq;     // per transfer: the k of its pair's k-th send / receive
  std::vector<int64_t> partners;         // per transfer: the node holding its partner
  bool started = false;
  bool done = false;
};

struct Comm {
  int64_t size = 0;
  std::string group;            // a name a member used for it
  std::vector<int64_t> member;  // group rank -> trace index, kNone if it posted nothing
};

class Checker {
 public:
  explicit Checker(const std::vector<RankTrace>& traces) : traces_(traces) {
    MEGATORCH_CHECK(!traces_.empty(), "NCCL check: expected one trace per rank, got none");
    for (int64_t t = 0; t < static_cast<int64_t>(traces_.size()); ++t) {
      first_node_.push_back(static_cast<int64_t>(nodes_.size()));
      for (int64_t i = 0; i < static_cast<int64_t>(traces_[t].ops.size()); ++i) nodes_.push_back(Node{t, i});
      report_.waits += static_cast<int64_t>(traces_[t].waits.size());
    }
    report_.ranks = static_cast<int64_t>(traces_.size());
  }

  NcclCheckReport run() {
    collect_communicators();
    link_streams();
    match_collectives();
    match_transfers();
    simulate();
    return report_;
  }

 private:
  const TracedOp& op(int64_t n) const { return traces_[nodes_[n].trace].ops[nodes_[n].index]; }
  int64_t rank_of(int64_t n) const { return traces_[nodes_[n].trace].rank; }

  // "rank 3's all_reduce #4 (float32x1024,sum) on group 'x.tp'".
  std::string describe(int64_t n) const {
    const TracedOp& o = op(n);
    const Node& node = nodes_[n];
    std::ostringstream os;
    os << "rank " << rank_of(n) << " (group rank " << o.group_rank << ")'s ";
    if (o.transfers.empty()) {
      os << comm_op_name(o.op) << " #" << node.collective_seq;
      if (!o.signature.empty()) os << " (" << o.signature << ")";
    } else {
      if (o.batch) os << "batch [";
      for (size_t j = 0; j < o.transfers.size(); ++j) {
        const TracedTransfer& t = o.transfers[j];
        os << (j ? ", " : "") << (t.send ? "send #" : "recv #") << (j < node.transfer_seq.size() ? node.transfer_seq[j] : 0)
           << (t.send ? " to " : " from ") << "group rank " << t.peer << " (tag " << t.tag << ", " << t.bytes
           << " bytes)";
      }
      if (o.batch) os << "]";
    }
    os << " on group '" << o.group << "'";
    return os.str();
  }

  void collect_communicators() {
    for (int64_t n = 0; n < static_cast<int64_t>(nodes_.size()); ++n) {
      const TracedOp& o = op(n);
      MEGATORCH_CHECK(o.group_size >= 1 && o.group_rank >= 0 && o.group_rank < o.group_size, "NCCL check: ",
                      describe(n), " names group rank ", o.group_rank, " of a group of ", o.group_size);
      Comm& c = comms_[o.comm];
      if (c.size == 0) {
        c.size = o.group_size;
        c.group = o.group;
        c.member.assign(c.size, kNone);
      }
      MEGATORCH_CHECK(c.size == o.group_size, "NCCL check: communicator of group '", o.group, "' has ", c.size,
                      " ranks in one trace and ", o.group_size, " in ", describe(n),
                      "; every member must see the same group");
      int64_t& m = c.member[o.group_rank];
      MEGATORCH_CHECK(m == kNone || m == nodes_[n].trace, "NCCL check: ranks ", traces_[m].rank, " and ", rank_of(n),
                      " both claim group rank ", o.group_rank, " of group '", o.group,
                      "'; two group instances share one communicator identity (comm_identity: give every group "
                      "instance a unique description)");
      m = nodes_[n].trace;
    }
    report_.communicators = static_cast<int64_t>(comms_.size());
  }

  // A communicator's collectives and batches share its stream; a lone send or receive
  // runs on its pair's (c10d's per-pair communicator).
  void link_streams() {
    std::map<std::tuple<int64_t, std::string, int64_t, int64_t>, int64_t> last;
    for (int64_t n = 0; n < static_cast<int64_t>(nodes_.size()); ++n) {
      const TracedOp& o = op(n);
      int64_t a = kNone, b = kNone;
      if (!o.transfers.empty() && !o.batch) {
        a = std::min(o.group_rank, o.transfers[0].peer);
        b = std::max(o.group_rank, o.transfers[0].peer);
      }
      auto [it, fresh] = last.try_emplace({nodes_[n].trace, o.comm, a, b}, n);
      if (!fresh) {
        nodes_[n].prev_on_stream = it->second;
        nodes_[it->second].next_on_stream = n;
        it->second = n;
      }
    }
  }

  void match_collectives() {
    std::map<std::pair<std::string, int64_t>, std::vector<int64_t>> lists;  // (comm, group rank) -> nodes
    for (int64_t n = 0; n < static_cast<int64_t>(nodes_.size()); ++n) {
      const TracedOp& o = op(n);
      if (!o.transfers.empty()) continue;
      auto& list = lists[{o.comm, o.group_rank}];
      nodes_[n].collective_seq = static_cast<int64_t>(list.size());
      list.push_back(n);
      report_.collectives += 1;
    }
    for (const auto& [id, c] : comms_) {
      size_t longest = 0;
      int64_t longest_rank = 0;
      for (int64_t g = 0; g < c.size; ++g) {
        const auto it = lists.find({id, g});
        const size_t len = it == lists.end() ? 0 : it->second.size();
        if (len > longest) longest = len, longest_rank = g;
      }
      if (longest == 0) continue;
      const auto& ref = lists.at({id, longest_rank});
      for (int64_t g = 0; g < c.size; ++g) {
        const auto it = lists.find({id, g});
        const size_t len = it == lists.end() ? 0 : it->second.size();
        if (len < longest) {
          MEGATORCH_FAIL("NCCL check: group '", c.group, "': ", describe(ref[len]), " has no match: group rank ", g,
                         c.member[g] == kNone ? " (which posted nothing on this group)"
                                              : " (rank " + std::to_string(traces_[c.member[g]].rank) + ")",
                         " issued only ", len, " collectives on it. On NCCL the group's collective #", len,
                         " would hang; every member must issue the same collectives in the same order.");
        }
      }
      for (size_t k = 0; k < longest; ++k) {
        const int64_t a = ref[k];
        std::vector<int64_t> match;
        for (int64_t g = 0; g < c.size; ++g) {
          const int64_t b = lists.at({id, g})[k];
          const TracedOp &x = op(a), &y = op(b);
          MEGATORCH_CHECK(x.op == y.op && x.signature == y.signature, "NCCL check: group '", c.group,
                          "': collective #", k, " differs between members: ", describe(a), " and ", describe(b),
                          ". NCCL matches collectives by issue order, so these would run as one operation (wrong "
                          "results or a hang); every member must issue the same collectives in the same order.");
          nodes_[b].collective_match = static_cast<int64_t>(collectives_.size());
          match.push_back(b);
        }
        collectives_.push_back(std::move(match));
      }
    }
  }

  void match_transfers() {
    // (comm, from, to, batch) -> the sends on `from` and the receives on `to`, in issue order:
    // (node, transfer index).
    using Key = std::tuple<std::string, int64_t, int64_t, bool>;
    std::map<Key, std::vector<std::pair<int64_t, size_t>>> sends, recvs;
    for (int64_t n = 0; n < static_cast<int64_t>(nodes_.size()); ++n) {
      const TracedOp& o = op(n);
      if (o.transfers.empty()) continue;
      if (o.batch) report_.batches += 1;
      nodes_[n].transfer_seq.assign(o.transfers.size(), 0);
      nodes_[n].partners.assign(o.transfers.size(), kNone);
      for (size_t j = 0; j < o.transfers.size(); ++j) {
        const TracedTransfer& t = o.transfers[j];
        MEGATORCH_CHECK(t.peer >= 0 && t.peer < o.group_size && t.peer != o.group_rank, "NCCL check: ", describe(n),
                        " names a peer outside the group or itself");
        auto& list = t.send ? sends[{o.comm, o.group_rank, t.peer, o.batch}] : recvs[{o.comm, t.peer, o.group_rank, o.batch}];
        nodes_[n].transfer_seq[j] = static_cast<int64_t>(list.size());
        list.emplace_back(n, j);
        report_.transfers += 1;
      }
    }
    auto unmatched = [&](const Key& key, const std::pair<int64_t, size_t>& lone, bool send, size_t count) {
      const Comm& c = comms_.at(std::get<0>(key));
      const int64_t other = send ? std::get<2>(key) : std::get<1>(key);
      const auto& opposite = send ? recvs : sends;
      const Key mode_flipped{std::get<0>(key), std::get<1>(key), std::get<2>(key), !std::get<3>(key)};
      const auto flipped = opposite.find(mode_flipped);
      std::ostringstream os;
      os << "NCCL check: group '" << c.group << "': " << describe(lone.first) << " has no matching "
         << (send ? "receive" : "send") << ": group rank " << other << " posted only " << count << " "
         << (send ? "receives from" : "sends to") << " group rank " << (send ? std::get<1>(key) : std::get<2>(key))
         << (std::get<3>(key) ? " in batches" : " as lone ops") << ".";
      if (flipped != opposite.end() && !flipped->second.empty())
        os << " It posted " << flipped->second.size() << " of them " << (std::get<3>(key) ? "as lone ops" : "in batches")
           << ": on NCCL a batch_p2p group and a lone send/recv travel on different communicators and never pair;"
              " post both ends the same way.";
      os << " On NCCL this transfer would hang; every send needs the peer's receive, in the same order.";
      MEGATORCH_FAIL(os.str());
    };
    for (const auto& [key, s] : sends) {
      const auto it = recvs.find(key);
      const size_t nr = it == recvs.end() ? 0 : it->second.size();
      if (s.size() > nr) unmatched(key, s[nr], true, nr);
      for (size_t k = 0; k < s.size(); ++k) {
        const auto [sn, sj] = s[k];
        const auto [rn, rj] = it->second[k];
        const TracedTransfer &x = op(sn).transfers[sj], &y = op(rn).transfers[rj];
        MEGATORCH_CHECK(x.tag == y.tag && x.bytes == y.bytes, "NCCL check: group '", comms_.at(std::get<0>(key)).group,
                        "': send #", k, " and receive #", k, " between group ranks ", std::get<1>(key), " and ",
                        std::get<2>(key), " pair on NCCL (by issue order) but ", x.tag != y.tag ? "carry different tags" : "differ in size",
                        ": ", describe(sn), " and ", describe(rn),
                        ". NCCL would deliver the wrong tensor; both ends must post their transfers between each "
                        "other in the same order.");
        nodes_[sn].partners[sj] = rn;
        nodes_[rn].partners[rj] = sn;
      }
    }
    for (const auto& [key, r] : recvs) {
      const auto it = sends.find(key);
      const size_t ns = it == sends.end() ? 0 : it->second.size();
      if (r.size() > ns) unmatched(key, r[ns], false, ns);
    }
  }

  bool can_start(int64_t n) const {
    const Node& node = nodes_[n];
    if (node.prev_on_stream != kNone && !nodes_[node.prev_on_stream].done) return false;
    return waits_done_[node.trace] >= op(n).waits_before;
  }

  bool can_complete(int64_t n) const {
    const Node& node = nodes_[n];
    if (node.collective_match != kNone) {
      for (int64_t m : collectives_[node.collective_match])
        if (!nodes_[m].started) return false;
      return true;
    }
    for (int64_t m : node.partners)
      if (!nodes_[m].started) return false;
    return true;
  }

  void simulate() {
    const int64_t nt = static_cast<int64_t>(traces_.size());
    waits_done_.assign(nt, 0);
    std::vector<int64_t> gate(nt, 0);  // per trace: ops before this index were offered after their waits
    std::deque<int64_t> queue;
    for (int64_t n = 0; n < static_cast<int64_t>(nodes_.size()); ++n) queue.push_back(n);
    auto offer_gated = [&](int64_t t) {
      const auto& ops = traces_[t].ops;
      while (gate[t] < static_cast<int64_t>(ops.size()) && ops[gate[t]].waits_before <= waits_done_[t])
        queue.push_back(first_node_[t] + gate[t]++);
    };
    while (!queue.empty()) {
      const int64_t n = queue.front();
      queue.pop_front();
      Node& node = nodes_[n];
      if (node.done) continue;
      if (!node.started) {
        if (!can_start(n)) continue;
        node.started = true;
        // Peers waiting for this one to start may complete now.
        if (node.collective_match != kNone)
          for (int64_t m : collectives_[node.collective_match]) queue.push_back(m);
        for (int64_t m : node.partners) queue.push_back(m);
      }
      if (!can_complete(n)) continue;
      node.done = true;
      if (node.next_on_stream != kNone) queue.push_back(node.next_on_stream);
      const auto& waits = traces_[node.trace].waits;
      int64_t& w = waits_done_[node.trace];
      const int64_t before = w;
      while (w < static_cast<int64_t>(waits.size()) && nodes_[first_node_[node.trace] + waits[w]].done) ++w;
      if (w != before) offer_gated(node.trace);
    }
    report_deadlock();
  }

  // Why node n has not completed, one hop: its stream, its rank's waits, or its peers.
  std::string blocker(int64_t n) const {
    const Node& node = nodes_[n];
    if (!node.started) {
      if (node.prev_on_stream != kNone && !nodes_[node.prev_on_stream].done)
        return "queued on its stream behind " + describe(node.prev_on_stream);
      const auto& waits = traces_[node.trace].waits;
      return "posted after rank " + std::to_string(rank_of(n)) + " waited for " +
             describe(first_node_[node.trace] + waits[waits_done_[node.trace]]) + ", which has not completed";
    }
    std::vector<int64_t> peers = node.collective_match != kNone ? collectives_[node.collective_match] : node.partners;
    for (int64_t m : peers) {
      if (nodes_[m].started) continue;
      std::string why = "waits for " + describe(m) + ", which has not started (";
      const Node& peer = nodes_[m];
      if (peer.prev_on_stream != kNone && !nodes_[peer.prev_on_stream].done) {
        why += "queued behind " + describe(peer.prev_on_stream);
      } else {
        why += "its rank waited for an op that has not completed";
      }
      return why + ")";
    }
    return "waits for its peers";
  }

  void report_deadlock() const {
    std::ostringstream os;
    int64_t stuck = 0;
    for (int64_t t = 0; t < static_cast<int64_t>(traces_.size()); ++t) {
      for (int64_t i = 0; i < static_cast<int64_t>(traces_[t].ops.size()); ++i) {
        const int64_t n = first_node_[t] + i;
        if (nodes_[n].done) continue;
        // The rank's first op that is started but stuck, else its first stuck op.
        int64_t pick = n;
        for (int64_t j = i; j < static_cast<int64_t>(traces_[t].ops.size()); ++j)
          if (nodes_[first_node_[t] + j].started && !nodes_[first_node_[t] + j].done) {
            pick = first_node_[t] + j;
            break;
          }
        os << "\n  " << describe(pick) << " (op #" << nodes_[pick].index << " of the rank) " << blocker(pick);
        stuck += 1;
        break;
      }
    }
    if (stuck == 0) return;
    MEGATORCH_FAIL("NCCL check: these calls deadlock under NCCL's rules (an op runs after the one before it on its "
                   "stream and after what its rank waited for; a send or receive completes only when its peer's "
                   "has started, a collective when every member's has). ",
                   stuck, " of ", traces_.size(), " ranks never finish:", os.str(),
                   "\nPost the ops that must meet on different communicators or in one batch_p2p group, or post "
                   "the receive before waiting on something its sender waits for.");
  }

  const std::vector<RankTrace>& traces_;
  std::vector<Node> nodes_;
  std::vector<int64_t> first_node_;  // per trace: its first node
  std::map<std::string, Comm> comms_;
  std::vector<std::vector<int64_t>> collectives_;  // per matched collective: every member's node
  std::vector<int64_t> waits_done_;                // per trace: waits whose ops have completed, in wait order
  NcclCheckReport report_;
};

}  // namespace

NcclCheckReport check_nccl_semantics(const std::vector<RankTrace>& traces) { return Checker(traces).run(); }

NcclCheckReport check_nccl_semantics_across_ranks(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
                                                  int64_t rank, int64_t world) {
  MEGATORCH_CHECK(store, "NCCL check: expected a store to exchange traces through, got null");
  MEGATORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "NCCL check: expected rank in [0, ", world, "), got ", rank);
  const std::string mine = serialize_trace(take_trace(rank));
  store->set(key + "/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<RankTrace> traces;
  traces.reserve(world);
  for (int64_t r = 0; r < world; ++r) {
    const std::vector<uint8_t> bytes = store->get(key + "/" + std::to_string(r));
    traces.push_back(parse_trace(std::string(bytes.begin(), bytes.end())));
  }
  return check_nccl_semantics(traces);
}

}  // namespace megatorch::comm
