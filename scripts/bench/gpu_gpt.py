#!/usr/bin/env python3
"""GPU benchmark of GPT training steps (docs/benchmarks_gpu.md): megatorch's C++ GPTModel (bf16, fused
kernels, flash attention through at::scaled_dot_product_attention, its DistributedOptimizer)
next to the same model in plain PyTorch eager (SDPA), the same under torch.compile, and
Megatron-Core's GPTModel with its local (non-Transformer-Engine) layers — a ~1.3B and a
~350M model at sequence 2048 on one GPU.

    MEGATORCH_LIBRARY=build-gpu/lib/libmegatorch.so PYTHONPATH=torch_ext \\
        python3 scripts/bench/gpu_gpt.py --out results/gpt.json [--budget-s 240]

Per row: tokens/s, model TFLOP/s by PaLM's count (6N + 12·L·h·s per token, N every
parameter once, attention counted in full: csrc/train/trainer.cpp's count), MFU against
the bf16 matmul rate measured in the same run (the best of a few large matmuls) and
against the datasheet (--datasheet-tflops, 989 for H100/H200 SXM dense bf16), peak
memory. A training step is forward, backward and AdamW (fp32 master weights and states,
bf16 parameters, gradients and activations, for every implementation); no gradient
accumulation, no recomputation, no dropout. Timing: wall clock over --iters steps after
--warmup steps, synchronised at both ends. The micro-batch is sized to fill the GPU (an
activation estimate), the same for every implementation of a size, halved on
out-of-memory (each row says what it ran).

The rows run in worker processes (megatorch and eager; torch.compile; Megatron-Core), so
a crash or a CUDA error loses one row, not the run; --budget-s bounds the whole, rows run
in priority order (1.3B first within each worker) and the ones that no longer fit say so.

Without a GPU it says so, and runs the same harness on the CPU at toy sizes (fp32) to
check the script itself: "no GPU: ran the CPU fallback at toy sizes; numbers are not GPU
numbers". --no-fallback writes {"gpu": false, ...} instead.
"""
import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpt_builders import build_mcore, build_megatorch, build_reference  # noqa: E402
from gpt_reference import GPTShape, same_loss_as  # noqa: E402

DATASHEET_TFLOPS = 989.0  # H100 / H200 SXM, dense bf16
VOCAB = 50304             # GPT-2's 50257 rounded up to a multiple of 128: no padding in any implementation
GPU_SIZES = {             # GPT-3's shapes (Brown et al. 2020, table 2.1)
    "1.3B": dict(hidden_size=2048, num_attention_heads=16, num_layers=24, seq_length=2048, vocab_size=VOCAB),
    "350M": dict(hidden_size=1024, num_attention_heads=16, num_layers=24, seq_length=2048, vocab_size=VOCAB),
}
CPU_SIZES = {             # the CPU fallback: the same code paths at toy sizes
    "toy-b": dict(hidden_size=128, num_attention_heads=4, num_layers=2, seq_length=128, vocab_size=512),
    "toy-a": dict(hidden_size=64, num_attention_heads=4, num_layers=2, seq_length=64, vocab_size=512),
}
IMPLS = ("megatorch", "eager", "compile", "mcore")
# Seconds a row needs beyond its steps (model build, compilation): rows that no longer fit
# in the budget are skipped, not started.
SETUP_S = {"megatorch": 30, "eager": 15, "compile": 75, "mcore": 40}
NO_GPU_MESSAGE = "no GPU: ran the CPU fallback at toy sizes; numbers are not GPU numbers"


def sig(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits (CPU fallback rates are tiny; GPU ones are not)."""
    return float(f"{x:.{digits}g}")


def log(msg):
    print(f"[gpu_gpt] {msg}", flush=True)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def free_memory(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- measurements in the parent

def matmul_rate(device, dtype, small: bool) -> dict:
    """The best TFLOP/s of a few large matmuls (the rate the GPU actually reaches), median of
    each shape's timed calls."""
    shapes = [(512, 512, 512)] if small else [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 16384, 16384)]
    best, per_shape = 0.0, {}
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        for _ in range(5):
            torch.matmul(a, b)
        sync(device)
        times = []
        for _ in range(5 if small else 20):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.matmul(a, b)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                torch.matmul(a, b)
                times.append(time.perf_counter() - t0)
        times.sort()
        tflops = 2 * m * n * k / times[len(times) // 2] / 1e12
        per_shape[f"{m}x{k} @ {k}x{n}"] = sig(tflops)
        best = max(best, tflops)
        del a, b
    free_memory(device)
    return {"tflops": sig(best), "dtype": str(dtype).replace("torch.", ""), "shapes": per_shape}


def auto_micro_batch(shape: GPTShape, free_bytes: int, cap: int) -> int:
    """The largest power of two whose activations fit next to the model states: per layer
    ~34·s·h bytes per sample in 16-bit without the s² scores (flash attention; Korthikanti
    et al.), with a 1.3x margin for the unfused peers, plus the logits and their fp32 loss
    (~12·s·V); states 20 bytes per parameter (the peers' bf16 parameter + grad, fp32 master,
    grad copy and two moments; megatorch needs 18)."""
    s, h, L, V = shape.seq_length, shape.hidden_size, shape.num_layers, shape.vocab_size
    per_sample = 1.3 * 34 * s * h * L + 12 * s * V
    free = 0.85 * free_bytes - 20 * shape.num_parameters() - 2 * 2 ** 30
    b = max(1, int(free // per_sample))
    b = 2 ** int(math.log2(b))
    return max(1, min(cap, b))


def sdpa_backend(shape: GPTShape, b, device, dtype) -> str:
    """The backend SDPA picks for this shape's causal attention (torch._fused_sdp_choice)."""
    if device != "cuda":
        return "cpu"
    try:
        from torch.nn.attention import SDPBackend
        q = torch.empty(b, shape.num_attention_heads, shape.seq_length, shape.head_dim, device=device, dtype=dtype)
        choice = torch._fused_sdp_choice(q, q, q, is_causal=True)
        return SDPBackend(choice).name
    except Exception as e:  # informative only
        return f"unknown ({type(e).__name__})"


def run_row(size, impl, shape: GPTShape, device, dtype, b, args) -> dict:
    row = {"size": size, "impl": impl, "seq_length": shape.seq_length}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        # Left over from earlier rows of this worker (should be ~0): counted in this row's peak.
        row["memory_at_start_gib"] = round(torch.cuda.memory_allocated() / 2 ** 30, 2)
    t0 = time.time()
    if impl == "megatorch":
        model, loss_fn, opt, notes = build_megatorch(shape, device, dtype, args)
    elif impl in ("eager", "compile"):
        model, loss_fn, opt, notes = build_reference(shape, device, dtype, args, compiled=impl == "compile")
    elif impl == "mcore":
        model, loss_fn, opt, notes = build_mcore(shape, device, dtype, args)
    else:
        raise ValueError(impl)
    sync(device)
    row["build_s"] = round(time.time() - t0, 1)
    row["notes"] = notes
    # Every parameter once (a tied weight is one tensor): N of PaLM's 6N.
    seen, n = set(), 0
    for p in model.parameters():
        key = (p.data_ptr(), p.numel()) if p.numel() else id(p)
        if key not in seen:
            seen.add(key)
            n += p.numel()
    row["params"] = n
    row["params_formula"] = shape.num_parameters()
    row["flops_per_token"] = 6.0 * n + 12.0 * shape.num_layers * shape.hidden_size * shape.seq_length

    # Harness self-tests (CPU): a simulated out-of-memory above this micro-batch; a worker that dies.
    fake_oom = int(os.environ.get("MEGATORCH_GPT_BENCH_FAKE_OOM_ABOVE", "0"))
    if os.environ.get("MEGATORCH_GPT_BENCH_CRASH") == impl:
        os._exit(3)
    gen = torch.Generator(device="cpu").manual_seed(7)
    data = torch.randint(shape.vocab_size, (b, shape.seq_length + 1), generator=gen).to(device)
    retries = 0
    while True:
        ids, labels = data[:b, :-1].contiguous(), data[:b, 1:].contiguous()

        def step():
            loss = loss_fn(ids, labels)
            if fake_oom and ids.size(0) > fake_oom:
                raise torch.OutOfMemoryError(f"CUDA out of memory (simulated above micro-batch {fake_oom})")
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        oom = None
        try:
            t_first = time.time()
            first = step()
            sync(device)
            row["first_step_s"] = round(time.time() - t_first, 2)
            for _ in range(args.warmup - 1):
                step()
            sync(device)
            t_start = time.perf_counter()
            for _ in range(args.iters):
                last = step()
            sync(device)
            elapsed = time.perf_counter() - t_start
            break
        except Exception as e:
            if not is_oom(e) or b == 1:
                raise
            oom = str(e).strip().splitlines()[0][:160]
        # Out of the except block, so the traceback (and the activations its frames hold) is gone.
        opt.zero_grad()
        free_memory(device)
        b //= 2
        retries += 1
        log(f"{size} {impl}: out of memory ({oom}); micro-batch {b}")
    row.update(status="ok", micro_batch=b, oom_retries=retries, warmup=args.warmup, iters=args.iters,
               step_ms=round(elapsed / args.iters * 1e3, 2), loss_first=round(float(first), 4),
               loss_last=round(float(last), 4))
    row["tokens_per_s"] = round(b * shape.seq_length * args.iters / elapsed, 1)
    row["tflops"] = sig(row["tokens_per_s"] * row["flops_per_token"] / 1e12)
    if impl in ("megatorch", "eager", "compile"):
        row["sdpa_backend"] = sdpa_backend(shape, b, device, dtype)
    if device == "cuda":
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2 ** 30, 2)
    else:
        try:
            import resource
            row["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)
        except Exception:
            pass
    del model, loss_fn, opt, data
    return row


def parity_check(arch, device) -> dict:
    """megatorch's GPTModel and ReferenceGPT, same weights, fp32, one small batch: the same loss,
    so the peers are the same model (same FLOPs)."""
    import megatorch  # noqa: F401
    import megatorch.cpp as mt
    shape = GPTShape(hidden_size=128, num_attention_heads=4, num_layers=2, seq_length=64, vocab_size=512, arch=arch)
    model = mt.GPTModel(mt.TransformerConfig(**shape.megatorch_fields(), params_dtype=torch.float32, device=device,
                                             fused_kernels=True, seed=5))
    model.eval()
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(shape.vocab_size, (2, shape.seq_length + 1), generator=gen).to(device)
    out = same_loss_as(model, shape, data[:, :-1], data[:, 1:], rtol=1e-4)
    params = sum(p.numel() for p in model.parameters())
    if params != shape.num_parameters():
        raise RuntimeError(f"megatorch has {params} parameters, GPTShape.num_parameters() says "
                           f"{shape.num_parameters()}")
    return {k: (round(v, 6) if k != "rel_diff" else float(f"{v:.2e}")) for k, v in out.items()}


def worker(args) -> int:
    """Runs the jobs "size:impl,..." in order, appending one JSON line per event to --rows."""
    device = args.device
    dtype = getattr(torch, args.dtype)
    sizes = GPU_SIZES if device == "cuda" else CPU_SIZES
    batches = json.loads(args.micro_batches)
    rows = open(args.rows, "a")

    def emit(obj):
        rows.write(json.dumps(obj) + "\n")
        rows.flush()

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 parity check compares fp32 arithmetic
        torch.backends.cudnn.allow_tf32 = False
    if args.parity:
        try:
            emit({"event": "parity", "result": parity_check(args.arch, device)})
        except Exception as e:
            emit({"event": "parity", "error": f"{type(e).__name__}: {str(e)[:400]}"})
        free_memory(device)
    if device == "cuda" and args.sdpa == "flash":
        # Flash attention for every SDPA user (megatorch's C++ calls share these global switches);
        # math stays as the fallback for shapes flash rejects, which sdpa_backend would show.
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    for job in args.jobs.split(","):
        size, impl = job.split(":")
        shape = GPTShape(**sizes[size], arch=args.arch)
        b = batches[size]
        need = SETUP_S[impl] * (0.2 if device == "cpu" else 1.0)
        if time.time() + need > args.deadline:
            emit({"event": "row", "row": {"size": size, "impl": impl, "status": "skipped",
                                          "error": f"time budget: {args.deadline - time.time():.0f} s left, "
                                                   f"the row needs about {need:.0f} s"}})
            continue
        emit({"event": "start", "size": size, "impl": impl})
        log(f"{size} {impl}: micro-batch {b} x {shape.seq_length}")
        try:
            row = run_row(size, impl, shape, device, dtype, b, args)
        except Exception as e:
            text = str(e).strip()
            where = ""
            frames = traceback.extract_tb(e.__traceback__)
            frames = [f for f in frames if "/torch/" not in f.filename] or frames  # the caller into torch
            if frames:  # where it failed, for a report from a machine nobody can log into
                f = frames[-1]
                where = f" at {'/'.join(Path(f.filename).parts[-3:])}:{f.lineno} ({f.name})"
            first = f"{type(e).__name__}{where}: {text.splitlines()[0][:300] if text else ''}"
            row = {"size": size, "impl": impl, "status": "error",
                   "error": ("megatron-core: not runnable here: " if impl == "mcore" else "") + first}
            traceback.print_exc()
        free_memory(device)
        emit({"event": "row", "row": row})
        if row.get("status") == "ok":
            log(f"{size} {impl}: {row['tokens_per_s']:.0f} tokens/s, {row['tflops']:.4g} TFLOP/s, "
                f"step {row['step_ms']:.1f} ms, micro-batch {row['micro_batch']}, "
                f"peak {row.get('peak_memory_gib', row.get('peak_rss_gib', '?'))} GiB")
        else:
            log(f"{size} {impl}: {row['status']}: {row['error']}")
    rows.close()
    return 0


# ---------------------------------------------------------------- the parent

def run_workers(job_batches, args, device, micro_batches, deadline, rows_path) -> tuple:
    """Runs each batch of jobs in a fresh worker; after a crash, restarts one for what is left."""
    rows = {}
    parity = None
    for batch in job_batches:
        pending = list(batch)
        first_worker = True
        while pending:
            left = deadline - time.time()
            if left <= 0:
                for j in pending:
                    rows[j] = {"size": j[0], "impl": j[1], "status": "skipped", "error": "time budget spent"}
                break
            cmd = [sys.executable, __file__, "--worker", "--device", device, "--arch", args.arch,
                   "--jobs", ",".join(f"{s}:{i}" for s, i in pending), "--rows", str(rows_path),
                   "--micro-batches", json.dumps(micro_batches), "--deadline", str(deadline),
                   "--warmup", str(args.warmup), "--iters", str(args.iters), "--compile", args.compile,
                   "--sdpa", args.sdpa, "--lr", str(args.lr), "--dtype", args.dtype]
            if parity is None and first_worker and "megatorch" in {i for _, i in pending} and not args.no_parity:
                cmd.append("--parity")
            first_worker = False
            rows_path.write_text("")
            status = None
            try:
                status = subprocess.run(cmd, timeout=max(10.0, left + 15)).returncode
            except subprocess.TimeoutExpired:
                status = "timeout"
            started = None
            for line in rows_path.read_text().splitlines():
                ev = json.loads(line)
                if ev["event"] == "parity":
                    parity = ev
                elif ev["event"] == "start":
                    started = (ev["size"], ev["impl"])
                elif ev["event"] == "row":
                    r = ev["row"]
                    rows[(r["size"], r["impl"])] = r
                    started = None
            done = [j for j in pending if j in rows]
            if started is not None and started not in rows:
                why = ("killed at the time budget" if status == "timeout" else
                       f"the worker died (exit status {status}) during this row")
                rows[started] = {"size": started[0], "impl": started[1], "status": "error",
                                 "error": ("megatron-core: not runnable here: " if started[1] == "mcore" else "") + why}
                done.append(started)
            pending = [j for j in pending if j not in done]
            if status == "timeout" or (pending and not done):
                # Out of time, or a worker that dies before finishing any row would die again.
                for j in pending:
                    rows[j] = {"size": j[0], "impl": j[1],
                               "status": "skipped" if status == "timeout" else "error",
                               "error": "time budget spent" if status == "timeout" else
                               f"the worker exited with status {status} before this row (see the log above)"}
                pending = []
    return rows, parity


def derive(rows: dict, matmul_tflops: float, datasheet: float, device) -> None:
    for r in rows.values():
        if r.get("status") != "ok":
            continue
        r["mfu_vs_matmul"] = sig(r["tflops"] / matmul_tflops) if matmul_tflops else None
        r["mfu_vs_datasheet"] = sig(r["tflops"] / datasheet) if device == "cuda" else None
    for size in {s for s, _ in rows}:
        mt = rows.get((size, "megatorch"), {})
        if mt.get("status") != "ok":
            continue
        for impl in ("eager", "compile", "mcore"):
            other = rows.get((size, impl), {})
            if other.get("status") == "ok":
                mt[f"speedup_vs_{impl}"] = round(mt["tokens_per_s"] / other["tokens_per_s"], 3)


def markdown(result) -> str:
    lines = []
    head = result.get("gpu_name") or "CPU"
    mm = result["matmul"]
    lines.append(f"{head}, torch {result['torch']}, {result['arch']} architecture, {result['dtype']}; "
                 f"{mm['dtype']} matmul rate measured in this run {mm['tflops']:.0f} TFLOP/s, "
                 f"datasheet {result['datasheet_tflops']:.0f} TFLOP/s" if result["gpu"] else
                 f"CPU fallback ({NO_GPU_MESSAGE}); {result['arch']} architecture, {result['dtype']}; "
                 f"{mm['dtype']} matmul rate {mm['tflops']:.3g} TFLOP/s")
    if result.get("parity"):
        lines.append("Same model: megatorch and the plain PyTorch GPT, same weights (fp32, small shape): "
                     f"{result['parity']}")
    lines += ["", "| model | implementation | micro-batch | tokens/s | TFLOP/s | MFU (measured matmul) | "
                  "MFU (datasheet) | peak memory GiB | step ms | notes |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r.get("status") != "ok":
            why = r.get("error", "").replace("|", "/")
            lines.append(f"| {r['size']} | {r['impl']} | – | – | – | – | – | – | – | "
                         f"{r['status']}: {why[:160]} |")
            continue
        mem = r.get("peak_memory_gib", r.get("peak_rss_gib"))
        ds = f"{100 * r['mfu_vs_datasheet']:.1f}%" if r.get("mfu_vs_datasheet") is not None else "–"
        mm = f"{100 * r['mfu_vs_matmul']:.1f}%" if r.get("mfu_vs_matmul") is not None else "–"
        extra = []
        for impl in ("eager", "compile", "mcore"):
            if f"speedup_vs_{impl}" in r:
                extra.append(f"x{r[f'speedup_vs_{impl}']:.2f} vs {impl}")
        if r.get("oom_retries"):
            extra.append(f"{r['oom_retries']} OOM halvings")
        lines.append(f"| {r['size']} ({r['params'] / 1e6:.3g}M) | {r['impl']} | {r['micro_batch']} | "
                     f"{r['tokens_per_s']:.0f} | {r['tflops']:.3g} | {mm} | {ds} | "
                     f"{mem if mem is not None else '–'} | {r['step_ms']:.1f} | {', '.join(extra)} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="JSON file, or a folder for gpt.json")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                    help="auto: cuda when torch sees a GPU, else the CPU fallback at toy sizes")
    ap.add_argument("--no-fallback", action="store_true", help="without a GPU write gpu: false and stop")
    ap.add_argument("--sizes", default=None, help="comma-separated, e.g. 1.3B,350M (default: both, 1.3B first)")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    ap.add_argument("--arch", default="gpt", choices=["gpt", "llama"],
                    help="gpt: GPT-2/3 (LayerNorm, GeLU, learned positions, biases); llama: RMSNorm, SwiGLU, RoPE")
    ap.add_argument("--micro-batch", type=int, default=0, help="0: sized to fill the GPU")
    ap.add_argument("--max-micro-batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--compile", default="regional", choices=["regional", "full"],
                    help="regional: torch.compile each layer (compiled once) and the head; full: the whole loss")
    ap.add_argument("--sdpa", default="default", choices=["flash", "default"],
                    help="default: every SDPA backend enabled, each row gets the fastest one torch picks for its "
                         "shape (cuDNN or flash on Hopper; recorded as sdpa_backend); flash: only flash attention "
                         "(and math as the fallback)")
    ap.add_argument("--budget-s", type=float, default=420, help="the whole run; rows that no longer fit are skipped")
    ap.add_argument("--datasheet-tflops", type=float, default=DATASHEET_TFLOPS)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="parameters and activations; auto: bfloat16 on the GPU, float32 for the CPU fallback")
    ap.add_argument("--no-parity", action="store_true", help="skip the megatorch-vs-reference loss check")
    # worker
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--jobs", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--micro-batches", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--parity", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    started = time.time()
    deadline = started + args.budget_s
    out = Path(args.out)
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "gpt.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    device = args.device if args.device != "auto" else ("cuda" if gpu else "cpu")
    result = {"gpu": device == "cuda", "torch": torch.__version__, "cuda": torch.version.cuda, "device": device,
              "arch": args.arch, "datasheet_tflops": args.datasheet_tflops,
              "flops_count": "PaLM: 6N + 12*L*h*s per token, N every parameter once, attention in full"}
    if device == "cuda" and not gpu:
        ap.error("--device cuda: torch sees no GPU")
    if device == "cpu":
        reason = (f"no CUDA device visible to torch {torch.__version__} (cuda build: {torch.version.cuda})"
                  if not gpu else "--device cpu")
        if args.no_fallback:
            log(f"{reason}; GPU GPT benchmark not run (--no-fallback)")
            out.write_text(json.dumps({**result, "gpu": False, "reason": reason}, indent=2) + "\n")
            return 0
        log(f"{reason}. {NO_GPU_MESSAGE}.")
        result.update(reason=reason, note=NO_GPU_MESSAGE)
        sizes = CPU_SIZES
        args.dtype = "float32" if args.dtype == "auto" else args.dtype
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    else:
        props = torch.cuda.get_device_properties(0)
        result.update(gpu_name=props.name, sm=f"{props.major}.{props.minor}",
                      gpu_memory_gib=round(props.total_memory / 2 ** 30, 1))
        sizes = GPU_SIZES
        args.dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    dtype = getattr(torch, args.dtype)
    result["dtype"] = args.dtype
    chosen = args.sizes.split(",") if args.sizes else list(sizes)
    for s in chosen:
        if s not in sizes:
            ap.error(f"--sizes: expected some of {', '.join(sizes)} on {device}, got {s}")
    impls = args.impls.split(",")
    for i in impls:
        if i not in IMPLS:
            ap.error(f"--impls: expected some of {', '.join(IMPLS)}, got {i}")

    result["matmul"] = matmul_rate(device, dtype, small=device == "cpu")
    log(f"{result.get('gpu_name', 'CPU')}: {result['matmul']['dtype']} matmul {result['matmul']['tflops']} TFLOP/s "
        f"({result['matmul']['shapes']})")

    micro_batches = {}
    for s in chosen:
        shape = GPTShape(**sizes[s], arch=args.arch)
        if args.micro_batch:
            micro_batches[s] = args.micro_batch
        elif device == "cuda":
            free, _ = torch.cuda.mem_get_info()  # less this process's CUDA context, which stays
            micro_batches[s] = auto_micro_batch(shape, free, args.max_micro_batch)
        else:
            micro_batches[s] = 2
    if device == "cuda":
        free_memory(device)
    result["micro_batches"] = micro_batches
    result["sizes"] = {s: {**sizes[s], "arch": args.arch,
                           "params": GPTShape(**sizes[s], arch=args.arch).num_parameters()} for s in chosen}

    # Priority order, one worker each: megatorch and eager PyTorch (both sizes, the first the goal
    # row); torch.compile (its compile workers and dynamo state stay in its process); Megatron-Core
    # (its import and global state likewise).
    job_batches = [[(s, i) for s in chosen for i in group if i in impls]
                   for group in (("megatorch", "eager"), ("compile",), ("mcore",))]
    job_batches = [b for b in job_batches if b]
    rows_path = out.parent / (out.stem + ".rows.jsonl")
    rows, parity = run_workers(job_batches, args, device, micro_batches, deadline, rows_path)
    try:
        rows_path.unlink()
    except OSError:
        pass
    derive(rows, result["matmul"]["tflops"], args.datasheet_tflops, device)
    result["rows"] = [rows[(s, i)] for s in chosen for i in IMPLS if (s, i) in rows]
    if parity is not None:
        result["parity"] = parity.get("result") or {"error": parity.get("error")}
    goal_size = chosen[0]
    mt_row = rows.get((goal_size, "megatorch"), {})
    if device == "cuda" and mt_row.get("status") == "ok":
        peers = [rows.get((goal_size, i), {}) for i in ("eager", "compile")]
        result["goal"] = {
            "size": goal_size, "mfu_vs_datasheet": mt_row["mfu_vs_datasheet"], "mfu_target": 0.5,
            "mfu_met": mt_row["mfu_vs_datasheet"] >= 0.5,
            "ahead_of_eager_and_compile": all(p.get("status") == "ok" and mt_row["tokens_per_s"] > p["tokens_per_s"]
                                              for p in peers),
        }
    result["seconds"] = round(time.time() - started, 1)
    out.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (out.with_suffix(".md")).write_text(table + "\n")
    print(table)
    if "parity" in result:
        log(f"parity (megatorch vs plain PyTorch, same weights, fp32): {result['parity']}")
    if "goal" in result:
        g = result["goal"]
        log(f"goal ({g['size']}): MFU {100 * g['mfu_vs_datasheet']:.1f}% of {args.datasheet_tflops:.0f} TFLOP/s "
            f"({'met' if g['mfu_met'] else 'NOT met'}, target 50%); ahead of eager and torch.compile: "
            f"{g['ahead_of_eager_and_compile']}")
    if device == "cpu":
        log(NO_GPU_MESSAGE)
    log(f"wrote {out} and {out.with_suffix('.md')} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
