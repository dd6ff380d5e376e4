"""Mixture of experts on CPU ranks: dense against MoE of equal active parameters, the two
token dispatchers, and the grouped GEMM against the per-expert loop (docs/benchmarks.md,
"Mixture of experts").

    flock /tmp/mt_build.lock .venv/bin/python scripts/bench/moe.py [--out runs/moe] \\
        [--parts dense,dispatcher,gemm,kernel --rounds 2 --iters 40 ...]
    .venv/bin/python scripts/bench/moe.py --quick       # tiny sizes, one round: a smoke test (seconds)
    .venv/bin/python scripts/bench/moe.py --render runs/moe/results.json

The model parts train one GPT-2 style model (gpt_pretrain: learned positions, LayerNorm,
GeLU MLP with biases, tied embeddings; --layers, --hidden-size, --seq-length; fp32,
vocabulary 257, the bundled data, AdamW + clipping + cosine decay as the other CPU
benchmarks, scripts/bench/peers/config.py) under torchrun, one intra-op thread per rank
on Gloo, each configuration --rounds times, the rounds interleaved (every configuration
once, then every one again); a run during which other processes used more than 10 % of
the machine is repeated once.

  dense       a dense GPT with MLP width F against an MoE with E experts, top-k, each
              expert of width F / k (every layer an MoE layer): each token's MLP FLOPs
              and active parameters equal (plus the router's h x E), total parameters
              ~E/k times the MLP's. At 1 rank, at 4 ranks (DP4 against EP4 over DP4) and
              at TP2 x DP2 + SP (against EP2 with TP2 + SP).
  dispatcher  the same MoE at EP2 and EP4 with --moe-token-dispatcher-type alltoall and
              allgather: step time, the bytes the log counts for the 'ep' group, and the
              losses, which must agree.
  gemm        the same MoE with and without --no-moe-grouped-gemm at 1 rank and EP4, and
              with --gemm-experts experts (width F / k still) at 1 rank.
  kernel      kernels::grouped_gemm by itself: megatorch's grouped path (at::_grouped_mm)
              against its per-expert loop, through a small C++ driver linked against
              libmegatorch.so (scripts/bench/moe_grouped_gemm.cpp, compiled into OUT/bin);
              and, in Python, torch._grouped_mm against a loop of torch.mm over
              x.split(counts) / w.unbind(0). Balanced and skewed counts, forward and
              forward + backward, one thread.

Step time: gpt_pretrain's ms_per_iteration of the logging rank, median of every round's
steps after --warmup; tokens/s: global batch x sequence / that median. Losses are the
LM loss (without the auxiliary loss), of round 1; the rounds must repeat them bit for bit.
Runs of one model at other layouts, dispatchers or GEMM paths must agree within
--tolerance (relative) over the first --check-steps steps; the report also shows every
step, and the step at which two runs' expert loads first differ (a near tie in the router
decided the other way). A failed check, or a kernel path whose outputs differ from the
other's, makes the script exit 1.

Writes OUT/results.json and OUT/report.md and prints the report. Needs the build
(build/bin/gpt_pretrain, build/lib/libmegatorch.so) and a C++ compiler for the kernel
part. About 6 minutes on an idle 2-core machine with the defaults (it waits first while
the machine is busy), --quick under a minute. Hold the build lock around it on a shared
machine.
"""
import argparse
import json
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE / "peers"))
from config import BenchConfig, to_args  # noqa: E402
from machine_load import OtherLoad, wait_until_idle  # noqa: E402

MiB = 1 << 20
BUSY = 0.10  # a run during which other processes used more than this share of the machine is repeated once
GPT_PRETRAIN = ROOT / "build" / "bin" / "gpt_pretrain"
LIBRARY = ROOT / "build" / "lib" / "libmegatorch.so"


def log(msg):
    print(f"[moe] {msg}", file=sys.stderr, flush=True)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def display(cmd) -> str:
    return shlex.join(str(c) for c in cmd).replace(str(ROOT) + "/", "")


def last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|error:|what\(\)|megatorch:|Exception)", ln) and "ChildFailedError" not in ln:
            return ln[:400]
    return lines[-1][:400] if lines else "no output"


def quartiles(xs):
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


# ---- the model parts ---------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One gpt_pretrain configuration."""
    key: str
    world: int
    moe: bool
    tp: int = 1
    ep: int = 1
    sp: bool = False
    dispatcher: str = "alltoall"
    grouped: bool = True
    experts: int = 0  # 0: --experts

    def layout(self) -> str:
        dp = self.world // self.tp
        if not self.moe:
            parts = ([f"TP{self.tp}"] if self.tp > 1 else []) + ([f"DP{dp}"] if dp > 1 else [])
            return " x ".join(parts) + (" + SP" if self.sp else "") if parts else "1 rank"
        parts = [f"EP{self.ep}"] if self.ep > 1 else []
        parts += ([f"TP{self.tp}"] if self.tp > 1 else []) + ([f"DP{dp}"] if dp > 1 else [])
        return " x ".join(parts) + (" + SP" if self.sp else "") if parts else "1 rank"


def plan_runs(args) -> list:
    """Every configuration the chosen parts need, each once."""
    runs = {}

    def add(r: Run):
        runs.setdefault(r.key, r)

    w = 2 if args.quick else 4
    if "dense" in args.parts:
        add(Run("dense_1", 1, False))
        add(Run("moe_1", 1, True))
        add(Run(f"dense_dp{w}", w, False))
        add(Run(f"moe_ep{w}", w, True, ep=w))
        if not args.quick:
            add(Run("dense_tp2dp2_sp", 4, False, tp=2, sp=True))
            add(Run("moe_ep2tp2dp2_sp", 4, True, tp=2, ep=2, sp=True))
    if "dispatcher" in args.parts:
        add(Run("moe_1", 1, True))
        for ep in ([2] if args.quick else [2, 4]):
            add(Run(f"moe_ep{ep}", ep, True, ep=ep))
            add(Run(f"moe_ep{ep}_allgather", ep, True, ep=ep, dispatcher="allgather"))
    if "gemm" in args.parts:
        add(Run("moe_1", 1, True))
        add(Run("moe_1_loop", 1, True, grouped=False))
        if not args.quick:
            add(Run(f"moe_ep{w}", w, True, ep=w))
            add(Run(f"moe_ep{w}_loop", w, True, ep=w, grouped=False))
        for e in args.gemm_experts:
            if e != args.experts:
                add(Run(f"moe{e}_1", 1, True, experts=e))
                add(Run(f"moe{e}_1_loop", 1, True, experts=e, grouped=False))
    return list(runs.values())


class Model:
    """The model and the flags every run shares."""

    def __init__(self, args):
        self.args = args
        self.cfg = BenchConfig().with_(
            num_layers=args.layers, hidden_size=args.hidden_size, num_attention_heads=args.heads,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size, warmup_steps=args.warmup, timed_steps=args.iters - args.warmup)
        self.dense_ffn = args.ffn_hidden_size
        self.moe_ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size // args.topk

    def flags(self, r: Run) -> list:
        a = self.args
        f = self.cfg.gpt_pretrain_flags()
        at = f.index("--eval-iters")  # one validation at the end (the config's flags say 0)
        f[at + 1] = a.eval_iters
        f += ["--ffn-hidden-size", self.dense_ffn,
                                             "--tensor-model-parallel-size", r.tp, "--pipeline-model-parallel-size", 1]
        if r.sp:
            f.append("--sequence-parallel")
        if r.moe:
            f += ["--num-experts", r.experts or a.experts, "--moe-router-topk", a.topk,
                  "--moe-ffn-hidden-size", self.moe_ffn, "--moe-aux-loss-coeff", a.aux_loss_coeff,
                  "--expert-model-parallel-size", r.ep, "--moe-token-dispatcher-type", r.dispatcher]
            if not r.grouped:
                f.append("--no-moe-grouped-gemm")
        return f

    def parameters(self, experts: int, tp: int = 1) -> dict:
        """Total and active (per token) parameters as gpt_pretrain builds the model: the
        embedding padded to a multiple of 128 x TP rows, biases everywhere, an [E, h] router."""
        h, L, s = self.cfg.hidden_size, self.cfg.num_layers, self.cfg.seq_length
        vocab = -(-self.cfg.vocab_size // (128 * tp)) * 128 * tp
        attention = 4 * h * h + 4 * h + 4 * h  # qkv + proj with biases, two LayerNorms
        embed = vocab * h + s * h + 2 * h  # word and position embeddings, final LayerNorm
        if experts == 0:
            mlp = 2 * h * self.dense_ffn + self.dense_ffn + h
            total = active = embed + L * (attention + mlp)
            return {"total": total, "active": active, "mlp_total": L * mlp, "mlp_active": L * mlp}
        expert = 2 * h * self.moe_ffn + self.moe_ffn + h
        router = experts * h
        total = embed + L * (attention + router + experts * expert)
        active = embed + L * (attention + router + self.args.topk * expert)
        return {"total": total, "active": active, "mlp_total": L * (router + experts * expert),
                "mlp_active": L * (router + self.args.topk * expert)}


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.model = Model(args)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.results = {
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "quick": args.quick, "parts": args.parts,
            "machine": {"cpu": cpu_name(), "cpus": os.cpu_count()},
            "config": json.loads(self.model.cfg.to_json()),
            "moe": {"experts": args.experts, "topk": args.topk, "dense_ffn": self.model.dense_ffn,
                    "moe_ffn": self.model.moe_ffn, "aux_loss_coeff": args.aux_loss_coeff,
                    "gemm_experts": args.gemm_experts},
            "rounds": args.rounds, "tolerance": args.tolerance, "check_steps": args.check_steps,
            "runs": {}, "kernel": None, "checks": []}

    def save(self):
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))

    def launch(self, r: Run, round_no: int) -> dict:
        tag = f"{r.key}.round{round_no}"
        log_json = self.out / f"{tag}.jsonl"
        flags = self.model.flags(r)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={r.world}",
               "--no-python", str(GPT_PRETRAIN)] + to_args(flags + ["--log-json", log_json])
        shown = display(["torchrun", "--standalone", f"--nproc-per-node={r.world}", "--no-python", GPT_PRETRAIN]
                        + to_args(flags))
        for attempt in (1, 2):
            log_json.unlink(missing_ok=True)
            t0 = time.time()
            with OtherLoad() as other:
                try:
                    proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=self.args.timeout,
                                          cwd=ROOT)
                    rc, text = proc.returncode, proc.stdout + proc.stderr
                except subprocess.TimeoutExpired as e:
                    rc = "timeout"
                    text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            wall = time.time() - t0
            (self.out / f"{tag}.log").write_text(text)
            if other.share <= BUSY or attempt == 2 or self.args.quick:
                break
            log(f"  other processes used {other.share:.0%} of the machine; running {tag} again")
        rec = {"round": round_no, "command": shown, "other_load": other.share, "wall_s": wall}
        if rc != 0 or not log_json.exists():
            rec["error"] = f"exit {rc}: {last_error(text)}"
            log(f"  {tag} failed: {rec['error']}")
            return rec
        its = [json.loads(ln) for ln in log_json.read_text().splitlines() if ln.strip()]
        val = [it["val_loss"] for it in its if "val_loss" in it]
        its = [it for it in its if "loss" in it]
        m = re.search(r"(\d+) parameters", text)
        last = its[-1]
        rec.update({
            "losses": [it["loss"] for it in its], "step_ms": [it["ms_per_iteration"] for it in its],
            "val_loss": val[-1] if val else None,
            # Per step and MoE layer: the fewest and most tokens an expert got. Where two runs of
            # one model differ here, a token went to another expert (a near tie in the router).
            "routing": [[[x["tokens_per_expert_min"], x["tokens_per_expert_max"]] for x in it["moe"]["layers"]]
                        for it in its] if "moe" in its[-1] else None,
            "parameters_logged": int(m.group(1)) if m else None,
            "comm_bytes_per_step": {k: statistics.median(int(it["comm_bytes"].get(k, 0)) for it in its)
                                    for k in last["comm_bytes"]},
            "state_bytes_per_rank": last["memory_bytes"]["total_bytes"],
            "rss_bytes": last["memory_bytes"].get("rss_bytes"),
        })
        if "moe" in last:
            layers = last["moe"]["layers"]
            rec["moe_last_step"] = {"aux_loss": last["moe"]["aux_loss"], "dropped": last["moe"]["dropped"],
                                    "tokens_per_expert_max": max(x["tokens_per_expert_max"] for x in layers),
                                    "tokens_per_expert_min": min(x["tokens_per_expert_min"] for x in layers),
                                    "tokens_per_expert_mean": layers[0]["tokens_per_expert_mean"]}
        timed = rec["step_ms"][self.args.warmup:]
        log(f"  {tag}: median {statistics.median(timed):.1f} ms/step, final loss {rec['losses'][-1]:.6f}, "
            f"other load {other.share:.0%}")
        return rec

    def run_models(self):
        runs = plan_runs(self.args)
        self.results["run_specs"] = {r.key: r.__dict__ for r in runs}
        for rnd in range(1, self.args.rounds + 1):
            if not self.args.quick:
                wait_until_idle(log=log)
            log(f"round {rnd}/{self.args.rounds}: {len(runs)} configurations")
            for r in runs:
                rec = self.launch(r, rnd)
                self.results["runs"].setdefault(r.key, []).append(rec)
                self.save()
        for r in runs:
            self.results["runs"][r.key] = summarize(self.results["runs"][r.key], self.args.warmup,
                                                    self.model.cfg, r, self.model)
        self.save()

    def run(self):
        t0 = time.time()
        if {"dense", "dispatcher", "gemm"} & set(self.args.parts):
            self.run_models()
        if "kernel" in self.args.parts:
            self.results["kernel"] = kernel_bench(self.args, self.out)
            self.save()
        self.results["checks"] = checks(self.results)
        self.results["total_s"] = time.time() - t0
        self.save()
        report = render(self.results)
        (self.out / "report.md").write_text(report)
        print(report)
        log(f"results: {self.out / 'results.json'}, report: {self.out / 'report.md'} ({self.results['total_s']:.0f} s)")
        failed = [c for c in self.results["checks"] if not c["ok"]]
        return 1 if failed else 0


def summarize(recs: list, warmup: int, cfg: BenchConfig, r: Run, model: Model) -> dict:
    ok = [x for x in recs if "error" not in x]
    out = {"spec": r.__dict__, "layout": r.layout(), "rounds": recs}
    if not ok:
        out["error"] = recs[-1]["error"]
        return out
    steps = [ms for x in ok for ms in x["step_ms"][warmup:]]
    first = ok[0]
    median = statistics.median(steps)
    experts = (r.experts or model.args.experts) if r.moe else 0
    out.update({
        "command": first["command"], "losses": first["losses"], "val_loss": first["val_loss"],
        "routing": first["routing"], "median_ms": median,
        "p25_ms": quartiles(steps)[0], "p75_ms": quartiles(steps)[1], "timed_steps": len(steps),
        "tokens_per_s": cfg.global_batch_size * cfg.seq_length / (median / 1e3),
        "round_loss_diff": max((max(abs(a - b) for a, b in zip(x["losses"], first["losses"])) for x in ok[1:]),
                               default=0.0),
        "comm_bytes_per_step": first["comm_bytes_per_step"], "state_bytes_per_rank": first["state_bytes_per_rank"],
        "parameters": model.parameters(experts, r.tp), "parameters_logged": first["parameters_logged"],
        "other_load": max(x["other_load"] for x in recs), "moe_last_step": first.get("moe_last_step"),
    })
    return out


def max_abs_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b)) if a and b and len(a) == len(b) else float("nan")


def max_rel_diff(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a and b and len(a) == len(b) else float("nan")


def agreement_pairs(runs: dict) -> list:
    """(label, run, reference): configurations that train the same model and must give the
    same losses."""
    pairs = []
    keys = [k for k in runs if "error" not in runs[k]]
    for k in keys:
        spec = runs[k]["spec"]
        if not spec["moe"]:
            if k != "dense_1" and "dense_1" in runs:
                pairs.append((f"dense {runs[k]['layout']} vs 1 rank", k, "dense_1"))
            continue
        e = spec["experts"]
        base = f"moe{e}_1" if e else "moe_1"
        if k == base or base not in runs:
            continue
        what = runs[k]["layout"]
        if spec["dispatcher"] != "alltoall":
            what += f" {spec['dispatcher']}"
        if not spec["grouped"]:
            what += " per-expert loop"
        if k.replace("_loop", "") != base:
            pairs.append((f"MoE{e or ''} {what} vs 1 rank", k, base))
        if spec["dispatcher"] == "allgather" and k.replace("_allgather", "") in runs:
            pairs.append((f"MoE {runs[k]['layout']}: allgather vs alltoall", k, k.replace("_allgather", "")))
        if not spec["grouped"] and k.replace("_loop", "") in runs:
            pairs.append((f"MoE{e or ''} {runs[k]['layout']}: per-expert loop vs grouped", k, k.replace("_loop", "")))
    return pairs


def first_routing_difference(a: dict, b: dict):
    """The first step (1-based) at which two runs' per-layer expert loads differ, or None."""
    if not a.get("routing") or not b.get("routing"):
        return None
    for step, (x, y) in enumerate(zip(a["routing"], b["routing"]), 1):
        if x != y:
            return step
    return None


def compare(res: dict, k: str, ref: str) -> dict:
    """Loss agreement of run k with run ref: over the first --check-steps steps (the
    check), over every step, and the step where the routing first differs."""
    a, b, n = res["runs"][k], res["runs"][ref], res["check_steps"]
    return {"max_rel_loss_diff": max_rel_diff(a["losses"][:n], b["losses"][:n]),
            "max_rel_loss_diff_all_steps": max_rel_diff(a["losses"], b["losses"]),
            "max_abs_loss_diff_all_steps": max_abs_diff(a["losses"], b["losses"]),
            "routing_first_differs_at_step": first_routing_difference(a, b)}


def checks(res: dict) -> list:
    out = []
    tol, n = res["tolerance"], res["check_steps"]
    runs = res.get("runs", {})
    for label, k, ref in agreement_pairs(runs):
        if "error" in runs.get(k, {}) or "error" in runs.get(ref, {}):
            continue
        c = compare(res, k, ref)
        out.append({"check": f"{label}, first {n} steps", **c, "ok": c["max_rel_loss_diff"] <= tol})
    for k, r in runs.items():
        if "error" in r:
            out.append({"check": f"{k} ran", "error": r["error"], "ok": False})
        elif r["round_loss_diff"] != 0.0:
            out.append({"check": f"{k}: rounds repeat the losses", "max_abs_loss_diff": r["round_loss_diff"],
                        "ok": False})
        elif r["parameters_logged"] is not None and r["parameters_logged"] != r["parameters"]["total"]:
            out.append({"check": f"{k}: parameter count", "logged": r["parameters_logged"],
                        "counted": r["parameters"]["total"], "ok": False})
    kernel = res.get("kernel") or {}
    for c in kernel.get("cases", []):
        for key in ("megatorch_diff", "torch_diff"):
            d = c.get(key)
            if d is not None and not d <= 1e-3:
                out.append({"check": f"kernel {c['name']} {c['mode']} {key}", "max_abs_diff": d, "ok": False})
    return out


# ---- the kernel part ---------------------------------------------------------------------

KERNEL_SHAPES = [(8, 256, 512), (8, 1024, 2048), (32, 512, 1024), (64, 256, 512), (64, 1024, 2048)]
KERNEL_SHAPES_QUICK = [(4, 64, 128)]


def kernel_counts(rows: int, experts: int, skewed: bool) -> list:
    """Balanced: rows / E each. Skewed: rows drawn from a Zipf law over the experts
    (p_e ~ 1 / (e + 1)^1.2, a fixed seed), so a few experts take most rows and the last ones
    may get none."""
    if not skewed:
        counts = [rows // experts] * experts
        counts[0] += rows - sum(counts)
        return counts
    weights = [1.0 / (e + 1) ** 1.2 for e in range(experts)]
    drawn = random.Random(experts).choices(range(experts), weights=weights, k=rows)
    return [drawn.count(e) for e in range(experts)]


def build_driver(out: Path) -> Path:
    """Compiles scripts/bench/moe_grouped_gemm.cpp against libmegatorch.so and the venv's
    libtorch (once; again when the source or the library is newer)."""
    import torch
    src = HERE / "moe_grouped_gemm.cpp"
    exe = out / "bin" / "moe_grouped_gemm"
    lib = LIBRARY.resolve()
    if exe.exists() and exe.stat().st_mtime > max(src.stat().st_mtime, lib.stat().st_mtime):
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    tdir = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f"-I{ROOT / 'include'}", f"-I{tdir / 'include'}", f"-I{tdir / 'include/torch/csrc/api/include'}",
           str(src), "-o", str(exe), f"-L{lib.parent}", "-lmegatorch", f"-L{tdir / 'lib'}", "-ltorch", "-ltorch_cpu",
           "-lc10", f"-Wl,-rpath,{lib.parent}:{tdir / 'lib'}"]
    log(f"compiling {src.name} ...")
    subprocess.run(cmd, check=True)
    return exe


def python_kernel(h, f, counts, mode, iters, budget_ms, warmup):
    """torch._grouped_mm against a Python loop of torch.mm over x.split(counts) and
    w.unbind(0), interleaved call by call; at least `iters` calls of each, more (up to 50)
    while the slower one's add up to less than budget_ms, as its first call predicts."""
    import torch
    torch.manual_seed(0)
    rows, backward = sum(counts), mode == "fwdbwd"
    x = torch.randn(rows, h, requires_grad=backward)
    w = (torch.randn(len(counts), h, f) * 0.02).requires_grad_(backward)
    grad = torch.randn(rows, f)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def grouped():
        return torch._grouped_mm(x, w, offs)

    def loop():
        return torch.cat([a @ b for a, b in zip(x.split(counts), w.unbind(0))])

    def call(fn, keep=False):
        y = fn()
        if not backward:
            return (y,) if keep else None
        y.backward(grad)
        res = (y, x.grad, w.grad) if keep else None
        x.grad = w.grad = None
        return res

    t0 = time.perf_counter()
    a = call(grouped, True)
    t1 = time.perf_counter()
    b = call(loop, True)
    slower = max(t1 - t0, time.perf_counter() - t1) * 1e3
    iters = max(iters, min(50, int(budget_ms / max(slower, 1e-3))))
    diff = max((p - q).abs().max().item() for p, q in zip(a, b))
    for _ in range(warmup - 1):
        call(grouped), call(loop)
    tg, tl = [], []
    for i in range(iters):
        for fn in ((grouped, loop) if i % 2 == 0 else (loop, grouped)):
            t0 = time.perf_counter()
            call(fn)
            (tg if fn is grouped else tl).append((time.perf_counter() - t0) * 1e3)
    return statistics.median(tg), statistics.median(tl), diff, iters


def kernel_bench(args, out: Path) -> dict:
    import torch
    torch.set_num_threads(1)
    exe = build_driver(out)
    shapes = KERNEL_SHAPES_QUICK if args.quick else KERNEL_SHAPES
    rows = 256 if args.quick else args.kernel_rows
    iters, warmup = (2, 1) if args.quick else (args.kernel_iters, 1)
    budget = 0 if args.quick else args.kernel_budget_ms
    res = {"rows": rows, "iters": iters, "budget_ms": budget, "threads": 1, "torch": torch.__version__,
           "loop_backward_limit_gib": args.loop_backward_limit_gib, "cases": []}
    if not args.quick:
        wait_until_idle(log=log)
    for e, h, f in shapes:
        for skewed in (False, True):
            counts = kernel_counts(rows, e, skewed)
            for mode in ("fwd", "fwdbwd"):
                name = f"E{e}_h{h}_F{f}_{'skewed' if skewed else 'balanced'}"
                # The loop's backward holds the per-expert gradients and their concatenation:
                # about twice the [E, h, F] weight's bytes.
                slow = mode == "fwdbwd" and 2 * e * h * f * 4 > args.loop_backward_limit_gib * (1 << 30)
                line = f"{name} {mode} {iters} {budget} {warmup} {h} {f} {','.join(map(str, counts))}" + \
                    (" grouped_only" if slow else "")
                with OtherLoad() as other:
                    proc = subprocess.run([str(exe)], input=line + "\n", capture_output=True, text=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
                    mt = json.loads(proc.stdout.strip().splitlines()[-1])
                    t_grouped, t_loop, t_diff, t_iters = python_kernel(h, f, counts, mode, iters, budget, warmup)
                case = {"name": name, "experts": e, "h": h, "F": f, "rows": rows, "skewed": skewed, "mode": mode,
                        "counts": counts, "empty_groups": counts.count(0), "max_count": max(counts),
                        "megatorch_grouped_ms": mt["grouped_ms"], "megatorch_loop_ms": mt["loop_ms"],
                        "megatorch_diff": mt["max_abs_diff"], "megatorch_loop_skipped": slow,
                        "torch_grouped_mm_ms": t_grouped, "torch_loop_ms": t_loop, "torch_diff": t_diff,
                        "megatorch_iters": mt["iters"], "torch_iters": t_iters,
                        "gflop": (3 if mode == "fwdbwd" else 1) * 2 * rows * h * f / 1e9,
                        "other_load": other.share}
                res["cases"].append(case)
                loop = f"{mt['loop_ms']:.1f}" if mt["loop_ms"] is not None else "skipped"
                log(f"  {name} {mode}: megatorch grouped {mt['grouped_ms']:.1f} ms, loop {loop} ms; "
                    f"torch._grouped_mm {t_grouped:.1f} ms, split/unbind loop {t_loop:.1f} ms")
    return res


# ---- the report --------------------------------------------------------------------------


def fmt_ms(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def fmt_params(n: int) -> str:
    return f"{n / 1e6:.2f} M"


def render(res: dict) -> str:
    cfg, moe, runs = res["config"], res["moe"], res.get("runs", {})
    L = []
    if runs:
        L += [f"{res['date']}, {res['machine']['cpu']}, {res['machine']['cpus']} cores; "
              f"{'--quick; ' if res['quick'] else ''}{res['rounds']} round(s).", "",
              f"Model: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
              f"sequence {cfg['seq_length']}, vocabulary {cfg['vocab_size']}, global batch {cfg['global_batch_size']} "
              f"({cfg['global_batch_size'] * cfg['seq_length']} tokens/step), micro-batch {cfg['micro_batch_size']}, "
              f"fp32, {cfg['warmup_steps'] + cfg['timed_steps']} iterations ({cfg['warmup_steps']} not timed). "
              f"Dense MLP width {moe['dense_ffn']}; MoE: {moe['experts']} experts, top-{moe['topk']}, expert width "
              f"{moe['moe_ffn']}, aux-loss coefficient {moe['aux_loss_coeff']}, every layer MoE, dropless.", ""]
    dense, moe_run = runs.get("dense_1"), runs.get("moe_1")
    if dense and moe_run and "error" not in dense and "error" not in moe_run:
        pd, pm = dense["parameters"], moe_run["parameters"]
        L += ["| parameters | total | active per token | of it MLP / experts + router, total | active |",
              "|---|---|---|---|---|",
              f"| dense | {fmt_params(pd['total'])} | {fmt_params(pd['active'])} | {fmt_params(pd['mlp_total'])} "
              f"| {fmt_params(pd['mlp_active'])} |",
              f"| MoE | {fmt_params(pm['total'])} | {fmt_params(pm['active'])} | {fmt_params(pm['mlp_total'])} "
              f"| {fmt_params(pm['mlp_active'])} |", ""]

    def ms(r):
        return f"{r['median_ms']:.1f} ({r['p25_ms']:.1f}–{r['p75_ms']:.1f})"

    def ok(k):
        return k in runs and "error" not in runs[k]

    def val(r):
        return f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else "–"

    # (a) dense against MoE
    pairs = [(d, m) for d, m in (("dense_1", "moe_1"), ("dense_dp4", "moe_ep4"), ("dense_dp2", "moe_ep2"),
                                 ("dense_tp2dp2_sp", "moe_ep2tp2dp2_sp")) if d in runs and m in runs]
    if "dense" in res["parts"] and pairs:
        L += ["**Dense against MoE of equal active parameters** (ms/step: median (p25–p75); "
              "state: parameters + gradients + AdamW bytes of the logging rank):", "",
              "| ranks | dense layout | MoE layout | dense ms/step | MoE ms/step | MoE ÷ dense time | dense tokens/s "
              "| MoE tokens/s | loss, last step: dense / MoE | mean of last 5: MoE − dense "
              "| validation loss: dense / MoE | state MiB/rank dense / MoE |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for d, m in pairs:
            if not (ok(d) and ok(m)):
                L.append(f"| {runs[d]['spec']['world']} | {d} | {m} | failed: "
                         f"{runs[d].get('error') or runs[m].get('error')} |" + " |" * 8)
                continue
            rd, rm = runs[d], runs[m]
            tail = (statistics.mean(rm["losses"][-5:]) - statistics.mean(rd["losses"][-5:]))
            L.append(f"| {rd['spec']['world']} | {rd['layout']} | {rm['layout']} | {ms(rd)} | {ms(rm)} "
                     f"| {rm['median_ms'] / rd['median_ms']:.2f} | {rd['tokens_per_s']:.0f} | {rm['tokens_per_s']:.0f} "
                     f"| {rd['losses'][-1]:.4f} / {rm['losses'][-1]:.4f} | {tail:+.4f} | {val(rd)} / {val(rm)} "
                     f"| {rd['state_bytes_per_rank'] / MiB:.1f} / {rm['state_bytes_per_rank'] / MiB:.1f} |")
        L.append("")

    # (b) the dispatchers
    eps = [int(k[len("moe_ep"):-len("_allgather")]) for k in runs if re.fullmatch(r"moe_ep\d+_allgather", k)]
    if "dispatcher" in res["parts"] and eps:
        L += ["**Token dispatchers** (the same MoE, same seed; EP over DP, world = EP; ep bytes: the log's "
              "`comm_bytes.ep` per step, median over steps, comm_stats.h's convention):", "",
              "| EP | alltoall ms/step | allgather ms/step | allgather ÷ alltoall time | alltoall tokens/s "
              "| allgather tokens/s | alltoall ep MiB/step | allgather ep MiB/step | bytes ratio "
              "| max abs loss diff allgather vs alltoall, every step |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for ep in sorted(eps):
            a, g = f"moe_ep{ep}", f"moe_ep{ep}_allgather"
            if not (ok(a) and ok(g)):
                L.append(f"| {ep} | failed: {runs.get(a, {}).get('error') or runs.get(g, {}).get('error')} |" + " |" * 8)
                continue
            ra, rg = runs[a], runs[g]
            ba, bg = ra["comm_bytes_per_step"].get("ep", 0), rg["comm_bytes_per_step"].get("ep", 0)
            L.append(f"| {ep} | {ms(ra)} | {ms(rg)} | {rg['median_ms'] / ra['median_ms']:.2f} | {ra['tokens_per_s']:.0f} "
                     f"| {rg['tokens_per_s']:.0f} | {ba / MiB:.2f} | {bg / MiB:.2f} | {bg / ba if ba else float('nan'):.2f} "
                     f"| {max_abs_diff(ra['losses'], rg['losses']):.1e} |")
        L.append("")

    # (c) grouped GEMM against the loop, end to end
    loops = [k for k in runs if k.endswith("_loop")]
    if "gemm" in res["parts"] and loops:
        L += ["**Grouped GEMM against the per-expert loop, end to end** (`--no-moe-grouped-gemm`):", "",
              "| experts | layout | local experts/rank | grouped ms/step | loop ms/step | loop ÷ grouped time "
              "| grouped tokens/s | loop tokens/s | max abs loss diff |",
              "|---|---|---|---|---|---|---|---|---|"]
        for k in loops:
            g = k[:-len("_loop")]
            if not (ok(k) and ok(g)):
                L.append(f"| {k} | failed: {runs.get(k, {}).get('error') or runs.get(g, {}).get('error')} |" + " |" * 7)
                continue
            rl, rg = runs[k], runs[g]
            e = rg["spec"]["experts"] or moe["experts"]
            L.append(f"| {e} | {rg['layout']} | {e // rg['spec']['ep']} | {ms(rg)} | {ms(rl)} "
                     f"| {rl['median_ms'] / rg['median_ms']:.2f} | {rg['tokens_per_s']:.0f} | {rl['tokens_per_s']:.0f} "
                     f"| {max_abs_diff(rl['losses'], rg['losses']):.1e} |")
        L.append("")

    # the kernel
    kernel = res.get("kernel")
    if kernel:
        L += [f"**kernels::grouped_gemm by itself** (one projection, {kernel['rows']} rows = token-expert pairs, "
              f"input [rows, h] x weight [E, h, F], fp32, one thread, torch {kernel['torch']}; median of "
              + (f"{kernel['iters']} to 50 interleaved calls per path (more while the slower path's add up to "
                 f"less than {kernel['budget_ms']:g} ms)" if kernel.get("budget_ms") else
                 f"{kernel['iters']} interleaved calls per path")
              + "; ratio > 1: grouped faster):", "",
              "| E | h | F | counts | mode | GFLOP | megatorch grouped ms | megatorch loop ms | loop ÷ grouped "
              "| torch._grouped_mm ms | split/unbind loop ms | loop ÷ grouped |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in kernel["cases"]:
            counts = "balanced" if not c["skewed"] else f"skewed (max {c['max_count']}, {c['empty_groups']} empty)"
            if c["megatorch_loop_ms"] is None:
                mloop, mratio = "not run¹", "–"
            else:
                mloop = fmt_ms(c["megatorch_loop_ms"])
                mratio = f"{c['megatorch_loop_ms'] / c['megatorch_grouped_ms']:.2f}"
            L.append(f"| {c['experts']} | {c['h']} | {c['F']} | {counts} | {'fwd+bwd' if c['mode'] == 'fwdbwd' else 'fwd'} "
                     f"| {c['gflop']:.2f} | {fmt_ms(c['megatorch_grouped_ms'])} | {mloop} | {mratio} "
                     f"| {fmt_ms(c['torch_grouped_mm_ms'])} | {fmt_ms(c['torch_loop_ms'])} "
                     f"| {c['torch_loop_ms'] / c['torch_grouped_mm_ms']:.2f} |")
        if any(c["megatorch_loop_ms"] is None for c in kernel["cases"]):
            L.append(f"\n¹ not run: the loop's backward would hold about twice the [E, h, F] weight "
                     f"(2 E h F × 4 bytes > {kernel['loop_backward_limit_gib']} GiB).")
        L.append("")

    # the checks
    cks = res.get("checks", [])
    if cks:
        n = res.get("check_steps", 10)
        L += [f"Loss agreement of runs that train the same model (checked: max relative difference over the first "
              f"{n} steps ≤ {res['tolerance']:g}; the rounds must repeat every loss bit for bit):", "",
              f"| check | first {n} steps, max rel. | every step, max rel. | every step, max abs. "
              "| routing first differs at step | ok |",
              "|---|---|---|---|---|---|"]
        for c in cks:
            if "max_rel_loss_diff_all_steps" in c:
                step = c["routing_first_differs_at_step"]
                L.append(f"| {c['check'].rsplit(',', 1)[0]} | {c['max_rel_loss_diff']:.1e} "
                         f"| {c['max_rel_loss_diff_all_steps']:.1e} | {c['max_abs_loss_diff_all_steps']:.1e} "
                         f"| {step if step else 'never'} | {'yes' if c['ok'] else '**NO**'} |")
        for c in cks:
            if "max_rel_loss_diff_all_steps" not in c:
                detail = ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in c.items() if k not in ("check", "ok"))
                L.append(f"- {'ok' if c['ok'] else '**FAILED**'}: {c['check']} ({detail})")
        L.append("")
    loads = [f"{k} {r.get('other_load', 0):.0%}" for k, r in runs.items() if "other_load" in r]
    if loads:
        L.append("Other processes' largest share of the machine during a run: " + ", ".join(loads))
    cmds = [(k, r["command"]) for k, r in runs.items() if "command" in r]
    if cmds:
        L += ["", "Commands (round 1; each also with `--log-json FILE`):", ""]
        L += [f"    # {k}\n    {c}" for k, c in cmds]
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=None, help="default: runs/moe (runs/moe_quick with --quick)")
    ap.add_argument("--parts", type=lambda s: s.split(","), default=["dense", "dispatcher", "gemm", "kernel"])
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, 2 ranks at most, one round, one kernel shape: seconds, for a smoke test")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=40, help="training iterations per run")
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of the step-time median")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--ffn-hidden-size", type=int, default=512, help="the dense MLP's width")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-ffn-hidden-size", type=int, default=0, help="0: --ffn-hidden-size / --topk")
    ap.add_argument("--aux-loss-coeff", type=float, default=1e-2)
    ap.add_argument("--gemm-experts", type=lambda s: [int(x) for x in s.split(",") if x], default=[32],
                    help="more expert counts for the end-to-end GEMM comparison at 1 rank")
    ap.add_argument("--kernel-rows", type=int, default=4096)
    ap.add_argument("--kernel-iters", type=int, default=3, help="timed calls per path, at least")
    ap.add_argument("--kernel-budget-ms", type=float, default=400,
                    help="more timed calls (up to 50) while a path's calls take less than this in all")
    ap.add_argument("--loop-backward-limit-gib", type=float, default=8.0,
                    help="skip the per-expert loop's forward + backward when E x the weight's bytes exceed this")
    ap.add_argument("--tolerance", type=float, default=1e-5, help="relative loss agreement for the checks")
    ap.add_argument("--check-steps", type=int, default=10,
                    help="the checks compare this many first steps (later a near tie in the router may send a "
                         "token elsewhere in one layout; the report shows every step too)")
    ap.add_argument("--eval-iters", type=int, default=8, help="validation batches after the last step")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per run")
    ap.add_argument("--render", metavar="RESULTS_JSON", help="only print the report of an earlier run")
    args = ap.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    if args.quick:
        args.rounds, args.iters, args.warmup, args.eval_iters = 1, 4, 1, 1
        args.layers, args.hidden_size, args.heads, args.seq_length = 1, 64, 2, 64
        args.global_batch_size, args.micro_batch_size, args.ffn_hidden_size, args.experts = 8, 2, 128, 4
        args.gemm_experts = []
    args.out = args.out or str(ROOT / "runs" / ("moe_quick" if args.quick else "moe"))
    for p in args.parts:
        if p not in ("dense", "dispatcher", "gemm", "kernel"):
            ap.error(f"unknown part {p!r}")
    if not GPT_PRETRAIN.exists() or not LIBRARY.exists():
        ap.error("expected build/bin/gpt_pretrain and build/lib/libmegatorch.so: build first (scripts/build.sh)")
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
