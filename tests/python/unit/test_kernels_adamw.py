"""fused_adamw_ against torch.optim.AdamW (single-tensor path), on CPU and, when
present, on the GPU. Tolerance: 1e-5 relative to each tensor's magnitude after several
steps (tolerance.assert_close) -- the same fp32 formula, only the association of a few
products differs."""
import pytest
import torch

import megatorch  # noqa: F401  (loads the operators)
from tolerance import assert_close

SIZES = [1, 7, 33, 1000, 4099]
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _devices():
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    return out


def _run(device, grad_dtype, model_dtype, steps=4, betas=HYPER["betas"]):
    hyper = dict(HYPER, betas=betas)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    ref = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(ref, foreach=False, fused=False, **hyper)
    ps = [p.clone().to(device) for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    models = None if model_dtype is None else [torch.empty(p.shape, dtype=model_dtype, device=device) for p in ps]
    for step in range(1, steps + 1):
        grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in SIZES]
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        torch.ops.megatorch.fused_adamw_(ps, [g.to(device) for g in grads], ms, vs, hyper["lr"], betas[0], betas[1],
                                         hyper["eps"], hyper["weight_decay"], step, models)
    for i, (p, r) in enumerate(zip(ps, ref)):
        state = opt.state[r]
        assert_close(p.cpu(), r.detach(), msg=f"param {i}")
        assert_close(ms[i].cpu(), state["exp_avg"], msg=f"exp_avg {i}")
        # A sum of positive terms (no cancellation): relative to each element itself.
        assert_close(vs[i].cpu(), state["exp_avg_sq"], scale=0.0, msg=f"exp_avg_sq {i}")
        if models is not None:
            assert torch.equal(models[i], p.to(model_dtype)), "model copy is the fp32 param cast"


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_dtype", [None, torch.bfloat16, torch.float16])
def test_fused_adamw_matches_torch(device, grad_dtype, model_dtype):
    _run(device, grad_dtype, model_dtype)


@pytest.mark.parametrize("device", _devices())
def test_fused_adamw_default_betas(device):
    # beta2 = 0.999: 1 - beta2 must be rounded from double once, as torch passes it; 1.0f minus
    # float(0.999) is 1.3e-5 short, which exp_avg_sq (compared to 1e-5 of itself) shows.
    _run(device, torch.float32, None, betas=(0.9, 0.999))


def test_fused_adamw_many_tensors_cpu():
    # More tensors than one CUDA launch takes (24): the chunking is exercised on GPU.
    sizes = [3 + i for i in range(50)]
    p = [torch.randn(n) for n in sizes]
    g = [torch.randn(n) for n in sizes]
    ref = [x.clone().requires_grad_(True) for x in p]
    for r, gg in zip(ref, g):
        r.grad = gg.clone()
    torch.optim.AdamW(ref, foreach=False, lr=1e-3).step()
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    torch.ops.megatorch.fused_adamw_(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 1)
    for a, b in zip(p, ref):
        assert_close(a, b.detach())


def test_fused_adamw_rejects_bad_arguments():
    p = [torch.zeros(4)]
    with pytest.raises(RuntimeError, match="1-based step"):
        torch.ops.megatorch.fused_adamw_(p, [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4)], 1e-3, 0.9, 0.999,
                                         1e-8, 0.0, 0)
    with pytest.raises(RuntimeError, match="fp32 params and states"):
        torch.ops.megatorch.fused_adamw_([torch.zeros(4, dtype=torch.bfloat16)], [torch.zeros(4)], [torch.zeros(4)],
                                         [torch.zeros(4)], 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(RuntimeError, match="numel"):
        torch.ops.megatorch.fused_adamw_(p, [torch.zeros(5)], [torch.zeros(4)], [torch.zeros(4)], 1e-3, 0.9, 0.999,
                                         1e-8, 0.0, 1)


def test_fused_adamw_opcheck():
    def args():
        return ([torch.randn(5), torch.randn(3)], [torch.randn(5), torch.randn(3)], [torch.zeros(5), torch.zeros(3)],
                [torch.zeros(3 + 2), torch.zeros(3)], 1e-3, 0.9, 0.999, 1e-8, 0.01, 1,
                [torch.empty(5, dtype=torch.bfloat16), torch.empty(3, dtype=torch.bfloat16)])
    torch.library.opcheck(torch.ops.megatorch.fused_adamw_.default, args())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU comparison of fused_adamw_ skipped")
def test_fused_adamw_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(1)
    sizes = [1, 129, 1 << 20, 77] * 10  # 40 tensors: two launches
    state = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(2)]
    grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    cpu = [[t.clone() for t in state[0]], [t.clone() for t in grads], [t.clone() for t in state[1]],
           [t.abs() for t in state[1]]]
    gpu = [[t.cuda() for t in lst] for lst in cpu]
    cpu_model = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    gpu_model = [t.cuda() for t in cpu_model]
    torch.ops.megatorch.fused_adamw_(*cpu, 1e-3, 0.9, 0.95, 1e-8, 0.1, 3, cpu_model)
    torch.ops.megatorch.fused_adamw_(*gpu, 1e-3, 0.9, 0.95, 1e-8, 0.1, 3, gpu_model)
    for a, b in zip(cpu[0] + cpu[2] + cpu[3], gpu[0] + gpu[2] + gpu[3]):
        assert_close(b.cpu(), a, rtol=1e-6)  # the same formula; the GPU contracts other products into FMAs
