"""megatorch's side of the benchmark: gpt_pretrain (and pipeline_timeline for the bubble)
launched with torchrun, their logs read into the same record the Python peers write.

gpt_pretrain's --log-json has one object per iteration from its logging rank (the last
rank): loss, grad_norm, ms_per_iteration (the whole step, as the peers time it),
comm_bytes per group (bytes this rank handed to collectives, the convention comm_count.py
follows) and memory_bytes (parameters, gradients, master weights, optimizer state).
"""
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from config import ROOT, BenchConfig, Layout, to_args

BIN = ROOT / "build" / "bin"
HERE = Path(__file__).resolve().parent


def torchrun(nproc: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def display(cmd) -> str:
    """A command as someone would type it in the repository root."""
    text = shlex.join(str(c) for c in cmd).replace(str(ROOT) + "/", "")
    return text.replace(shlex.join([sys.executable, "-m", "torch.distributed.run"]), "torchrun") \
               .replace(sys.executable, "python")


def error_summary(log: str) -> str:
    """The line of a failed run's log that says what went wrong (not torchrun's wrapper)."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|error:|what\(\))", ln) and "ChildFailedError" not in ln \
                and "elastic" not in ln and not ln.startswith("raise"):
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def env() -> dict:
    # One intra-op thread per rank, as the peers (torch.set_num_threads(1)).
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def run_gpt_pretrain(cfg: BenchConfig, layout: Layout, out_dir: Path, tag: str, timeout: int, extra_flags=()):
    """One gpt_pretrain run; returns the record (or raises with the log's tail)."""
    log_json, rss_prefix = out_dir / f"{tag}.log.jsonl", out_dir / f"{tag}.rss"
    cmd = torchrun(layout.world) + [str(HERE / "child_rss.py"), str(rss_prefix), "--", str(BIN / "gpt_pretrain")]
    cmd += to_args(cfg.gpt_pretrain_flags() + layout.gpt_pretrain_flags(cfg) + ["--log-json", log_json])
    cmd += to_args(extra_flags)
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    (out_dir / f"{tag}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not log_json.exists():
        raise RuntimeError(f"gpt_pretrain exited with {proc.returncode}: {error_summary(proc.stdout + proc.stderr)} "
                           f"({tag}.log)\n{display(cmd)}\n{(proc.stdout + proc.stderr)[-2500:]}")
    iters = [json.loads(line) for line in log_json.read_text().splitlines() if line.strip()]
    step_ms = [it["ms_per_iteration"] for it in iters[cfg.warmup_steps:]]
    counted = iters[cfg.warmup_steps - 1]  # the step the peers count (bytes are the same every step)
    by_group = {k: int(v) for k, v in counted["comm_bytes"].items()}
    rss = []
    for r in range(layout.world):
        with open(f"{rss_prefix}.{r}") as f:
            rss.append(json.load(f)["peak_rss_bytes"])
    mem = counted["memory_bytes"]
    return {
        "system": "megatorch", "world": layout.world, "layout": layout.describe(),
        "losses": [it["loss"] for it in iters], "grad_norms": [it["grad_norm"] for it in iters],
        "step_ms": step_ms, "median_ms": statistics.median(step_ms),
        "comm_bytes_per_step": {"total": sum(by_group.values()), "by_group": by_group},
        "peak_rss_bytes": rss,
        # The logging rank's count; every rank of these layouts holds the same amount.
        "state_bytes": [mem["total_bytes"]] * layout.world, "memory_bytes": mem,
        "command": display(["torchrun", "--standalone", f"--nproc-per-node={layout.world}", "--no-python",
                            BIN / "gpt_pretrain"] + to_args(cfg.gpt_pretrain_flags() + layout.gpt_pretrain_flags(cfg))),
    }


_BUBBLE = re.compile(r"measured bubble ([0-9.eE+-]+) .*formula ([0-9.eE+-]+).*: ([0-9.eE+-]+)")


def run_pipeline_timeline(cfg: BenchConfig, p: int, m: int, out_dir: Path, timeout: int, steps: int = 3):
    """build/bin/pipeline_timeline (examples/pipeline_timeline.cpp): 1F1B on p ranks, the
    measured bubble (idle / busy per stage, mean of `steps` steps after one warm-up) next
    to (p-1)/m. Its model is the benchmark's shape with its own fixed vocabulary (1024)
    and 8 heads; the bubble depends on the stage times, not on those."""
    svg = out_dir / f"timeline_p{p}_m{m}.svg"
    cmd = torchrun(p) + ["--no-python", str(BIN / "pipeline_timeline"), "--pipeline-model-parallel-size", str(p),
                         "--num-microbatches", str(m), "--schedule", "1f1b", "--num-layers", str(cfg.num_layers),
                         "--hidden-size", str(cfg.hidden_size), "--seq-length", str(cfg.seq_length),
                         "--micro-batch-size", str(cfg.micro_batch_size), "--steps", str(steps), "--svg", str(svg)]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    (out_dir / f"bubble_p{p}_m{m}.log").write_text(proc.stdout + proc.stderr)
    match = _BUBBLE.search(proc.stdout)
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"pipeline_timeline exited with {proc.returncode}: {error_summary(proc.stdout + proc.stderr)}"
                           f"\n{(proc.stdout + proc.stderr)[-2000:]}")
    return {"p": p, "m": m, "measured": float(match.group(1)), "formula": float(match.group(2)),
            "simulated": float(match.group(3)), "svg": svg.name, "command": display(cmd)}
