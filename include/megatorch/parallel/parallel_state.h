#pragma once
// ParallelState: the world store, the world process group and its split into tensor-,
// context-, data- and pipeline-parallel groups in Megatron's rank order (rank_layout.h),
// and the expert layers' groups folded into each pipeline stage.
// Every group is a c10d ProcessGroup registered by name ("<name>.tp", "<name>.cp",
// "<name>.dp", "<name>.pp", "<name>.world", "<name>.dp_cp": DP x CP, the gradient
// reduction's group, and "<name>.ep", "<name>.etp", "<name>.edp": expert-, expert-tensor-
// and expert-data-parallel), so operators and Python code find it by that name. A kind
// whose members equal an earlier kind's is that group under a second name.
// No process-wide "current" state: hold the object, pass it (or group names) down.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/arg.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <chrono>
#include <string>

#include "megatorch/parallel/device_selection.h"
#include "megatorch/parallel/launch_env.h"
#include "megatorch/parallel/rank_layout.h"


namespace megatorch::parallel {

// A client of the rendezvous store torchrun's environment names (`env`); rank 0 hosts it
// unless torchrun's agent does. ParallelState connects through this; so can a tool that
// needs the store without a process group (the NCCL check's trace exchange).
c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& env, std::chrono::milliseconds timeout);

struct ParallelStateOptions {
  ParallelStateOptions(int64_t tensor_model_parallel_size = 1, int64_t pipeline_model_parallel_size = 1)
      : tensor_model_parallel_size_(tensor_model_parallel_size),
        pipeline_model_parallel_size_(pipeline_model_parallel_size) {}
  TORCH_ARG(int64_t, tensor_model_parallel_size);
  TORCH_ARG(int64_t, pipeline_model_parallel_size);
  // Ranks that split each sequence (context parallelism); world = tp x cp x dp x pp.
  TORCH_ARG(int64_t, context_parallel_size) = 1;
  // The expert layers' layout inside each pipeline stage's tp x cp x dp ranks (Megatron's
  // parallel folding): ep x etp must divide them; the rest is expert-data-parallel.
  TORCH_ARG(int64_t, expert_model_parallel_size) = 1;
  TORCH_ARG(int64_t, expert_tensor_parallel_size) = 1;
  // Prefix of the registered group names; two live ParallelStates need different names.
  TORCH_ARG(std::string, name) = "megatorch";
  // "auto": CUDA (device = LOCAL_RANK) when a GPU is present, else CPU; "cpu", "cuda" or
  // "cuda:N" to force (device_selection.h). Gloo always serves CPU tensors.
  TORCH_ARG(std::string, device) = "auto";
  // Backend of the device's tensors: "auto" (NCCL on CUDA), "nccl", or "gloo" (also for
  // CUDA tensors: several ranks sharing one GPU, which NCCL refuses).
  TORCH_ARG(std::string, backend) = "auto";
  // Store connection and collective timeout.
  TORCH_ARG(std::chrono::milliseconds, timeout) = default_comm_timeout();
};

class ParallelState {
 public:
  // From torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). The configuration
  // is validated before anything connects, so a bad one fails on every rank at once.
  explicit ParallelState(ParallelStateOptions options = {});
  // From an existing store, for tests and for programs that rendezvous their own way.
  ParallelState(c10::intrusive_ptr<c10d::Store> store, int64_t rank, int64_t world_size,
                ParallelStateOptions options = {});
  ~ParallelState();  // unregisters its groups
  ParallelState(const ParallelState&) = delete;
  ParallelState& operator=(const ParallelState&) = delete;

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return layout_.world_size(); }
  int64_t local_rank() const { return local_rank_; }
  const RankLayout& layout() const { return layout_; }
  RankCoord coord() const { return layout_.coord(rank_); }
  int64_t tp_rank() const { return coord().tp; }
  int64_t dp_rank() const { return coord().dp; }
  int64_t pp_rank() const { return coord().pp; }
  int64_t cp_rank() const { return coord().cp; }
  int64_t tp_size() const { return layout_.tp_size(); }
  int64_t dp_size() const { return layout_.dp_size(); }
  int64_t pp_size() const { return layout_.pp_size(); }
  int64_t cp_size() const { return layout_.cp_size(); }
  ExpertCoord expert_coord() const { return layout_.expert_coord(rank_); }
  int64_t ep_rank() const { return expert_coord().ep; }
  int64_t etp_rank() const { return expert_coord().etp; }
  int64_t edp_rank() const { return expert_coord().edp; }
  int64_t ep_size() const { return layout_.ep_size(); }
  int64_t etp_size() const { return layout_.etp_size(); }
  int64_t edp_size() const { return layout_.edp_size(); }

  const std::string& group_name(GroupKind kind) const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group(GroupKind kind) const;
  const std::vector<int64_t>& group_ranks(GroupKind kind) const;
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }
  c10::Device device() const { return choice_.device; }
  // "nccl" or "gloo": the backend that carries tensors on device().
  const std::string& backend() const { return choice_.backend; }
  const ParallelStateOptions& options() const { return options_; }

  // One line per group kind: its name and global ranks, as seen from this rank.
  std::string describe() const;

 private:
  void build_groups();

  ParallelStateOptions options_;
  RankLayout layout_;
  int64_t rank_;
  int64_t local_rank_;
  DeviceChoice choice_;
  c10::intrusive_ptr<c10d::Store> store_;
  static constexpr int kKinds = 9;
  std::array<std::string, kKinds> names_;
  std::array<std::vector<int64_t>, kKinds> ranks_;
  std::array<c10::intrusive_ptr<c10d::ProcessGroup>, kKinds> groups_;
};

}  // namespace megatorch::parallel
