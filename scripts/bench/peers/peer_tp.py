"""Tensor (and sequence) parallelism from PyTorch itself: DTensor's `parallelize_module`
over the TP dimension of a 2-D (dp, tp) device mesh, DDP or FSDP2 over the DP dimension.

Megatron's layout expressed in PyTorch's styles, the plan torchtitan uses for its models:
QKV and fc1 ColwiseParallel, proj and fc2 RowwiseParallel, the token embedding
RowwiseParallel (vocabulary-sharded rows, output all-reduced), and the tied output head
a matmul with the same vocabulary-sharded weight whose logits stay sharded, with the
cross entropy computed on the shards under `loss_parallel()`. With sequence parallelism
the norms and the position embedding become SequenceParallel regions (activations split
along the sequence), the embedding and the row-parallel outputs reduce-scatter into them
and each column-parallel input all-gathers out of them (PrepareModuleInput).

Over DP: `tp_ddp` converts the DTensor parameters to local tensors for DDP
(`_pre_dp_module_transform`, PyTorch's documented TP + DDP composition); `tp_fsdp2`
shards every layer over the DP mesh dimension with fully_shard (ZeRO-3) and the Gloo
sum-reduction workaround. Gradients are clipped by the global norm (grad_norm.py).
"""
from contextlib import nullcontext

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
from torch.nn.parallel import DistributedDataParallel

import grad_norm
import train_loop
from gpt import GPT, lm_loss
from init_weights import load_into
from samples import micro_batches


def tp_plan(model: GPT, sequence_parallel: bool) -> dict:
    """parallelize_module's plan for gpt.py's module names."""
    if not sequence_parallel:
        plan = {
            "embedding.word": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            # The head's input is replicated; making it a DTensor marks where its gradient is
            # all-reduced (Megatron's f before the vocabulary-parallel matmul).
            "head": PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None)),
        }
        layer = {"attention.qkv": ColwiseParallel(), "attention.proj": RowwiseParallel(),
                 "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    else:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan = {
            "embedding.word": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "embedding.position": SequenceParallel(use_local_output=True),
            "final_norm": SequenceParallel(),
            "head": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        }
        layer = {"input_norm": SequenceParallel(), "attention": gather, "attention.qkv": ColwiseParallel(),
                 "attention.proj": RowwiseParallel(output_layouts=Shard(1)),
                 "post_attention_norm": SequenceParallel(), "mlp": gather, "mlp.fc1": ColwiseParallel(),
                 "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}
    for i in model.layers:
        plan.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    return plan


class TensorParallelPeer:
    def __init__(self, cfg, layout, weights, samples, dp_wrapper: str):
        self.cfg, self.layout, self.samples = cfg, layout, samples
        self.name = f"tp_{dp_wrapper}"
        world = dist.get_world_size()
        # Megatron's rank order: tp fastest, so rank = dp_rank * tp + tp_rank.
        self.mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.dp_group = self.mesh.get_group("dp")
        model = GPT(cfg)
        load_into(model, weights)
        parallelize_module(model, self.mesh["tp"], tp_plan(model, layout.sequence_parallel))
        self.inner = model
        if dp_wrapper == "ddp":
            # Copies per parameter must be read while the parameters are still DTensors.
            copies = {n: (grad_norm.dtensor_copies(p, world) if isinstance(p, DTensor) else world)
                      for n, p in model.named_parameters()}
            _pre_dp_module_transform(model)
            self.model = DistributedDataParallel(model, process_group=self.dp_group)
            self.clip_list = [(p, copies[n]) for n, p in model.named_parameters()]
        else:
            for layer in model.layers.values():
                fully_shard(layer, mesh=self.mesh["dp"])
            fully_shard(model, mesh=self.mesh["dp"])
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
            self.model = model
            self.clip_list = [(p, grad_norm.dtensor_copies(p, world)) for p in model.parameters()]
        self.optimizer = train_loop.adamw(cfg, model.named_parameters())

    def _sync(self, last: bool):
        if isinstance(self.model, DistributedDataParallel):
            return nullcontext() if last else self.model.no_sync()
        self.model.set_requires_gradient_sync(last)
        return nullcontext()

    def train_step(self, step: int):
        train_loop.set_lr(self.optimizer, self.cfg.lr_at(step))
        mbs = micro_batches(self.samples, self.cfg, step, self.dp_rank, self.layout.dp)
        local = 0.0
        for k, (ids, labels) in enumerate(mbs):
            with self._sync(k == len(mbs) - 1), loss_parallel():
                loss = lm_loss(self.model(ids), labels) / len(mbs)
                loss.backward()
            local += (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
        norm = grad_norm.clip_grad_norm_(self.clip_list, self.cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return train_loop.mean_over(local, self.dp_group, self.layout.dp), float(norm)

    def state_bytes(self) -> int:
        # From the optimizer: under DDP the module swaps its parameter objects at every forward.
        return train_loop.model_state_bytes(self.optimizer)
