"""The fp32 matmul rate of this machine on one thread, measured next to the single-process
runs so that their step can be read as a fraction of it (docs/benchmarks.md, "Single
process"). Two rates:

  square  a 1024 x 1024 x 1024 matmul: what one core's GEMM reaches at all
  shapes  the GEMMs one training step of the benchmark's GPT runs, at their own shapes
          and in their own proportions (forward, data gradient and weight gradient of
          the QKV, projection, MLP and output layers, and attention's two batched
          products and their gradients): the most a step could reach if it did nothing
          but its GEMMs

and the model FLOPs of one step by the count gpt_pretrain logs (PaLM's 6N + 12·L·h·s per
token, N every parameter once), so a step's time converts to a rate.

    python scripts/bench/peers/matmul_rate.py --out FILE
"""
import argparse
import json
import statistics
import time

import torch

from config import BenchConfig


def seconds(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` batches, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_gemms(cfg: BenchConfig):
    """(count, m, k, n) of the matmuls of one micro-batch's forward and backward."""
    t, h, f, v, s = cfg.micro_batch_size * cfg.seq_length, cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.seq_length
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    gemms = []
    for n_out, n_in in ((3 * h, h), (h, h), (f, h), (h, f)):  # per layer: y[t, out] = x[t, in] · Wᵀ
        gemms += [(cfg.num_layers, t, n_in, n_out),   # forward
                  (cfg.num_layers, t, n_out, n_in),   # data gradient
                  (cfg.num_layers, n_out, t, n_in)]   # weight gradient
    gemms += [(1, t, h, v), (1, t, v, h), (1, v, t, h)]  # output layer (tied embedding)
    bh = cfg.num_layers * cfg.micro_batch_size * heads
    gemms += [(bh, s, d, s), (bh, s, s, d)]  # scores = q·kᵀ, out = p·v
    gemms += [(2 * bh, s, s, d), (2 * bh, s, d, s)]  # their gradients (two products each)
    return gemms


def shapes_rate(cfg: BenchConfig, repeats: int) -> float:
    cases = [(count, torch.randn(m, k), torch.randn(k, n)) for count, m, k, n in step_gemms(cfg)]
    flops = sum(2 * count * a.shape[0] * a.shape[1] * b.shape[1] for count, a, b in cases)

    def run():
        for count, a, b in cases:
            for _ in range(count):
                torch.mm(a, b)

    return flops / seconds(run, repeats)


def square_rate(n: int, repeats: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n ** 3 / seconds(lambda: torch.mm(a, b), repeats)


def step_flops(cfg: BenchConfig) -> float:
    """Model FLOPs of one optimizer step, as csrc/train/trainer.cpp counts them."""
    per_token = 6 * cfg.parameter_count() + 12 * cfg.num_layers * cfg.hidden_size * cfg.seq_length
    return per_token * cfg.global_batch_size * cfg.seq_length


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = BenchConfig()
    rec = {"square_gflops": square_rate(1024, args.repeats) / 1e9,
           "shapes_gflops": shapes_rate(cfg, args.repeats) / 1e9,
           "step_gflop": step_flops(cfg) / 1e9, "threads": torch.get_num_threads()}
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=2)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
