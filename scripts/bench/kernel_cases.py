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
                    lambda: F.gelu(x + b, approximate="tanh"), 2 * _nbytes(x), "≥80% copy, ≥1.5× eager")

    def bias_dropout_add():
        x, b, r = rand(tokens, hidden), rand(hidden), rand(tokens, hidden)
        return Case("bias_dropout_add", f"[{tokens}, {hidden}] p=0.1", dtype,
                    lambda: ops.bias_dropout_add(x, b, r, 0.1, True), lambda: r + F.dropout(x + b, 0.1, True),
                    3 * _nbytes(x) + x.numel(), "≥80% copy, ≥1.5× eager", compare=False)

    def layer_norm():
        x, w, b = rand(tokens, hidden), rand(hidden), rand(hidden)
        return Case("layer_norm", f"[{tokens}, {hidden}]", dtype, lambda: ops.layer_norm(x, w, b, 1e-5),
                    lambda: F.layer_norm(x, (hidden,), w, b, 1e-5), 2 * _nbytes(x), "≥80% copy, ≥1.5× eager")

    def rms_norm():
        x, w = rand(tokens, hidden), rand(hidden)
        return Case("rms_norm", f"[{tokens}, {hidden}]", dtype, lambda: ops.rms_norm(x, w, 1e-6),
                    lambda: rms_norm_reference(x, w, 1e-6), 2 * _nbytes(x), "≥80% copy, ≥1.5× eager")

    def swiglu():
        x = rand(tokens, 2 * 4 * hidden)
        return Case("swiglu", f"[{tokens}, {8 * hidden}]", dtype, lambda: ops.swiglu(x),
                    lambda: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1], _nbytes(x) * 3 // 2,
                    "≥80% copy, ≥1.5× eager")

    def rotary_embedding():
        d, b = 128, 4
        s, nh = max(tokens // b, 1), max(hidden // d, 1)
        x = rand(s, b, nh, d)
        angles = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=g)
        freqs = angles.repeat(1, 2).view(s, 1, 1, d).to(device)
        return Case("rotary_embedding", f"[{s}, {b}, {nh}, {d}]", dtype, lambda: ops.rotary_embedding(x, freqs),
                    lambda: rope_reference(x, freqs), 2 * _nbytes(x), "≥80% copy, ≥1.5× eager")

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
                    lambda: adamw_reference_step(p2, grads, m2, v2, *hp, 10), per * sum(sizes), "≥80% copy",
                    compare=False)

    builders = [bias_gelu, bias_dropout_add, layer_norm, rms_norm, swiglu, rotary_embedding, scaled_masked_softmax,
                scaled_upper_triang_masked_softmax, vocab_parallel_cross_entropy_local, fused_adamw_]
    return [make() for make in builders if only is None or make.__name__ in only]


def max_abs_diff(a, b) -> float:
    if isinstance(a, (tuple, list)):
        return max(max_abs_diff(x, y) for x, y in zip(a, b))
    return (a.float() - b.float()).abs().max().item()
