#!/usr/bin/env python3
"""GPU benchmark of GPT and Llama training steps (docs/benchmarks_gpu.md): megatorch's C++
GPTModel driven from Python (bf16, fused kernels, attention through
at::scaled_dot_product_attention, its DistributedOptimizer) next to the same model in plain
PyTorch eager (SDPA), the same under torch.compile (each layer), Megatron-Core's GPTModel
with its local (non-Transformer-Engine) layers, torchtitan's Llama (Llama shapes, when
torchtitan is importable), and in FP8 megatorch's model with TransformerConfig.fp8 (hybrid,
delayed) next to the eager model with torchao's float8 training (when torchao is
importable) — in one run, on one GPU, at sequence 2048:

    1.3B      GPT-3 1.3B: h 2048, 24 layers, 16 heads, LayerNorm, GeLU, learned positions,
              biases, tied embeddings, vocabulary 50304 (1,315,819,520 parameters)
    llama-1B  Llama 3.2 1B's transformer (h 2048, 16 layers, 32 heads of 64, GQA 4:1 = 8 query
              groups, SwiGLU 8192, RMSNorm, RoPE, no biases) with an untied output layer and
              Llama 2's 32000-token vocabulary (1,104,218,112 parameters); 32000 rather than
              Llama 3's 128256 keeps it ~1B and the step comparable with GPT 1.3B: untied, a 128256
              vocabulary would be a third of the parameters (1.50B in all) and its fp32 logits
              (12·s·V bytes a sample: 3.2 GB against 0.8 GB) would shrink the micro-batch
    350M      GPT-3 350M (--sizes 350M; not in the default run)

    MEGATORCH_LIBRARY=build-gpu/lib/libmegatorch.so PYTHONPATH=torch_ext \\
        python3 scripts/bench/gpu_gpt.py --out results/gpt.json [--budget-s 420] \\
        [--arch gpt,llama | --sizes 1.3B,llama-1B] [--pretrain-json results/pretrain.json]

Every row of a size starts from the same weights (gpt_reference.shared_init_, drawn per
megatorch parameter name; Megatron-Core's and torchtitan's names, torchtitan's split QKV and
interleaved RoPE mapped onto them) and the same tokens, so their first-step losses agree
(`same_start`); before the rows, megatorch and the reference load the same weights at a toy
shape in fp32 per architecture and must give the same loss (`parity`).

Per row: tokens/s, model TFLOP/s by PaLM's count (6N + 12·L·h·s per token, N every
parameter once, attention counted in full: csrc/train/trainer.cpp's count), MFU against
the bf16 matmul rate measured in the same run (the best of a few large matmuls) and
against the datasheet (--datasheet-tflops, 989 for H100/H200 SXM dense bf16), peak
memory, the first-step loss. A training step is forward, backward and AdamW (fp32 master
weights and states, bf16 parameters, gradients and activations, for every implementation);
no gradient accumulation, no recomputation, no dropout. Steps: 1 (builds, compiles),
2..--warmup, then for megatorch and eager the sync check (--sync-steps steps under
torch.cuda.set_sync_debug_mode("error"), steps 4-6 by default: gpt_profile.sync_check),
then --iters steps timed by the wall clock, synchronised at both ends, then for megatorch
and eager at the first size (--profile) --profile-steps steps under torch.profiler
(a Chrome trace profile_<impl>_<size>.json.gz next to the JSON, and device time per kernel
class with the idle/launch gaps: gpt_profile). The micro-batch is sized to fill the GPU (an
activation estimate), the same for every implementation of a size, halved on out-of-memory.

`goal` (gpt_report.goals): megatorch from Python and gpt_pretrain (its GPT 1.3B row read
from --pretrain-json, gpu_pretrain.py's output of the same gpu_check run) against MFU 55%
of the datasheet at GPT 1.3B bf16, x1.05 eager's tokens/s and x1.0 torch.compile's; the
Llama size against the two ratios; each true/false, null where a row is missing.

The rows run in worker processes, one per group in priority order — megatorch and eager
(every size), torch.compile, torchtitan, Megatron-Core — so a crash or a CUDA error loses
one row (the worker is restarted for the rest), not the run. Megatron-Core and torchtitan
rows that cannot be found (gpt_builders.locate) say so without starting a worker.

Time plan (--budget-s bounds the whole; rows that no longer fit are skipped, saying so):
gpu_check.sh gives this step what is left of its 8 minutes after the build, the tests and
gpt_pretrain, less 60 s for the steps after it (at least 90 s; MEGATORCH_GPT_BENCH_S sets
it): about 90-130 s on an H100; 350M is left out of the default run. Estimates from
the H200 run: the parent's matmul rate ~3 s; the megatorch+eager worker ~6 s to start with
the two parity checks, then per row the build (megatorch ~15 s, eager ~6 s), 3 warm-up + 3
sync-check + 5 timed steps (~2-7 s at 0.2-0.6 s a step) and at 1.3B the profile (2 steps
plus the trace, ~5 s): about 65-80 s for the four rows of both models; torch.compile ~60 s
per size (the compilation), torchtitan ~20 s, Megatron-Core ~40 s per size. So within
gpu_check the megatorch and eager rows of GPT 1.3B and Llama 1B (the goal rows) come first
and fit, torch.compile of GPT 1.3B runs if ~60 s are left; the rest is skipped there and
needs the standalone run (--budget-s 420, about 5 minutes, every row).

Without a GPU it says so, and runs the same harness on the CPU at toy sizes (fp32, toy-gpt
and toy-llama with GQA and an untied output) to check the script itself: "no GPU: ran the
CPU fallback at toy sizes; numbers are not GPU numbers" (profile: CPU operators; sync
check: "skipped: no CUDA"). --no-fallback writes {"gpu": false, ...} instead. Harness
self-tests: MEGATORCH_GPT_BENCH_CRASH=<impl> makes that row's worker die (os._exit(3)),
MEGATORCH_GPT_BENCH_FAKE_OOM_ABOVE=<b> simulates out-of-memory above micro-batch b.
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpt_report  # noqa: E402
from gpt_builders import OPTIONAL, locate  # noqa: E402
from gpt_measure import auto_micro_batch, free_memory, log, matmul_rate, parity_check, run_row  # noqa: E402
from gpt_profile import KERNEL_CLASSES, SyncCheckBroken  # noqa: E402
from gpt_reference import GPTShape  # noqa: E402

DATASHEET_TFLOPS = 989.0  # H100 / H200 SXM, dense bf16
VOCAB = 50304             # GPT-2's 50257 rounded up to a multiple of 128: no padding in any implementation
GPU_SIZES = {             # GPT-3's shapes (Brown et al. 2020, table 2.1); Llama 3.2 1B's body, Llama 2's vocabulary
    "1.3B": dict(hidden_size=2048, num_attention_heads=16, num_layers=24, seq_length=2048, vocab_size=VOCAB,
                 arch="gpt"),
    "llama-1B": dict(hidden_size=2048, num_attention_heads=32, num_query_groups=8, num_layers=16,
                     ffn_hidden_size=8192, seq_length=2048, vocab_size=32000, arch="llama", tie_embeddings=False),
    "350M": dict(hidden_size=1024, num_attention_heads=16, num_layers=24, seq_length=2048, vocab_size=VOCAB,
                 arch="gpt"),
}
CPU_SIZES = {             # the CPU fallback: the same code paths at toy sizes
    "toy-gpt": dict(hidden_size=128, num_attention_heads=4, num_layers=2, seq_length=128, vocab_size=512, arch="gpt"),
    "toy-llama": dict(hidden_size=128, num_attention_heads=8, num_query_groups=2, num_layers=2, seq_length=128,
                      vocab_size=512, arch="llama", tie_embeddings=False),
}
ARCHS = ("gpt", "llama")
IMPLS = ("megatorch", "eager", "compile", "mcore", "torchtitan", "megatorch_fp8", "torchao_fp8")
# One worker each, in this order.
GROUPS = (("megatorch", "eager"), ("compile",), ("megatorch_fp8", "torchao_fp8"), ("torchtitan",), ("mcore",))
# Seconds a row needs beyond its steps (model build, compilation): rows that no longer fit
# in the budget are skipped, not started.
SETUP_S = {"megatorch": 30, "eager": 15, "compile": 60, "mcore": 40, "torchtitan": 20, "megatorch_fp8": 30,
           "torchao_fp8": 20}
NO_GPU_MESSAGE = "no GPU: ran the CPU fallback at toy sizes; numbers are not GPU numbers"


def applies(impl, size_cfg) -> bool:
    return impl != "torchtitan" or size_cfg["arch"] == "llama"  # torchtitan has no GPT-2 model


def worker(args) -> int:
    """Runs the jobs "size:impl,..." in order, appending one JSON line per event to --rows."""
    device = args.device
    dtype = getattr(torch, args.dtype)
    sizes = GPU_SIZES if device == "cuda" else CPU_SIZES
    batches = json.loads(args.micro_batches)
    profile_sizes = set(filter(None, args.profile_sizes.split(",")))
    rows = open(args.rows, "a")

    def emit(obj):
        rows.write(json.dumps(obj) + "\n")
        rows.flush()

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 parity check compares fp32 arithmetic
        torch.backends.cudnn.allow_tf32 = False
    for arch in filter(None, (args.parity or "").split(",")):
        try:
            emit({"event": "parity", "arch": arch, "result": parity_check(arch, device)})
        except Exception as e:
            emit({"event": "parity", "arch": arch, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        free_memory(device)
    if device == "cuda" and args.sdpa == "flash":
        # Flash attention for every SDPA user (megatorch's C++ calls share these global switches);
        # math stays as the fallback for shapes flash rejects, which sdpa_backend would show.
        torch.backends.cuda.enable_flash_sdp(True)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    for job in args.jobs.split(","):
        size, impl = job.split(":")
        shape = GPTShape(**sizes[size])
        b = batches[size]
        need = SETUP_S[impl] * (0.2 if device == "cpu" else 1.0)
        if time.time() + need > args.deadline:
            emit({"event": "row", "row": {"size": size, "arch": shape.arch, "impl": impl, "status": "skipped",
                                          "error": f"time budget: {args.deadline - time.time():.0f} s left, "
                                                   f"the row needs about {need:.0f} s"}})
            continue
        emit({"event": "start", "size": size, "impl": impl})
        log(f"{size} {impl}: micro-batch {b} x {shape.seq_length}")
        trace = (Path(args.trace_dir) / f"profile_{impl}_{size}.json.gz"
                 if size in profile_sizes and impl in ("megatorch", "eager") else None)
        try:
            broken = None
            try:
                row = run_row(size, impl, shape, device, dtype, b, args, profile_path=trace)
            except SyncCheckBroken as e:
                broken = e.result  # the evidence; the failed row's model goes with the exception
            if broken is not None:  # the row built again without the sync check
                log(f"{size} {impl}: the step after a caught sync failed ({broken['rerun_failed']}); "
                    "again without the sync check")
                free_memory(device)
                unchecked = argparse.Namespace(**{**vars(args), "sync_steps": 0})
                row = run_row(size, impl, shape, device, dtype, b, unchecked, profile_path=trace)
                row["sync_check"] = broken
        except Exception as e:
            text = str(e).strip()
            where = ""
            frames = traceback.extract_tb(e.__traceback__)
            frames = [f for f in frames if "/torch/" not in f.filename] or frames  # the caller into torch
            if frames:  # where it failed, for a report from a machine nobody can log into
                f = frames[-1]
                where = f" at {'/'.join(Path(f.filename).parts[-3:])}:{f.lineno} ({f.name})"
            first = f"{type(e).__name__}{where}: {text.splitlines()[0][:300] if text else ''}"
            prefix = {"mcore": "megatron-core: not runnable here: ", "torchao_fp8": "torchao float8: ",
                      "torchtitan": "torchtitan not importable: " if isinstance(e, ImportError) else
                      "torchtitan: not runnable here: "}.get(impl, "")
            row = {"size": size, "arch": shape.arch, "impl": impl,
                   "status": "unavailable" if isinstance(e, ImportError) else "error", "error": prefix + first}
            traceback.print_exc()
        free_memory(device)
        emit({"event": "row", "row": row})
        if row.get("status") == "ok":
            log(f"{size} {impl}: {row['tokens_per_s']:.0f} tokens/s, {row['tflops']:.4g} TFLOP/s, "
                f"step {row['step_ms']:.1f} ms, micro-batch {row['micro_batch']}, "
                f"peak {row.get('peak_memory_gib', row.get('peak_rss_gib', '?'))} GiB, first loss {row['loss_first']}")
        else:
            log(f"{size} {impl}: {row['status']}: {row['error']}")
    rows.close()
    return 0


# ---------------------------------------------------------------- the parent

def worker_command(args, device, pending, rows_path, micro_batches, deadline, parity, profile_sizes, trace_dir):
    cmd = [sys.executable, __file__, "--worker", "--device", device,
           "--jobs", ",".join(f"{s}:{i}" for s, i in pending), "--rows", str(rows_path),
           "--micro-batches", json.dumps(micro_batches), "--deadline", str(deadline),
           "--warmup", str(args.warmup), "--iters", str(args.iters), "--sync-steps", str(args.sync_steps),
           "--profile-steps", str(args.profile_steps), "--profile-sizes", ",".join(profile_sizes),
           "--trace-dir", str(trace_dir), "--compile", args.compile, "--sdpa", args.sdpa, "--lr", str(args.lr),
           "--dtype", args.dtype]
    if parity:
        cmd += ["--parity", ",".join(parity)]
    return cmd


def run_workers(job_batches, args, device, micro_batches, deadline, rows_path, parity_archs, profile_sizes,
                sizes) -> tuple:
    """Runs each batch of jobs in a fresh worker; after a crash, restarts one for what is left."""
    rows, parity = {}, {}

    def mark(j, status, error):
        rows[j] = {"size": j[0], "arch": sizes[j[0]]["arch"], "impl": j[1], "status": status, "error": error}

    for batch in job_batches:
        pending = list(batch)
        while pending:
            left = deadline - time.time()
            if left <= 0:
                for j in pending:
                    mark(j, "skipped", "time budget spent")
                break
            todo = [a for a in parity_archs if a not in parity] if "megatorch" in {i for _, i in pending} else []
            cmd = worker_command(args, device, pending, rows_path, micro_batches, deadline, todo, profile_sizes,
                                 rows_path.parent)
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
                    parity[ev["arch"]] = ev.get("result") or {"error": ev.get("error")}
                elif ev["event"] == "start":
                    started = (ev["size"], ev["impl"])
                elif ev["event"] == "row":
                    r = ev["row"]
                    rows[(r["size"], r["impl"])] = r
                    started = None
            for a in todo:  # a worker that died in the parity check does not retry it
                parity.setdefault(a, {"error": f"the worker exited (status {status}) before the parity check ended"})
            done = [j for j in pending if j in rows]
            if started is not None and started not in rows:
                why = ("killed at the time budget" if status == "timeout" else
                       f"the worker died (exit status {status}) during this row")
                mark(started, "error", ("megatron-core: not runnable here: " if started[1] == "mcore" else "") + why)
                done.append(started)
            pending = [j for j in pending if j not in done]
            if status == "timeout" or (pending and not done):
                # Out of time, or a worker that dies before finishing any row would die again.
                for j in pending:
                    if status == "timeout":
                        mark(j, "skipped", "time budget spent")
                    else:
                        mark(j, "error", f"the worker exited with status {status} before this row (see the log above)")
                pending = []
    return rows, parity


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="JSON file, or a folder for gpt.json")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                    help="auto: cuda when torch sees a GPU, else the CPU fallback at toy sizes")
    ap.add_argument("--no-fallback", action="store_true", help="without a GPU write gpu: false and stop")
    ap.add_argument("--arch", default="gpt,llama",
                    help="comma-separated architectures whose default size runs (gpt: 1.3B, llama: llama-1B; "
                         "CPU: toy-gpt, toy-llama), in this order; ignored with --sizes")
    ap.add_argument("--sizes", default=None, help="comma-separated sizes, first = the profiled one (GPU: "
                    + ", ".join(GPU_SIZES) + "; CPU: " + ", ".join(CPU_SIZES) + ")")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    ap.add_argument("--micro-batch", type=int, default=0, help="0: sized to fill the GPU")
    ap.add_argument("--max-micro-batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the sync check and the timing (>= 1)")
    ap.add_argument("--iters", type=int, default=5, help="timed steps")
    ap.add_argument("--sync-steps", type=int, default=3,
                    help="megatorch and eager rows: steps under set_sync_debug_mode('error') after the warm-up "
                         "(0: off)")
    ap.add_argument("--profile", default="first", choices=["first", "all", "none"],
                    help="torch.profiler for the megatorch and eager rows of the first size, of every size, or none")
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--pretrain-json", default=None,
                    help="gpu_pretrain.py's pretrain.json of the same run: gpt_pretrain's 1.3B row for `goal`")
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
    ap.add_argument("--parity", default="", help=argparse.SUPPRESS)
    ap.add_argument("--profile-sizes", default="", help=argparse.SUPPRESS)
    ap.add_argument("--trace-dir", default=".", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.warmup < 1 or args.iters < 1:
        ap.error("--warmup and --iters must be at least 1")

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
              "datasheet_tflops": args.datasheet_tflops,
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
    if args.sizes:
        chosen = args.sizes.split(",")
        for s in chosen:
            if s not in sizes:
                ap.error(f"--sizes: expected some of {', '.join(sizes)} on {device}, got {s}")
    else:
        archs = args.arch.split(",")
        for a in archs:
            if a not in ARCHS:
                ap.error(f"--arch: expected some of {', '.join(ARCHS)}, got {a}")
        chosen = [next(s for s in sizes if sizes[s]["arch"] == a) for a in dict.fromkeys(archs)]
    result["archs"] = list(dict.fromkeys(sizes[s]["arch"] for s in chosen))
    result["arch"] = ",".join(result["archs"])
    impls = args.impls.split(",")
    for i in impls:
        if i not in IMPLS:
            ap.error(f"--impls: expected some of {', '.join(IMPLS)}, got {i}")

    result["matmul"] = matmul_rate(device, dtype, small=device == "cpu")
    log(f"{result.get('gpu_name', 'CPU')}: {result['matmul']['dtype']} matmul {result['matmul']['tflops']} TFLOP/s "
        f"({result['matmul']['shapes']})")

    micro_batches = {}
    for s in chosen:
        shape = GPTShape(**sizes[s])
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
    result["sizes"] = {s: {**sizes[s], "ffn_hidden_size": GPTShape(**sizes[s]).ffn,
                           "num_query_groups": GPTShape(**sizes[s]).groups,
                           "params": GPTShape(**sizes[s]).num_parameters()} for s in chosen}
    result["steps"] = {"warmup": args.warmup, "sync_check": args.sync_steps, "timed": args.iters,
                       "profiled": args.profile_steps if args.profile != "none" else 0}

    # Optional peers that are nowhere to be found: their rows say so, no worker starts for them.
    rows = {}
    for impl, (module, env, _) in OPTIONAL.items():
        if impl in impls and any(applies(impl, sizes[s]) for s in chosen) and locate(impl) is None:
            why = (f"{module} not found: not in {sys.executable}'s packages, ${env} "
                   f"{'= ' + os.environ[env] + ' holds no ' + module if os.environ.get(env) else 'unset'}, "
                   "no copy in the repository's .venv")
            name = {"torchtitan": "torchtitan not importable", "torchao_fp8": "torchao not importable"}.get(
                impl, "megatron-core: not runnable here")
            for s in chosen:
                if applies(impl, sizes[s]):
                    rows[(s, impl)] = {"size": s, "arch": sizes[s]["arch"], "impl": impl, "status": "unavailable",
                                       "error": f"{name}: {why}"}
    job_batches = [[(s, i) for s in chosen for i in group if i in impls and applies(i, sizes[s])
                    and (s, i) not in rows] for group in GROUPS]
    job_batches = [b for b in job_batches if b]
    profile_sizes = {"first": chosen[:1], "all": chosen, "none": []}[args.profile]
    parity_archs = [] if args.no_parity else result["archs"]
    rows_path = out.parent / (out.stem + ".rows.jsonl")
    more, parity = run_workers(job_batches, args, device, micro_batches, deadline, rows_path, parity_archs,
                               profile_sizes, sizes)
    rows.update(more)
    try:
        rows_path.unlink()
    except OSError:
        pass
    result["same_start"] = gpt_report.derive(rows, result["matmul"]["tflops"], args.datasheet_tflops, device,
                                             args.dtype, order=chosen)
    result["rows"] = [rows[(s, i)] for s in chosen for i in IMPLS if (s, i) in rows]
    if parity:
        result["parity"] = parity
    if profile_sizes:
        size = profile_sizes[0]
        result["profile"] = {"size": size, "steps": args.profile_steps,
                             "rules": [{"class": c, "regex": r or "(anything else)"} for c, r in KERNEL_CLASSES],
                             "impls": {i: rows[(size, i)]["profile"] for i in ("megatorch", "eager")
                                       if rows.get((size, i), {}).get("profile")}}
    result["goal"] = gpt_report.goals(rows, chosen, sizes, args.dtype, device, args.pretrain_json)
    result["seconds"] = round(time.time() - started, 1)
    out.write_text(json.dumps(result, indent=2) + "\n")
    table = gpt_report.markdown(result, NO_GPU_MESSAGE)
    (out.with_suffix(".md")).write_text(table + "\n")
    print(table)
    g = result["goal"]
    log(f"goal: all reached: {g['all_reached']}; " + "; ".join(f"{k}: {e['reached']}" for k, e in g["entries"].items()))
    if device == "cpu":
        log(NO_GPU_MESSAGE)
    log(f"wrote {out} and {out.with_suffix('.md')} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
