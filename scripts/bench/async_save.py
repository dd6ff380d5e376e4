"""Asynchronous checkpoints on CPU ranks: how long a save blocks the training loop with
and without --async-save, side by side in one run, and the step time around a save
(docs/checkpoints.md, "Asynchronous saves").

    .venv/bin/python scripts/bench/async_save.py [--hidden-size 512 --num-layers 16
        --saves 3 --out runs/async_save]

Both runs: gpt_pretrain under torchrun, TP2 x PP2 on 4 CPU ranks (one intra-op thread
each), the same ~50M-parameter GPT (hidden 512, 16 layers, byte-level vocabulary,
sequence 128), fp32, ZeRO-1, a save every 2 iterations into a fresh directory under
--save-root (the same disk for both). Blocked time per save is what the logging rank
prints: the synchronous save's whole duration; the asynchronous one's copy to host
memory plus the wait, if any, when it was published (median over the --saves interval
saves). The save at the end of the run is shown apart: there the program waits for the
writer before it exits. Step
times come from --log-json; "after a save" is the step during which the background
writer runs. The two runs' losses must be equal, and the checkpoints byte-identical.
Writes OUT/results.json and prints the table.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "build" / "bin" / "gpt_pretrain"
DATA = ROOT / "data" / "default" / "stdlib_docs_text_document"


def run(args, save_dir, log, extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "--no-python",
           str(TRAIN), *args, "--save", str(save_dir), "--log-json", str(log), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_COMM_TIMEOUT_S="600")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(out.stdout[-3000:] + out.stderr[-3000:])
    return out.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--save-root", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--out", default="runs/async_save")
    a = p.parse_args()
    interval = 2
    iters = interval * a.saves + 1  # the last step saves nothing: its time is one more sample
    args = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-attention-heads", "8",
            "--seq-length", "128", "--vocab-size", "257", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
            "--lr", "1e-4", "--data-path", str(DATA), "--eval-iters", "0", "--log-interval", "1",
            "--train-iters", str(iters), "--save-interval", str(interval)]
    root = Path(a.save_root or tempfile.mkdtemp(prefix="megatorch_async_save_"))
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, extra in [("sync", []), ("async", ["--async-save"])]:
        save_dir, log = root / name, root / f"{name}.json"
        shutil.rmtree(save_dir, ignore_errors=True)
        start = time.monotonic()
        out = run(args, save_dir, log, extra)
        wall = time.monotonic() - start
        if name == "sync":
            blocked = [float(x) for x in re.findall(r"saved checkpoint at iteration \d+ to \S+ \(([\d.]+) s\)", out)]
        else:
            started = [float(x) for x in re.findall(r"in the background \(training blocked ([\d.]+) s\)", out)]
            waited = [float(x) for x in re.findall(r"training blocked ([\d.]+) s here\)", out)]
            published = [float(x) for x in re.findall(r"published ([\d.]+) s after it started", out)]
            # A save blocks for its copy, and for the wait (if any) when the next save or
            # the end found it still writing; publishing between iterations is counted too.
            blocked = [s + w for s, w in zip(started, waited)]
            results["async_publish_after_s"] = published
        # The save at the end is apart: the program waits for its writer before it exits.
        blocked, at_end = blocked[:a.saves], blocked[a.saves:]
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        after = [r["ms_per_iteration"] for r in rows if r["iteration"] % interval == 1 and r["iteration"] > 1]
        other = [r["ms_per_iteration"] for r in rows if r["iteration"] % interval == 0 or r["iteration"] == 1]
        results[name] = {"blocked_s": blocked, "blocked_at_end_s": at_end, "step_ms_after_save": after,
                         "step_ms_other": other, "wall_s": wall, "losses": {r["iteration"]: r["loss"] for r in rows}}
    s, y = results["sync"], results["async"]
    assert s["losses"] == y["losses"], "the two runs' losses differ"
    for it in range(interval, iters, interval):
        d = f"iter_{it:07d}"
        for f in sorted((root / "sync" / d).iterdir()):
            assert f.read_bytes() == (root / "async" / d / f.name).read_bytes(), f"{d}/{f.name} differs"
    sync_blocked, async_blocked = statistics.median(s["blocked_s"]), statistics.median(y["blocked_s"])
    results["summary"] = {
        "saves": a.saves,
        "checkpoint_bytes": sum(f.stat().st_size for f in (root / "sync" / f"iter_{interval:07d}").iterdir()),
        "sync_blocked_median_s": sync_blocked,
        "async_blocked_median_s": async_blocked,
        "async_over_sync_blocked": async_blocked / sync_blocked,
        "sync_blocked_at_end_s": s["blocked_at_end_s"],
        "async_blocked_at_end_s": y["blocked_at_end_s"],
        "sync_run_wall_s": s["wall_s"],
        "async_run_wall_s": y["wall_s"],
        "sync_step_ms_after_save": statistics.median(s["step_ms_after_save"]),
        "async_step_ms_after_save": statistics.median(y["step_ms_after_save"]),
        "sync_step_ms_other": statistics.median(s["step_ms_other"]),
        "async_step_ms_other": statistics.median(y["step_ms_other"]),
        "losses_equal": True,
        "checkpoints_byte_identical": True,
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    r = results["summary"]
    print(f"checkpoint: {r['checkpoint_bytes'] / 2**20:.0f} MiB over 4 ranks, {a.saves} saves per run")
    print(f"{'':28}{'sync':>10}{'async':>10}{'ratio':>8}")
    print(f"{'blocked per save (s)':28}{sync_blocked:10.3f}{async_blocked:10.3f}{async_blocked / sync_blocked:8.3f}")
    print(f"{'the save at the end (s)':28}{s['blocked_at_end_s'][0]:10.3f}{y['blocked_at_end_s'][0]:10.3f}"
          f"{y['blocked_at_end_s'][0] / s['blocked_at_end_s'][0]:8.3f}")
    print(f"{'whole run (s)':28}{s['wall_s']:10.1f}{y['wall_s']:10.1f}{y['wall_s'] / s['wall_s']:8.3f}")
    print(f"{'step after a save (ms)':28}{r['sync_step_ms_after_save']:10.1f}{r['async_step_ms_after_save']:10.1f}"
          f"{r['async_step_ms_after_save'] / r['sync_step_ms_after_save']:8.3f}")
    print(f"{'other steps (ms)':28}{r['sync_step_ms_other']:10.1f}{r['async_step_ms_other']:10.1f}"
          f"{r['async_step_ms_other'] / r['sync_step_ms_other']:8.3f}")
    print("losses equal, checkpoints byte-identical")
    if not a.save_root:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
