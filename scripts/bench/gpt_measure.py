"""The measurements of scripts/bench/gpu_gpt.py: the matmul rate (in the parent), the
micro-batch estimate, and in a worker one row (build, step, sync check, timing, profile)
and the same-model parity check."""
import gc
import math
import os
import time
from pathlib import Path

import torch

from gpt_builders import (MEGATORCH_FP8, build_mcore, build_megatorch, build_reference, build_torchao_fp8,
                          build_torchtitan)
from gpt_profile import profile_steps, sync_check
from gpt_reference import GPTShape, same_loss_as

# The toy shapes of the parity check, one per architecture (Llama: GQA 8:2 and untied output).
PARITY_SHAPES = {
    "gpt": dict(hidden_size=128, num_attention_heads=4, num_layers=2, seq_length=64, vocab_size=512, arch="gpt"),
    "llama": dict(hidden_size=128, num_attention_heads=8, num_query_groups=2, num_layers=2, seq_length=64,
                  vocab_size=512, arch="llama", tie_embeddings=False),
}


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
    """The largest power of two whose activations fit next to the model states: per layer and
    token ~16h bytes for attention and norms plus the MLP's (2h + 4f with GeLU, 2h + 8f with
    SwiGLU: 34h for GPT's f = 4h, Korthikanti et al. without dropout masks and the s² scores),
    with a 1.3x margin for the unfused peers, plus the logits and their fp32 loss (~12·s·V);
    states 20 bytes per parameter (the peers' bf16 parameter + grad, fp32 master, grad copy and
    two moments; megatorch needs 18)."""
    s, h, L, V, f = shape.seq_length, shape.hidden_size, shape.num_layers, shape.vocab_size, shape.ffn
    per_token_layer = 16 * h + 2 * h + (8 if shape.llama else 4) * f
    per_sample = 1.3 * per_token_layer * s * L + 12 * s * V
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
        kv = torch.empty(b, shape.groups, shape.seq_length, shape.head_dim, device=device, dtype=dtype)
        gqa = shape.groups != shape.num_attention_heads
        choice = torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=gqa)
        return SDPBackend(choice).name
    except Exception as e:  # informative only
        return f"unknown ({type(e).__name__})"


def build(impl, shape, device, dtype, args):
    if impl == "megatorch":
        return build_megatorch(shape, device, dtype, args)
    if impl == "megatorch_fp8":
        return build_megatorch(shape, device, dtype, args, fp8=MEGATORCH_FP8)
    if impl in ("eager", "compile"):
        return build_reference(shape, device, dtype, args, compiled=impl == "compile")
    if impl == "mcore":
        return build_mcore(shape, device, dtype, args)
    if impl == "torchtitan":
        return build_torchtitan(shape, device, dtype, args)
    if impl == "torchao_fp8":
        return build_torchao_fp8(shape, device, dtype, args)
    raise ValueError(impl)


def run_row(size, impl, shape: GPTShape, device, dtype, b, args, profile_path: Path = None) -> dict:
    """One row: build, the first step, warm-up to --warmup steps, the sync check (megatorch and
    eager: --sync-steps steps), --iters timed steps, the profile (profile_path given)."""
    row = {"size": size, "arch": shape.arch, "impl": impl, "seq_length": shape.seq_length}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        # Left over from earlier rows of this worker (should be ~0): counted in this row's peak.
        row["memory_at_start_gib"] = round(torch.cuda.memory_allocated() / 2 ** 30, 2)
    t0 = time.time()
    model, loss_fn, opt, notes = build(impl, shape, device, dtype, args)
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

        def step(mark=lambda phase: None):
            mark("forward")
            loss = loss_fn(ids, labels)
            if fake_oom and ids.size(0) > fake_oom:
                raise torch.OutOfMemoryError(f"CUDA out of memory (simulated above micro-batch {fake_oom})")
            mark("backward")
            loss.backward()
            mark("optimizer")
            opt.step()
            mark("zero_grad")
            opt.zero_grad()
            mark(None)
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
            if impl in ("megatorch", "eager") and args.sync_steps > 0:
                row["sync_check"] = sync_check(step, opt.zero_grad, device, args.sync_steps, args.warmup + 1)
            t_start = time.perf_counter()
            for _ in range(args.iters):
                last = step()
            sync(device)
            elapsed = time.perf_counter() - t_start
            if profile_path is not None:
                row["profile"] = profile_steps(step, device, args.profile_steps, profile_path,
                                               step_ms=round(elapsed / args.iters * 1e3, 3))
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
               step_ms=round(elapsed / args.iters * 1e3, 2), loss_first=round(float(first), 6),
               loss_last=round(float(last), 4))
    row["tokens_per_s"] = round(b * shape.seq_length * args.iters / elapsed, 1)
    row["tflops"] = sig(row["tokens_per_s"] * row["flops_per_token"] / 1e12)
    if impl in ("megatorch", "eager", "compile", "torchtitan"):
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
    so the peers are the same model (same FLOPs). The Llama shape has GQA (8 heads, 2 groups)
    and an untied output layer."""
    import megatorch  # noqa: F401
    import megatorch.cpp as mt
    shape = GPTShape(**PARITY_SHAPES[arch])
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
    out = {k: (round(v, 6) if k != "rel_diff" else float(f"{v:.2e}")) for k, v in out.items()}
    out["shape"] = {k: v for k, v in PARITY_SHAPES[arch].items()}
    return out
