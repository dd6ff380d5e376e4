#!/usr/bin/env python3
"""gpt_pretrain on a GPU, checked and measured from the trainer's own JSON log
(scripts/gpu_check.sh step `pretrain`):

1. parity: one GPU, fp32, a tiny GPT: the first 10 losses equal a CPU run of the same
   configuration within 1e-4 (relative); fp8_parity: the same with --fp8-format hybrid
   (cuBLASLt's FP8 GEMMs against the CPU's _scaled_mm) within 1e-3.
2. shared_gpu: TP2 x PP2 as 4 processes on the one GPU (NCCL refuses two ranks on one
   device, so --device cuda:0 --distributed-backend gloo: Gloo with CUDA tensors), its
   losses equal the same layout's CPU run within 1e-4; shared_gpu_zb_h1, shared_gpu_zb_v and
   shared_gpu_dualpipev: the same under --schedule zb-h1, zb-v and dualpipev (the split
   backward and the V's in-place turn on CUDA; the V schedules run on Gloo only) against
   the CPU's 1F1B.
3. host_sync: the tiny GPT on one GPU, fp32 and bf16, with --sync-debug-iters 4-6: the
   steady-state step makes no device-to-host synchronisation (CUDA's sync debug mode
   "error" around steps 4-6; a synchronisation fails the run and its message is kept).
4. gpt_1p3b: one GPU, bf16, GPT ~1.3B (h 2048, 24 layers, 16 heads, seq 2048, vocabulary
   50304), the micro-batch halved from --micro-batch until it fits: steady-state
   tokens/s, TFLOP/s and MFU against the 989 TFLOP/s bf16 datasheet figure. llama_1b: the
   same for gpu_gpt.py's llama-1B (Llama 3.2 1B's layers, GQA 4:1, untied, vocabulary
   32000), so the goal has gpt_pretrain's row for both models.
   gpt_1p3b_fp8_delayed, gpt_1p3b_fp8_tensorwise, llama_1b_fp8_delayed: the same with FP8
   GEMMs (docs/fp8.md; tokens/s over bf16's, goal >= 1.3x at 1.3B), and fp8_losses: GPT
   1.3B's first 50 losses in bf16 and in FP8 on the bundled data (goal: the last 10 within 1%).
5. cuda_graph_350m: GPT ~350M (h 1024, 24 layers) bf16 at micro-batch 1, without and with
   --cuda-graph (no dropout in either): host and wall milliseconds per step and the
   speed-up, i.e. whether the step is launch-bound there and what graph replay gains.
   Skipped with the reason when the budget is spent.

    python3 scripts/bench/gpu_pretrain.py --bin build-gpu/bin --out OUT/pretrain.json \\
        [--gpt-json OUT/gpt.json] [--budget-s 200]

With --gpt-json (scripts/bench/gpu_gpt.py's output of the same run) the markdown table
puts the PyTorch eager and torch.compile rows of the same model next to gpt_pretrain's.
Without a GPU it says so: the parity check runs CPU against CPU (it exercises the harness,
not a GPU), the others are skipped with that reason. Exit status 1 if a check failed.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "default" / "stdlib_docs_text_document"
DATASHEET_TFLOPS = 989.0  # H100 / H200 SXM, dense bf16
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--vocab-size", "257", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
        "--lr-warmup-iters", "2", "--train-iters", "10", "--eval-iters", "0", "--seed", "11"]
# The shared-GPU checks: result key -> schedule.
SHARED = {"shared_gpu": "1f1b", "shared_gpu_zb_h1": "zb-h1", "shared_gpu_zb_v": "zb-v",
          "shared_gpu_dualpipev": "dualpipev"}
GPT_350M = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
            "--vocab-size", "50304", "--bf16", "--lr", "1e-4", "--lr-warmup-iters", "2", "--eval-iters", "0",
            "--clip-grad", "1.0", "--seed", "1234"]
# gpu_gpt.py's llama-1B: Llama 3.2 1B's layers (GQA 4:1, SwiGLU 8192, RMSNorm, RoPE, no
# biases), an untied output layer and Llama 2's 32000-token vocabulary.
LLAMA_1B = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32", "--group-query-attention",
            "--num-query-groups", "8", "--ffn-hidden-size", "8192", "--swiglu", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--seq-length", "2048", "--vocab-size", "32000", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--bf16", "--lr", "1e-4", "--lr-warmup-iters", "2", "--eval-iters", "0", "--clip-grad", "1.0",
            "--seed", "1234"]
GPT_1P3B = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
            "--vocab-size", "50304", "--bf16", "--lr", "1e-4", "--lr-warmup-iters", "2", "--eval-iters", "0",
            "--clip-grad", "1.0", "--seed", "1234"]


# FP8 recipes measured next to bf16 (docs/fp8.md): TE's usual delayed setting, and current scaling.
FP8 = {"fp8_delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "1024",
                       "--fp8-amax-compute-algo", "max"],
       "fp8_tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]}
# Result key -> (the table's name for it, the flags).
# In the order they are measured (what the time budget no longer fits is skipped).
MODELS = {"gpt_1p3b": ("GPT 1.3B", GPT_1P3B),
          "gpt_1p3b_fp8_delayed": ("GPT 1.3B fp8 delayed", GPT_1P3B + FP8["fp8_delayed"]),
          "llama_1b": ("Llama 1B", LLAMA_1B),
          "gpt_1p3b_fp8_tensorwise": ("GPT 1.3B fp8 tensorwise", GPT_1P3B + FP8["fp8_tensorwise"]),
          "llama_1b_fp8_delayed": ("Llama 1B fp8 delayed", LLAMA_1B + FP8["fp8_delayed"])}
FP8_DATASHEET_TFLOPS = 1979.0  # H100 / H200 SXM, dense FP8
MEASURED = {k: name for k, (name, _) in MODELS.items()}
FP8_LOSS_ITERS = 50


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pretrain(binary, nproc, args, timeout):
    """Runs gpt_pretrain under torchrun; returns (iteration -> record, returncode, output tail)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", "--no-python", str(binary), *args, "--data-path", str(DATA),
               "--log-json", str(log)]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
            code, text = out.returncode, out.stdout + out.stderr
        except subprocess.TimeoutExpired as e:
            code, text = -1, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
        records = {}
        if log.exists():
            for line in log.read_text().splitlines():
                r = json.loads(line)
                if "loss" in r:
                    records[r["iteration"]] = r
        return records, code, text[-4000:]


def compare(device_run, cpu_run, rtol):
    """Per-iteration relative differences of two loss curves, and whether all are within rtol."""
    rows = []
    for it in sorted(cpu_run):
        a, b = device_run.get(it, {}).get("loss"), cpu_run[it]["loss"]
        rel = abs(a - b) / abs(b) if a is not None else None
        rows.append({"iteration": it, "device_loss": a, "cpu_loss": b, "rel_diff": rel})
    ok = bool(rows) and all(r["rel_diff"] is not None and r["rel_diff"] <= rtol for r in rows)
    return rows, ok


def check_parity(binary, gpu, timeout, extra=(), rtol=1e-4, what="fp32"):
    device = ["--device", "cuda"] if gpu else ["--device", "cpu"]
    dev, code_d, tail_d = run_pretrain(binary, 1, [*TINY, *extra, *device], timeout)
    cpu, code_c, tail_c = run_pretrain(binary, 1, [*TINY, *extra, "--device", "cpu"], timeout)
    rows, ok = compare(dev, cpu, rtol)
    return {"what": f"1 GPU vs CPU, {what}, first 10 losses" if gpu else "no GPU: CPU vs CPU (harness check only)",
            "ok": ok and code_d == 0 and code_c == 0, "rtol": rtol, "losses": rows,
            "max_rel_diff": max((r["rel_diff"] or 0) for r in rows) if rows else None,
            "log_tail": "" if code_d == code_c == 0 else tail_d + tail_c}


def check_shared_gpu(binary, timeout, schedule="1f1b"):
    """TP2 x PP2 on the GPU under `schedule` against the CPU's 1F1B run of the same layout
    (zb-h1's split backward must give 1F1B's losses)."""
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    dev, code_d, tail_d = run_pretrain(binary, 4, [*TINY, *layout, "--schedule", schedule, "--device", "cuda:0",
                                                   "--distributed-backend", "gloo"], timeout)
    cpu, code_c, tail_c = run_pretrain(binary, 4, [*TINY, *layout, "--device", "cpu"], timeout)
    rows, ok = compare(dev, cpu, 1e-4)
    return {"what": f"TP2 x PP2 {schedule}, 4 processes on one GPU (Gloo, CUDA tensors) vs the same layout's "
                    "1f1b on CPU",
            "ok": ok and code_d == 0 and code_c == 0, "rtol": 1e-4, "losses": rows,
            "max_rel_diff": max((r["rel_diff"] or 0) for r in rows) if rows else None,
            "log_tail": "" if code_d == code_c == 0 else tail_d + tail_c}


def measure_model(binary, model, micro_batch, iters, deadline):
    """bf16 `model` (flags) on one GPU: halves the micro-batch on out-of-memory; steady state =
    the iterations after the first three (allocator warm-up, first-touch)."""
    mbs, tried = micro_batch, []
    while mbs >= 1:
        left = deadline - time.monotonic()
        if left < 60:
            return {"ok": False, "tried": tried, "error": "out of time budget before a run fitted"}
        args = [*model, "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs),
                "--train-iters", str(iters), "--device", "cuda"]
        recs, code, tail = run_pretrain(binary, 1, args, timeout=int(left))
        tried.append({"micro_batch": mbs, "exit": code})
        if code == 0 and len(recs) == iters:
            steady = [recs[i] for i in sorted(recs) if i > 3]
            mean = lambda k: sum(r[k] for r in steady) / len(steady)  # noqa: E731
            tflops = mean("tflops_per_rank")
            mem = recs[max(recs)].get("memory_bytes", {})
            return {"ok": True, "micro_batch": mbs, "iterations": iters, "tokens_per_s": mean("tokens_per_s"),
                    "tflops": tflops, "mfu_datasheet": tflops / DATASHEET_TFLOPS,
                    "ms_per_iteration": mean("ms_per_iteration"), "loss_first": recs[1]["loss"],
                    "loss_last": recs[max(recs)]["loss"],
                    "max_allocated_gib": mem.get("cuda_max_allocated_bytes", 0) / 2 ** 30, "tried": tried}
        if "out of memory" not in tail.lower():
            return {"ok": False, "tried": tried, "error": tail}
        mbs //= 2
    return {"ok": False, "tried": tried, "error": "out of memory at micro-batch 1"}


def compare_fp8_losses(binary, micro_batch, deadline):
    """GPT 1.3B on the bundled data, bf16 and hybrid/delayed FP8, FP8_LOSS_ITERS iterations
    each at the same micro-batch: both loss curves and the relative difference of the last
    10 iterations' means (goal: within 1%)."""
    curves = {}
    for name, extra in (("bf16", []), ("fp8_delayed", FP8["fp8_delayed"])):
        left = deadline - time.monotonic()
        if left < 60:
            return {"skipped": f"time budget: {int(left)} s left", "ok": True, "losses": curves}
        args = [*GPT_1P3B, *extra, "--micro-batch-size", str(micro_batch), "--global-batch-size", str(micro_batch),
                "--train-iters", str(FP8_LOSS_ITERS), "--device", "cuda"]
        recs, code, tail = run_pretrain(binary, 1, args, timeout=int(left))
        if code != 0 or len(recs) != FP8_LOSS_ITERS:
            return {"ok": False, "error": tail, "losses": curves}
        curves[name] = [recs[i]["loss"] for i in sorted(recs)]
    mean = lambda xs: sum(xs[-10:]) / 10  # noqa: E731
    diff = abs(mean(curves["fp8_delayed"]) - mean(curves["bf16"])) / mean(curves["bf16"])
    return {"ok": True, "what": f"GPT 1.3B, {FP8_LOSS_ITERS} iterations, micro-batch {micro_batch}",
            "losses": curves, "last10_rel_diff": diff, "goal_met": diff <= 0.01}


def check_host_sync(binary, timeout):
    """The steady-state step issues its work without waiting for the device."""
    out = {"what": "tiny GPT on one GPU, --sync-debug-iters 4-6 (CUDA sync debug mode 'error')", "runs": {}}
    for dtype in ("fp32", "bf16"):
        args = [*TINY, "--device", "cuda", "--sync-debug-iters", "4-6", "--hidden-dropout", "0",
                "--attention-dropout", "0", *(["--bf16"] if dtype == "bf16" else [])]
        recs, code, tail = run_pretrain(binary, 1, args, timeout)
        sync_line = next((line for line in tail.splitlines() if "synchroniz" in line.lower()), "")
        out["runs"][dtype] = {"ok": code == 0 and len(recs) == 10, "exit": code, "synchronisation": sync_line,
                              "log_tail": "" if code == 0 else tail[-1500:]}
    out["ok"] = all(r["ok"] for r in out["runs"].values())
    return out


def measure_cuda_graph(binary, deadline, iters=10):
    """350M bf16 at micro-batch 1, eager layers against captured ones: host vs wall time."""
    rows = {}
    for name, flags in (("eager", []), ("cuda_graph", ["--cuda-graph"])):
        left = deadline - time.monotonic()
        if left < 45:
            rows[name] = {"ok": False, "error": "skipped: out of time budget"}
            continue
        args = [*GPT_350M, "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(iters),
                "--device", "cuda", "--hidden-dropout", "0", "--attention-dropout", "0", *flags]
        recs, code, tail = run_pretrain(binary, 1, args, timeout=int(left))
        if code != 0 or len(recs) != iters:
            rows[name] = {"ok": False, "exit": code, "error": tail[-1500:]}
            continue
        steady = [recs[i] for i in sorted(recs) if i > 3]
        mean = lambda k: sum(r[k] for r in steady) / len(steady)  # noqa: E731
        rows[name] = {"ok": True, "ms_per_iteration": mean("ms_per_iteration"),
                      "host_ms_per_iteration": mean("host_ms_per_iteration"), "tokens_per_s": mean("tokens_per_s"),
                      "loss_first": recs[1]["loss"], "captured": "cuda graph: not captured" not in tail}
    out = {"what": "GPT 350M bf16, micro-batch 1, one GPU: eager layers vs --cuda-graph", "rows": rows,
           "ok": all(r["ok"] for r in rows.values())}
    if out["ok"]:
        e, g = rows["eager"], rows["cuda_graph"]
        out["host_share_eager"] = e["host_ms_per_iteration"] / e["ms_per_iteration"]
        out["speedup"] = e["ms_per_iteration"] / g["ms_per_iteration"]
        out["same_first_loss"] = abs(e["loss_first"] - g["loss_first"]) <= 1e-3 * abs(e["loss_first"])
        out["ok"] = out["same_first_loss"] and g["captured"]
    return out


def fp8_lines(result):
    """The FP8 goals: each recipe's tokens/s over bf16's (goal >= 1.3 at 1.3B), and the loss check."""
    out = []
    base = result.get("gpt_1p3b", {})
    for key in FP8:
        r = result.get(f"gpt_1p3b_{key}", {})
        if base.get("ok") and r.get("ok") and "tokens_per_s" in r:
            ratio = r["tokens_per_s"] / base["tokens_per_s"]
            out.append(f"| GPT 1.3B {key.replace('_', ' ')} / bf16 tokens/s | {ratio:.2f}x | goal >= 1.3x: "
                       f"{'met' if ratio >= 1.3 else 'not met'}; MFU against the FP8 datasheet "
                       f"({FP8_DATASHEET_TFLOPS:.0f} TFLOP/s): {100 * r['tflops'] / FP8_DATASHEET_TFLOPS:.1f}% |")
    c = result.get("fp8_losses", {"skipped": "not run"})
    if c.get("skipped"):
        out.append(f"| FP8 losses vs bf16 | skipped: {c['skipped']} | |")
    elif c.get("ok"):
        out.append(f"| FP8 losses vs bf16 | {100 * c['last10_rel_diff']:.2f}% | {c['what']}, mean of the last 10; "
                   f"goal <= 1%: {'met' if c['goal_met'] else 'not met'} |")
    else:
        out.append(f"| FP8 losses vs bf16 | failed: {str(c.get('error', ''))[-120:]!r} | |")
    return ["", "| FP8 | value | detail |", "|---|---|---|", *out] if out else []


def markdown(result, gpt_rows):
    lines = ["| check | result | detail |", "|---|---|---|"]
    for key in ("parity", "fp8_parity", *SHARED):
        c = result.get(key, {"skipped": "not run"})  # a JSON from before the check existed
        if c.get("skipped"):
            lines.append(f"| {key} | skipped | {c['skipped']} |")
        else:
            d = c["max_rel_diff"]
            lines.append(f"| {key} | {'pass' if c['ok'] else 'FAIL'} | {c['what']}; max relative loss difference "
                         f"{d:.2e} (tolerance {c['rtol']}) |" if d is not None else f"| {key} | FAIL | no losses |")
    lines += ["", "| one GPU, bf16 params | micro-batch | tokens/s | TFLOP/s | MFU (989 TFLOP/s) |",
              "|---|---|---|---|---|"]
    for key, name in MEASURED.items():
        g = result.get(key, {"skipped": "not run"})
        if g.get("skipped"):
            lines.append(f"| {name}: gpt_pretrain | skipped: {g['skipped']} | | | |")
        elif g["ok"]:
            lines.append(f"| {name}: gpt_pretrain (trainer's log) | {g['micro_batch']} | {g['tokens_per_s']:.0f} | "
                         f"{g['tflops']:.1f} | {100 * g['mfu_datasheet']:.1f}% |")
        else:
            lines.append(f"| {name}: gpt_pretrain | failed: {str(g.get('error', ''))[-200:]!r} | | | |")
    h = result.get("host_sync", {"skipped": "not run"})
    if h.get("skipped"):
        lines.insert(2 + len(SHARED) + 2, f"| host_sync | skipped | {h['skipped']} |")
    else:
        detail = "; ".join(f"{k}: {'no synchronisation' if r['ok'] else (r['synchronisation'] or 'failed')}"
                           for k, r in h["runs"].items())
        lines.insert(2 + len(SHARED) + 2, f"| host_sync | {'pass' if h['ok'] else 'FAIL'} | {h['what']}: {detail} |")
    names = {"megatorch": "megatorch model in Python (gpu_gpt.py)", "eager": "PyTorch eager (gpu_gpt.py)",
             "compile": "torch.compile (gpu_gpt.py)"}
    for r in gpt_rows:
        if r.get("size") != "1.3B" or r.get("impl") not in names:
            continue
        if r.get("status") == "ok":
            lines.append(f"| GPT 1.3B: {names[r['impl']]} | {r.get('micro_batch', '')} | {r['tokens_per_s']:.0f} | "
                         f"{r['tflops']:.1f} | {100 * (r.get('mfu_vs_datasheet') or 0):.1f}% |")
        else:
            lines.append(f"| GPT 1.3B: {names[r['impl']]} | {r.get('status', 'not run')}: {str(r.get('error', ''))[:80]} | | | |")
    lines += fp8_lines(result)
    c = result.get("cuda_graph_350m", {"skipped": "not run"})
    lines += ["", "| GPT 350M, bf16, micro-batch 1 | ms/step | host ms/step | tokens/s |", "|---|---|---|---|"]
    if c.get("skipped"):
        lines.append(f"| skipped: {c['skipped']} | | | |")
    else:
        for name, r in c["rows"].items():
            lines.append(f"| gpt_pretrain{' --cuda-graph' if name == 'cuda_graph' else ''} | "
                         + (f"{r['ms_per_iteration']:.1f} | {r['host_ms_per_iteration']:.1f} | {r['tokens_per_s']:.0f} |"
                            if r["ok"] else f"failed: {str(r.get('error', ''))[-120:]!r} | | |"))
        if "speedup" in c:
            lines.append(f"\nEager host time is {100 * c['host_share_eager']:.0f}% of the step; CUDA graphs: "
                         f"{c['speedup']:.2f}x the eager step's speed, same first loss: {c['same_first_loss']}.")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "build" / "bin"), help="folder holding gpt_pretrain")
    ap.add_argument("--out", required=True, help="JSON path; the markdown table goes next to it (.md)")
    ap.add_argument("--gpt-json", help="scripts/bench/gpu_gpt.py's JSON of the same run, for its 1.3B rows")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--micro-batch", type=int, default=8, help="first micro-batch tried for the 1.3B run")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the markdown from an existing --out JSON (and --gpt-json)")
    a = ap.parse_args()
    out = Path(a.out)
    gpt_rows = []
    if a.gpt_json and Path(a.gpt_json).exists():
        gpt_rows = json.loads(Path(a.gpt_json).read_text()).get("rows", [])
    if a.render:
        table = markdown(json.loads(out.read_text()), gpt_rows)
        out.with_suffix(".md").write_text(table)
        print(table)
        return 0
    deadline = time.monotonic() + a.budget_s
    binary = Path(a.bin) / "gpt_pretrain"
    gpu = torch.cuda.is_available()
    if not gpu:
        print("no GPU: torch sees no CUDA device; the parity check runs CPU against CPU (a harness check, not a GPU "
              "result) and the shared-GPU and 1.3B checks are skipped", flush=True)
    result = {"gpu": gpu, "datasheet_tflops": DATASHEET_TFLOPS}
    result["parity"] = check_parity(binary, gpu, timeout=300)
    print("parity:", json.dumps({k: v for k, v in result["parity"].items() if k != "losses"}), flush=True)
    if gpu:
        # In priority order, each with the seconds it needs at least: what no longer fits in
        # --budget-s is skipped with the reason (the schedules' checks, which passed on the
        # H200 and change least, last).
        # FP8 GEMMs: cuBLASLt's _scaled_mm (fast accumulation in forward) against the CPU's.
        plan = [("fp8_parity", 30, lambda left: check_parity(binary, gpu, left, FP8["fp8_delayed"], 1e-3,
                                                               "fp32 params, --fp8-format hybrid (delayed)")),
                ("host_sync", 30, lambda left: check_host_sync(binary, timeout=left))]
        plan += [(key, 60, lambda left, flags=flags: measure_model(binary, flags, a.micro_batch, a.iters, deadline))
                 for key, (_, flags) in MODELS.items()]
        plan += [("fp8_losses", 120, lambda left: compare_fp8_losses(
                     binary, result.get("gpt_1p3b_fp8_delayed", {}).get("micro_batch") or 1, deadline)),
                 ("cuda_graph_350m", 90, lambda left: measure_cuda_graph(binary, deadline))]
        plan += [(key, 30, lambda left, schedule=schedule: check_shared_gpu(binary, timeout=left, schedule=schedule))
                 for key, schedule in SHARED.items()]
        for key, needs, run in plan:
            left = int(deadline - time.monotonic())
            if left < needs:
                result[key] = {"skipped": f"time budget: {left} s left of --budget-s, needs about {needs} s",
                               "ok": True}
            else:
                result[key] = run(left)
            print(f"{key}:", json.dumps({k: v for k, v in result[key].items() if k != "losses"})[:2000], flush=True)
    else:
        for key in (*SHARED, "fp8_parity", "host_sync", *MEASURED, "fp8_losses", "cuda_graph_350m"):
            result[key] = {"skipped": "no GPU", "ok": True}
    result["ok"] = all(result[k]["ok"] for k in ("parity", *SHARED, "fp8_parity", "host_sync", *MEASURED,
                                                 "fp8_losses", "cuda_graph_350m"))
    out.write_text(json.dumps(result, indent=2))
    table = markdown(result, gpt_rows)
    out.with_suffix(".md").write_text(table)
    print(table)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
