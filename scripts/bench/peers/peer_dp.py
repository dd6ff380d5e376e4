"""Data-parallel peers from PyTorch itself, over all ranks:

  ddp        DistributedDataParallel, AdamW replicated                (megatorch ZeRO-0)
  ddp_zero   DDP + ZeroRedundancyOptimizer: optimizer state sharded,
             updated parameters broadcast from their owners            (megatorch ZeRO-1)
  fsdp2      fully_shard per layer and at the root: parameters, gradients and
             optimizer state sharded, gathered per layer               (megatorch ZeRO-3)
  fsdp2_noreshard  the same, parameters kept gathered from forward to
             backward (reshard_after_forward=False, FSDP2's ZeRO-2-like mode)

Gradient accumulation over the step's micro-batches communicates once per step, as
megatorch does (DDP `no_sync`, FSDP2 `set_requires_gradient_sync(False)` until the last
micro-batch). FSDP2 averages gradients with ReduceOp.AVG, which Gloo does not implement;
`set_force_sum_reduction_for_comms(True)` on every FSDP module makes it reduce with SUM
and divide afterwards (the Gloo workaround).
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import train_loop
from gpt import GPT, lm_loss
from init_weights import load_into
from samples import micro_batches


class DataParallelPeer:
    def __init__(self, cfg, weights, samples, kind: str):
        self.cfg, self.samples, self.kind = cfg, samples, kind
        self.rank, self.dp = dist.get_rank(), dist.get_world_size()
        model = GPT(cfg)
        load_into(model, weights)
        if kind in ("ddp", "ddp_zero"):
            self.model = DistributedDataParallel(model)
            params = list(model.named_parameters())
            if kind == "ddp_zero":
                self.optimizer = ZeroRedundancyOptimizer(
                    train_loop.param_groups(params, cfg.weight_decay), optimizer_class=torch.optim.AdamW,
                    lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
            else:
                self.optimizer = train_loop.adamw(cfg, params)
        else:
            reshard = kind == "fsdp2"
            for layer in model.layers.values():
                fully_shard(layer, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
            self.model = model
            self.optimizer = train_loop.adamw(cfg, model.named_parameters())

    def _sync(self, last: bool):
        """Gradient communication only on the step's last micro-batch."""
        if isinstance(self.model, DistributedDataParallel):
            return nullcontext() if last else self.model.no_sync()
        self.model.set_requires_gradient_sync(last)
        return nullcontext()

    def train_step(self, step: int):
        train_loop.set_lr(self.optimizer, self.cfg.lr_at(step))
        mbs = micro_batches(self.samples, self.cfg, step, self.rank, self.dp)
        local = 0.0
        for k, (ids, labels) in enumerate(mbs):
            with self._sync(k == len(mbs) - 1):
                loss = lm_loss(self.model(ids), labels) / len(mbs)
                loss.backward()
            local += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return train_loop.mean_over(local, None, self.dp), float(norm)

    def state_bytes(self) -> int:
        # ZeroRedundancyOptimizer trains every parameter but holds the state of its shard only.
        opt = self.optimizer.optim if isinstance(self.optimizer, ZeroRedundancyOptimizer) else self.optimizer
        return train_loop.model_state_bytes(self.optimizer, opt)
