"""The fused kernels next to the unfused PyTorch chains they replace, as benchmark cases
shared by scripts/bench/gpu_kernels.py (GPU: GB/s, eager and torch.compile) and
scripts/bench/kernels_cpu.py (CPU: fused vs unfused, side by side).

Each case holds its inputs, the fused call, the unfused ("eager") chain computing the
same thing, and the bytes the fused kernel must move at least (every input read once,
every output written once): GB/s = bytes / time.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import megatorch  # noqa: F401  (loads the operators)

ops = torch.ops.megatorch


@dataclass
class Case:
    name: str
    shape: str
    dtype: torch.dtype
    fused: Callable[[], object]
    eager: Callable[[], object]
    bytes: int  # minimum traffic of the fused kernel
    goal: str = ""  # the kernel's GPU target, shown in gpu_kernels.py's table (docs/kernels.md lists the targets)
    compare: bool = True  # outputs comparable (dropout draws differ between the two paths)
    extra: Dict[str, float] = field(default_factory=dict)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rope_reference(x, freqs):
    r = freqs.shape[-1]
    rot = x[..., :r].float()
    x1, x2 = rot.chunk(2, -1)
    out = (rot * freqs.cos() + torch.cat([-x2, x1], -1) * freqs.sin()).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], -1)


def rms_norm_reference(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def masked_softmax_reference(x, mask, scale):
    y = (x.float() * scale)
    if mask is not None:
        y = y.masked_fill(mask, float("-inf"))
    return torch.softmax(y, -1).to(x.dtype)


def ce_local_reference(logits, target, start, real):
    x = logits[..., :real].float()
    mx = x.max(-1).values
    se = (x - mx.unsqueeze(-1)).exp().sum(-1)
    local = target - start
    inside = (local >= 0) & (local < logits.shape[-1])
    tl = torch.where(inside, logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1).float(),
                     0.0)
    return mx, se, tl, x.sum(-1)


def adamw_reference_step(params, grads, m, v, lr, b1, b2, eps, wd, step):
    """torch's foreach AdamW arithmetic (what torch.optim.AdamW(foreach=True) runs)."""
    torch._foreach_mul_(params, 1 - lr * wd)
    g32 = [g.float() for g in grads]
    torch._foreach_lerp_(m, g32, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, g32, g32, 1 - b2)
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2 ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, m, denom, -lr / bc1)


def make_cases(device: str, dtype: torch.dtype, tokens: int, hidden: int, heads: int, sk: int,
               vocab_shard: int, adam_numel: int, only: List[str] = None) -> List[Case]:
    """Cases over `tokens` rows of width `hidden` (activations [tokens, hidden]); softmax
    over [*, heads, sk, sk]; the loss's local part over [tokens, vocab_shard]; AdamW over
    adam_numel fp32 parameters in 8 tensors (grads and model copy in `dtype`)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    # One builder per case: each closes over its own inputs.
    def bias_gelu():
        x, b = rand(tokens, 4 * hidden), rand(4 * hidden)
        return Case("bias_gelu", f"[{tokens}, {4 * hidden}]", dtype, lambda: ops.bias_gelu(x, b),
                    lambda: F.gelu(x + b, approximate="tanh"), 2 * _nbytes(x), "≥85% copy, ≥1.5× eager")

    def bias_dropout_add():
        x, b, r = rand(tokens, hidden), rand(hidden), rand(tokens, hidden)
        return Case("bias_dropout_add", f"[{tokens}, {hidden}] p=0.1", dtype,
                    lambda: ops.bias_dropout_add(x, b, r, 0.1, True), lambda: r + F.dropout(x + b, 0.1, True),
                    3 * _nbytes(x) + x.numel(), "≥85% copy, ≥1.5× eager", compare=False)

    def layer_norm():
        x, w, b = rand(tokens, hidden), rand(hidden), rand(hidden)
        return Case("layer_norm", f"[{tokens}, {hidden}]", dtype, lambda: ops.layer_norm(x, w, b, 1e-5),
                    lambda: F.layer_norm(x, (hidden,), w, b, 1e-5), 2 * _nbytes(x), "≥85% copy, ≥1.5× eager")

    def rms_norm():
        x, w = rand(tokens, hidden), rand(hidden)
        return Case("rms_norm", f"[{tokens}, {hidden}]", dtype, lambda: ops.rms_norm(x, w, 1e-6),
                    lambda: rms_norm_reference(x, w, 1e-6), 2 * _nbytes(x), "≥85% copy, ≥1.5× eager")

    def swiglu():
        x = rand(tokens, 2 * 4 * hidden)
        return Case("swiglu", f"[{tokens}, {8 * hidden}]", dtype, lambda: ops.swiglu(x),
                    lambda: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1], _nbytes(x) * 3 // 2,
                    "≥85% copy, ≥1.5× eager")

    def rotary_embedding():
        d, b = 128, 4
        s, nh = max(tokens // b, 1), max(hidden // d, 1)
        x = rand(s, b, nh, d)
        angles = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=g)
        freqs = angles.repeat(1, 2).view(s, 1, 1, d).to(device)
        return Case("rotary_embedding", f"[{s}, {b}, {nh}, {d}]", dtype, lambda: ops.rotary_embedding(x, freqs),
                    lambda: rope_reference(x, freqs), 2 * _nbytes(x), "≥85% copy, ≥1.5× eager")

    def scaled_masked_softmax():
        bs = max(1, tokens // sk)
        x = rand(bs, heads, sk, sk)
        mask = (torch.rand(bs, 1, sk, sk, generator=g) < 0.1).to(device)
        return Case("scaled_masked_softmax", f"[{bs}, {heads}, {sk}, {sk}]", dtype,
                    lambda: ops.scaled_masked_softmax(x, mask, 0.125),
                    lambda: masked_softmax_reference(x, mask, 0.125), 2 * _nbytes(x) + mask.numel(), "≥1.3× eager")

    def scaled_upper_triang_masked_softmax():
        bs = max(1, tokens // sk)
        x = rand(bs * heads, sk, sk)
        causal = torch.ones(sk, sk, dtype=torch.bool, device=device).triu(1)
        return Case("scaled_upper_triang_masked_softmax", f"[{bs * heads}, {sk}, {sk}]", dtype,
                    lambda: ops.scaled_upper_triang_masked_softmax(x, 0.125),
                    lambda: masked_softmax_reference(x, causal, 0.125), 2 * _nbytes(x), "≥1.3× eager")

    def vocab_parallel_cross_entropy_local():
        logits = rand(tokens, vocab_shard)
        target = torch.randint(0, 2 * vocab_shard, (tokens,), generator=g).to(device)
        real = vocab_shard - 7
        return Case("vocab_parallel_cross_entropy_local", f"[{tokens}, {vocab_shard}]", dtype,
                    lambda: ops.vocab_parallel_cross_entropy_local(logits, target, vocab_shard, real),
                    lambda: ce_local_reference(logits, target, vocab_shard, real), _nbytes(logits))

    def fused_adamw_():
        n = 8
        sizes = [adam_numel // n] * n
        params = [rand(k, dt=torch.float32) for k in sizes]
        grads = [rand(k) * 1e-2 for k in sizes]
        m = [torch.zeros(k, device=device) for k in sizes]
        v = [torch.zeros(k, device=device) for k in sizes]
        model = [p.to(dtype) for p in params] if dtype != torch.float32 else None
        p2, m2, v2 = [p.clone() for p in params], [t.clone() for t in m], [t.clone() for t in v]
        hp = (1e-4, 0.9, 0.95, 1e-8, 0.1)
        # fp32 param, m, v read and written; the grad read; the model copy written.
        per = 4 * 3 * 2 + grads[0].element_size() + (model[0].element_size() if model else 0)
        return Case("fused_adamw_", f"{n} × {sizes[0]} fp32, grads {str(dtype).replace('torch.', '')}", dtype,
                    lambda: ops.fused_adamw_(params, grads, m, v, *hp, 10, model),
                    lambda: adamw_reference_step(p2, grads, m2, v2, *hp, 10), per * sum(sizes), "≥85% copy",
                    compare=False)

    builders = [bias_gelu, bias_dropout_add, layer_norm, rms_norm, swiglu, rotary_embedding, scaled_masked_softmax,
                scaled_upper_triang_masked_softmax, vocab_parallel_cross_entropy_local, fused_adamw_]
    return [make() for make in builders if only is None or make.__name__ in only]


# ---- norms and bias-dropout-add against the alternatives (gpu_kernels.py's second table) ----

# (model, operator, rows = sequence × micro-batch, hidden): GPT-1.3B (LayerNorm, h 2048,
# seq 2048, micro-batch 8: scripts/bench/gpu_pretrain.py) and Llama-1B (Llama 3.2 1B:
# RMSNorm, h 2048, seq 4096 × micro-batch 4).
NORM_MODELS = [("gpt-1.3b", "layer_norm", 2048 * 8, 2048), ("llama-1b", "rms_norm", 4096 * 4, 2048)]
NORM_SWEEP_HIDDEN = (1024, 4096, 5120, 8192)
NORM_SWEEP_LONG = (65536, (2048, 8192))  # rows, hiddens


@dataclass
class NormCase:
    name: str  # "layer_norm fwd", "rms_norm bwd", "bias_dropout_add train", ...
    model: str
    shape: str
    dtype: torch.dtype
    bytes: int  # minimum traffic: activations read and written once, statistics included
    impls: Dict[str, Callable[[], object]]  # implementation -> one call
    missing: Dict[str, str]  # implementation -> why it is not measured
    check: Callable[[], float]  # megatorch vs the reference: max over outputs of max|diff| / max|ref|
    optional: bool = False  # --norm-sweep rows: skipped once the time budget has passed


def _describe(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160]}" if text else type(e).__name__


def _rel_diff(got, want) -> float:
    got = got if isinstance(got, (tuple, list)) else [got]
    want = want if isinstance(want, (tuple, list)) else [want]
    worst = 0.0
    for a, b in zip(got, want):
        if a is None or b is None:
            continue
        scale = b.float().abs().max().item() or 1.0
        worst = max(worst, (a.float() - b.float()).abs().max().item() / scale)
    return worst


def _third_party(kind: str, hidden: int, eps: float, device: str, dtype, w, b):
    """{name: module} of Apex's and Liger's norm for `kind` with our weights, and
    {name: reason} for those that cannot be used here."""
    mods, missing = {}, {}
    if device != "cuda":
        return mods, {"apex": "GPU only", "liger": "GPU only"}
    try:
        from apex.normalization import FusedLayerNorm, FusedRMSNorm
        mods["apex"] = (FusedLayerNorm(hidden, eps=eps) if kind == "layer_norm" else FusedRMSNorm(hidden, eps=eps))
    except Exception as e:  # noqa: BLE001 - not installed, or built without its CUDA extension
        missing["apex"] = f"not importable: {_describe(e)}"
    try:
        if kind == "layer_norm":
            from liger_kernel.transformers import LigerLayerNorm
            mods["liger"] = LigerLayerNorm(hidden, eps=eps)
        else:
            from liger_kernel.transformers import LigerRMSNorm
            try:  # in_place=True (the default) writes dx over the incoming gradient
                mods["liger"] = LigerRMSNorm(hidden, eps=eps, in_place=False)
            except TypeError:
                mods["liger"] = LigerRMSNorm(hidden, eps=eps)
    except Exception as e:  # noqa: BLE001
        missing["liger"] = f"not importable: {_describe(e)}"
    for name in list(mods):
        m = mods[name]
        try:
            m.to(device=device, dtype=dtype)
            with torch.no_grad():
                m.weight.copy_(w)
                if getattr(m, "bias", None) is not None and b is not None:
                    m.bias.copy_(b)
        except Exception as e:  # noqa: BLE001
            del mods[name]
            missing[name] = f"set-up failed: {_describe(e)}"
    return mods, missing


def _norm_cases(device, dtype, model, kind, rows, hidden, optional, g):
    eps = 1e-5 if kind == "layer_norm" else 1e-6

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x, w, dy = rand(rows, hidden), 1 + 0.1 * rand(hidden), rand(rows, hidden)
    b = 0.1 * rand(hidden) if kind == "layer_norm" else None
    es = x.element_size()
    n = x.numel()
    stats = rows * (8 if kind == "layer_norm" else 4)
    shape = f"[{rows}, {hidden}]"

    def ours(xx, ww, bb):
        return ops.layer_norm(xx, ww, bb, eps) if kind == "layer_norm" else ops.rms_norm(xx, ww, eps)

    def theirs(xx, ww, bb):
        return F.layer_norm(xx, (hidden,), ww, bb, eps) if kind == "layer_norm" else F.rms_norm(xx, (hidden,), ww, eps)

    mods, missing = _third_party(kind, hidden, eps, device, dtype, w, b)
    fwd = {"megatorch": lambda: ours(x, w, b), "torch": lambda: theirs(x, w, b)}
    for name, m in mods.items():
        fwd[name] = (lambda m=m: m(x))

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    # Backward: autograd of the forward's output, for every implementation alike.
    def leaf(t):
        return None if t is None else t.detach().clone().requires_grad_(True)

    def backward_of(fn_inputs):
        y, inputs = fn_inputs()
        return lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True)

    def ours_graph():
        xx, ww, bb = leaf(x), leaf(w), leaf(b)
        return ours(xx, ww, bb), [t for t in (xx, ww, bb) if t is not None]

    def theirs_graph():
        xx, ww, bb = leaf(x), leaf(w), leaf(b)
        return theirs(xx, ww, bb), [t for t in (xx, ww, bb) if t is not None]

    bwd = {"megatorch": backward_of(ours_graph), "torch": backward_of(theirs_graph)}
    for name, m in mods.items():
        def graph(m=m):
            xx = leaf(x)
            return m(xx), [xx] + [p for p in (m.weight, getattr(m, "bias", None)) if p is not None]
        try:
            bwd[name] = backward_of(graph)
        except Exception as e:  # noqa: BLE001
            missing[name] = f"forward failed: {_describe(e)}"

    def check_fwd():
        with torch.no_grad():
            return _rel_diff(ours(x, w, b), theirs(x, w, b))

    def check_bwd():
        return _rel_diff(bwd["megatorch"](), bwd["torch"]())

    return [
        NormCase(f"{kind} fwd", model, shape, dtype, 2 * n * es + stats, {k: no_grad(v) for k, v in fwd.items()},
                 dict(missing), check_fwd, optional),
        NormCase(f"{kind} bwd", model, shape, dtype, 3 * n * es + stats, bwd, dict(missing), check_bwd, optional),
    ]


def _bias_dropout_add_cases(device, dtype, model, rows, hidden, optional, g):
    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    x, b, r = rand(rows, hidden), rand(hidden), rand(rows, hidden)
    n, es, p = x.numel(), x.element_size(), 0.1
    shape = f"[{rows}, {hidden}] p={p}"
    na = {"apex": "no such kernel", "liger": "no such kernel"}

    def check_train():
        # Other draws than at::dropout: check out = residual + mask·(x + b)/(1 - p) instead.
        out, mask = ops._bias_dropout_add_fwd(x, b, r, p, True)
        want = (r.float() + (x + b).float() * mask * (1 / (1 - p))).to(dtype)
        return _rel_diff(out, want)

    def check_eval():
        return _rel_diff(ops.bias_dropout_add(x, b, r, p, False), r + (x + b))

    return [
        NormCase("bias_dropout_add train", model, shape, dtype, 3 * n * es + n,
                 {"megatorch": lambda: ops.bias_dropout_add(x, b, r, p, True),
                  "torch": lambda: r + F.dropout(x + b, p, True)}, na, check_train, optional),
        NormCase("bias_dropout_add eval", model, shape, dtype, 3 * n * es,
                 {"megatorch": lambda: ops.bias_dropout_add(x, b, r, p, False),
                  "torch": lambda: r + (x + b)}, na, check_eval, optional),
    ]


def make_norm_cases(device: str, dtypes, small: bool = False, sweep: bool = False, only: List[str] = None):
    """Generator of NormCase (built one at a time: the large ones hold GiBs) for the models
    in NORM_MODELS in each dtype, then bias-dropout-add at GPT-1.3B's shape, then with
    `sweep` the hidden sizes of NORM_SWEEP_HIDDEN and the long rows of NORM_SWEEP_LONG in
    bf16. "torch" is the reference: F.layer_norm / F.rms_norm, and the eager chain
    residual + dropout(x + b)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    wanted = (lambda name: only is None or name in only or "norms" in only)
    plan = []
    for dtype in dtypes:
        for model, kind, rows, hidden in NORM_MODELS:
            plan.append(("norm", dtype, model, kind, rows, hidden, False))
    for dtype in dtypes:
        model, _, rows, hidden = NORM_MODELS[0]
        plan.append(("bda", dtype, model, "bias_dropout_add", rows, hidden, False))
    if sweep:
        for kind in ("layer_norm", "rms_norm"):
            for hidden in NORM_SWEEP_HIDDEN:
                plan.append(("norm", torch.bfloat16, "sweep", kind, 16384, hidden, True))
            for hidden in NORM_SWEEP_LONG[1]:
                plan.append(("norm", torch.bfloat16, "sweep", kind, NORM_SWEEP_LONG[0], hidden, True))
        for hidden in NORM_SWEEP_HIDDEN:
            plan.append(("bda", torch.bfloat16, "sweep", "bias_dropout_add", 16384, hidden, True))
    for what, dtype, model, kind, rows, hidden, optional in plan:
        if not wanted(kind):
            continue
        if small:  # toy sizes for --device cpu --small; 5120 -> 40: not a power of two either
            rows, hidden = 256, (40 if hidden == 5120 else min(hidden, 64))
        if what == "norm":
            yield from _norm_cases(device, dtype, model, kind, rows, hidden, optional, g)
        else:
            yield from _bias_dropout_add_cases(device, dtype, model, rows, hidden, optional, g)


def max_abs_diff(a, b) -> float:
    if isinstance(a, (tuple, list)):
        return max(max_abs_diff(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item()
