"""Fused operators against unfused PyTorch references (CPU), gradcheck in double,
opcheck; the GPU comparison with the CPU implementation when a GPU is present.
Tolerances (tolerance.assert_close: |got - want| <= rtol (|want| + max|want|)): fp32 1e-5
(only the summation order differs), bf16 2e-2 and fp16 2e-3 (the fused kernels round
once, the references after every op), fp64 1e-10."""
import math

import pytest
import torch
import torch.nn.functional as F

import megatorch  # noqa: F401
from tolerance import assert_close

ops = torch.ops.megatorch
# rtol per dtype; the absolute part is rtol x max|want| (the reference tensor's magnitude).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float64: 1e-10}


def ref_rope(x, freqs):
    r = freqs.shape[-1]
    rot, rest = x[..., :r].float(), x[..., r:]
    x1, x2 = rot.chunk(2, -1)
    out = (rot * freqs.cos() + torch.cat([-x2, x1], -1) * freqs.sin()).to(x.dtype)
    return torch.cat([out, rest], -1)


def ref_masked_softmax(x, mask, scale):
    y = x.float() * scale
    if mask is not None:
        y = y.masked_fill(mask, float("-inf"))
    out = torch.softmax(y, -1).nan_to_num(0.0)
    return out.to(x.dtype)


def ref_causal_softmax(x, scale):
    sq, sk = x.shape[-2:]
    mask = torch.ones(sq, sk, dtype=torch.bool).triu(1)
    return ref_masked_softmax(x, mask, scale)


def cases(dtype, gen):
    """(name, fused fn, reference fn, inputs) for every differentiable operator."""
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    h = 37  # not a multiple of any vector width
    out = [
        ("bias_gelu", ops.bias_gelu, lambda x, b: F.gelu(x.float() + b.float(), approximate="tanh").to(x.dtype),
         (r(3, 5, h), r(h))),
        ("swiglu", ops.swiglu, lambda x: (F.silu(x.float().chunk(2, -1)[0]) * x.float().chunk(2, -1)[1]).to(x.dtype),
         (r(4, 3, 2 * h),)),
        ("layer_norm", lambda x, w, b: ops.layer_norm(x, w, b, 1e-5),
         lambda x, w, b: F.layer_norm(x.float(), (h,), w.float(), b.float(), 1e-5).to(x.dtype), (r(6, h), r(h), r(h))),
        ("rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-6),
         lambda x, w: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype),
         (r(6, h), r(h))),
        ("rotary_embedding", lambda x: ops.rotary_embedding(x, FREQS),
         lambda x: ref_rope(x, FREQS), (r(5, 2, 3, 10),)),
        ("scaled_masked_softmax", lambda x: ops.scaled_masked_softmax(x, MASK, 0.3),
         lambda x: ref_masked_softmax(x, MASK, 0.3), (r(2, 3, 5, 33),)),
        ("scaled_upper_triang_masked_softmax", lambda x: ops.scaled_upper_triang_masked_softmax(x, 0.7),
         lambda x: ref_causal_softmax(x, 0.7), (r(6, 9, 9),)),
        ("bias_dropout_add_eval", lambda x, b, res: ops.bias_dropout_add(x, b, res, 0.1, False),
         lambda x, b, res: (res.float() + x.float() + b.float()).to(x.dtype), (r(4, h), r(h), r(4, h))),
    ]
    return out


FREQS = (torch.arange(5, dtype=torch.float32)[:, None] * torch.tensor([1.0, 0.3, 0.1, 0.1, 0.3, 1.0])
         ).view(5, 1, 1, 6)  # r = 6 < d = 10: the last 4 channels pass through
MASK = torch.zeros(2, 1, 5, 33, dtype=torch.bool)
MASK[0, 0, 1, ::2] = True
MASK[1, 0, 3, :] = True  # a fully masked row -> zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_and_backward_match_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    for name, fused, ref, inputs in cases(dtype, gen):
        a = [t.clone().requires_grad_(True) for t in inputs]
        b = [t.clone().requires_grad_(True) for t in inputs]
        ya, yb = fused(*a), ref(*b)
        assert_close(ya, yb, RTOL[dtype], msg=f"{name} forward")
        g = torch.randn(ya.shape, generator=gen).to(dtype)
        ya.backward(g)
        yb.backward(g)
        for i, (ta, tb) in enumerate(zip(a, b)):
            assert_close(ta.grad, tb.grad, RTOL[dtype], msg=f"{name} grad {i}")


def test_fully_masked_rows_are_zero_not_nan():
    y = ops.scaled_masked_softmax(torch.randn(1, 1, 2, 4), torch.ones(1, 1, 2, 4, dtype=torch.bool), 1.0)
    assert torch.equal(y, torch.zeros(1, 1, 2, 4))


@pytest.mark.parametrize("sk", [1, 7, 1000, 4096])
def test_softmax_long_rows(sk):
    x = torch.randn(1, 2, 3, sk)
    assert_close(ops.scaled_masked_softmax(x, None, 0.125), torch.softmax(x * 0.125, -1))


def test_gradcheck_in_double():
    gen = torch.Generator().manual_seed(1)
    for name, fused, _, inputs in cases(torch.float64, gen):
        args = [t.clone().requires_grad_(True) for t in inputs]
        assert torch.autograd.gradcheck(fused, args, eps=1e-6, atol=1e-6), name


def test_bias_dropout_add_equals_unfused_under_same_generator_state():
    x, b, res = torch.randn(8, 33), torch.randn(33), torch.randn(8, 33)
    torch.manual_seed(5)
    fused = ops.bias_dropout_add(x, b, res, 0.3, True)
    torch.manual_seed(5)
    unfused = res + F.dropout(x + b, 0.3, True)
    assert torch.equal(fused, unfused)
    dropped = (fused - res == 0).float().mean().item()
    assert 0.15 < dropped < 0.45


def test_bias_dropout_add_backward_uses_the_mask():
    x = torch.randn(64, 16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    res = torch.randn(64, 16, requires_grad=True)
    y = ops.bias_dropout_add(x, b, res, 0.5, True)
    y.sum().backward()
    kept = (y - res.detach()) != 0
    # Exact: 1 / (1 - 0.5) = 2 and sums of 64 terms 0 or 2 are integers, in any order.
    assert torch.equal(x.grad, kept.float() * 2.0)
    assert torch.equal(b.grad, x.grad.sum(0))
    assert torch.equal(res.grad, torch.ones_like(res))


def test_cross_entropy_local():
    logits = torch.randn(5, 3, 11)
    target = torch.tensor([[0, 12, 3], [11, 14, 20], [-100, 13, 12], [19, 15, 16], [12, 13, 14]])
    start, real = 11, 9  # columns 20, 21 of this shard are padding
    mx, se, tl, sl = ops.vocab_parallel_cross_entropy_local(logits, target, start, real)
    x = logits[..., :real]
    assert torch.equal(mx, x.max(-1).values)  # a max does not round
    assert_close(se, (x - x.max(-1, keepdim=True).values).exp().sum(-1))  # positive terms
    assert_close(sl, x.sum(-1), scale=x.abs().sum(-1))  # the sum cancels: relative to its |terms|
    local = target - start
    inside = (local >= 0) & (local < 11)
    expect = torch.where(inside, logits.gather(-1, local.clamp(0, 10).unsqueeze(-1)).squeeze(-1), 0.0)
    assert torch.equal(tl, expect)  # the target's logit, picked


def _opcheck_args():
    x = torch.randn(3, 4, 8)
    return {
        "bias_gelu": (x.clone().requires_grad_(), torch.randn(8, requires_grad=True)),
        "swiglu": (x.clone().requires_grad_(),),
        "layer_norm": (x.clone().requires_grad_(), torch.randn(8, requires_grad=True), torch.randn(8), 1e-5),
        "rms_norm": (x.clone().requires_grad_(), torch.randn(8, requires_grad=True), 1e-5),
        "rotary_embedding": (torch.randn(5, 2, 3, 8, requires_grad=True), torch.randn(5, 1, 1, 4)),
        "scaled_masked_softmax": (torch.randn(2, 3, 4, 5, requires_grad=True), torch.rand(2, 1, 4, 5) > 0.5, 0.5),
        "scaled_upper_triang_masked_softmax": (torch.randn(6, 5, 5, requires_grad=True), 0.5),
        "bias_dropout_add": (x.clone().requires_grad_(), torch.randn(8), torch.randn(3, 4, 8), 0.2, False),
        "vocab_parallel_cross_entropy_local": (torch.randn(4, 9), torch.tensor([0, 3, 12, -100]), 2, 7),
    }


@pytest.mark.parametrize("name", list(_opcheck_args()))
def test_opcheck(name):
    torch.library.opcheck(getattr(ops, name).default, _opcheck_args()[name])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU comparisons with the CPU kernels skipped")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    gen = torch.Generator().manual_seed(2)
    global FREQS, MASK
    for name, fused, _, inputs in cases(dtype, gen):
        cpu_in = [t.clone().requires_grad_(True) for t in inputs]
        y_cpu = fused(*cpu_in)
        g = torch.randn(y_cpu.shape, generator=gen).to(dtype)
        y_cpu.backward(g)
        FREQS, MASK = FREQS.cuda(), MASK.cuda()
        try:
            gpu_in = [t.cuda().requires_grad_(True) for t in inputs]
            y_gpu = fused(*gpu_in)
            y_gpu.backward(g.cuda())
        finally:
            FREQS, MASK = FREQS.cpu(), MASK.cpu()
        assert_close(y_gpu.cpu(), y_cpu, RTOL[dtype], msg=name)
        for a, b in zip(gpu_in, cpu_in):
            assert_close(a.grad.cpu(), b.grad, RTOL[dtype], msg=f"{name} grad")
    x = torch.randn(2, 4, 4096, 4096 // 64, generator=gen).to(dtype)
    assert_close(ops.scaled_upper_triang_masked_softmax(x.view(8, 4096, 64).cuda()[:, :64, :64], 0.1).cpu(),
                 ops.scaled_upper_triang_masked_softmax(x.view(8, 4096, 64)[:, :64, :64], 0.1), RTOL[dtype])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the norms' vectorised CUDA paths skipped")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [256, 1024, 2048, 5120, 8192])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_cuda_norms_vector_paths_match_cpu(dtype, cols, weight_fp32):
    """Row lengths whole in 16-byte packs take the register-resident kernels (a warp per
    row up to 128 packs, a block per row beyond); weights in the input's dtype or fp32.
    Forward, input gradient and weight/bias gradients (summed over 300 rows, more than
    one block's share) against the CPU kernels."""
    gen = torch.Generator().manual_seed(cols)
    rows = 300
    x = (torch.randn(rows, cols, generator=gen) * 3 + 1).to(dtype)
    w = (torch.rand(cols, generator=gen) + 0.5).to(torch.float32 if weight_fp32 else dtype)
    b = torch.randn(cols, generator=gen).to(w.dtype)
    g = torch.randn(rows, cols, generator=gen).to(dtype)
    for name, fn, args in (("layer_norm", lambda x, w, b: ops.layer_norm(x, w, b, 1e-5), (x, w, b)),
                           ("rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-6), (x, w))):
        cpu_in = [t.clone().requires_grad_(True) for t in args]
        gpu_in = [t.cuda().requires_grad_(True) for t in args]
        y_cpu, y_gpu = fn(*cpu_in), fn(*gpu_in)
        y_cpu.backward(g)
        y_gpu.backward(g.cuda())
        assert_close(y_gpu.cpu(), y_cpu, RTOL[dtype], msg=name)
        for which, a, c in zip(("x", "weight", "bias"), gpu_in, cpu_in):
            assert_close(a.grad.cpu(), c.grad, RTOL[dtype] if which == "x" else max(RTOL[dtype], 1e-4),
                         msg=f"{name} grad {which}")


def _off_alignment(t):
    """t's values in a tensor whose data starts one element past a 16-byte boundary: the
    CUDA SwiGLU and RoPE kernels then take packs of one element (the scalar path)."""
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return storage[1:].view(t.shape).copy_(t)


def _assert_gpu_matches_cpu(got, want, msg):
    """fp32: 1e-5 of max|want|; 16-bit: that, then at most one rounding to the dtype apart."""
    if want.dtype == torch.float32:
        assert_close(got.cpu(), want, RTOL[torch.float32], msg=msg)
    else:
        _assert_one_rounding(got, want, msg, rtol32=RTOL[torch.float32])


def _swiglu_vector_case(dtype, f, device):
    """SwiGLU forward and backward on `device` against the CPU kernels; then the same input
    off 16-byte alignment (one element per pack) must give the same bits as the packs."""
    gen = torch.Generator().manual_seed(f)
    rows = 300
    x = (torch.randn(rows, 2 * f, generator=gen) * 2).to(dtype)
    g = torch.randn(rows, f, generator=gen).to(dtype)
    cpu_in, dev_in = x.clone().requires_grad_(True), x.to(device).requires_grad_(True)
    y_cpu, y_dev = ops.swiglu(cpu_in), ops.swiglu(dev_in)
    y_cpu.backward(g)
    y_dev.backward(g.to(device))
    _assert_gpu_matches_cpu(y_dev, y_cpu, f"swiglu forward, f = {f}")
    _assert_gpu_matches_cpu(dev_in.grad, cpu_in.grad, f"swiglu grad, f = {f}")
    x_off = _off_alignment(x.to(device))
    assert torch.equal(ops.swiglu(x_off), y_dev.detach()), "swiglu: scalar and vector paths differ"
    assert torch.equal(ops._swiglu_bwd(g.to(device), x_off), dev_in.grad), "swiglu grad: scalar and vector paths differ"


def _rope_vector_case(dtype, d, r, device):
    """RoPE forward and backward (autograd) on `device` against the CPU kernels, random
    angles (cos/sin of the two halves differ); pass-through channels copied exactly; the
    input off 16-byte alignment (one element per pack) gives the same bits as the packs."""
    gen = torch.Generator().manual_seed(d + r)
    s, b, heads = 48, 2, 5
    x = torch.randn(s, b, heads, d, generator=gen).to(dtype)
    g = torch.randn(s, b, heads, d, generator=gen).to(dtype)
    freqs = torch.rand(s, 1, 1, r, generator=gen) * 2 * math.pi
    cpu_in, dev_in = x.clone().requires_grad_(True), x.to(device).requires_grad_(True)
    y_cpu, y_dev = ops.rotary_embedding(cpu_in, freqs), ops.rotary_embedding(dev_in, freqs.to(device))
    y_cpu.backward(g)
    y_dev.backward(g.to(device))
    _assert_gpu_matches_cpu(y_dev, y_cpu, f"rope forward, d = {d}, r = {r}")
    _assert_gpu_matches_cpu(dev_in.grad, cpu_in.grad, f"rope grad, d = {d}, r = {r}")
    assert torch.equal(y_dev[..., r:].cpu(), x[..., r:]), "rope: pass-through channels changed"
    assert torch.equal(dev_in.grad[..., r:].cpu(), g[..., r:]), "rope grad: pass-through channels changed"
    fwd, bwd = ops._rotary_embedding_fwd, ops._rotary_embedding_bwd
    assert torch.equal(fwd(_off_alignment(x.to(device)), freqs.to(device)), y_dev.detach()), \
        "rope: scalar and vector paths differ"
    assert torch.equal(bwd(_off_alignment(g.to(device)), freqs.to(device)), dev_in.grad), \
        "rope grad: scalar and vector paths differ"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the SwiGLU vectorised CUDA paths skipped")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("f", [64, 1000, 5632])
def test_cuda_swiglu_vector_paths_match_cpu(dtype, f):
    """f a multiple of 8: 16-byte packs of gate, up (and grad) per thread."""
    _swiglu_vector_case(dtype, f, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the RoPE vectorised CUDA paths skipped")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,r", [(64, 64), (128, 128), (128, 64), (64, 32)])
def test_cuda_rope_vector_paths_match_cpu(dtype, d, r):
    """r/2 and d multiples of 8: a thread rotates a 16-byte pack of the first half with its
    partner pack of the second half; r < d adds pass-through packs."""
    _rope_vector_case(dtype, d, r, "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU dropout statistics skipped")
def test_cuda_bias_dropout_add_rate_and_generator():
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.manual_seed(3)
    a = ops.bias_dropout_add(x, None, torch.zeros_like(x), 0.25, True)
    torch.cuda.manual_seed(3)
    b = ops.bias_dropout_add(x, None, torch.zeros_like(x), 0.25, True)
    assert torch.equal(a, b)
    assert abs((a == 0).float().mean().item() - 0.25) < 0.01
    assert math.isclose(a.max().item(), 1 / 0.75, rel_tol=1e-6)
    # The vectorised path (rows whole in packs, with a bias): out = res + mask * (x + b) / keep.
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    out = ops.bias_dropout_add(x, bias, res, 0.1, True)
    kept = out != res  # a dropped element leaves the residual (x + b == 0 is measure-zero here)
    want = torch.where(kept, res.float() + (x.float() + bias.float()) / 0.9, res.float())
    assert_close(out.float(), want, RTOL[torch.bfloat16])
    assert abs(1 - kept.float().mean().item() - 0.1) < 0.01


_FAKE_GROUPS = {}  # c10d's registry holds groups weakly: keep them alive here


def _fake_tp_group(rank, size):
    """The name of a process group that says "rank `rank` of `size`" and communicates
    nothing (c10d's FakeProcessGroup): the loss's backward reads only the rank (its shard
    starts at rank · cols) and runs no collective, so one process can test any shard."""
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    name = f"megatorch_test_fake_tp_{rank}_of_{size}"
    if name not in _FAKE_GROUPS:
        pg = c10d.ProcessGroup(dist.HashStore(), rank, size)
        backend = c10d.FakeProcessGroup._create_internal(rank, size)
        pg._set_default_backend(c10d.ProcessGroup.BackendType.CUSTOM)
        for device in ("cpu", "cuda"):
            pg._register_backend(torch.device(device), c10d.ProcessGroup.BackendType.CUSTOM, backend)
        c10d._register_process_group(name, pg)
        _FAKE_GROUPS[name] = pg
    return name


def _assert_one_rounding(got, want, msg, rtol32=1e-6):
    """16-bit results of fp32 arithmetic that agrees to rtol32 x max|want| (the fp32 criterion:
    where p - ε/K cancels, an ulp of p is large next to the result) and is then rounded once
    to the dtype: at most one rounding step apart beyond that."""
    finfo = torch.finfo(want.dtype)
    g, w = got.cpu().double(), want.double()
    allowed = finfo.eps * torch.maximum(g.abs(), w.abs()) + rtol32 * w.abs().max() + finfo.smallest_normal * finfo.eps
    over = (g - w).abs() > allowed
    assert not over.any(), (f"{msg}: {int(over.sum())} values more than one rounding apart, e.g. got "
                            f"{g[over][0].item()!r}, want {w[over][0].item()!r}")


# (rank, tp, cols, vocab_size (0: every column real), label smoothing, elements off 16-byte
# alignment): this rank's shard is [rank · cols, (rank + 1) · cols), its columns at or past
# vocab_size are padding.
CE_BWD_CASES = [
    (0, 1, 1000, 0, 0.0, 0),  # one shard, 16-byte packs
    (1, 2, 1024, 2000, 0.1, 0),  # shard [1024, 2048): its last 48 columns padded
    (2, 4, 37, 100, 0.1, 0),  # a row length of no pack width: the scalar path
    (3, 4, 64, 150, 0.1, 0),  # a shard of padding only
    (3, 4, 12608, 50304, 0.1, 0),  # GPT's vocabulary at TP 4: several column chunks per row, 128 padded
    (1, 2, 48, 90, 0.05, 1),  # logits one element off 16-byte alignment: narrower packs
]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: the fused CUDA cross-entropy backward against the CPU backward skipped")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CE_BWD_CASES, ids=lambda c: "rank{}of{}-cols{}-vocab{}-eps{}-off{}".format(*c))
def test_cuda_cross_entropy_backward_matches_cpu(dtype, case):
    """The fused CUDA backward (kernels::cross_entropy_backward_cuda) against the CPU
    backward's ATen chain, through the loss's backward operator: fp32 to 1e-6 (the same
    fp32 arithmetic, op by op; only exp differs by an ulp or two), 16-bit to that and one rounding;
    padded columns and ignored rows exactly 0; targets in this shard, in other shards and
    ignore_index; the logits left as they were."""
    rank, tp, cols, vocab, smoothing, offset = case
    group = _fake_tp_group(rank, tp)
    start = rank * cols
    real = vocab if vocab > 0 else cols * tp
    real_cols = max(0, min(real - start, cols))
    gen = torch.Generator().manual_seed(cols + rank)
    shape = (4, 33)
    logits = (torch.randn(*shape, cols, generator=gen) * 3).to(dtype)
    target = torch.randint(0, real, shape, generator=gen)  # mostly in other shards
    if real_cols > 0:  # about half in this one
        here = start + torch.randint(0, real_cols, shape, generator=gen)
        target = torch.where(torch.rand(shape, generator=gen) < 0.5, here, target)
    target[0, 1] = target[3, 30] = -100
    lse = torch.logsumexp(logits.float(), -1) + torch.rand(shape, generator=gen)  # other shards add to the sum
    grad_loss = torch.randn(shape, generator=gen)
    bwd = ops._vocab_parallel_cross_entropy_bwd
    want = bwd(grad_loss, logits, target, lse, group, smoothing, -100, vocab)

    storage = torch.empty(logits.numel() + offset, dtype=dtype, device="cuda")
    logits_gpu = storage[offset:].view(logits.shape).copy_(logits)
    got = bwd(grad_loss.cuda(), logits_gpu, target.cuda(), lse.cuda(), group, smoothing, -100, vocab)
    assert got.dtype == dtype and got.shape == logits.shape and got.is_cuda
    assert torch.equal(logits_gpu.cpu(), logits), "the logits were overwritten"
    name = f"{dtype}, {case}"
    if dtype == torch.float32:
        assert_close(got.cpu(), want, 1e-6, msg=name)
    else:
        _assert_one_rounding(got, want, name)
    got = got.cpu()
    assert (got[..., real_cols:] == 0).all() and (want[..., real_cols:] == 0).all(), f"{name}: padded columns"
    assert (got[0, 1] == 0).all() and (got[3, 30] == 0).all(), f"{name}: ignored rows"


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: the CUDA cross-entropy backward through autograd skipped")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_cross_entropy_autograd_matches_cpu(dtype):
    """The loss's autograd on CUDA (fused backward, grad of a mean: an expanded grad_loss)
    against the CPU, with label smoothing and ignored tokens. The forwards' log-sum-exps
    differ in their last bits (CUDA's __expf, another summation order): 1e-5."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(6, 5, 256, generator=gen) * 2).to(dtype)
    target = torch.randint(0, 256, (6, 5), generator=gen)
    target[2] = -100
    grads = []
    for device in ("cpu", "cuda"):
        x = logits.to(device).requires_grad_(True)
        ops.vocab_parallel_cross_entropy(x, target.to(device), "", 0.1, -100).mean().backward()
        grads.append(x.grad.cpu())
    if dtype == torch.float32:
        assert_close(grads[1], grads[0], RTOL[dtype])
    else:
        _assert_one_rounding(grads[1], grads[0], str(dtype), rtol32=RTOL[torch.float32])
    assert (grads[1][2] == 0).all()


def test_extreme_inputs_match_reference():
    """The CPU kernels' vectorised exp (cpu_vec.cpp) at the edges: saturation, underflow, -inf."""
    x = torch.tensor([-200.0, -90.0, -87.5, -30.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 30.0, 87.5, 90.0, 200.0])
    # Elementwise (GeLU, SiLU and their derivatives): nothing is summed, each value rounds
    # relative to itself, or to O(1) where 1 + tanh cancels (x ~ -5): scale 1, not
    # max|want| = 200 (which would allow 2e-3 on values of 1e-3).
    elementwise = dict(rtol=1e-5, scale=1.0)
    assert_close(ops.bias_gelu(x[None], torch.zeros_like(x)), F.gelu(x[None], approximate="tanh"), **elementwise)
    assert_close(ops.swiglu(torch.cat([x, torch.ones_like(x)])[None]), F.silu(x)[None], **elementwise)
    for scale in [1.0, 0.01]:
        assert_close(ops.scaled_masked_softmax(x.view(1, 1, 1, -1), None, scale),
                     torch.softmax(x * scale, -1).view(1, 1, 1, -1), msg=f"softmax, scale {scale}")
    mx, se, tl, sl = ops.vocab_parallel_cross_entropy_local(x[None], torch.tensor([3]), 0, x.numel())
    assert_close(se, (x - x.max()).exp().sum()[None])
    grad = torch.randn(1, x.numel())
    xg = x[None].clone().requires_grad_(True)
    ops.bias_gelu(xg, torch.zeros_like(x)).backward(grad)
    xr = x[None].clone().requires_grad_(True)
    F.gelu(xr, approximate="tanh").backward(grad)
    assert_close(xg.grad, xr.grad, **elementwise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 4099])
def test_vector_tails(dtype, n):
    """Row lengths around and between the vector widths (4, 8, 16 floats)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=gen).to(dtype)
    b, w = torch.randn(n, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    rtol = RTOL[dtype]
    f = lambda t: t.float()  # noqa: E731
    assert_close(ops.bias_gelu(x, b), F.gelu(f(x) + f(b), approximate="tanh").to(dtype), rtol, msg="bias_gelu")
    assert_close(ops.layer_norm(x, w, b, 1e-5), F.layer_norm(f(x), (n,), f(w), f(b), 1e-5).to(dtype), rtol,
                 msg="layer_norm")
    assert_close(ops.rms_norm(x, w, 1e-5),
                 (f(x) * torch.rsqrt(f(x).pow(2).mean(-1, keepdim=True) + 1e-5) * f(w)).to(dtype), rtol, msg="rms_norm")
    assert_close(ops.swiglu(torch.cat([x, x.flip(-1)], -1)), (F.silu(f(x)) * f(x).flip(-1)).to(dtype), rtol,
                 msg="swiglu")
    assert_close(ops.scaled_upper_triang_masked_softmax(x.view(1, 3, n)[:, :, :n], 0.5)[0, 2, :3],
                 ref_causal_softmax(x.view(1, 3, n), 0.5)[0, 2, :3], rtol, msg="causal softmax")
