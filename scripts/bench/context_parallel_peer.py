"""The PyTorch side of the long-sequence benchmark (scripts/bench/context_parallel.py), one
process per rank under torchrun:

    torchrun --standalone --nproc-per-node=C scripts/bench/context_parallel_peer.py \\
        --work DIR --mode eager|torch_cp [--rotate alltoall|allgather] [--sdpa default|math] --out FILE

  eager     gpt.py's GPT in plain PyTorch on one rank, no context parallelism: the same
            model, data, initial weights and update as gpt_pretrain at c = 1
  torch_cp  the same GPT under PyTorch's own context parallelism,
            torch.distributed.tensor.experimental.context_parallel over a 1-D CPU mesh of
            all ranks (Gloo): the ids, labels and position ids are the CP buffers (its
            head-tail load balancing, the same chunks r and 2c-1-r megatorch holds), SDPA
            is dispatched to its ring attention, gradients are summed over the CP ranks

DIR is what scripts/bench/peers/prepare.py wrote (config.json, samples.npy, init.pt). The
step is gpt_pretrain's: one micro-batch (the global batch), the loss the mean over the
sequence's tokens, global-norm clipping, AdamW with megatorch's decay groups and LR
schedule. The record (FILE, JSON) has the losses and step times, or the error that
stopped the run: a peer that does not run on CPU is a result, reported as such.
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import train_loop  # noqa: E402
from config import BenchConfig  # noqa: E402
from gpt import GPT  # noqa: E402
from init_weights import load_into  # noqa: E402
from samples import micro_batches  # noqa: E402


class PositionIds:
    """Learned positions read at explicit position ids instead of the first s rows: under
    context parallelism a rank holds two non-adjacent chunks of the sequence, and the
    position ids are a CP buffer sharded (and load-balanced) exactly as the tokens are."""

    def __init__(self, model: GPT, seq_length: int):
        self.ids = torch.arange(seq_length).unsqueeze(0)  # [1, s]: batch-first like the tokens
        position = model.embedding.position
        position.forward = lambda x: x + position.weight[self.ids[0]]


class Peer:
    def __init__(self, cfg: BenchConfig, weights: dict, samples: np.ndarray, mode: str, rotate: str, sdpa: str):
        self.cfg, self.samples, self.mode, self.sdpa = cfg, samples, mode, sdpa
        self.world = dist.get_world_size()
        self.model = GPT(cfg)
        load_into(self.model, weights)
        self.positions = PositionIds(self.model, cfg.seq_length)
        self.optimizer = train_loop.adamw(cfg, self.model.named_parameters())
        if mode == "torch_cp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.experimental._attention import set_rotate_method
            self.mesh = init_device_mesh("cpu", (self.world,), mesh_dim_names=("cp",))
            set_rotate_method(rotate)

    def _attention_backend(self):
        from contextlib import nullcontext
        if self.sdpa == "default":
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.MATH])

    def _forward_backward(self, ids, labels):
        # Sum over this rank's tokens / the whole sequence's count: summed over the CP
        # ranks that is the sequence's mean, as gpt_pretrain's loss.
        logits = self.model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / self.cfg.seq_length
        loss.backward()
        return loss.detach()

    def train_step(self, step: int):
        train_loop.set_lr(self.optimizer, self.cfg.lr_at(step))
        (ids, labels), = micro_batches(self.samples, self.cfg, step, 0, 1)
        ids, labels = ids.clone(), labels.clone()
        pos = torch.arange(self.cfg.seq_length).unsqueeze(0)
        with self._attention_backend():
            if self.mode == "eager":
                self.positions.ids = pos
                loss = self._forward_backward(ids, labels)
            else:
                from torch.distributed.tensor.experimental import context_parallel
                # Buffers are sharded in place on entry (seq dim 1 of [b, s]).
                with context_parallel(self.mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1],
                                      no_restore_buffers={ids, labels, pos}):
                    self.positions.ids = pos
                    loss = self._forward_backward(ids, labels)
        if self.world > 1:
            # Parameters are replicated over CP: each rank holds its tokens' share of the gradient.
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([g.flatten() for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            dist.all_reduce(loss)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss), float(norm)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--mode", required=True, choices=["eager", "torch_cp"])
    ap.add_argument("--rotate", default="alltoall", choices=["alltoall", "allgather"])
    ap.add_argument("--sdpa", default="default", choices=["default", "math"],
                    help="default: the kernel SDPA picks (flash attention on CPU); math: SDPBackend.MATH only")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    cfg = BenchConfig.from_json(Path(args.work, "config.json").read_text())
    samples = np.load(os.path.join(args.work, "samples.npy"))
    weights = torch.load(os.path.join(args.work, "init.pt"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = {"mode": args.mode, "world": world, "rotate": args.rotate if args.mode == "torch_cp" else None,
              "sdpa": args.sdpa, "torch": torch.__version__}
    losses, step_ms = [], []
    try:
        peer = Peer(cfg, weights, samples, args.mode, args.rotate, args.sdpa)
        for step in range(cfg.train_iters):
            t0 = time.perf_counter()
            loss, norm = peer.train_step(step)
            ms = (time.perf_counter() - t0) * 1e3
            losses.append(loss)
            if step >= cfg.warmup_steps:
                step_ms.append(ms)
            if rank == world - 1:
                print(f"  [torch {args.mode}] step {step + 1}/{cfg.train_iters} loss {loss:.6f} {ms:.0f} ms", flush=True)
        record.update(losses=losses, step_ms=step_ms, median_ms=statistics.median(step_ms))
    except Exception as e:  # the failure is the result; its first line and where it came from
        tb = traceback.extract_tb(e.__traceback__)
        record.update(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0]}",
                      raised_in=f"{Path(tb[-1].filename).name}:{tb[-1].lineno} ({tb[-1].name})" if tb else None,
                      losses=losses)
        if rank == world - 1:
            traceback.print_exc()
    record["peak_rss_bytes_self"] = train_loop.peak_rss_bytes()
    if rank == world - 1:
        Path(args.out).write_text(json.dumps(record, indent=1))
    # No barrier or destroy: after a failed collective the group may be unusable.
    os._exit(0)


if __name__ == "__main__":
    main()
