"""Bytes a rank hands to collectives, counted for any PyTorch-based peer without touching it.

DDP's reducer, FSDP2, DTensor (functional collectives), torch.distributed.pipelining,
ZeroRedundancyOptimizer and DeepSpeed all end in the c10d dispatcher operators
(`c10d::allreduce_`, `c10d::_allgather_base_`, `c10d::send`, ...), whichever thread
issues them. The profiler records those operators with their input shapes, so one
profiled step gives every collective of the step. Profiling slows a step down, so the
counted step is a warm-up step, never a timed one.

The convention is megatorch's (include/megatorch/comm/comm_stats.h): the bytes of the
tensor a rank hands in - the reduced tensor for all-reduce, the local shard for
all-gather, the full input for reduce-scatter, the tensor for send/recv/broadcast. The
profiler names a tensor list's element type only as "TensorList"; those are counted as
fp32 (everything these benchmarks communicate is fp32).
"""
import json
import os
import tempfile
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

# Which argument holds the payload, per c10d operator (schemas in torch/csrc/distributed/c10d/Ops.cpp).
_PAYLOAD_ARG = {
    "allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "reduce_": 0, "send": 0, "recv_": 0,
    "recv_any_source_": 0, "_allgather_base_": 1, "allgather_": 1, "allgather_coalesced_": 1,
    "allgather_into_tensor_coalesced_": 1, "_reduce_scatter_base_": 1, "reduce_scatter_": 1,
    "reduce_scatter_tensor_coalesced_": 1, "alltoall_base_": 1, "alltoall_": 1, "gather_": 1, "scatter_": 0,
}
_ITEMSIZE = {"float": 4, "double": 8, "long int": 8, "int": 4, "c10::BFloat16": 2, "c10::Half": 2, "bool": 1,
             "unsigned char": 1, "signed char": 1, "short int": 2}


def _numel(dims) -> int:
    """Elements of a shape [d0, d1, ...] or of a (nested) list of shapes."""
    if not dims:
        return 0 if dims == [] else 1
    if all(isinstance(d, int) for d in dims):
        n = 1
        for d in dims:
            n *= d
        return n
    return sum(_numel(d) for d in dims)


class CommCounter:
    """`with CommCounter() as c: step()` then `c.bytes_by_op` {op: bytes}, `c.total_bytes`."""

    def __enter__(self):
        self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        self.bytes_by_op, self.calls_by_op = defaultdict(int), defaultdict(int)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        for e in events:
            name = str(e.get("name", ""))
            if not name.startswith("c10d::") or name[6:] not in _PAYLOAD_ARG:
                continue
            op, args = name[6:], e.get("args", {})
            k = _PAYLOAD_ARG[op]
            dims, types = args.get("Input Dims", []), args.get("Input type", [])
            if k >= len(dims):
                continue
            itemsize = _ITEMSIZE.get(types[k] if k < len(types) else "", 4)
            self.bytes_by_op[op.strip("_")] += _numel(dims[k]) * itemsize
            self.calls_by_op[op.strip("_")] += 1
        return False

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    def to_json(self) -> dict:
        return {"total": self.total_bytes, "by_op": dict(self.bytes_by_op), "calls": dict(self.calls_by_op)}
