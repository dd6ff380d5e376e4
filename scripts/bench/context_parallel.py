"""Long sequences on CPU ranks: megatorch's context parallelism at c = 1, 2, 4 next to
PyTorch's own (docs/benchmarks.md, "Context parallelism: long sequences on CPU ranks").

    .venv/bin/python scripts/bench/context_parallel.py [--out runs/context_parallel] \\
        [--seq-length 8192 --hidden-size 256 --sizes 1,2,4 --budget-mib 768 ...]

One GPT (2 layers, 4 heads, micro-batch = global batch = 1, fp32, vocabulary 257) is
trained from the same initial weights on the same samples of the bundled data with
gpt_pretrain at --context-parallel-size c (world = c, TP = PP = DP = 1) for every c in
--sizes and every --cp-comm-type that the heads allow (a2a needs heads divisible by c),
each rank one intra-op thread on Gloo. Per run: the median step time without the
warm-up steps, every rank's peak RSS (getrusage of the rank's process, which this script
starts as its child: `context_parallel.py --child`), the CPU time each rank used, the
bytes the logging rank handed to the CP group per step (the log's comm_bytes.cp), and
every step's loss, compared with c = 1's (fp32: they must agree to ~1e-5 relative).

The memory budget (--budget-mib) is a per-rank peak RSS limit; the report says which
runs stay under it, measured. megatorch-plan's prediction for the same model is shown
next to it when the planner takes --context-parallel-size: with --flash-attention
--mask-bytes 0 (no s×s scores and no dropout masks, as megatorch runs here), and
Korthikanti's count as the bound. --plan-only reruns just the planner.

The peers (scripts/bench/context_parallel_peer.py): gpt.py's GPT in PyTorch eager at one
rank (no CP: loss, time and memory next to c = 1), and the same GPT under
torch.distributed.tensor.experimental.context_parallel on 2 Gloo ranks with each rotate
method. A peer that fails is reported with its error, not left out.

Writes OUT/results.json and OUT/report.md and prints the report. Takes ~3 minutes on an
idle 2-core machine with the defaults; it waits first while the machine is busy. Hold
the build lock around it on a shared machine (`flock /tmp/mt_build.lock ...`).
"""
import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE / "peers"))
from config import BenchConfig, to_args  # noqa: E402
from machine_load import OtherLoad, wait_until_idle  # noqa: E402

sys.path.insert(0, str(HERE))
from bench_util import quartiles  # noqa: E402

MiB = 1 << 20
BUSY = 0.10  # a run during which other processes used more than this share of the machine is repeated once


def child_main(argv):
    """`context_parallel.py --child OUT -- CMD...`: runs CMD as this rank's child and writes
    OUT.<RANK> with its peak RSS (ru_maxrss, what /proc's VmHWM shows) and CPU time."""
    out, sep, cmd = argv[0], argv[1], argv[2:]
    assert sep == "--", "usage: context_parallel.py --child OUT -- COMMAND [ARGS...]"
    t0 = time.time()
    rc = subprocess.call(cmd)
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(f"{out}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump({"peak_rss_bytes": r.ru_maxrss * 1024, "cpu_s": r.ru_utime + r.ru_stime,
                   "wall_s": time.time() - t0, "returncode": rc}, f)
    sys.exit(rc)


def display(cmd) -> str:
    """A command as typed in the repository root."""
    text = shlex.join(str(c) for c in cmd).replace(str(ROOT) + "/", "")
    return text.replace(shlex.join([sys.executable, "-m", "torch.distributed.run"]), "torchrun") \
               .replace(sys.executable, "python")


def last_error(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|Exception|error:|what\(\)|megatorch:)", ln) and "ChildFailedError" not in ln \
                and "elastic" not in ln and not ln.startswith("raise"):
            return ln[:400]
    return lines[-1][:400] if lines else "no output"


def attention_work(c: int, comm: str, seq: int, heads: int) -> float:
    """Unmasked (query, key) pairs one rank computes per layer and sample, as a fraction of
    the whole causal attention (c = 1): p2p holds chunks r and 2c-1-r of L = S/2c tokens,
    (2c-1)L^2 + L(L+1) pairs per head; a2a runs the whole sequence for heads/c heads."""
    whole = seq * (seq + 1) / 2 * heads
    if c == 1:
        return 1.0
    if comm == "a2a":
        return seq * (seq + 1) / 2 * (heads // c) / whole
    L = seq // (2 * c)
    return ((2 * c - 1) * L * L + L * (L + 1)) * heads / whole


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.work = self.out / "work"
        self.out.mkdir(parents=True, exist_ok=True)
        self.cfg = BenchConfig().with_(
            num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length, micro_batch_size=1, global_batch_size=1,
            warmup_steps=args.warmup_steps, timed_steps=args.timed_steps)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "torch_ext"), os.environ.get("PYTHONPATH")])),
                    "MEGATORCH_LIBRARY": os.environ.get("MEGATORCH_LIBRARY", str(ROOT / "build/lib/libmegatorch.so"))}
        self.results = {"config": json.loads(self.cfg.to_json()), "budget_mib": args.budget_mib,
                        "machine": {"cpus": os.cpu_count(), "mem_total_gib": self._mem_total_gib()},
                        "runs": [], "peers": []}

    @staticmethod
    def _mem_total_gib() -> float:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) / (1 << 20)

    def log(self, msg):
        print(f"[context_parallel] {msg}", file=sys.stderr, flush=True)

    def save(self):
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))

    def torchrun(self, nproc: int):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]

    def prepare(self):
        """Samples, initial weights and their checks against megatorch (peers/prepare.py)."""
        proc = subprocess.run([sys.executable, str(HERE / "peers" / "prepare.py"), "--work", str(self.work),
                               "--config", json.dumps(json.loads(self.cfg.to_json()))],
                              env=self.env, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"prepare.py failed:\n{proc.stdout}{proc.stderr}")
        self.results["checks"] = json.loads((self.work / "checks.json").read_text())
        for k, v in self.results["checks"].items():
            self.log(f"{k}: {v}")

    def launch(self, tag: str, nproc: int, cmd: list, timeout: int):
        """torchrun of `cmd` on nproc ranks, each through --child; waits for an idle machine
        first and repeats once when other processes took more than BUSY of it."""
        rss_prefix = self.out / f"{tag}.rank"
        full = self.torchrun(nproc) + [str(Path(__file__).resolve()), "--child", str(rss_prefix), "--"] + cmd
        for attempt in (1, 2):
            wait_until_idle(log=self.log)
            t0 = time.time()
            with OtherLoad() as other:
                try:
                    proc = subprocess.run(full, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
                    rc, text = proc.returncode, proc.stdout + proc.stderr
                except subprocess.TimeoutExpired as e:
                    rc = "timeout"
                    text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            (self.out / f"{tag}.log").write_text(text)
            if other.share <= BUSY or attempt == 2:
                break
            self.log(f"  other processes used {other.share:.0%} of the machine; running {tag} again")
        ranks = []
        for r in range(nproc):
            p = Path(f"{rss_prefix}.{r}")
            ranks.append(json.loads(p.read_text()) if p.exists() else None)
        return rc, text, ranks, other.share, time.time() - t0

    # ---- megatorch -------------------------------------------------------------------

    def megatorch(self, c: int, comm: str):
        tag = f"megatorch_c{c}_{comm}"
        log_json = self.out / f"{tag}.log.jsonl"
        log_json.unlink(missing_ok=True)
        flags = self.cfg.gpt_pretrain_flags() + ["--tensor-model-parallel-size", 1, "--pipeline-model-parallel-size", 1,
                                                 "--context-parallel-size", c, "--cp-comm-type", comm]
        cmd = [str(ROOT / "build" / "bin" / "gpt_pretrain")] + to_args(flags + ["--log-json", log_json])
        self.log(f"megatorch c={c} {comm} ...")
        rc, text, ranks, other, wall = self.launch(tag, c, cmd, self.args.timeout)
        shown = display(["torchrun", "--standalone", f"--nproc-per-node={c}", "--no-python"] + cmd[:1] + to_args(flags))
        rec = {"system": "megatorch", "c": c, "comm": comm, "command": shown, "other_load": other, "wall_s": wall}
        if rc != 0 or not log_json.exists():
            rec["error"] = f"exit {rc}: {last_error(text)}"
            self.log(f"  failed: {rec['error']}")
            return rec
        iters = [json.loads(line) for line in log_json.read_text().splitlines() if line.strip()]
        step_ms = [it["ms_per_iteration"] for it in iters[self.cfg.warmup_steps:]]
        cp_bytes = [int(it["comm_bytes"].get("cp", 0)) for it in iters]
        rec.update({
            "losses": [it["loss"] for it in iters], "step_ms": step_ms, "median_ms": statistics.median(step_ms),
            "p25_ms": quartiles(step_ms)[0], "p75_ms": quartiles(step_ms)[1],
            "cp_bytes_per_step": cp_bytes[-1], "cp_bytes_every_step": cp_bytes,
            "comm_bytes_last_step": iters[-1]["comm_bytes"], "memory_bytes": iters[-1]["memory_bytes"],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks], "cpu_s": [r["cpu_s"] for r in ranks],
            "attention_work_per_rank": attention_work(c, comm, self.cfg.seq_length, self.cfg.num_attention_heads),
        })
        self.log(f"  median {rec['median_ms']:.0f} ms, peak RSS {max(rec['peak_rss_bytes']) / MiB:.0f} MiB, "
                 f"cp {cp_bytes[-1] / MiB:.1f} MiB/step, losses {', '.join(f'{x:.6f}' for x in rec['losses'])}")
        return rec

    # ---- PyTorch peers ---------------------------------------------------------------

    def peer(self, mode: str, c: int, rotate: str = "alltoall", sdpa: str = "default"):
        tag = f"pytorch_{mode}_c{c}" + (f"_{rotate}_sdpa_{sdpa}" if mode == "torch_cp" else "")
        out = self.out / f"{tag}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, str(HERE / "context_parallel_peer.py"), "--work", str(self.work), "--mode", mode,
               "--rotate", rotate, "--sdpa", sdpa, "--out", str(out)]
        self.log(f"PyTorch {mode} c={c} {rotate if mode == 'torch_cp' else ''} {sdpa} ...")
        rc, text, ranks, other, wall = self.launch(tag, c, cmd, self.args.timeout)
        rec = json.loads(out.read_text()) if out.exists() else {"error": f"exit {rc}: {last_error(text)}"}
        rec.update({"system": "pytorch", "c": c, "tag": tag, "other_load": other, "wall_s": wall,
                    "command": display(["torchrun", "--standalone", f"--nproc-per-node={c}"] + cmd[1:])
                    .replace(str(self.work), "OUT/work").replace(str(out), f"OUT/{out.name}")})
        if all(ranks):
            rec["peak_rss_bytes"] = [r["peak_rss_bytes"] for r in ranks]
            rec["cpu_s"] = [r["cpu_s"] for r in ranks]
        if "step_ms" in rec and rec["step_ms"]:
            rec["p25_ms"], rec["p75_ms"] = quartiles(rec["step_ms"])
        self.log(f"  failed: {rec['error']}" if "error" in rec else f"  median {rec['median_ms']:.0f} ms")
        return rec

    # ---- the planner's prediction ----------------------------------------------------

    def plan(self, c: int):
        tool = ROOT / "build" / "bin" / "megatorch-plan"
        help_text = subprocess.run([str(tool), "--help"], capture_output=True, text=True).stdout if tool.exists() else ""
        if "--context-parallel-size" not in help_text:
            return {"c": c, "error": "megatorch-plan has no --context-parallel-size"}
        cfg = self.cfg
        cmd = [str(tool), "--num-layers", cfg.num_layers, "--hidden-size", cfg.hidden_size,
               "--num-attention-heads", cfg.num_attention_heads, "--seq-length", cfg.seq_length,
               "--vocab-size", cfg.vocab_size, "--global-batch-size", 1, "--micro-batch-size", 1,
               "--precision", "fp32", "--gpus-per-node", c, "--gpu-memory-gb", 80, "--reserved-gb", 0,
               "--tensor-model-parallel-size", 1, "--pipeline-model-parallel-size", 1, "--data-parallel-size", 1,
               "--context-parallel-size", c, "--zero-stage", 0, "--recompute-granularity", "none",
               "--megatorch-activations", "--json"]
        # --flash-attention: the attention as megatorch runs it here (flash SDPA at c = 1, ring
        # attention under CP: no s×s scores), and --mask-bytes 0: the runs have no dropout, so
        # no masks. Without them, Korthikanti's count (1-byte masks): the bound.
        flash = cmd[:-1] + ["--flash-attention", "--mask-bytes", 0, "--json"]
        rec = {"c": c, "command": display(to_args(flash))}
        for key, args in (("", flash), ("korthikanti_", cmd)):
            proc = subprocess.run(to_args(args), capture_output=True, text=True, timeout=120)
            try:
                mem = json.loads(proc.stdout)["top"][0]["memory"]
                rec.update({key + "total_bytes": mem["total_bytes"], key + "activation_bytes": mem["activation_bytes"]})
                rec["state_bytes"] = mem["param_bytes"] + mem["grad_bytes"] + mem["optimizer_state_bytes"]
            except (json.JSONDecodeError, KeyError, IndexError):
                rec[key + "error"] = last_error(proc.stdout + proc.stderr)
        return rec

    def plan_only(self):
        """Reruns only the planner (seconds, no training) for this model and --sizes, and
        stores its records in OUT/results.json, keeping an earlier run's measurements there
        (and rewriting report.md from them)."""
        path = self.out / "results.json"
        if path.exists():
            self.results = json.loads(path.read_text())
        self.results["plan"] = [self.plan(c) for c in self.args.sizes]
        self.save()
        print(json.dumps(self.results["plan"], indent=1))
        if self.results.get("runs"):
            (self.out / "report.md").write_text(render(self.results))

    # ---- the fixed footprint ---------------------------------------------------------

    def footprint(self):
        """Peak RSS of the same gpt_pretrain at a 256-token sequence: what a rank holds
        whatever the sequence (libraries, allocator, Gloo, the model's state)."""
        seq = 256
        flags = self.cfg.with_(seq_length=seq, warmup_steps=1, timed_steps=2).gpt_pretrain_flags()
        cmd = [str(ROOT / "build" / "bin" / "gpt_pretrain")] + to_args(flags)
        self.log(f"footprint: megatorch c=1 at sequence {seq} ...")
        rc, text, ranks, other, _ = self.launch("megatorch_footprint", 1, cmd, self.args.timeout)
        if rc != 0 or not ranks[0]:
            return {"seq_length": seq, "error": f"exit {rc}: {last_error(text)}"}
        self.log(f"  peak RSS {ranks[0]['peak_rss_bytes'] / MiB:.0f} MiB")
        return {"seq_length": seq, "peak_rss_bytes": ranks[0]["peak_rss_bytes"], "other_load": other}

    # ---- the whole benchmark ---------------------------------------------------------

    def run(self):
        t0 = time.time()
        self.prepare()
        self.save()
        heads = self.cfg.num_attention_heads
        for c in self.args.sizes:
            for comm in (["p2p"] if c == 1 else self.args.comm_types):
                if comm == "a2a" and heads % c:
                    self.log(f"skipping c={c} a2a: {heads} heads are not divisible by {c}")
                    continue
                self.results["runs"].append(self.megatorch(c, comm))
                self.save()
        if not self.args.no_peers:
            self.results["peers"].append(self.peer("eager", 1))
            self.save()
            for rotate, sdpa in (("alltoall", "default"), ("allgather", "default"), ("alltoall", "math")):
                self.results["peers"].append(self.peer("torch_cp", 2, rotate, sdpa))
                self.save()
        self.results["footprint"] = self.footprint()
        self.results["plan"] = [self.plan(c) for c in self.args.sizes]
        self.results["total_s"] = time.time() - t0
        self.save()
        report = render(self.results)
        (self.out / "report.md").write_text(report)
        print(report)
        self.log(f"results: {self.out / 'results.json'}, report: {self.out / 'report.md'} "
                 f"({self.results['total_s']:.0f} s)")


def max_rel_diff(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a and b and len(a) == len(b) else float("nan")


def render(res: dict) -> str:
    cfg, budget = res["config"], res["budget_mib"]
    runs = [r for r in res["runs"] if "error" not in r]
    base = next((r for r in runs if r["c"] == 1), None)
    fp = res.get("footprint", {})
    fixed = fp.get("peak_rss_bytes", 0) / MiB
    lines = [f"Model: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
             f"sequence {cfg['seq_length']}, vocabulary {cfg['vocab_size']}, micro-batch = global batch = 1, fp32; "
             f"{cfg['warmup_steps']} warm-up + {cfg['timed_steps']} timed steps per run. "
             f"Memory budget: {budget} MiB peak RSS per rank.", ""]
    if fixed:
        lines += [f"Fixed footprint (gpt_pretrain, same model at sequence {fp['seq_length']}, 1 rank): "
                  f"{fixed:.0f} MiB peak RSS.", ""]
    lines += ["| system | c | comm | ms/step, median (p25–p75) | c=1 ÷ this | peak RSS/rank, MiB (max) "
              f"| above footprint | ≤ {budget} MiB | CP bytes/step (of it sent) | DP×CP grad bytes/step | attention work/rank "
              "| CPU s/rank (whole run) | max rel. loss diff vs c=1 |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def rss_cells(rec):
        if "peak_rss_bytes" not in rec:
            return "–", "–", "–"
        rss = max(rec["peak_rss_bytes"]) / MiB
        return f"{rss:.0f}", (f"{rss - fixed:.0f}" if fixed else "–"), ("yes" if rss <= budget else "**no**")

    for r in res["runs"]:
        if "error" in r:
            lines.append(f"| megatorch | {r['c']} | {r['comm']} | failed: {r['error']} |" + " |" * 9)
            continue
        rss, above, fits = rss_cells(r)
        speed = f"{base['median_ms'] / r['median_ms']:.2f}" if base else "–"
        diff = "–" if r is base or not base else f"{max_rel_diff(r['losses'], base['losses']):.1e}"
        grad = r["comm_bytes_last_step"].get("dp", 0) / MiB
        # comm_stats.h counts a send and the buffer a recv fills (the ring: as much in as out),
        # and for all_to_all the part of the input sent to other ranks.
        sent = r["cp_bytes_per_step"] / MiB / (2 if r["comm"] == "p2p" else 1)
        lines.append(
            f"| megatorch | {r['c']} | {r['comm'] if r['c'] > 1 else '–'} | {r['median_ms']:.0f} "
            f"({r['p25_ms']:.0f}–{r['p75_ms']:.0f}) | {speed} | {rss} | {above} | {fits} "
            f"| {r['cp_bytes_per_step'] / MiB:.1f} MiB ({sent:.1f}) | {grad:.1f} MiB | {r['attention_work_per_rank']:.3f} "
            f"| {max(r['cpu_s']):.1f} | {diff} |")
    for p in res.get("peers", []):
        label = "PyTorch eager (gpt.py)" if p.get("mode") == "eager" else \
            f"PyTorch `context_parallel` ({p.get('rotate')}, SDPA {p.get('sdpa')})"
        if "error" in p:
            lines.append(f"| {label} | {p['c']} | – | **fails** (first step) |" + " |" * 9)
            continue
        rss, above, fits = rss_cells(p)
        speed = f"{base['median_ms'] / p['median_ms']:.2f}" if base else "–"
        diff = f"{max_rel_diff(p['losses'], base['losses']):.1e}" if base else "–"
        lines.append(f"| {label} | {p['c']} | – | {p['median_ms']:.0f} ({p['p25_ms']:.0f}–{p['p75_ms']:.0f}) | {speed} "
                     f"| {rss} | – | {fits} | – | – | 1.000 | {max(p.get('cpu_s', [0])):.1f} | {diff} |")
    lines.append("")
    if base:
        lines.append("Losses at c=1, step by step: " + ", ".join(f"{x:.6f}" for x in base["losses"]))
    for p in res.get("peers", []):
        if "error" in p:
            lines.append(f"- {p['tag']}: `{p['error']}`" + (f" (raised in {p['raised_in']})" if p.get("raised_in") else ""))
    plans = res.get("plan", [])
    if any("total_bytes" in p for p in plans):
        lines += ["", "megatorch-plan (`--recompute-granularity none`, fp32, `--flash-attention --mask-bytes 0`: no "
                  "s×s attention scores and no dropout masks, as megatorch runs here) per rank, next to the measured "
                  "peak RSS above the fixed footprint (what the planner models: state, activations, logits); "
                  "Korthikanti's count "
                  "(without `--flash-attention`: the scores kept) is the bound:", "",
                  "| c | predicted | of it activations | of it parameters + gradients + AdamW | "
                  f"predicted + footprint ≤ {budget} MiB | measured above footprint | Korthikanti bound |",
                  "|---|---|---|---|---|---|---|"]
        for p in plans:
            bound = f"{p['korthikanti_total_bytes'] / MiB:.0f} MiB" if "korthikanti_total_bytes" in p else "–"
            if "total_bytes" not in p:
                lines.append(f"| {p['c']} | {p.get('error', '')} | | | | | {bound} |")
                continue
            meas = [(f"{r['comm']} " if r["c"] > 1 else "") + f"{max(r['peak_rss_bytes']) / MiB - fixed:.0f}"
                    for r in runs if r["c"] == p["c"] and "peak_rss_bytes" in r]
            fits = "yes" if p["total_bytes"] / MiB + fixed <= budget else "no"
            lines.append(f"| {p['c']} | {p['total_bytes'] / MiB:.0f} MiB | {p['activation_bytes'] / MiB:.0f} MiB "
                         f"| {p['state_bytes'] / MiB:.0f} MiB | {fits} | {', '.join(meas)} MiB | {bound} |")
    lines.append("")
    lines.append("Other processes' share of the machine during each run: "
                 + ", ".join(f"{r.get('tag') or 'megatorch c=%d %s' % (r['c'], r.get('comm', ''))} {r['other_load']:.0%}"
                             for r in res["runs"] + res.get("peers", []) if "other_load" in r))
    return "\n".join(lines) + "\n"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "runs" / "context_parallel"))
    ap.add_argument("--seq-length", type=int, default=8192)
    # 256, not 128: the sequence-proportional memory must stand out from the ~0.5 GiB footprint.
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--comm-types", type=lambda s: s.split(","), default=["p2p", "a2a"])
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--timed-steps", type=int, default=8)
    ap.add_argument("--budget-mib", type=int, default=768, help="per-rank peak RSS budget")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--render", metavar="RESULTS_JSON", help="only print the report of an earlier run")
    ap.add_argument("--plan-only", action="store_true",
                    help="only rerun megatorch-plan (seconds) and store its prediction in OUT/results.json")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return
    if args.plan_only:
        Bench(args).plan_only()
        return
    Bench(args).run()


if __name__ == "__main__":
    main()
