"""Tensor-parallel layers as torch.nn.Modules over torch.ops.megatorch.

Each layer holds only its shard and takes the tensor-parallel group (a
``torch.distributed`` ProcessGroup or its ``group_name``). ``from_dense`` shards an
existing ``nn.Linear`` / ``nn.Embedding`` so a model can be converted layer by layer.
Activations use Megatron's [s, b, h] layout when ``sequence_parallel`` is on.
"""
import collections
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

GroupLike = Union[str, dist.ProcessGroup]


def _group_name(group: GroupLike) -> str:
    return group if isinstance(group, str) else group.group_name


def _rank_size(group: GroupLike):
    pg = group if isinstance(group, dist.ProcessGroup) else dist.distributed_c10d._resolve_process_group(group)
    return dist.get_rank(pg), dist.get_world_size(pg)


def _shard(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if tensor.size(dim) % size:
        raise ValueError(f"megatorch: expected dim {dim} of size {tensor.size(dim)} to be divisible by the "
                         f"tensor-parallel size {size}")
    return tensor.chunk(size, dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A's rows (output features) split: weight shard [out/tp, in]."""

    def __init__(self, in_features: int, out_features: int, group: GroupLike, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.group = _group_name(group)
        self.rank, self.world = _rank_size(group)
        if out_features % self.world:
            raise ValueError(f"megatorch: expected out_features ({out_features}) to be divisible by the "
                             f"tensor-parallel size ({self.world})")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // self.world, in_features, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features // self.world, **kw)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: GroupLike, **kwargs) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard(linear.weight, 0, layer.rank, layer.world))
            if linear.bias is not None:
                layer.bias.copy_(_shard(linear.bias, 0, layer.rank, layer.world))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.megatorch.column_parallel_linear(x, self.weight, self.bias, self.group, self.gather_output,
                                                          self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.world}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A's columns (input features) split: weight shard [out, in/tp];
    the bias is replicated and added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, group: GroupLike, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.group = _group_name(group)
        self.rank, self.world = _rank_size(group)
        if in_features % self.world:
            raise ValueError(f"megatorch: expected in_features ({in_features}) to be divisible by the "
                             f"tensor-parallel size ({self.world})")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.world, **kw))
        self.bias = nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: GroupLike, **kwargs) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(_shard(linear.weight, 1, layer.rank, layer.world))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.megatorch.row_parallel_linear(x, self.weight, self.bias, self.group, self.input_is_parallel,
                                                       self.sequence_parallel)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.world}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split: rank r holds rows
    [r·V/tp, (r+1)·V/tp). ``from_dense`` pads the vocabulary with zero rows up to a
    multiple of the tensor-parallel size when needed (those ids are never looked up)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: GroupLike, device=None, dtype=None):
        super().__init__()
        self.group = _group_name(group)
        self.rank, self.world = _rank_size(group)
        self.num_embeddings = num_embeddings
        self.padded = -(-num_embeddings // self.world) * self.world
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(self.padded // self.world, embedding_dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group: GroupLike) -> "VocabParallelEmbedding":
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device=embedding.weight.device,
                    dtype=embedding.weight.dtype)
        full = embedding.weight.detach()
        if layer.padded != layer.num_embeddings:
            full = torch.cat([full, full.new_zeros(layer.padded - layer.num_embeddings, full.size(1))])
        with torch.no_grad():
            layer.weight.copy_(_shard(full, 0, layer.rank, layer.world))
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.megatorch.vocab_parallel_embedding(ids, self.weight, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.world}"


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: GroupLike,
                                 label_smoothing: float = 0.0, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss from this rank's vocabulary shard of the logits (unreduced)."""
    return torch.ops.megatorch.vocab_parallel_cross_entropy(logits, target, _group_name(group), label_smoothing,
                                                            ignore_index)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


def _called_children_with_parameters(module: nn.Module) -> list:
    """The children a forward calls, containers expanded: ModuleList and ModuleDict hold
    modules but are never called, so forward hooks on them would never run."""
    out = []
    for m in module.children():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            out.extend(_called_children_with_parameters(m))
        elif any(True for _ in m.parameters()):
            out.append(m)
    return out


class FullyShard(nn.Module):
    """ZeRO-3 from Python: wraps ``module`` so that a DistributedOptimizer with
    ``zero_stage=3`` keeps only its shard of each unit's parameters between uses.

    Units are the children of ``module`` that have parameters, with ``nn.ModuleList`` /
    ``nn.ModuleDict`` containers (never called themselves) replaced by their elements, or
    the modules given as ``units``; the root unit holds the parameters left over and any
    parameter shared by two units (a tied embedding and head), gathered for the whole
    forward and backward. Each unit is all-gathered right before
    its forward, freed after it, gathered again before its backward and freed once its
    gradients have all been accumulated; the next unit is prefetched. Until an optimizer is
    attached the wrapper is a plain pass-through.
    """

    def __init__(self, module: nn.Module, group: GroupLike, units: Optional[list] = None):
        super().__init__()
        self.module = module
        self.group = _group_name(group)
        unit_modules = list(units) if units is not None else _called_children_with_parameters(module)
        # A parameter in two units (tied weights) would be freed by one while the other
        # still needs it: it goes to the root unit instead.
        uses = collections.Counter(id(p) for m in unit_modules for p in m.parameters())
        own = [[p for p in m.parameters() if p.requires_grad and uses[id(p)] == 1] for m in unit_modules]
        unit_modules = [m for m, ps in zip(unit_modules, own) if ps]  # nothing of its own: no unit
        self._units = [[]] + [ps for ps in own if ps]  # unit 0: the root
        in_units = {id(p) for u in self._units for p in u}
        self._units[0] = [p for p in module.parameters() if p.requires_grad and id(p) not in in_units]
        self._opt = None
        for i, p in enumerate(q for u in self._units for q in u):
            p._megatorch_fully_shard = self
        for k, m in enumerate(unit_modules, start=1):
            m.register_forward_pre_hook(lambda mod, args, k=k: self._before(k))
            m.register_forward_hook(lambda mod, args, out, k=k: self._after(k, out))

    @staticmethod
    def _owner_of(params):
        owners = {id(getattr(p, "_megatorch_fully_shard", None)): getattr(p, "_megatorch_fully_shard", None)
                  for p in params}
        owners.pop(id(None), None)
        if len(owners) > 1:
            raise ValueError("megatorch: parameters from several FullyShard modules; use one optimizer per module")
        return next(iter(owners.values()), None)

    def _attach(self, opt) -> None:
        self._opt = opt

    # The unit schedule itself (what to gather, prefetch and free, and when) is the C++
    # optimizer's, the same one GPTModel runs: these only report where a unit starts and ends.
    def _before(self, unit: int) -> None:
        if self._opt is not None:
            self._opt.before_unit_forward(unit)

    def _after(self, unit: int, out):
        if self._opt is None:
            return out
        if isinstance(out, torch.Tensor):
            return self._opt.after_unit_forward(unit, out)
        if type(out) in (tuple, list):
            # Every tensor output gathers the unit before its backward (idempotent).
            wrapped = [self._opt.after_unit_forward(unit, t) if isinstance(t, torch.Tensor) else t for t in out]
            self._opt.release_unit(unit)  # also when no output is a tensor
            return type(out)(wrapped)
        self._opt.release_unit(unit)
        return out

    def forward(self, *args, **kwargs):
        self._before(0)
        return self._after(0, self.module(*args, **kwargs))
