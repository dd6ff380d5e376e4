"""The kernel table of scripts/bench/moe.py: megatorch's grouped GEMM (kernels::grouped_gemm,
driven by moe_grouped_gemm.cpp) and its per-expert loop, next to torch._grouped_mm and a
Python loop of torch.mm, on balanced and Zipf-skewed row counts, forward and forward +
backward, one thread. `log` is the caller's progress printer."""
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LIBRARY = ROOT / "build" / "lib" / "libmegatorch.so"
sys.path.insert(0, str(HERE / "peers"))
from machine_load import OtherLoad, wait_until_idle  # noqa: E402

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


def build_driver(out: Path, log) -> Path:
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


def kernel_bench(args, out: Path, log) -> dict:
    import torch
    torch.set_num_threads(1)
    exe = build_driver(out, log)
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
