"""Pipeline parallelism from PyTorch itself: torch.distributed.pipelining's PipelineStage
with ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B, DDP inside each stage over
the DP dimension.

The stages are built by hand (gpt.py's GPT over a layer range), as Megatron builds them:
rank r of p holds virtual stages r, r + p, ... (the placement the interleaved schedule
expects), each with L / (p·v) layers; the first also holds the embedding, the last the
final norm and the head. The head's weight is tied to the embedding, which lives on
another rank, so the last stage keeps a copy and - as Megatron does - the two copies'
gradients are summed over the "embedding group" (first and last stage of the same DP
replica) after the schedule, before clipping; the copy is left out of the norm.

The schedule averages the micro-batch losses (scale_grads=True: gradients are divided
by m after accumulation), DDP averages over DP on the last backward of the step.
"""
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.nn.parallel import DistributedDataParallel

import grad_norm
import train_loop
from gpt import GPT, lm_loss
from init_weights import load_into
from samples import micro_batches

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class PipelinePeer:
    def __init__(self, cfg, layout, weights, samples):
        self.cfg, self.layout, self.samples = cfg, layout, samples
        p, v, dp = layout.pp, layout.virtual_chunks, layout.dp
        self.name = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                     "interleaved": "ScheduleInterleaved1F1B"}[layout.schedule]
        # Megatron's rank order: dp before pp, so rank = pp_rank * dp + dp_rank.
        mesh = init_device_mesh("cpu", (p, dp), mesh_dim_names=("pp", "dp"))
        self.pp_rank, self.dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        self.dp_group = mesh.get_group("dp")
        # One embedding group per DP replica; every rank takes part in creating all of them.
        self.embedding_group = None
        for d in range(dp):
            g = dist.new_group([d, (p - 1) * dp + d])
            if d == self.dp_rank and self.pp_rank in (0, p - 1):
                self.embedding_group = g
        per_chunk, n_stages = cfg.num_layers // (p * v), p * v
        self.chunks, stages = [], []
        for k in range(v):
            s = self.pp_rank + k * p
            chunk = GPT(cfg, range(s * per_chunk, (s + 1) * per_chunk), pre_process=s == 0,
                        post_process=s == n_stages - 1)
            load_into(chunk, weights)
            self.chunks.append(chunk)
            wrapped = DistributedDataParallel(chunk, process_group=self.dp_group) if dp > 1 else chunk
            stages.append(PipelineStage(wrapped, s, n_stages, torch.device("cpu"), group=mesh.get_group("pp")))
        m = layout.micro_batches(cfg)
        loss_fn = lm_loss
        if layout.schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss_fn)
        else:
            self.schedule = SCHEDULES[layout.schedule](stages[0], n_microbatches=m, loss_fn=loss_fn)
        self.first = any(c.pre_process for c in self.chunks)
        self.last = any(c.post_process for c in self.chunks)
        named = [(n, q) for c in self.chunks for n, q in c.named_parameters()]
        # Each stage's parameters live on the dp ranks of its replica group; the head's copy
        # of the tied weight counts zero times (the embedding counts it).
        self.clip_list = [(q, math.inf if n == "output_weight" else dp) for n, q in named]
        self.optimizer = train_loop.adamw(cfg, named)

    def _sum_tied_gradients(self):
        """The embedding's gradient (first virtual stage, on pp rank 0) plus the head copy's
        (last virtual stage, on pp rank p-1): both copies then take the same update."""
        if self.embedding_group is None:
            return
        holder = self.chunks[0] if self.pp_rank == 0 else self.chunks[-1]
        dist.all_reduce(holder.tied_weight().grad, group=self.embedding_group)

    def train_step(self, step: int):
        train_loop.set_lr(self.optimizer, self.cfg.lr_at(step))
        mbs = micro_batches(self.samples, self.cfg, step, self.dp_rank, self.layout.dp)
        ids = torch.cat([x for x, _ in mbs])
        labels = torch.cat([y for _, y in mbs])
        losses = []
        args = (ids,) if self.first else ()
        kwargs = {"target": labels, "losses": losses} if self.last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self._sum_tied_gradients()
        norm = grad_norm.clip_grad_norm_(self.clip_list, self.cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad()
        local = torch.stack(losses).mean().item() if self.last else 0.0
        return train_loop.mean_over(local, self.dp_group, self.layout.dp), norm

    def state_bytes(self) -> int:
        return train_loop.model_state_bytes(self.optimizer)
