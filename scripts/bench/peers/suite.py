"""The CPU side-by-side benchmark, every run of it, one after the other (docs/benchmarks.md:
megatorch next to PyTorch's and DeepSpeed's parallelism, ZeRO stages included).
scripts/bench/cpu_peers.sh is the command; this is its body:

    python scripts/bench/peers/suite.py --out runs/cpu_peers [--parts main single scaling bubble]

Each run is its own torchrun (4 ranks, Gloo, one intra-op thread per rank) and writes a
record; records collect in OUT/results.json, rewritten after every run so that a partial
run still leaves its numbers. report.py turns that file into the markdown tables.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from config import ROOT, BenchConfig, Layout
from machine_load import OtherLoad, wait_until_idle
from megatorch_run import display, env, error_summary, run_gpt_pretrain, run_pipeline_timeline, torchrun

HERE = Path(__file__).resolve().parent
MATMUL_RATE = "fp32 matmul rate (one thread)"  # the single part's rate record, not a system
PY = sys.executable

# (configuration, megatorch's layout, peers: (system, label)). The layout also tells the
# peer its tp / pp / schedule / ZeRO stage.
MAIN = [
    ("TP2×DP2", Layout(tp=2, dp=2), [("tp_ddp", "DTensor TP + DDP"), ("tp_fsdp2", "DTensor TP + FSDP2")]),
    ("TP2×DP2 + SP", Layout(tp=2, dp=2, sequence_parallel=True), [("tp_ddp", "DTensor TP/SP + DDP")]),
    ("PP2×DP2 1F1B (m=8)", Layout(pp=2, dp=2, schedule="1f1b"), [("pp", "Schedule1F1B + DDP")]),
    ("PP2×DP2 GPipe (m=8)", Layout(pp=2, dp=2, schedule="gpipe"), [("pp", "ScheduleGPipe + DDP")]),
    ("PP4 interleaved (v=2, m=16)", Layout(pp=4, schedule="interleaved", virtual_chunks=2),
     [("pp", "ScheduleInterleaved1F1B")]),
    ("DP4 ZeRO-0", Layout(dp=4, zero_stage=0), [("ddp", "DDP")]),
    ("DP4 ZeRO-1", Layout(dp=4, zero_stage=1), [("ddp_zero", "DDP + ZeroRedundancyOptimizer"),
                                               ("deepspeed", "DeepSpeed ZeRO-1")]),
    ("DP4 ZeRO-2", Layout(dp=4, zero_stage=2), [("fsdp2_noreshard", "FSDP2 (reshard_after_forward=False)"),
                                               ("deepspeed", "DeepSpeed ZeRO-2")]),
    ("DP4 ZeRO-3", Layout(dp=4, zero_stage=3), [("fsdp2", "FSDP2 fully_shard"), ("deepspeed", "DeepSpeed ZeRO-3")]),
]

# Growth at a fixed layout (TP2×DP2): hidden size doubling at 8 layers, layers doubling
# at hidden 128; fewer steps (the step time settles after two).
SCALING_LAYOUT = Layout(tp=2, dp=2)
SCALING = [dict(hidden_size=h) for h in (64, 128, 256)] + [dict(num_layers=n) for n in (4, 16)]
SCALING_STEPS = dict(warmup_steps=2, timed_steps=6)
# A run during which other processes used more than this share of the machine is repeated once.
BUSY = 0.10
BUBBLE = [(2, m) for m in (2, 4, 8)] + [(4, m) for m in (4, 8, 16)]


class Suite:
    def __init__(self, out: Path, timeout: int):
        self.out, self.timeout = out, timeout
        self.results_path = out / "results.json"
        self.results = json.loads(self.results_path.read_text()) if self.results_path.exists() else {}
        self.results.setdefault("runs", [])

    def save(self):
        self.results_path.write_text(json.dumps(self.results, indent=1))

    def record(self, part: str, config: str, label: str, fn, round_: int = 0):
        """Runs fn() -> record; keeps the record (or the error) under results['runs']."""
        for attempt in range(2):  # a second try when something else took the machine meanwhile
            waited = wait_until_idle(log=lambda msg: print(msg, file=sys.stderr, flush=True))
            t0 = time.time()
            print(f"[cpu_peers] {part} | {config} | {label} | round {round_ + 1} ...", file=sys.stderr, flush=True)
            try:
                with OtherLoad() as load:
                    rec = fn()
            except Exception as e:  # a failing system is a result too: say so in the table
                rec = {"error": str(e).splitlines()[0], "error_detail": str(e)[-2500:]}
                print(f"[cpu_peers]   FAILED: {rec['error']}", file=sys.stderr, flush=True)
            if getattr(load, "share", 0.0) <= BUSY or "error" in rec:
                break
            print(f"[cpu_peers]   other processes took {load.share:.0%} of the machine: once more",
                  file=sys.stderr, flush=True)
        rec.update(part=part, config=config, label=label, round=round_, wall_s=round(time.time() - t0, 1),
                   other_load=round(getattr(load, "share", float("nan")), 3), waited_s=round(waited))
        key = (part, config, label, round_)
        runs = self.results["runs"]
        same = [i for i, r in enumerate(runs) if (r["part"], r["config"], r["label"], r.get("round", 0)) == key]
        if same:  # a rerun replaces its record in place, so the tables keep their order
            runs[same[0]] = rec
        else:
            runs.append(rec)
        self.save()
        if "median_ms" in rec:
            print(f"[cpu_peers]   median {rec['median_ms']:.1f} ms, final loss {rec['losses'][-1]:.6f}, "
                  f"other load {rec['other_load']:.0%}", file=sys.stderr, flush=True)
        return rec

    def prepare(self, name: str, changes: dict) -> Path:
        work = self.out / "work" / name
        if not (work / "init.pt").exists():
            subprocess.run([PY, str(HERE / "prepare.py"), "--work", str(work), "--config", json.dumps(changes)],
                           check=True, timeout=self.timeout)
        self.results.setdefault("checks", {})[name] = json.loads((work / "checks.json").read_text())
        return work

    def peer(self, work: Path, system: str, layout: Layout, config: str, tag: str):
        out = self.out / f"{tag}.json"
        cmd = torchrun(layout.world) + [str(HERE / "run_peer.py"), "--work", str(work), "--system", system,
                                        "--config", config, "--out", str(out), "--tp", str(layout.tp),
                                        "--pp", str(layout.pp), "--schedule", layout.schedule,
                                        "--virtual-chunks", str(layout.virtual_chunks),
                                        "--zero-stage", str(layout.zero_stage)]
        if layout.sequence_parallel:
            cmd.append("--sp")
        return self._launch(cmd, out, tag, {"DS_ACCELERATOR": "cpu"} if system == "deepspeed" else {})

    def _launch(self, cmd, out: Path, tag: str, extra_env=None):
        if out.exists():
            out.unlink()
        e = {**env(), "PYTHONWARNINGS": "ignore", **(extra_env or {})}
        proc = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=self.timeout, cwd=ROOT)
        (self.out / f"{tag}.log").write_text(proc.stdout + proc.stderr)
        if not out.exists():
            raise RuntimeError(f"exit {proc.returncode}, no result: {error_summary(proc.stdout + proc.stderr)} "
                               f"({tag}.log)\n{(proc.stdout + proc.stderr)[-2500:]}")
        rec = json.loads(out.read_text())
        if proc.returncode != 0:  # it finished and wrote its numbers, then failed on the way out
            rec["exit_note"] = f"exited with {proc.returncode} after writing its results (see {tag}.log)"
        rec["command"] = display(cmd)
        return rec

    # ---- the four parts

    def main_table(self, cfg: BenchConfig, work: Path, rounds: int):
        # Whole rounds, one after the other: every system of a configuration runs once per
        # round, so a slow minute of the machine does not fall on one system only.
        for r in range(rounds):
            for config, layout, peers in MAIN:
                slug = config.split(" (")[0].replace("×", "x").replace(" ", "_").replace("+", "") + f"_r{r + 1}"
                self.record("main", config, "megatorch",
                            lambda: run_gpt_pretrain(cfg, layout, self.out, f"main_{slug}_megatorch", self.timeout), r)
                for system, label in peers:
                    self.record("main", config, label,
                                lambda: self.peer(work, system, layout, config, f"main_{slug}_{system}"), r)

    def single(self, cfg: BenchConfig, work: Path, rounds: int):
        for r in range(rounds):
            self.record("single", "1 rank", "megatorch gpt_pretrain (TP=PP=DP=1)",
                        lambda: run_gpt_pretrain(cfg, Layout(), self.out, f"single_megatorch_r{r + 1}", self.timeout), r)
            for system in ("libtorch", "eager"):
                out = self.out / f"single_{system}_r{r + 1}.json"
                cmd = [PY, str(HERE / "single_process.py"), "--work", str(work), "--system", system, "--out", str(out)]
                label = {"libtorch": "plain LibTorch (megatorch.cpp GPTModel + torch AdamW)",
                         "eager": "PyTorch eager (gpt.py + torch AdamW)"}[system]
                self.record("single", "1 rank", label, lambda: self._launch(cmd, out, out.stem), r)
            # The machine's fp32 matmul rate in the same rounds: the step as a fraction of it.
            out = self.out / f"single_matmul_rate_r{r + 1}.json"
            cmd = [PY, str(HERE / "matmul_rate.py"), "--out", str(out)]
            self.record("single", "1 rank", MATMUL_RATE, lambda: self._launch(cmd, out, out.stem), r)

    def scaling(self, with_peer: bool):
        for changes in SCALING:
            name = "h%d_L%d" % (changes.get("hidden_size", 128), changes.get("num_layers", 8))
            cfg = BenchConfig().with_(**changes, **SCALING_STEPS)
            work = self.prepare(f"scaling_{name}", {**changes, **SCALING_STEPS})
            self.record("scaling", name, "megatorch",
                        lambda: run_gpt_pretrain(cfg, SCALING_LAYOUT, self.out, f"scaling_{name}_megatorch",
                                                 self.timeout))
            if with_peer:
                self.record("scaling", name, "DTensor TP + DDP",
                            lambda: self.peer(work, "tp_ddp", SCALING_LAYOUT, name, f"scaling_{name}_tp_ddp"))

    def bubble(self, cfg: BenchConfig):
        for p, m in BUBBLE:
            self.record("bubble", f"p={p}", f"m={m}", lambda: run_pipeline_timeline(cfg, p, m, self.out, self.timeout))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "runs" / "cpu_peers"))
    ap.add_argument("--parts", nargs="+", default=["main", "single", "scaling", "bubble"],
                    choices=["main", "single", "scaling", "bubble"])
    ap.add_argument("--only", nargs="*", help="main-table configurations whose name starts with one of these")
    ap.add_argument("--no-scaling-peer", action="store_true", help="megatorch only in the growth runs")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the main and single-process runs")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.only:
        MAIN[:] = [c for c in MAIN if any(c[0].startswith(o) for o in args.only)]
    suite = Suite(out, args.timeout)
    cfg = BenchConfig()
    suite.results["config"] = json.loads(cfg.to_json())
    work = suite.prepare("main", {})
    t0 = time.time()
    if "main" in args.parts:
        suite.main_table(cfg, work, args.rounds)
    if "single" in args.parts:
        suite.single(cfg, work, args.rounds)
    if "scaling" in args.parts:
        suite.scaling(not args.no_scaling_peer)
    if "bubble" in args.parts:
        suite.bubble(cfg)
    suite.results.setdefault("wall_s", {})[" ".join(args.parts)] = round(time.time() - t0, 1)
    suite.save()
    print(f"[cpu_peers] done in {time.time() - t0:.0f} s: {suite.results_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
