"""Narayanan et al. 2021 Table 1 (docs/reference.md) next to megatorch-plan's predictions.

For each row it asks build/bin/megatorch-plan for the published layout (TP, PP fixed; the
micro-batch is searched) and for the free ranking of all (TP, PP), with the runs' settings:
A100 cluster defaults, fp16, full recompute, no ZeRO, no SP, the 1F1B schedule, and the one
default calibration. Prints a markdown table; exits non-zero if a row is off by more than 15%
or the published layout is not among the top 3.

    .venv/bin/python scripts/plan_table1.py [--bin build/bin/megatorch-plan]
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROWS = [  # params (B), heads, hidden, layers, TP, PP, GPUs, batch, published TFLOP/s per GPU
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def plan(binary, row, *extra):
    _, a, h, L, _, _, gpus, batch, _ = row
    cmd = [binary, "--num-layers", str(L), "--hidden-size", str(h), "--num-attention-heads", str(a),
           "--vocab-size", "51200", "--seq-length", "2048", "--nodes", str(gpus // 8), "--global-batch-size",
           str(batch), "--fp16", "--zero-stage", "0", "--recompute-granularity", "full", "--no-sequence-parallel",
           "--virtual-pipeline-model-parallel-size", "1", "--context-parallel-size", "1", "--top", "1000", "--json",
           *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default=str(Path(__file__).resolve().parents[1] / "build" / "bin" / "megatorch-plan"))
    args = parser.parse_args()
    print("| params | TP | PP | GPUs | batch | published TFLOP/s | predicted | error | predicted layout (mb) "
          "| rank of published (TP, PP) | planner's top 3 (TP, PP) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for row in ROWS:
        params, _, _, _, tp, pp, gpus, batch, published = row
        ranked = plan(args.bin, row)["top"]
        order = []
        for t in ranked:
            key = (t["layout"]["tensor_model_parallel_size"], t["layout"]["pipeline_model_parallel_size"])
            if key not in order:
                order.append(key)
        rank = order.index((tp, pp)) + 1 if (tp, pp) in order else None
        best = plan(args.bin, row, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                    str(pp))["top"][0]
        pred = best["time"]["tflops_per_gpu"]
        err = pred / published - 1
        bad += abs(err) > 0.15 or rank is None or rank > 3
        top3 = ", ".join(f"({t}, {p})" for t, p in order[:3])
        print(f"| {params}B | {tp} | {pp} | {gpus} | {batch} | {published} | {pred:.1f} | {100 * err:+.1f}% "
              f"| mb={best['layout']['micro_batch_size']}, bubble {best['time']['bubble_fraction']:.3f} "
              f"| {rank} | {top3} |")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
