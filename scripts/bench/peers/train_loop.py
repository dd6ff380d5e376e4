"""What every Python peer shares: the optimizer set-up that matches megatorch's, the step
loop with its timing, the counted step, peak memory, and the result record.

A peer is an object with
    train_step(step) -> (loss, grad_norm)
                                one optimizer step over the global batch; returns the global
                                mean loss and the gradient norm before clipping (at least on
                                the reporting rank)
    state_bytes() -> int        parameters + gradients + optimizer state this rank holds
and `run(peer, ...)` does the rest. The timed region is the whole step: forward and
backward over the micro-batches, gradient reduction, clipping, the optimizer, and the
loss reduction (gpt_pretrain's `ms_per_iteration` covers the same).
"""
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist

from comm_count import CommCounter
from config import BenchConfig


def param_groups(named_parameters, weight_decay: float):
    """Megatron's (and megatorch's) rule: weight decay on matrices and embeddings (dim > 1),
    none on biases and norm weights."""
    decay, no_decay = [], []
    for _, p in named_parameters:
        (decay if p.dim() > 1 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(cfg: BenchConfig, named_parameters, **kw) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(named_parameters, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, **kw)


def set_lr(optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def tensor_bytes(tensors) -> int:
    """Bytes of the local storage of each tensor (a DTensor's local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer) -> int:
    return tensor_bytes(v for s in optimizer.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0)


def model_state_bytes(optimizer, state_of=None) -> int:
    """Parameters + gradients (counted at the parameters' size: they exist from backward to
    the step) + optimizer state, of the parameters `optimizer` trains on this rank (their
    local pieces). `state_of`: the optimizer that holds the state, when it is wrapped."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return 2 * tensor_bytes(params) + optimizer_state_bytes(state_of or optimizer)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def mean_over(loss: float, group, size: int) -> float:
    """The mean of a per-rank loss over a group (megatorch's reduce_loss)."""
    t = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / size


def run(peer, cfg: BenchConfig, system: str, config_name: str, out_path: str, report_rank: int, extra=None):
    """Runs the warm-up and timed steps, then one extra step under the profiler to count
    the bytes communicated (an extra step, so that neither the timing nor the peak RSS
    include the profiler; it reuses the first batch and changes no recorded number).
    Writes one JSON record from `report_rank` (the last rank, megatorch's logging rank)."""
    rank = dist.get_rank()
    losses, norms, step_ms = [], [], []
    for step in range(cfg.train_iters):
        t0 = time.perf_counter()
        loss, norm = peer.train_step(step)
        ms = (time.perf_counter() - t0) * 1e3
        losses.append(float(loss))
        norms.append(float(norm))
        if step >= cfg.warmup_steps:
            step_ms.append(ms)
        if rank == report_rank:
            print(f"  [{system}] step {step + 1}/{cfg.train_iters} loss {loss:.5f} grad norm {norm:.4f} {ms:.0f} ms",
                  flush=True)
    rss = [None] * dist.get_world_size()
    dist.all_gather_object(rss, peak_rss_bytes())
    state = [None] * dist.get_world_size()
    dist.all_gather_object(state, peer.state_bytes())
    with CommCounter() as counter:
        peer.train_step(cfg.train_iters)
    if rank == report_rank:
        record = {
            "system": system, "config": config_name, "world": dist.get_world_size(),
            "losses": losses, "grad_norms": norms, "step_ms": step_ms,
            "median_ms": statistics.median(step_ms),
            "comm_bytes_per_step": counter.to_json(), "peak_rss_bytes": rss, "state_bytes": state,
            **(extra or {}),
        }
        with open(out_path, "w") as f:
            json.dump(record, f, indent=1)
    dist.barrier()
