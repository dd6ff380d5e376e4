"""Writes what every system of one benchmark run shares into the work folder:

  config.json   the BenchConfig
  samples.npy   the train samples in gpt_pretrain's order (samples.py)
  init.pt       megatorch's initial weights (init_weights.py)

and, when megatorch is built, checks both against megatorch itself: the initial weights
against the C++ GPTModel built through megatorch.cpp (bit for bit), the samples against
`megatorch-dataset samples` (token for token). A mismatch stops the run: comparing losses
from different starting points or data would be meaningless.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from config import ROOT, BenchConfig
from init_weights import megatorch_init
from samples import build_train_samples


def check_weights_against_megatorch(cfg: BenchConfig, weights: dict) -> str:
    try:
        import megatorch.cpp as mtc
    except Exception as e:  # no build yet: say so, do not fail
        return f"not checked against megatorch.cpp ({type(e).__name__}: {e})"
    config = mtc.TransformerConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                                   num_layers=cfg.num_layers, seq_length=cfg.seq_length, vocab_size=cfg.vocab_size,
                                   seed=cfg.seed)
    model = mtc.GPTModel(config)
    theirs = dict(model.named_parameters())
    names = {"embedding.word.weight": "embedding.weight", "embedding.position.weight": "position_embedding"}
    for name, mine in weights.items():
        t = theirs[names.get(name, name)].detach()
        if name == "embedding.word.weight":
            assert torch.all(t[cfg.vocab_size:] == 0), "megatorch's padded vocabulary rows are not zero"
            t = t[: cfg.vocab_size]
        if not torch.equal(t, mine):
            raise SystemExit(f"prepare: initial weight {name} differs from megatorch's GPTModel "
                             f"(max |diff| {(t - mine).abs().max().item():.3g}); init_weights.py is out of date")
    return f"equal to megatorch.cpp GPTModel's initial weights ({len(weights)} tensors, bit for bit)"


def check_samples_against_megatorch(cfg: BenchConfig, samples: np.ndarray, work: Path) -> str:
    tool = ROOT / "build" / "bin" / "megatorch-dataset"
    if not tool.exists():
        return "not checked against megatorch-dataset (not built)"
    out = work / "megatorch_samples"
    out.mkdir(exist_ok=True)
    n = cfg.train_iters * cfg.global_batch_size
    subprocess.run([str(tool), "samples", "--data-path", cfg.data_path, "--seq-length", str(cfg.seq_length),
                    "--seed", str(cfg.seed), "--split", cfg.split, "--num-samples", str(n), "0", "0",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    theirs = np.fromfile(out / "train.bin", dtype=np.int64).reshape(-1, cfg.seq_length + 1)[:n]
    if not np.array_equal(theirs, samples):
        raise SystemExit("prepare: the Megatron GPTDataset samples differ from megatorch-dataset's")
    return f"equal to megatorch-dataset's first {n} train samples"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--config", default="{}", help="BenchConfig fields to change, as JSON")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = BenchConfig().with_(**json.loads(args.config))
    (work / "config.json").write_text(cfg.to_json())
    samples = build_train_samples(cfg, str(work / "gpt_dataset_cache"))
    np.save(work / "samples.npy", samples)
    weights = megatorch_init(cfg)
    torch.save(weights, work / "init.pt")
    checks = {"weights": check_weights_against_megatorch(cfg, weights),
              "samples": check_samples_against_megatorch(cfg, samples, work)}
    (work / "checks.json").write_text(json.dumps(checks, indent=1))
    for k, v in checks.items():
        print(f"[prepare] {k}: {v}", file=sys.stderr)


if __name__ == "__main__":
    main()
