"""The ZeRO-sharded data-parallel optimizer from Python.

``DistributedOptimizer(model.parameters(), group, zero_stage=...)`` wraps
``torch.classes.megatorch.DistributedOptimizer``: it reduces every rank's local gradients
over ``group`` as its stage prescribes (all-reduce at stage 0, reduce-scatter from
stage 1), updates its shard with AdamW (or SGD with momentum) and puts the parameters
back together. Call ``zero_grad()`` through it, not through the model: gradients are
views into its flat buffers. Stage 3 needs the model wrapped in
:class:`megatorch.nn.FullyShard`, which gathers each unit's parameters just in time.

With tensor or pipeline parallelism pass ``model_parallel_groups`` (the TP and PP groups):
the gradient norm and the fp16 overflow flag are then reduced over them, so every rank
clips and skips alike; and ``counted_in_norm`` (one flag per parameter, False for a copy
another model-parallel rank also holds, e.g. a TP-replicated LayerNorm weight on tp rank
> 0) so that each parameter counts once. ``decay`` (one flag per parameter) turns weight
decay off where False (Megatron: biases and norms).
"""
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch

from .nn import FullyShard, GroupLike, _group_name


class DistributedOptimizer:
    def __init__(self, params: Iterable[torch.Tensor], group: GroupLike, zero_stage: int = 0, lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01, *,
                 clip_grad: float = 0.0, bucket_size: int = 0, sgd: bool = False, momentum: float = 0.9,
                 loss_scale: float = 0.0, overlap_grad_reduce: bool = True, grad_in_fp32: bool = True,
                 gradient_accumulation_fusion: bool = False,
                 model_parallel_groups: Sequence[GroupLike] = (), counted_in_norm: Optional[Sequence[bool]] = None,
                 decay: Optional[Sequence[bool]] = None):
        given = list(params)
        keep = [p.requires_grad for p in given]
        params = [p for p, k in zip(given, keep) if k]

        def per_param(flags, what):  # flags follow the order params were given in
            if flags is None:
                return {id(p): True for p in params}
            flags = list(flags)
            if len(flags) != len(given):
                raise ValueError(f"megatorch: expected one {what} flag per parameter ({len(given)}), got {len(flags)}")
            return {id(p): bool(f) for p, f in zip(given, flags)}

        norm_flags, decay_flags = per_param(counted_in_norm, "counted_in_norm"), per_param(decay, "decay")
        owner = FullyShard._owner_of(params)
        if zero_stage == 3 and owner is None:
            raise ValueError("megatorch: zero_stage=3 gathers parameters unit by unit around each forward; wrap the "
                             "model first: model = megatorch.nn.FullyShard(model, group), then pass model.parameters()")
        units = None
        if owner is not None:
            units = owner._units
            known = {id(p) for u in units for p in u}
            if {id(p) for p in params} != known:
                raise ValueError("megatorch: expected exactly the parameters of the FullyShard module that owns them")
            params = [p for u in units for p in u]
        self._opt = torch.classes.megatorch.DistributedOptimizer(params, _group_name(group), zero_stage, lr,
                                                                 betas[0], betas[1], eps, weight_decay)
        for key, value in (("clip_grad", clip_grad), ("bucket_size", bucket_size), ("sgd", float(sgd)),
                           ("momentum", momentum), ("loss_scale", loss_scale),
                           ("overlap_grad_reduce", float(overlap_grad_reduce)), ("grad_in_fp32", float(grad_in_fp32)),
                           ("gradient_accumulation_fusion", float(gradient_accumulation_fusion))):
            if key in ("clip_grad", "bucket_size", "loss_scale") and not value:
                continue
            self._opt.configure(key, float(value))
        if units is not None:
            self._opt.set_units([len(u) for u in units])
        if model_parallel_groups:
            self._opt.set_model_parallel_groups([_group_name(g) for g in model_parallel_groups])
        if counted_in_norm is not None or decay is not None:
            self._opt.set_param_info([norm_flags[id(p)] for p in params], [decay_flags[id(p)] for p in params])
        self._opt.build()  # collective: checks that every rank has the same parameters
        self.params = params
        self.lr = lr
        if owner is not None:
            owner._attach(self._opt)

    def step(self) -> bool:
        """Reduce, (unscale, clip,) update; False when an overflow skipped the step."""
        return self._opt.step()

    def zero_grad(self) -> None:
        self._opt.zero_grad()

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        self._opt.set_lr(lr)

    def set_grad_sync(self, enabled: bool) -> None:
        """False for all but the last micro-batch of a step: gradients accumulate locally."""
        self._opt.set_grad_sync(enabled)

    def grad_norm(self) -> float:
        return self._opt.grad_norm()

    def loss_scale(self) -> float:
        return self._opt.loss_scale()

    def memory_stats(self) -> Dict[str, int]:
        return dict(self._opt.memory_stats())

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return dict(self._opt.state_dict())

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self._opt.load_state_dict(state)


__all__ = ["DistributedOptimizer"]
