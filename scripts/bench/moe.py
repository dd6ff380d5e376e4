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

sys.path.insert(0, str(HERE))
from bench_util import cpu_name, quartiles  # noqa: E402
from moe_kernels import kernel_bench  # noqa: E402
from moe_report import max_abs_diff, render  # noqa: E402

MiB = 1 << 20
BUSY = 0.10  # a run during which other processes used more than this share of the machine is repeated once
GPT_PRETRAIN = ROOT / "build" / "bin" / "gpt_pretrain"
LIBRARY = ROOT / "build" / "lib" / "libmegatorch.so"


def log(msg):
    print(f"[moe] {msg}", file=sys.stderr, flush=True)


def display(cmd) -> str:
    return shlex.join(str(c) for c in cmd).replace(str(ROOT) + "/", "")


def last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|error:|what\(\)|megatorch:|Exception)", ln) and "ChildFailedError" not in ln:
            return ln[:400]
    return lines[-1][:400] if lines else "no output"


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
            self.results["kernel"] = kernel_bench(self.args, self.out, log)
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
