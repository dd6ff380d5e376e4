#!/usr/bin/env python3
"""Plots the loss curves of a training run from gpt_pretrain's --log-json file.

  python scripts/plot_log.py run.json loss.png

The file holds one JSON object per line (per iteration) with at least "iteration" and
"loss"; lines of evaluation iterations also carry "val_loss". Other fields (lr, grad_norm,
loss_scale, skipped, tokens_per_s, tflops_per_rank, ...) are ignored here, except that
skipped iterations (overflow) are left out of the training curve. Prints a one-line summary.
"""
import argparse
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_log(path):
    train, val = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"plot_log: {path} line {n} is not JSON: {e}")
            if "iteration" not in rec:
                raise SystemExit(f"plot_log: {path} line {n} has no \"iteration\" field")
            it = rec["iteration"]
            loss = rec.get("loss")
            if loss is not None and not rec.get("skipped", False) and math.isfinite(loss):
                train.append((it, loss))
            if rec.get("val_loss") is not None:
                val.append((it, rec["val_loss"]))
    return train, val


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="--log-json file of gpt_pretrain")
    ap.add_argument("out", help="PNG (or any matplotlib format by extension) to write")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    train, val = read_log(args.log)
    if not train and not val:
        raise SystemExit(f"plot_log: {args.log} has no loss values to plot")

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    if train:
        ax.plot([i for i, _ in train], [v for _, v in train], label="train loss", linewidth=1.2)
    if val:
        ax.plot([i for i, _ in val], [v for _, v in val], "o-", label="validation loss", linewidth=1.5, markersize=4)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (cross entropy, nats)")
    ax.set_title(args.title or args.log)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out)

    parts = []
    if train:
        parts.append(f"train loss {train[0][1]:.4f} -> {train[-1][1]:.4f} over {len(train)} iterations")
    if val:
        parts.append(f"validation loss {val[0][1]:.4f} -> {val[-1][1]:.4f} at {len(val)} evaluations")
    print("; ".join(parts) + f"; wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
