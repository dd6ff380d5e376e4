#!/usr/bin/env python3
"""CPU benchmark: megatorch's fused kernels next to the unfused PyTorch chains they replace,
side by side in one run (docs/kernels.md). Forward calls, fp32 and bf16; the median of --iters
calls of each, the two interleaved call by call so that both see the same machine load;
ratio = unfused median / fused median (> 1: the fused kernel is faster).

    MEGATORCH_LIBRARY=build/lib/libmegatorch.so PYTHONPATH=torch_ext \\
        .venv/bin/python scripts/bench/kernels_cpu.py [--out results.json] [--markdown]

The cases (inputs, the unfused chain, the bytes moved) are scripts/bench/kernel_cases.py's,
the ones scripts/bench/gpu_kernels.py times on a GPU, at CPU sizes.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import cpu_name  # noqa: E402
from kernel_cases import make_cases, max_abs_diff  # noqa: E402

SIZES = dict(tokens=4096, hidden=1024, heads=8, sk=512, vocab_shard=8192, adam_numel=1 << 22)


def interleaved(fused, eager, iters, warmup=2):
    for _ in range(warmup):
        fused(), eager()
    tf, te = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fused()
        t1 = time.perf_counter()
        eager()
        t2 = time.perf_counter()
        tf.append((t1 - t0) * 1e3)
        te.append((t2 - t1) * 1e3)
    return statistics.median(tf), statistics.median(te)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--only", nargs="*", help="case names")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "load_before": os.getloadavg()[0], "sizes": SIZES, "iters": args.iters}
    print(f"# {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {info['threads']} threads, "
          f"load {info['load_before']:.1f}", flush=True)
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for case in make_cases("cpu", dtype, only=args.only, **SIZES):
            diff = max_abs_diff(case.fused(), case.eager()) if case.compare else None
            fused_ms, eager_ms = interleaved(case.fused, case.eager, args.iters)
            row = {"name": case.name, "shape": case.shape, "dtype": dtype_name, "fused_ms": fused_ms,
                   "unfused_ms": eager_ms, "ratio": eager_ms / fused_ms, "fused_GBps": case.bytes / fused_ms / 1e6,
                   "max_abs_diff": diff}
            rows.append(row)
            print(f"{case.name:36s} {dtype_name:9s} fused {fused_ms:9.3f} ms  unfused {eager_ms:9.3f} ms  "
                  f"x{row['ratio']:.2f}  ({row['fused_GBps']:.1f} GB/s)", flush=True)
            del case
    info["load_after"] = os.getloadavg()[0]
    info["results"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(info, indent=2) + "\n")
    if args.markdown:
        print()
        print(markdown(info))
    return 0


def markdown(info) -> str:
    lines = ["| op | shape | dtype | fused ms | unfused ms | unfused / fused | fused GB/s |",
             "|---|---|---|---|---|---|---|"]
    for r in info["results"]:
        lines.append(f"| {r['name']} | {r['shape']} | {r['dtype']} | {r['fused_ms']:.2f} | {r['unfused_ms']:.2f} | "
                     f"{r['ratio']:.2f} | {r['fused_GBps']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
