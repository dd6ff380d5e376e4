"""torch.distributed.pipelining's schedules, its zero-bubble ones included, on the GPT that
megatorch's pipeline_timeline runs: the same layers, the same initial weights
(init_weights.py reproduces megatorch's) and the same micro-batches (token ids drawn from
a CPU generator seeded with --data-seed, as pipeline_timeline draws them), forward and
backward only (no optimizer step, as there), on Gloo with one intra-op thread per rank.

Placement: the looped schedules put stage s on rank s % p (Megatron's), ZBV and DualPipeV
the V: rank r holds stages r and 2p-1-r. Each step is timed from a barrier to a barrier
(the slowest rank's wall time); the loss is the mean of the micro-batch losses.

    torchrun --nproc-per-node=4 scripts/bench/peers/peer_zero_bubble.py \\
        --schedule ScheduleZBVZeroBubble --num-microbatches 8 --json out.json
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

from config import BenchConfig
from gpt import GPT, lm_loss
from init_weights import load_into, megatorch_init

# name -> (class, placement, stages per rank)
SCHEDULES = {
    "Schedule1F1B": (Schedule1F1B, "loop", 1),
    "ScheduleInterleaved1F1B": (ScheduleInterleaved1F1B, "loop", 2),
    "ScheduleInterleavedZeroBubble": (ScheduleInterleavedZeroBubble, "loop", 2),
    "ScheduleZBVZeroBubble": (ScheduleZBVZeroBubble, "v", 2),
    "ScheduleDualPipeV": (ScheduleDualPipeV, "v", 2),
}


def stage_indices(placement: str, rank: int, p: int, v: int) -> list:
    if placement == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(v)]


def keep_others(stage, rank: int):
    """The schedules' first batched p2p (a warm-up with each neighbouring stage) includes,
    under the V, a rank's send to itself (its two stages meet there). NCCL accepts that,
    Gloo cannot pair a rank with itself: the warm-up keeps the other ranks' ops only. The
    steps' own transfers between a rank's two stages are local and untouched."""
    ops = stage._get_init_p2p_neighbors_ops
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in ops() if op.peer != rank]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    ap.add_argument("--num-microbatches", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up step")
    ap.add_argument("--data-seed", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    cls, placement, v = SCHEDULES[a.schedule]
    # pipeline_timeline's model: 8 heads, a 1024-token vocabulary, megatorch's defaults otherwise.
    cfg = BenchConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=8,
                      seq_length=a.seq_length, vocab_size=1024, micro_batch_size=a.micro_batch_size)
    weights = megatorch_init(cfg)
    n = p * v
    assert cfg.num_layers % n == 0, f"expected layers divisible by {n} stages, got {cfg.num_layers}"
    per = cfg.num_layers // n
    chunks, stages = [], []
    for s in stage_indices(placement, rank, p, v):
        chunk = GPT(cfg, range(s * per, (s + 1) * per), pre_process=s == 0, post_process=s == n - 1)
        load_into(chunk, weights)
        chunks.append(chunk)
        stages.append(PipelineStage(chunk, s, n, torch.device("cpu")))
    for stage in stages:
        keep_others(stage, rank)
    m = a.num_microbatches
    schedule = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=lm_loss)
    gen = torch.Generator().manual_seed(a.data_seed)
    data = [torch.randint(cfg.vocab_size, (a.micro_batch_size, cfg.seq_length + 1), generator=gen) for _ in range(m)]
    ids = torch.cat([d[:, :-1] for d in data])
    labels = torch.cat([d[:, 1:] for d in data])
    first, last = any(c.pre_process for c in chunks), any(c.post_process for c in chunks)
    times, loss = [], 0.0
    for step in range(a.steps + 1):
        losses = []
        dist.barrier()
        t0 = time.perf_counter()
        schedule.step(*((ids,) if first else ()), **({"target": labels, "losses": losses} if last else {}))
        dist.barrier()
        t = torch.tensor([time.perf_counter() - t0,
                          torch.stack(losses).mean().item() if last else 0.0], dtype=torch.float64)
        gathered = [torch.zeros_like(t) for _ in range(p)]
        dist.all_gather(gathered, t)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        if step > 0:
            times.append(max(g[0].item() for g in gathered))
            loss = max(abs(g[1].item()) for g in gathered)
    if rank == 0:
        out = {"schedule": a.schedule, "p": p, "m": m, "v": v, "steps": a.steps, "step_s": sum(times) / len(times),
               "loss": loss}
        print(json.dumps(out))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
