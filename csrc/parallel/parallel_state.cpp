#include "megatorch/parallel/parallel_state.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
#include <sstream>

#include "megatorch/check.h"
#include "megatorch/parallel/device_selection.h"
#include "megatorch/parallel/process_group_factory.h"

namespace megatorch::parallel {
namespace {

constexpr std::array<GroupKind, 9> kAllKinds{GroupKind::kWorld,    GroupKind::kTensor,       GroupKind::kData,
                                             GroupKind::kPipeline, GroupKind::kContext,      GroupKind::kDataContext,
                                             GroupKind::kExpert,   GroupKind::kExpertTensor, GroupKind::kExpertData};

// Every rank builds its ParallelStates in the same order, so this count names the same
// store namespace on every rank and a later state never reads an earlier one's keys.
std::atomic<int64_t>& instance_counter() {
  static std::atomic<int64_t> n{0};
  return n;
}

}  // namespace

c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(env.master_port);
  opts.isServer = !env.use_agent_store && env.rank == 0;
  if (opts.isServer) opts.numWorkers = static_cast<size_t>(env.world_size);
  opts.waitWorkers = false;
  opts.timeout = timeout;
  opts.multiTenant = true;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    MEGATORCH_FAIL("rank ", env.rank, " could not reach the rendezvous store at MASTER_ADDR:MASTER_PORT = ",
                   env.master_addr, ":", env.master_port, " within ", timeout.count() / 1000.0, " s: ", e.what(),
                   "\nCheck that rank 0 (or torchrun's agent) is running and that MASTER_ADDR/MASTER_PORT "
                   "point at it.");
  }
  if (env.use_agent_store) {
    store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env.restart_count), store);
  }
  return store;
}

namespace {

// The device and its backend (device_selection.h), and the current CUDA device set.
DeviceChoice select_device(const ParallelStateOptions& o, int64_t local_rank, int64_t local_world_size) {
  DeviceChoice c = choose_device(o.device(), o.backend(), local_rank, local_world_size, visible_cuda_devices());
  if (c.device.is_cuda()) set_cuda_device(c.device.index());
  return c;
}

}  // namespace

ParallelState::ParallelState(ParallelStateOptions options)
    : options_(std::move(options)),
      // Validate sizes against WORLD_SIZE before connecting to anything.
      layout_([&] {
        const LaunchEnv env = LaunchEnv::from_environment();
        return RankLayout(env.world_size, options_.tensor_model_parallel_size(),
                          options_.pipeline_model_parallel_size(), options_.context_parallel_size(),
                          options_.expert_model_parallel_size(), options_.expert_tensor_parallel_size());
      }()),
      rank_(0),
      local_rank_(0) {
  const LaunchEnv env = LaunchEnv::from_environment();
  rank_ = env.rank;
  local_rank_ = env.local_rank;
  choice_ = select_device(options_, local_rank_, env.local_world_size);
  store_ = connect_store(env, options_.timeout());
  build_groups();
}

ParallelState::ParallelState(c10::intrusive_ptr<c10d::Store> store, int64_t rank, int64_t world_size,
                             ParallelStateOptions options)
    : options_(std::move(options)),
      layout_(world_size, options_.tensor_model_parallel_size(), options_.pipeline_model_parallel_size(),
              options_.context_parallel_size(), options_.expert_model_parallel_size(),
              options_.expert_tensor_parallel_size()),
      rank_(rank),
      local_rank_(rank),
      store_(std::move(store)) {
  MEGATORCH_CHECK(store_, "expected a store to build ParallelState from, got null");
  MEGATORCH_CHECK(rank >= 0 && rank < world_size, "expected rank in [0, ", world_size, "), got ", rank);
  // One process per rank on this machine, as a store-built test launches them.
  choice_ = select_device(options_, local_rank_, world_size);
  build_groups();
}

void ParallelState::build_groups() {
  const std::string& base = options_.name();
  MEGATORCH_CHECK(!base.empty(), "expected a non-empty ParallelStateOptions::name");
  for (GroupKind kind : kAllKinds) {
    const int k = static_cast<int>(kind);
    names_[k] = base + "." + group_kind_name(kind);
    bool taken = true;
    try {
      c10d::resolve_process_group(names_[k]);
    } catch (const std::exception&) {
      taken = false;
    }
    MEGATORCH_CHECK(!taken, "a process group named '", names_[k], "' is already registered in this process; ",
                    "destroy the ParallelState that made it first, or give this one another name with "
                    "ParallelStateOptions().name(...)");
  }
  const std::string instance = "megatorch/" + std::to_string(instance_counter().fetch_add(1)) + "/";
  const auto root = c10::make_intrusive<c10d::PrefixStore>(instance, store_);
  // Same kind order on every rank: each group's members rendezvous together.
  for (auto it = kAllKinds.begin(); it != kAllKinds.end(); ++it) {
    const GroupKind kind = *it;
    const int k = static_cast<int>(kind);
    ranks_[k] = layout_.group_ranks(kind, rank_);
    // A kind with the members of one built before (DP x CP without CP, EP = TP, ...) is the
    // same group under a second name, not a second connection. Groups of a kind partition
    // the ranks, so every member of this group finds the same earlier kind and all of them
    // skip the rendezvous together.
    const auto same = std::find_if(kAllKinds.begin(), it, [&](GroupKind earlier) {
      return ranks_[static_cast<int>(earlier)] == ranks_[k];
    });
    if (same != it) {
      groups_[k] = groups_[static_cast<int>(*same)];
      c10d::register_process_group(names_[k], groups_[k]);
      continue;
    }
    const int64_t index = layout_.group_index(kind, rank_);
    const int64_t group_rank = std::find(ranks_[k].begin(), ranks_[k].end(), rank_) - ranks_[k].begin();
    const std::string prefix = std::string(group_kind_name(kind)) + "/" + std::to_string(index) + "/";
    auto group_store = c10::make_intrusive<c10d::PrefixStore>(prefix, root);
    // The description tells this group instance from the same name's other groups (each
    // rank's "<name>.tp" is its own TP group) and from earlier states of the same name.
    groups_[k] = make_process_group(group_store, group_rank, static_cast<int64_t>(ranks_[k].size()), names_[k],
                                    choice_.device, choice_.backend, options_.timeout(),
                                    names_[k] + "@" + instance + prefix);
    c10d::register_process_group(names_[k], groups_[k]);
  }
}

ParallelState::~ParallelState() {
  for (const auto& name : names_) {
    if (name.empty()) continue;
    try {
      c10d::unregister_process_group(name);
    } catch (...) {
      // Already gone (e.g. torch.distributed.destroy_process_group ran first).
    }
  }
}

const std::string& ParallelState::group_name(GroupKind kind) const { return names_[static_cast<int>(kind)]; }

const c10::intrusive_ptr<c10d::ProcessGroup>& ParallelState::process_group(GroupKind kind) const {
  return groups_[static_cast<int>(kind)];
}

const std::vector<int64_t>& ParallelState::group_ranks(GroupKind kind) const {
  return ranks_[static_cast<int>(kind)];
}

std::string ParallelState::describe() const {
  std::ostringstream os;
  const RankCoord c = coord();
  const ExpertCoord e = expert_coord();
  os << "rank " << rank_ << " (" << layout_.describe() << "; tp_rank " << c.tp << ", cp_rank " << c.cp
     << ", dp_rank " << c.dp << ", pp_rank " << c.pp << ", ep_rank " << e.ep << ", etp_rank " << e.etp
     << ", edp_rank " << e.edp << ", device " << choice_.device << ", backend " << choice_.backend << ")";
  for (GroupKind kind : kAllKinds) {
    os << "\n  " << group_kind_name(kind) << " group '" << group_name(kind) << "': [";
    const auto& r = group_ranks(kind);
    for (size_t i = 0; i < r.size(); ++i) os << (i ? ", " : "") << r[i];
    os << "]";
  }
  return os.str();
}

}  // namespace megatorch::parallel
