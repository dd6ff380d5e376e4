"""DeepSpeed ZeRO 1/2/3 on CPU: DS_ACCELERATOR=cpu (set by the suite), a Gloo process
group (`deepspeed.init_distributed(dist_backend="gloo")` in run_peer.py), fp32.

The optimizer is torch.optim.AdamW with megatorch's weight-decay groups, handed to
deepspeed.initialize as a client optimizer: DeepSpeed's own Adam kernels are CUDA
(FusedAdam) or a C++ extension compiled on first use (DeepSpeedCPUAdam), and the
comparison is about the sharding, not the Adam kernel. DeepSpeed accumulates the step's
micro-batches itself (gradient_accumulation_steps, one reduction per step), averages
over DP, and clips by the global norm (gradient_clipping).

ZeRO-3 partitions each module's parameters and gathers them around that module's
forward; the head multiplies by the embedding's weight outside the embedding module, so
the weight is registered as an external parameter of the model (DeepSpeed's documented
way for tied weights).
"""
import deepspeed
import torch.distributed as dist

import train_loop
from gpt import GPT, lm_loss
from init_weights import load_into
from samples import micro_batches


class DeepSpeedPeer:
    def __init__(self, cfg, layout, weights, samples):
        self.cfg, self.layout, self.samples = cfg, layout, samples
        self.name = f"DeepSpeed ZeRO-{layout.zero_stage}"
        self.rank, self.dp = dist.get_rank(), dist.get_world_size()
        self.m = layout.micro_batches(cfg)
        model = GPT(cfg)
        load_into(model, weights)
        ds_config = {
            "train_batch_size": cfg.global_batch_size,
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_accumulation_steps": self.m,
            "gradient_clipping": cfg.clip_grad,
            # Below 1e5 elements DeepSpeed keeps a parameter whole on every rank
            # (stage3_param_persistence_threshold); every weight of this small model is below
            # that, so ZeRO-3 would shard nothing. 0 partitions them all, as ZeRO-3 means.
            "zero_optimization": {"stage": layout.zero_stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 1 << 30,
            "zero_allow_untested_optimizer": True,
        }
        optimizer = train_loop.adamw(cfg, model.named_parameters())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        if layout.zero_stage == 3:
            deepspeed.zero.register_external_parameter(self.engine.module, self.engine.module.embedding.word.weight)

    def train_step(self, step: int):
        train_loop.set_lr(self.optimizer, self.cfg.lr_at(step))
        local = 0.0
        for ids, labels in micro_batches(self.samples, self.cfg, step, self.rank, self.dp):
            loss = lm_loss(self.engine(ids), labels)
            self.engine.backward(loss)  # divides by gradient_accumulation_steps
            self.engine.step()  # updates at the step's last micro-batch only
            local += loss.item() / self.m
        return train_loop.mean_over(local, None, self.dp), float(self.engine.get_global_grad_norm())

    def state_bytes(self):
        # DeepSpeed keeps parameters, gradients and optimizer state in flat partitions and
        # buffers of its own; no count from outside would be comparable. Peak RSS is.
        return None
