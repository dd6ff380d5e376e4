"""Global-norm gradient clipping for parameters spread over ranks in any way (TP shards,
FSDP shards, pipeline stages, replicas), the way megatorch clips: each distinct gradient
element counted once.

torch.nn.utils.clip_grad_norm_ covers one layout at a time (plain tensors, or DTensors of
one mesh); a TP model wrapped in DDP holds local shards that look like plain tensors, and
a pipeline stage sees only its own parameters. Here each parameter carries `copies`: on
how many ranks of the world an identical gradient lives (a TP-sharded weight under DDP:
dp copies; a layer norm weight: tp x dp; a parameter on one pipeline stage, replicated
over DP: dp). Summing sum-of-squares / copies over the whole world counts each once.
"""
import math

import torch
import torch.distributed as dist


def dtensor_copies(p, world: int) -> int:
    """Copies of a DTensor parameter's local piece: the world over the distinct pieces
    (the product of its mesh's sharded dimensions). Parameters are never Partial, so
    anything not Replicate shards - including FSDP2's _StridedShard over a TP shard,
    for which is_shard() says False."""
    pieces = 1
    for dim, placement in enumerate(p.placements):
        if not placement.is_replicate():
            pieces *= p.device_mesh.size(dim)
    return world // pieces


def clip_grad_norm_(params_and_copies, max_norm: float) -> float:
    """Scales the gradients in place so that their global L2 norm is at most `max_norm`
    (coefficient max_norm / (norm + 1e-6), torch's and megatorch's); returns the norm."""
    local = torch.zeros((), dtype=torch.float64)
    grads = []
    for p, copies in params_and_copies:
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads.append(g)
        local += g.double().pow(2).sum() / copies
    dist.all_reduce(local)
    norm = math.sqrt(local.item())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return norm
