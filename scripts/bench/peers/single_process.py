"""Single process, no parallelism needed: what megatorch's parallel machinery costs when it
has nothing to do. Two of the three columns run here (the third is gpt_pretrain itself
at TP = PP = DP = 1, launched by the suite):

  libtorch  megatorch's C++ GPTModel built with no group, through the megatorch.cpp
            bindings (the same C++ modules and fused kernels gpt_pretrain runs), trained
            by a plain Python loop with torch.optim.AdamW - "a plain LibTorch model":
            no executor, no DistributedOptimizer, no flat buffers, no accounting
  eager     gpt.py's GPT in plain PyTorch, the same loop

    python scripts/bench/peers/single_process.py --work DIR --system eager --out FILE

Same step as gpt_pretrain's: the global batch as micro-batches with gradient
accumulation, global-norm clipping, AdamW with megatorch's decay groups and LR schedule.
"""
import argparse
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist

import train_loop
from config import BenchConfig
from gpt import GPT, lm_loss
from init_weights import load_into
from samples import micro_batches


def libtorch_model(cfg: BenchConfig):
    import megatorch.cpp as mtc
    config = mtc.TransformerConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                                   num_layers=cfg.num_layers, seq_length=cfg.seq_length, vocab_size=cfg.vocab_size,
                                   seed=cfg.seed)
    model = mtc.GPTModel(config)  # initial weights: megatorch's own (prepare.py checks they equal init.pt)
    return model, model.loss


def eager_model(cfg: BenchConfig, weights: dict):
    model = GPT(cfg)
    load_into(model, weights)
    return model, lambda ids, labels: lm_loss(model(ids), labels)


class SingleProcessPeer:
    def __init__(self, cfg, samples, model, loss_fn):
        self.cfg, self.samples, self.model, self.loss_fn = cfg, samples, model, loss_fn
        self.optimizer = train_loop.adamw(cfg, model.named_parameters())

    def train_step(self, step: int):
        train_loop.set_lr(self.optimizer, self.cfg.lr_at(step))
        mbs = micro_batches(self.samples, self.cfg, step, 0, 1)
        total = 0.0
        for ids, labels in mbs:
            loss = self.loss_fn(ids, labels) / len(mbs)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return total, float(norm)

    def state_bytes(self) -> int:
        return train_loop.model_state_bytes(self.optimizer)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--system", required=True, choices=["libtorch", "eager"])
    ap.add_argument("--config", default="1 rank")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    with open(os.path.join(args.work, "config.json")) as f:
        cfg = BenchConfig.from_json(f.read())
    samples = np.load(os.path.join(args.work, "samples.npy"))
    # A one-rank group, so that train_loop's gathers and loss reduction run unchanged.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if args.system == "libtorch":
        model, loss_fn = libtorch_model(cfg)
        name = "plain LibTorch (megatorch.cpp GPTModel + torch AdamW)"
    else:
        model, loss_fn = eager_model(cfg, torch.load(os.path.join(args.work, "init.pt")))
        name = "PyTorch eager (gpt.py + torch AdamW)"
    train_loop.run(SingleProcessPeer(cfg, samples, model, loss_fn), cfg, name, args.config, args.out, report_rank=0,
                   extra={"layout": "1 rank"})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
