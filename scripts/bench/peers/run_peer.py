"""One Python peer on this rank, launched by torchrun (the suite starts it):

    torchrun --standalone --nproc-per-node=4 scripts/bench/peers/run_peer.py \\
        --work DIR --system ddp --config DP4 --out DIR/ddp.json [--tp 2 --pp 2 --sp ...]

DIR holds what prepare.py wrote once for the whole run: the benchmark configuration
(config.json), the samples (samples.npy) and megatorch's initial weights (init.pt).
One intra-op thread per rank, Gloo, as gpt_pretrain runs.
"""
import argparse
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist

import train_loop
from config import BenchConfig, Layout

SYSTEMS = ["ddp", "ddp_zero", "fsdp2", "fsdp2_noreshard", "tp_ddp", "tp_fsdp2", "pp", "deepspeed"]


def make_peer(args, cfg, layout, weights, samples):
    if args.system in ("ddp", "ddp_zero", "fsdp2", "fsdp2_noreshard"):
        from peer_dp import DataParallelPeer
        return DataParallelPeer(cfg, weights, samples, args.system)
    if args.system in ("tp_ddp", "tp_fsdp2"):
        from peer_tp import TensorParallelPeer
        return TensorParallelPeer(cfg, layout, weights, samples, dp_wrapper=args.system[3:])
    if args.system == "pp":
        from peer_pp import PipelinePeer
        return PipelinePeer(cfg, layout, weights, samples)
    from peer_deepspeed import DeepSpeedPeer
    return DeepSpeedPeer(cfg, layout, weights, samples)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument("--config", required=True, help="the configuration's name in the report")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"])
    ap.add_argument("--virtual-chunks", type=int, default=1)
    ap.add_argument("--zero-stage", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    with open(os.path.join(args.work, "config.json")) as f:
        cfg = BenchConfig.from_json(f.read())
    world = int(os.environ["WORLD_SIZE"])
    layout = Layout(tp=args.tp, pp=args.pp, dp=world // (args.tp * args.pp), sequence_parallel=args.sp,
                    schedule=args.schedule, virtual_chunks=args.virtual_chunks, zero_stage=args.zero_stage)
    samples = np.load(os.path.join(args.work, "samples.npy"))
    weights = torch.load(os.path.join(args.work, "init.pt"))
    if args.system == "deepspeed":
        import deepspeed
        # Through DeepSpeed, so that its communication layer knows the (Gloo) group.
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    peer = make_peer(args, cfg, layout, weights, samples)
    train_loop.run(peer, cfg, getattr(peer, "name", args.system), args.config, args.out, report_rank=world - 1,
                   extra={"layout": layout.describe()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
