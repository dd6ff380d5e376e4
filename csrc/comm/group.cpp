#include "megatorch/comm/group.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <numeric>
#include <sstream>

#include "group_cache.h"
#include "megatorch/check.h"

namespace megatorch::comm {
namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return c10d::ReduceOp::SUM;
    case ReduceOp::kAvg: return c10d::ReduceOp::AVG;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

const char* reduce_op_name(ReduceOp op) {
  return op == ReduceOp::kSum ? "sum" : op == ReduceOp::kAvg ? "avg" : "max";
}

int64_t normalize_dim(int64_t dim, const at::Tensor& t, const char* what) {
  const int64_t nd = t.dim();
  MEGATORCH_CHECK(nd > 0 && dim >= -nd && dim < nd, what, ": expected dim in [", -nd, ", ", nd,
                  ") for a tensor of shape ", t.sizes(), ", got ", dim);
  return dim < 0 ? dim + nd : dim;
}

[[noreturn]] void fail(const CollectiveInfo& i, const std::string& cause) {
  MEGATORCH_FAIL("collective ", comm_op_name(i.op), " #", i.seq, i.detail, " on group '", i.group, "' (rank ",
                 i.rank, " of ", i.size, ", backend ", i.backend, ", timeout ", i.timeout.count() / 1000.0,
                 " s) failed: ", cause,
                 "\nEvery rank of the group must call the same collectives in the same order; a rank "
                 "that skipped this one or died is the usual cause. Raise MEGATORCH_COMM_TIMEOUT_S "
                 "if the work is just slow.");
}

}  // namespace

// ---------------------------------------------------------------------------- Work

Work::Work(c10::intrusive_ptr<c10d::Work> work, CollectiveInfo info, std::function<at::Tensor()> finish)
    : info_(std::move(info)), finish_(std::move(finish)) {
  if (work) works_.push_back(std::move(work));
}

Work::Work(std::vector<c10::intrusive_ptr<c10d::Work>> works, CollectiveInfo info, std::function<at::Tensor()> finish,
           std::vector<at::Tensor> keep_alive)
    : works_(std::move(works)), info_(std::move(info)), finish_(std::move(finish)),
      keep_alive_(std::move(keep_alive)) {}

at::Tensor Work::wait() {
  if (waited_) return result_;
  detail::trace_wait(trace_handle_);
  for (auto& work : works_) {
    try {
      work->wait(info_.timeout);
    } catch (const std::exception& e) {
      // The tensors stay referenced: a failed backend may still touch them.
      waited_ = true;
      fail(info_, e.what());
    }
  }
  waited_ = true;
  if (finish_) result_ = finish_();
  finish_ = nullptr;
  keep_alive_.clear();
  return result_;
}

bool Work::is_completed() const {
  if (waited_) return true;
  for (const auto& work : works_)
    if (!work->isCompleted()) return false;
  return true;
}

// --------------------------------------------------------------------------- Group

Group::Group(const std::string& name) : name_(name) {
  const detail::ResolvedGroup& r = detail::resolve_group(name_, pg_);
  rank_ = r.rank;
  size_ = r.size;
  timeout_ = r.timeout;
  counters_ = r.counters;
}

Group::Group(const parallel::ParallelState& state, parallel::GroupKind kind)
    : Group(state.group_name(kind)) {}

std::string Group::backend_for(const at::Tensor& t) const {
  return pg_->getBackend(t.device().type())->getBackendName();
}

int64_t Group::trace(CommOp op, const at::Tensor& t, const std::string& extra, bool batch,
                     std::vector<TracedTransfer> transfers) const {
  if (!nccl_check_enabled()) return -1;
  TracedOp o;
  // A group carries CPU tensors on Gloo and CUDA tensors on NCCL: two communicators.
  o.comm = comm_identity(*pg_, name_) + "/" + backend_for(t);
  o.group = name_;
  o.group_rank = rank_;
  o.group_size = size_;
  o.op = op;
  o.batch = batch;
  o.transfers = std::move(transfers);
  if (o.transfers.empty()) {
    o.signature = std::string(c10::toString(t.scalar_type())) + "x" + std::to_string(t.numel());
    if (!extra.empty()) o.signature += "," + extra;
  }
  return detail::trace_op(std::move(o));
}

Work Group::traced(Work work, int64_t handle) const {
  work.set_trace_handle(handle);
  return work;
}

CollectiveInfo Group::begin(CommOp op, int64_t bytes, const std::string& backend) const {
  CollectiveInfo info;
  info.group = name_;
  info.op = op;
  info.seq = detail::record_comm(*counters_, op, bytes);
  info.rank = rank_;
  info.size = size_;
  info.backend = backend;
  info.timeout = timeout_;
  return info;
}

Work Group::all_reduce_async(at::Tensor& tensor, ReduceOp op) {
  if (size_ == 1) return Work(tensor);
  const std::string backend = backend_for(tensor);
  const bool emulate_avg = op == ReduceOp::kAvg && backend == "gloo";
  MEGATORCH_CHECK(op != ReduceOp::kAvg || tensor.is_floating_point(),
                  "all_reduce AVG: expected a floating-point tensor, got ", tensor.scalar_type(),
                  "; reduce with SUM and divide yourself for integer tensors");
  auto info = begin(CommOp::kAllReduce, tensor.nbytes(), backend);
  // Collectives need dense contiguous buffers; reduce a copy and write it back if not.
  at::Tensor buf = tensor.is_contiguous() ? tensor : tensor.contiguous();
  // Gloo has no AVG: scale by 1/size, then sum (scaling first keeps fp16 from overflowing).
  if (emulate_avg) buf.div_(size_);
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(emulate_avg ? ReduceOp::kSum : op);
  opts.timeout = timeout_;
  std::vector<at::Tensor> bufs{buf};
  const int64_t handle = trace(CommOp::kAllReduce, buf, reduce_op_name(op));
  auto work = pg_->allreduce(bufs, opts);
  at::Tensor target = tensor;
  return traced(Work(work, info, [buf, target]() mutable {
    if (!buf.is_same(target)) target.copy_(buf);
    return target;
  }), handle);
}

at::Tensor Group::all_reduce(at::Tensor& tensor, ReduceOp op) { return all_reduce_async(tensor, op).wait(); }

Work Group::all_gather_async(const at::Tensor& input, int64_t dim) {
  dim = normalize_dim(dim, input, "all_gather");
  if (size_ == 1) return Work(input.clone());
  auto info = begin(CommOp::kAllGather, input.nbytes(), backend_for(input));
  // Detached: the backend copies into views of the output on its own thread, where an
  // input that requires grad would make autograd track (and refuse) those copies.
  at::Tensor in = input.detach().contiguous();
  // Into one preallocated buffer, the inputs concatenated along dim 0 in rank order: that
  // is the result along dim 0; along another dim, moving the rank index next to it is the
  // one copy.
  std::vector<int64_t> concatenated = in.sizes().vec();
  concatenated[0] *= size_;
  at::Tensor flat = at::empty(concatenated, in.options());
  c10d::AllgatherOptions opts;
  opts.timeout = timeout_;
  const int64_t handle = trace(CommOp::kAllGather, in, "");
  auto work = pg_->_allgather_base(flat, in, opts);
  const int64_t size = size_;
  return traced(Work(work, info, [flat, dim, size]() {
    return dim == 0 ? flat : flat.unflatten(0, {size, -1}).movedim(0, dim).flatten(dim, dim + 1);
  }), handle);
}

at::Tensor Group::all_gather(const at::Tensor& input, int64_t dim) { return all_gather_async(input, dim).wait(); }

Work Group::reduce_scatter_async(const at::Tensor& input, int64_t dim, ReduceOp op) {
  dim = normalize_dim(dim, input, "reduce_scatter");
  MEGATORCH_CHECK(input.size(dim) % size_ == 0, "reduce_scatter on group '", name_,
                  "': expected dim ", dim, " of the input (shape ", input.sizes(),
                  ") to be divisible by the group size ", size_,
                  "; pad it or choose a parallel size that divides it");
  if (size_ == 1) return Work(input.clone());
  const std::string backend = backend_for(input);
  auto info = begin(CommOp::kReduceScatter, input.nbytes(), backend);
  const int64_t handle = trace(CommOp::kReduceScatter, input, reduce_op_name(op));
  const int64_t chunk = input.size(dim) / size_;
  c10d::ReduceScatterOptions rs_opts;
  rs_opts.timeout = timeout_;
  if (backend != "gloo") {
    rs_opts.reduceOp = to_c10d(op);
    at::Tensor out = at::empty_like(input.narrow(dim, 0, chunk), at::MemoryFormat::Contiguous);
    // One flat input, chunk j at j: along dim 0 the input itself (when contiguous); along
    // another dim one copy that moves the chunk index to the front.
    at::Tensor flat = input.unflatten(dim, {size_, chunk}).movedim(dim, 0).contiguous();
    auto work = pg_->_reduce_scatter_base(out, flat, rs_opts);
    return traced(Work(work, info, [out, flat]() { return out; }), handle);
  }
  // Gloo has no reduce-scatter: all-reduce the whole input, keep this rank's chunk. The
  // counters record the logical reduce-scatter (its input bytes), not the emulation.
  MEGATORCH_CHECK(op != ReduceOp::kAvg || input.is_floating_point(),
                  "reduce_scatter AVG: expected a floating-point tensor, got ", input.scalar_type());
  at::Tensor buf = input.contiguous().clone();
  if (op == ReduceOp::kAvg) buf.div_(size_);
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op == ReduceOp::kAvg ? ReduceOp::kSum : op);
  opts.timeout = timeout_;
  std::vector<at::Tensor> bufs{buf};
  auto work = pg_->allreduce(bufs, opts);
  const int64_t start = rank_ * chunk;
  // A fresh tensor, not a view into buf: results never carry a storage offset.
  return traced(Work(work, info, [buf, dim, start, chunk]() {
    return buf.narrow(dim, start, chunk).clone(at::MemoryFormat::Contiguous);
  }), handle);
}

at::Tensor Group::reduce_scatter(const at::Tensor& input, int64_t dim, ReduceOp op) {
  return reduce_scatter_async(input, dim, op).wait();
}

Work Group::all_to_all_async(const at::Tensor& input, int64_t split_dim, int64_t concat_dim) {
  split_dim = normalize_dim(split_dim, input, "all_to_all");
  concat_dim = normalize_dim(concat_dim, input, "all_to_all");
  MEGATORCH_CHECK(input.size(split_dim) % size_ == 0, "all_to_all on group '", name_, "': expected dim ", split_dim,
                  " of the input (shape ", input.sizes(), ") to be divisible by the group size ", size_,
                  "; choose sizes the group divides");
  if (size_ == 1) return Work(input.clone(at::MemoryFormat::Contiguous));
  // Only the chunks for the other ranks leave this one.
  auto info = begin(CommOp::kAllToAll, input.nbytes() / size_ * (size_ - 1), backend_for(input));
  // alltoall_base splits dim 0 equally: bring split_dim to the front as [size, chunk, ...].
  std::vector<int64_t> shape{size_, input.size(split_dim) / size_};
  at::Tensor front = input.movedim(split_dim, 0);
  for (int64_t d = 1; d < front.dim(); ++d) shape.push_back(front.size(d));
  at::Tensor in = front.reshape(shape).contiguous();
  at::Tensor out = at::empty_like(in);
  std::vector<int64_t> equal_splits;  // empty: equal splits
  c10d::AllToAllOptions opts;
  opts.timeout = timeout_;
  const int64_t handle = trace(CommOp::kAllToAll, in, "");
  auto work = pg_->alltoall_base(out, in, equal_splits, equal_splits, opts);
  const int64_t n = size_;
  return traced(Work(work, info, [out, in, n, split_dim, concat_dim]() {
    std::vector<at::Tensor> pieces;
    pieces.reserve(n);
    for (int64_t j = 0; j < n; ++j) pieces.push_back(out.select(0, j).movedim(0, split_dim));
    return at::cat(pieces, concat_dim);
  }), handle);
}

at::Tensor Group::all_to_all(const at::Tensor& input, int64_t split_dim, int64_t concat_dim) {
  return all_to_all_async(input, split_dim, concat_dim).wait();
}

at::Tensor Group::all_to_all_rows(const at::Tensor& input, const std::vector<int64_t>& send_rows,
                                  const std::vector<int64_t>& recv_rows) {
  MEGATORCH_CHECK(input.dim() >= 1, "all_to_all_rows on group '", name_, "': expected a tensor of at least one ",
                  "dimension, got a scalar");
  MEGATORCH_CHECK(static_cast<int64_t>(send_rows.size()) == size_ && static_cast<int64_t>(recv_rows.size()) == size_,
                  "all_to_all_rows on group '", name_, "': expected ", size_, " send and receive row counts (one per ",
                  "rank), got ", send_rows.size(), " and ", recv_rows.size());
  int64_t sent = 0, received = 0;
  for (int64_t j = 0; j < size_; ++j) {
    MEGATORCH_CHECK(send_rows[j] >= 0 && recv_rows[j] >= 0, "all_to_all_rows on group '", name_,
                    "': expected non-negative row counts, got ", send_rows[j], " to and ", recv_rows[j], " from rank ", j);
    sent += send_rows[j];
    received += recv_rows[j];
  }
  MEGATORCH_CHECK(sent == input.size(0), "all_to_all_rows on group '", name_, "': the send counts add up to ", sent,
                  " rows but the input has ", input.size(0), "; send every row exactly once");
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] = received;
  at::Tensor in = input.contiguous();
  if (size_ == 1) return in.clone();
  const int64_t row_elems = std::accumulate(shape.begin() + 1, shape.end(), int64_t{1}, std::multiplies<int64_t>());
  auto info = begin(CommOp::kAllToAll, (sent - send_rows[rank_]) * row_elems * in.element_size(), backend_for(in));
  at::Tensor out = at::empty(shape, in.options());
  std::vector<int64_t> out_splits(recv_rows.begin(), recv_rows.end()), in_splits(send_rows.begin(), send_rows.end());
  c10d::AllToAllOptions opts;
  opts.timeout = timeout_;
  // Row counts differ between ranks by design: only the dtype and row width must agree.
  const int64_t handle = trace(CommOp::kAllToAll, in.narrow(0, 0, 0), "rows of " + std::to_string(row_elems));
  auto work = pg_->alltoall_base(out, in, out_splits, in_splits, opts);
  return traced(Work(work, info, [out, in]() { return out; }), handle).wait();
}

Work Group::broadcast_async(at::Tensor& tensor, int64_t src) {
  MEGATORCH_CHECK(src >= 0 && src < size_, "broadcast on group '", name_, "': expected src in [0, ",
                  size_, "), got ", src);
  if (size_ == 1) return Work(tensor);
  auto info = begin(CommOp::kBroadcast, tensor.nbytes(), backend_for(tensor));
  at::Tensor buf = tensor.is_contiguous() ? tensor : tensor.contiguous();
  c10d::BroadcastOptions opts;
  opts.rootRank = src;
  opts.timeout = timeout_;
  std::vector<at::Tensor> bufs{buf};
  const int64_t handle = trace(CommOp::kBroadcast, buf, "root " + std::to_string(src));
  auto work = pg_->broadcast(bufs, opts);
  at::Tensor target = tensor;
  return traced(Work(work, info, [buf, target]() mutable {
    if (!buf.is_same(target)) target.copy_(buf);
    return target;
  }), handle);
}

at::Tensor Group::broadcast(at::Tensor& tensor, int64_t src) { return broadcast_async(tensor, src).wait(); }

// What a send or receive hands the backend: the tensor itself when it is contiguous and
// the backend can reach its memory; else a contiguous copy; and a host copy when Gloo
// carries CUDA tensors (ranks sharing a GPU): Gloo's p2p reads and writes host memory only.
// A received copy is written back into the tensor when the receive is waited for.
at::Tensor Group::p2p_buffer(const at::Tensor& t, bool send) const {
  if (t.is_cuda() && backend_for(t) == "gloo") {
    return send ? t.to(at::kCPU).contiguous() : at::empty(t.sizes(), t.options().device(at::kCPU));
  }
  return t.is_contiguous() ? t : t.contiguous();
}

Work Group::send_async(const at::Tensor& tensor, int64_t dst, int64_t tag) {
  MEGATORCH_CHECK(dst >= 0 && dst < size_ && dst != rank_, "send on group '", name_,
                  "': expected a destination rank in [0, ", size_, ") other than this rank ", rank_,
                  ", got ", dst);
  auto info = begin(CommOp::kSend, tensor.nbytes(), backend_for(tensor));
  std::vector<at::Tensor> bufs{p2p_buffer(tensor, /*send=*/true)};
  const int64_t handle = trace(CommOp::kSend, tensor, "", false, {{true, dst, tag, static_cast<int64_t>(tensor.nbytes())}});
  auto work = pg_->send(bufs, static_cast<int>(dst), static_cast<int>(tag));
  return traced(Work(work, info, nullptr), handle);
}

void Group::send(const at::Tensor& tensor, int64_t dst, int64_t tag) { send_async(tensor, dst, tag).wait(); }

Work Group::recv_async(at::Tensor& tensor, int64_t src, int64_t tag) {
  MEGATORCH_CHECK(src >= 0 && src < size_ && src != rank_, "recv on group '", name_,
                  "': expected a source rank in [0, ", size_, ") other than this rank ", rank_,
                  ", got ", src);
  auto info = begin(CommOp::kRecv, tensor.nbytes(), backend_for(tensor));
  at::Tensor buf = p2p_buffer(tensor, /*send=*/false);
  std::vector<at::Tensor> bufs{buf};
  const int64_t handle = trace(CommOp::kRecv, tensor, "", false, {{false, src, tag, static_cast<int64_t>(tensor.nbytes())}});
  auto work = pg_->recv(bufs, static_cast<int>(src), static_cast<int>(tag));
  at::Tensor target = tensor;
  return traced(Work(work, info, [buf, target]() mutable {
    if (!buf.is_same(target)) target.copy_(buf);
    return target;
  }), handle);
}

at::Tensor Group::recv(at::Tensor& tensor, int64_t src, int64_t tag) { return recv_async(tensor, src, tag).wait(); }

bool Group::coalesces(c10::DeviceType device) const { return pg_->getBackend(device)->supportsCoalescing(); }

bool Group::follows_nccl_rules(c10::DeviceType device) const { return coalesces(device) || nccl_check_enabled(); }

Work Group::batch_p2p(const std::vector<P2POp>& ops) {
  if (ops.empty()) return Work();
  const c10::DeviceType device = ops.front().tensor.defined() ? ops.front().tensor.device().type() : c10::kCPU;
  std::ostringstream detail;
  detail << " (first of a batch of " << ops.size() << " p2p ops:";
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& op = ops[i];
    const bool send = op.kind == P2POp::Kind::kSend;
    MEGATORCH_CHECK(op.tensor.defined(), "batch_p2p on group '", name_, "': op ", i, " has no tensor");
    MEGATORCH_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_, "batch_p2p on group '", name_, "': expected ",
                    send ? "a destination" : "a source", " rank in [0, ", size_, ") other than this rank ", rank_,
                    " for op ", i, ", got ", op.peer);
    MEGATORCH_CHECK(op.tensor.device().type() == device, "batch_p2p on group '", name_,
                    "': expected every tensor of a batch on one device type (one backend), got ",
                    c10::DeviceTypeName(device), " for op 0 and ", c10::DeviceTypeName(op.tensor.device().type()),
                    " for op ", i, "; post them as separate batches");
    detail << (i ? ", " : " ") << (send ? "send to " : "recv from ") << op.peer << " tag " << op.tag;
  }
  detail << ")";
  // On NCCL the batch is one group whatever the backend here: traced as one op.
  std::vector<TracedTransfer> transfers;
  for (const P2POp& op : ops)
    transfers.push_back({op.kind == P2POp::Kind::kSend, op.peer, op.tag, static_cast<int64_t>(op.tensor.nbytes())});
  const int64_t handle = trace(ops.front().kind == P2POp::Kind::kSend ? CommOp::kSend : CommOp::kRecv,
                               ops.front().tensor, "", true, std::move(transfers));
  const auto backend = pg_->getBackend(device);
  const bool coalesce = coalesces(device);
  const std::string backend_name = backend->getBackendName();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> keep_alive;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (contiguous buffer, non-contiguous target)
  CollectiveInfo info;
  if (coalesce) pg_->startCoalescing(device);
  try {
    for (size_t i = 0; i < ops.size(); ++i) {
      const P2POp& op = ops[i];
      const bool send = op.kind == P2POp::Kind::kSend;
      auto op_info = begin(send ? CommOp::kSend : CommOp::kRecv, op.tensor.nbytes(), backend_name);
      if (i == 0) info = op_info;
      at::Tensor buf = p2p_buffer(op.tensor, send);
      keep_alive.push_back(buf);
      if (!send && !buf.is_same(op.tensor)) copy_back.emplace_back(buf, op.tensor);
      std::vector<at::Tensor> bufs{buf};
      auto work = send ? pg_->send(bufs, static_cast<int>(op.peer), static_cast<int>(op.tag))
                       : pg_->recv(bufs, static_cast<int>(op.peer), static_cast<int>(op.tag));
      // Inside a coalesced group c10d's per-op works track nothing of their own: the one
      // endCoalescing returns completes with the whole group.
      if (!coalesce && work) works.push_back(std::move(work));
    }
  } catch (...) {
    if (coalesce) {
      try {
        pg_->endCoalescing(device);  // close the group so the process group stays usable
      } catch (...) {
      }
    }
    throw;
  }
  if (coalesce) {
    auto work = pg_->endCoalescing(device);
    if (work) works.push_back(std::move(work));
  }
  info.detail = detail.str();
  std::function<at::Tensor()> finish;
  if (!copy_back.empty()) {
    finish = [copy_back]() mutable {
      for (auto& [buf, target] : copy_back) target.copy_(buf);
      return at::Tensor();
    };
  }
  for (auto& [buf, target] : copy_back) keep_alive.push_back(target);
  return traced(Work(std::move(works), info, std::move(finish), std::move(keep_alive)), handle);
}

void Group::barrier() {
  if (size_ == 1) return;
  auto info = begin(CommOp::kBarrier, 0, pg_->getBackendName());
  c10d::BarrierOptions opts;
  opts.timeout = timeout_;
  // Traced on the stream of the backend that runs it (NCCL's barrier is a device all-reduce).
  const bool nccl = pg_->getBackendName() == "nccl";
  const int64_t handle = trace(CommOp::kBarrier, at::empty({0}, nccl ? at::kCUDA : at::kCPU), "");
  traced(Work(pg_->barrier(opts), info, nullptr), handle).wait();
}

void reduce_flattened(const std::vector<at::Tensor>& tensors, const std::function<void(at::Tensor&)>& reduce) {
  if (tensors.empty()) return;
  std::vector<at::Tensor> flat_views;
  for (const auto& t : tensors) flat_views.push_back(t.reshape(-1));
  at::Tensor flat = at::cat(flat_views);
  reduce(flat);
  int64_t offset = 0;
  for (const auto& t : tensors) {
    at::Tensor target = t;
    target.copy_(flat.narrow(0, offset, t.numel()).view_as(t));
    offset += t.numel();
  }
}

}  // namespace megatorch::comm
