#pragma once
// `Group`: a handle on a c10d process group registered by name (by ParallelState or by
// torch.distributed.new_group in Python). It runs the collectives megatorch needs,
// counts their bytes (comm_stats.h), and turns a failed or timed-out collective into an
// error that names the group, the operation and its sequence number.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <ATen/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megatorch/comm/comm_stats.h"
#include "megatorch/comm/nccl_trace.h"
#include "megatorch/parallel/parallel_state.h"


namespace megatorch::comm {

enum class ReduceOp { kSum, kAvg, kMax };

// What a collective was, for error messages.
struct CollectiveInfo {
  std::string group;
  CommOp op = CommOp::kBarrier;
  int64_t seq = 0;
  int64_t rank = 0;
  int64_t size = 1;
  std::string backend;
  std::chrono::milliseconds timeout{0};
  std::string detail;  // more about the operation (the ops of a p2p batch), or empty
};

// An in-flight collective. wait() blocks (up to the group's timeout), finishes any
// emulation step and returns the result tensor (undefined for barrier/send/batch_p2p).
class Work {
 public:
  Work() = default;  // already complete (e.g. a group of one rank)
  explicit Work(at::Tensor done) : result_(std::move(done)) {}
  Work(c10::intrusive_ptr<c10d::Work> work, CollectiveInfo info, std::function<at::Tensor()> finish);
  // One operation made of several c10d works (a p2p batch posted op by op). `keep_alive`:
  // tensors the backend still reads or writes, held until wait() returns.
  Work(std::vector<c10::intrusive_ptr<c10d::Work>> works, CollectiveInfo info, std::function<at::Tensor()> finish,
       std::vector<at::Tensor> keep_alive);

  at::Tensor wait();
  bool is_completed() const;
  // The NCCL check's handle of the op (nccl_trace.h), recorded as waited by wait().
  void set_trace_handle(int64_t handle) { trace_handle_ = handle; }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  CollectiveInfo info_;
  std::function<at::Tensor()> finish_;
  std::vector<at::Tensor> keep_alive_;
  at::Tensor result_;
  bool waited_ = false;
  int64_t trace_handle_ = -1;
};

// One send or receive of a batch_p2p call.
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  at::Tensor tensor;  // the tensor sent, or the buffer received into
  int64_t peer = 0;   // rank within the group
  int64_t tag = 0;    // Gloo pairs by tag; NCCL ignores it and pairs by issue order
};

class Group {
 public:
  // Resolves a group registered in c10d's registry under `name`. Cheap enough to make one
  // per call: after a thread's first use of a name, what it resolves to is cached
  // (csrc/comm/group_cache.h) and only checked against the registry, so a name registered
  // again after its group was destroyed resolves to the new group.
  explicit Group(const std::string& name);
  // The group of `kind` that this rank belongs to in `state`.
  Group(const parallel::ParallelState& state, parallel::GroupKind kind);

  // The timeout of every wait: MEGATORCH_COMM_TIMEOUT_S if set (read when a thread first
  // resolves the group), else the process group's own timeout
  // (ParallelStateOptions::timeout, or new_group(timeout=...)).
  const std::string& name() const { return name_; }
  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return pg_; }

  // In place on `tensor`; returns it.
  at::Tensor all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  Work all_reduce_async(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // Concatenation of every rank's `input` along `dim` (in group-rank order).
  at::Tensor all_gather(const at::Tensor& input, int64_t dim = 0);
  Work all_gather_async(const at::Tensor& input, int64_t dim = 0);
  // Reduction of every rank's `input`, split along `dim`; this rank's chunk.
  at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim = 0, ReduceOp op = ReduceOp::kSum);
  Work reduce_scatter_async(const at::Tensor& input, int64_t dim = 0, ReduceOp op = ReduceOp::kSum);
  // `input` split equally along `split_dim` into size() chunks, chunk j sent to rank j;
  // the chunks received concatenated along `concat_dim` in rank order (c10d's
  // alltoall_base after moving split_dim to the front). Ulysses' sequence <-> head swap.
  at::Tensor all_to_all(const at::Tensor& input, int64_t split_dim, int64_t concat_dim);
  Work all_to_all_async(const at::Tensor& input, int64_t split_dim, int64_t concat_dim);
  // Uneven all-to-all along dim 0 (c10d's alltoall_base with split sizes): the first
  // send_rows[0] rows go to rank 0, the next send_rows[1] to rank 1, ...; the result holds
  // recv_rows[j] rows from rank j, in rank order. Both lists have size() entries and must
  // agree across ranks (rank i's send_rows[j] = rank j's recv_rows[i]). MoE's token
  // dispatch: only the rows for other ranks count as bytes moved.
  at::Tensor all_to_all_rows(const at::Tensor& input, const std::vector<int64_t>& send_rows,
                             const std::vector<int64_t>& recv_rows);
  // `src`, `dst` are ranks within this group.
  at::Tensor broadcast(at::Tensor& tensor, int64_t src);
  Work broadcast_async(at::Tensor& tensor, int64_t src);
  void send(const at::Tensor& tensor, int64_t dst, int64_t tag = 0);
  Work send_async(const at::Tensor& tensor, int64_t dst, int64_t tag = 0);
  at::Tensor recv(at::Tensor& tensor, int64_t src, int64_t tag = 0);
  Work recv_async(at::Tensor& tensor, int64_t src, int64_t tag = 0);
  // Posts `ops` (all on one device type) as one batch; the Work completes when they all
  // have. Where the backend for that device coalesces (NCCL) they form one group
  // (startCoalescing ... endCoalescing): NCCL pairs sends and receives by issue order and
  // blocks each until its peer's match is posted, so transfers that must meet have to be
  // posted together. Elsewhere (Gloo) each is posted alone, in order, with its tag.
  // Counted like send_async / recv_async: one send or recv per op, its bytes.
  Work batch_p2p(const std::vector<P2POp>& ops);
  // Whether batch_p2p groups the ops of tensors on `device` into one (NCCL) or posts
  // them one by one (Gloo).
  bool coalesces(c10::DeviceType device) const;
  // Whether callers must post ops on `device` as NCCL needs them (pairing by issue order,
  // each op waiting for its peer's): on NCCL, and on any backend while the NCCL check
  // runs (nccl_trace.h), which holds Gloo to NCCL's rules.
  bool follows_nccl_rules(c10::DeviceType device) const;
  void barrier();

  CommStats stats() const { return comm_stats(name_); }
  void reset_stats() const { reset_comm_stats(name_); }

 private:
  std::string backend_for(const at::Tensor& t) const;
  at::Tensor p2p_buffer(const at::Tensor& t, bool send) const;
  CollectiveInfo begin(CommOp op, int64_t bytes, const std::string& backend) const;
  // Records a posted op for the NCCL check; returns its handle (-1 when the check is off).
  int64_t trace(CommOp op, const at::Tensor& t, const std::string& detail, bool batch = false,
                std::vector<TracedTransfer> transfers = {}) const;
  Work traced(Work work, int64_t handle) const;

  std::string name_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int64_t rank_ = 0;
  int64_t size_ = 1;
  std::chrono::milliseconds timeout_;
  detail::CounterSlot* counters_ = nullptr;  // this name's, shared by every handle on it
};

// Many small tensors through one collective: `reduce` runs on the 1-D concatenation of
// `tensors` (in place) and the result is written back into each of them.
void reduce_flattened(const std::vector<at::Tensor>& tensors, const std::function<void(at::Tensor&)>& reduce);

}  // namespace megatorch::comm
