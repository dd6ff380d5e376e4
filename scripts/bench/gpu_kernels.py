#!/usr/bin/env python3
"""GPU benchmark of megatorch's fused kernels (docs/kernels.md): for each memory-bound kernel at
large sizes, the achieved GB/s next to a device-to-device copy measured in the same run,
and the speedup over the eager PyTorch chain it replaces and over torch.compile of that
chain. Forward kernels; bf16 activations (AdamW: fp32 master weights and states, bf16
grads and model copy).

    MEGATORCH_LIBRARY=build-gpu/lib/libmegatorch.so PYTHONPATH=torch_ext \\
        python3 scripts/bench/gpu_kernels.py --out results/kernels.json

Timing: CUDA events around each call, median of --iters calls after warm-up, inputs far
larger than the L2 cache. GB/s counts the bytes the fused kernel must move at least
(inputs read once, outputs written once); the copy counts its read and its write.
Without a GPU it says so, writes {"gpu": false, ...} and exits 0 (scripts/gpu_check.sh
runs it either way). `--device cpu --small` runs the same harness on the CPU at toy sizes
to check the script itself (those numbers mean nothing).

Norms and bias-dropout-add against the alternatives (JSON "norms", the second table):
megatorch's LayerNorm / RMSNorm forward and backward next to torch's own
(F.layer_norm / F.rms_norm) and, when importable, Apex's FusedLayerNorm / FusedRMSNorm and
Liger's LigerLayerNorm / LigerRMSNorm, at GPT-1.3B (LayerNorm) and Llama-1B (RMSNorm)
shapes in bf16 and fp32 (--norm-dtypes; --norm-sweep adds hidden 1024..8192 and 65536
rows), and bias-dropout-add next to its eager chain. Each row gives, per implementation,
the time, the fraction of the bandwidth of a plain device copy of the same number of bytes
(timed in the same run) and the ratio to torch, plus the largest difference of megatorch's
outputs (and gradients) from torch's. These are timed with the calls queued behind a
sleep kernel (torch.cuda._sleep), so that host overhead (dispatcher, autograd) stays off
the clock: GPU time per call. Backward = torch.autograd.grad of the forward's output,
every implementation alike.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_cases import _describe, make_cases, make_norm_cases, max_abs_diff  # noqa: E402


def timer(device):
    """Median milliseconds of fn over `iters` calls, after `warmup` calls."""
    def run(fn, iters, warmup=3):
        for _ in range(warmup):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            return statistics.median(times)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return run


def queued_timer(device):
    """Median milliseconds per call of fn on the GPU, `reps` calls at a time queued behind a
    sleep kernel long enough to cover their host time: the host work of the calls
    (dispatcher, autograd, allocator) overlaps the sleep, and the events time the GPU's
    work alone, including the gaps between kernels. On the CPU: wall time per call."""
    if device != "cuda" or not hasattr(torch.cuda, "_sleep"):
        return timer(device), False
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 1_000_000 / max(start.elapsed_time(end), 1e-3)

    def run(fn, iters, warmup=3, reps=10):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host_ms = (time.perf_counter() - t0) * 1e3  # host time of `reps` calls (upper bound)
        torch.cuda.synchronize()
        sleep = int(min(2.0 * host_ms + 0.5, 200.0) * cycles_per_ms)
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(sleep)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / reps)
        return statistics.median(times)
    return run, True


def copy_same_bytes(device, nbytes, bench, iters):
    """A plain device copy moving `nbytes` in all (nbytes / 2 read, nbytes / 2 written)."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), iters)
    return ms, nbytes / ms / 1e6


def copy_bandwidth(device, nbytes, bench, iters):
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), iters)
    return 2 * src.numel() * 4 / ms / 1e6, ms  # read + write, GB/s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="JSON file, or a folder for kernels.json")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="toy sizes (checking the script, not the kernels)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--budget-s", type=float, default=200, help="skip torch.compile once this much time has passed")
    ap.add_argument("--only", nargs="*", help="case names")
    ap.add_argument("--no-norms", action="store_true", help="skip the norms / bias-dropout-add comparison")
    ap.add_argument("--norm-dtypes", default="bfloat16,float32",
                    help="comma-separated dtypes of the norms comparison (bfloat16, float16, float32)")
    ap.add_argument("--norm-sweep", action="store_true",
                    help="norms comparison also at hidden 1024, 4096, 5120, 8192 and at 65536 rows (bf16)")
    args = ap.parse_args()
    out = Path(args.out)
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "kernels.json"
    started = time.time()
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": args.device}

    if args.device == "cuda" and not torch.cuda.is_available():
        reason = (f"no CUDA device visible to torch {torch.__version__} (cuda build: {torch.version.cuda}); "
                  "GPU kernel benchmarks not run")
        print(f"[gpu_kernels] {reason}")
        out.write_text(json.dumps({**info, "gpu": False, "reason": reason}, indent=2) + "\n")
        return 0

    device = args.device
    dtype = torch.bfloat16
    if device == "cuda":
        torch.cuda.init()
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=True, name=props.name, sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2 ** 30, 1))
    else:
        info.update(gpu=False, note="CPU dry run of the harness (--device cpu): numbers are not GPU results")
    sizes = (dict(tokens=256, hidden=64, heads=2, sk=64, vocab_shard=512, adam_numel=1 << 14) if args.small else
             # GPT 1.3B's shapes (micro-batch 8 x sequence 2048 tokens, hidden 2048, 16 heads of 128,
             # vocabulary 50304 on one GPU); SwiGLU's [tokens, 2 x 8192] is Llama-1B's MLP.
             dict(tokens=16384, hidden=2048, heads=16, sk=2048, vocab_shard=50304, adam_numel=1 << 28))
    info["sizes"] = sizes
    bench = timer(device)
    copy_gbps, copy_ms = copy_bandwidth(device, 1 << 20 if args.small else 1 << 31, bench, args.iters)
    info["copy"] = {"GBps": round(copy_gbps, 1), "bytes": 2 * ((1 << 20 if args.small else 1 << 31) // 4) * 4,
                    "ms": round(copy_ms, 4)}
    print(f"[gpu_kernels] {info.get('name', device)}: device-to-device copy {copy_gbps:.0f} GB/s")

    rows = []
    for case in make_cases(device, dtype, only=args.only, **sizes):
        row = {"name": case.name, "shape": case.shape, "dtype": str(case.dtype).replace("torch.", ""),
               "bytes": case.bytes, "goal": case.goal}
        if case.compare:
            row["max_abs_diff_vs_eager"] = max_abs_diff(case.fused(), case.eager())
        row["fused_ms"] = bench(case.fused, args.iters)
        row["eager_ms"] = bench(case.eager, args.iters)
        if not args.no_compile and time.time() - started < args.budget_s:
            try:
                compiled = torch.compile(case.eager)
                compiled()
                row["compile_ms"] = bench(compiled, args.iters)
            except Exception as e:  # report, keep going: the other columns still stand
                row["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        else:
            row["compile_skipped"] = "--no-compile" if args.no_compile else f"time budget {args.budget_s} s passed"
        row["fused_GBps"] = case.bytes / row["fused_ms"] / 1e6
        row["pct_of_copy"] = 100 * row["fused_GBps"] / copy_gbps
        row["speedup_vs_eager"] = row["eager_ms"] / row["fused_ms"]
        if "compile_ms" in row:
            row["speedup_vs_compile"] = row["compile_ms"] / row["fused_ms"]
        rows.append(row)
        print(f"[gpu_kernels] {case.name:36s} {row['fused_ms']:8.3f} ms {row['fused_GBps']:7.0f} GB/s "
              f"({row['pct_of_copy']:4.0f}% of copy)  x{row['speedup_vs_eager']:.2f} eager"
              + (f"  x{row['speedup_vs_compile']:.2f} compile" if "speedup_vs_compile" in row else ""), flush=True)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()

    if not args.no_norms:
        info["norms"] = measure_norms(args, device, started)
    info["gemms"] = measure_gemms(device, sizes, bench, args.iters)
    info.update(kernels=rows, seconds=round(time.time() - started, 1))
    out.write_text(json.dumps(info, indent=2) + "\n")
    print(markdown(info))
    print(f"[gpu_kernels] wrote {out}")
    return 0


def quantise(x, dtype):
    """megatorch's current-scaling quantisation as ATen ops (fp8/scaling.cpp): amax, scale,
    saturating cast."""
    fmax = torch.finfo(dtype).max
    scale = fmax / x.abs().amax().float().clamp_min(1e-12)
    return (x.float() * scale).clamp_(-fmax, fmax).to(dtype), scale.reciprocal()


def measure_gemms(device, sizes, bench, iters):
    """The linear layers' GEMMs at GPT 1.3B's shapes: bf16 x·Wᵀ against at::_scaled_mm's
    E4M3 GEMM (fast accumulation, as megatorch's forward), TFLOP/s of each, and the
    quantisation of the activation (amax, scale, cast) that FP8 adds per GEMM."""
    t, h = sizes["tokens"], sizes["hidden"]
    rows = []
    for name, n, k in (("qkv", 3 * h, h), ("proj", h, h), ("fc1", 4 * h, h), ("fc2", h, 4 * h)):
        x = torch.randn(t, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        qx, sx = quantise(x, torch.float8_e4m3fn)
        qw, sw = quantise(w, torch.float8_e4m3fn)
        flops = 2.0 * t * n * k
        row = {"gemm": name, "m": t, "n": n, "k": k}
        row["bf16_ms"] = bench(lambda: x @ w.t(), iters)
        try:
            row["fp8_ms"] = bench(lambda: torch._scaled_mm(qx, qw.t(), sx, sw, out_dtype=torch.bfloat16,
                                                           use_fast_accum=device == "cuda"), iters)
            row["quantise_ms"] = bench(lambda: quantise(x, torch.float8_e4m3fn), iters)
        except RuntimeError as e:  # a device without FP8 GEMMs: the bf16 column still stands
            row["fp8_error"] = str(e).splitlines()[0][:200]
        row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
        if "fp8_ms" in row:
            row["fp8_tflops"] = flops / row["fp8_ms"] / 1e9
            row["fp8_speedup"] = row["bf16_ms"] / row["fp8_ms"]
            row["fp8_speedup_with_quantise"] = row["bf16_ms"] / (row["fp8_ms"] + row["quantise_ms"])
        rows.append(row)
        print(f"[gpu_kernels] GEMM {name:5s} {t}x{n}x{k}: bf16 {row['bf16_tflops']:.0f} TFLOP/s"
              + (f", fp8 {row['fp8_tflops']:.0f} TFLOP/s (x{row['fp8_speedup']:.2f}; with the input's "
                 f"quantisation x{row['fp8_speedup_with_quantise']:.2f})" if "fp8_ms" in row else
                 f", fp8: {row['fp8_error']}"), flush=True)
        del x, w, qx, qw
    return rows


IMPLS = ("megatorch", "torch", "apex", "liger")


def measure_norms(args, device, started):
    """The norms / bias-dropout-add comparison (module docstring): one row per case, with
    each implementation's time, % of a same-bytes copy and ratio to torch."""
    bench, queued = queued_timer(device)
    dtypes = [getattr(torch, d.strip()) for d in args.norm_dtypes.split(",") if d.strip()]
    out = []
    for case in make_norm_cases(device, dtypes, small=args.small, sweep=args.norm_sweep, only=args.only):
        if case.optional and time.time() - started > args.budget_s:
            out.append({"name": case.name, "shape": case.shape, "skipped": f"time budget {args.budget_s} s passed"})
            continue
        row = {"name": case.name, "model": case.model, "shape": case.shape,
               "dtype": str(case.dtype).replace("torch.", ""), "bytes": case.bytes, "queued_timing": queued}
        copy_ms, copy_gbps = copy_same_bytes(device, case.bytes, bench, args.iters)
        row["copy_ms"], row["copy_GBps"] = copy_ms, copy_gbps
        try:
            row["max_rel_diff_vs_torch"] = case.check()
        except Exception as e:  # noqa: BLE001 - reported, the timings still stand
            row["check_error"] = _describe(e)
        impls = {}
        for name in IMPLS:
            fn = case.impls.get(name)
            if fn is None:
                impls[name] = {"error": case.missing.get(name, "not applicable")}
                continue
            try:
                ms = bench(fn, args.iters)
            except Exception as e:  # noqa: BLE001
                impls[name] = {"error": _describe(e)}
                continue
            gbps = case.bytes / ms / 1e6
            impls[name] = {"ms": ms, "GBps": gbps, "pct_of_copy": 100 * gbps / copy_gbps}
        torch_ms = impls.get("torch", {}).get("ms")
        for v in impls.values():
            if "ms" in v and torch_ms:
                v["x_torch"] = torch_ms / v["ms"]  # > 1: faster than torch
        row["impls"] = impls
        out.append(row)
        mt = impls["megatorch"]
        print(f"[gpu_kernels] {case.name:24s} {case.model:9s} {case.shape:16s} {row['dtype']:8s} "
              + (f"megatorch {mt['ms']:.4f} ms {mt['pct_of_copy']:4.0f}% of copy x{mt.get('x_torch', 0):.2f} torch"
                 if "ms" in mt else f"megatorch: {mt['error']}")
              + "".join(f"  {n} {impls[n]['pct_of_copy']:.0f}%" for n in ("torch", "apex", "liger")
                        if "ms" in impls[n]), flush=True)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def markdown(info) -> str:
    lines = [f"{info.get('name', info['device'])}, torch {info['torch']}; device-to-device copy "
             f"{info['copy']['GBps']:.0f} GB/s (read + write)", "",
             "| kernel | shape | fused ms | GB/s | % of copy | × eager | × torch.compile | goal |",
             "|---|---|---|---|---|---|---|---|"]
    for r in info["kernels"]:
        comp = f"{r['speedup_vs_compile']:.2f}" if "speedup_vs_compile" in r else "–"
        lines.append(f"| {r['name']} | {r['shape']} | {r['fused_ms']:.3f} | {r['fused_GBps']:.0f} | "
                     f"{r['pct_of_copy']:.0f}% | {r['speedup_vs_eager']:.2f} | {comp} | {r['goal']} |")
    if info.get("norms"):
        lines += ["", "Norms and bias-dropout-add: % of a device copy of the same bytes (× torch); "
                  "GPU time per call, calls queued", "",
                  "| kernel | model | shape | dtype | copy GB/s | megatorch | torch | apex | liger | max rel. diff vs torch |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in info["norms"]:
            if "impls" not in r:
                lines.append(f"| {r['name']} | | {r['shape']} | | | {r.get('skipped', '')} | | | | |")
                continue
            cells = []
            for n in IMPLS:
                v = r["impls"][n]
                cells.append(f"{v['pct_of_copy']:.0f}% (×{v['x_torch']:.2f})" if "x_torch" in v else
                             f"{v['pct_of_copy']:.0f}%" if "ms" in v else "–")
            diff = r.get("max_rel_diff_vs_torch", r.get("check_error", ""))
            diff = f"{diff:.2e}" if isinstance(diff, float) else str(diff)
            lines.append(f"| {r['name']} | {r['model']} | {r['shape']} | {r['dtype']} | {r['copy_GBps']:.0f} | "
                         + " | ".join(cells) + f" | {diff} |")
    if info.get("gemms"):
        lines += ["", "| GEMM (m x n x k) | bf16 TFLOP/s | FP8 _scaled_mm TFLOP/s | FP8 / bf16 | with the input's "
                  "quantisation |", "|---|---|---|---|---|"]
        for g in info["gemms"]:
            shape = f"{g['gemm']} ({g['m']} x {g['n']} x {g['k']})"
            lines.append(f"| {shape} | {g['bf16_tflops']:.0f} | " +
                         (f"{g['fp8_tflops']:.0f} | {g['fp8_speedup']:.2f}x | {g['fp8_speedup_with_quantise']:.2f}x |"
                          if "fp8_tflops" in g else f"{g['fp8_error']} | | |"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
