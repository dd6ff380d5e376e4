"""Float comparisons whose tolerance follows rounding, not luck.

    |got - want| <= rtol * (|want| + scale)   elementwise,

scale = max |want| over the reference by default (the magnitude that rounding errors of a
different summation order -- another SIMD width, thread count, MKL/oneDNN path -- are
relative to), or what the caller passes: e.g. the sum of the absolute terms of a reduction
whose result cancels. That is torch.allclose with atol = rtol * scale; the C++ tests use the
same criterion (rtol = 1e-5 for fp32 parity). An error of 1e-4 relative to the reference's
magnitude always fails at rtol = 1e-5.

Bit-for-bit properties (resume, the same layout twice, exact round trips) are not compared
here: they use torch.equal / ==.
"""
import math

import torch

__all__ = ["assert_close", "close_report", "assert_catches_injected_errors"]


def _tensor(x):
    if isinstance(x, torch.Tensor):
        return x.detach()
    return torch.as_tensor(x, dtype=torch.float64)


def close_report(got, want, rtol=1e-5, scale=None):
    """None when got is close to want under the criterion above, otherwise why not."""
    g, w = _tensor(got), _tensor(want)
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.dtype != want.dtype:
        return f"dtypes differ: got {got.dtype}, want {want.dtype}"
    if g.shape != w.shape:
        return f"shapes differ: got {tuple(g.shape)}, want {tuple(w.shape)}"
    g, w = g.cpu().double(), w.cpu().double()
    finite = torch.isfinite(w)
    # Non-finite references (inf, nan) must be reproduced exactly.
    same_special = (g == w) | (torch.isnan(g) & torch.isnan(w))
    bad_special = (~finite & ~same_special) | (finite & ~torch.isfinite(g))
    if bad_special.any():
        i = int(bad_special.flatten().nonzero()[0])
        return f"non-finite mismatch at flat index {i}: got {g.flatten()[i].item()!r}, want {w.flatten()[i].item()!r}"
    if scale is None:
        s = w[finite].abs().max().item() if finite.any() else 0.0
        scale_text = f"max|want| = {s:.3e}"
    elif isinstance(scale, torch.Tensor):
        s = scale.detach().cpu().double()
        scale_text = f"the given scale (max {s.abs().max().item():.3e})"
    else:
        s = float(scale)
        scale_text = f"the given scale {s:.3e}"
    allowed = rtol * (w.abs() + s)
    allowed = torch.broadcast_to(allowed, w.shape)
    diff = torch.where(finite, (g - w).abs(), torch.zeros_like(w))
    over = diff > allowed
    if not over.any():
        return None
    ratio = torch.where(over, diff / allowed.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(w))
    i = int(ratio.flatten().argmax())
    idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), w.shape)) if w.dim() else ()
    return (f"{int(over.sum())} of {w.numel()} elements outside rtol * (|want| + scale), rtol = {rtol:g}, "
            f"scale = {scale_text}; max |got - want| = {diff.max().item():.3e}; worst at {idx}: "
            f"got {g.flatten()[i].item():.9g}, want {w.flatten()[i].item():.9g}, "
            f"|diff| = {diff.flatten()[i].item():.3e} > allowed {allowed.flatten()[i].item():.3e}")


def assert_close(got, want, rtol=1e-5, scale=None, msg=None):
    """Asserts |got - want| <= rtol * (|want| + scale) elementwise (scale = max |want| unless
    given: a number, or a tensor broadcasting to want such as per-row sums of |terms|).
    got/want: tensors of the same dtype and shape, or Python numbers / lists."""
    report = close_report(got, want, rtol, scale)
    if report is not None:
        raise AssertionError(f"{msg}: {report}" if msg else report)


def assert_catches_injected_errors(got, want, rtol=1e-5, scale=None, rel=1e-4, msg=None):
    """The comparison assert_close(got, want, rtol, scale) passes, and rejects `got` with an
    injected error of `rel` relative: every element scaled by (1 + rel), and one element --
    the largest reference element, where the allowance is widest -- moved by rel * max|want|
    (away from want). Shows that the tolerance of a parity test is not too loose."""
    assert math.isfinite(rel) and rel > 2 * rtol, "an injected error below 2 rtol may legitimately pass"
    assert_close(got, want, rtol, scale, msg)
    g = _tensor(got).clone(memory_format=torch.contiguous_format)
    w = _tensor(want)
    magnitude = w.abs().max().item() if w.numel() else 0.0
    if magnitude > 0:  # an all-zero reference has no relative error to scale
        scaled = g * (1 + rel)
        assert close_report(scaled, want if isinstance(want, torch.Tensor) else w, rtol, scale) is not None, \
            f"{msg}: got * (1 + {rel:g}) passed"
    moved = g.clone()
    flat = moved.view(-1)
    i = int(w.abs().flatten().argmax())
    sign = 1.0 if (flat[i] - w.flatten()[i].to(flat.dtype)).item() >= 0 else -1.0
    flat[i] += sign * rel * (magnitude if magnitude > 0 else 1.0)
    assert close_report(moved, want if isinstance(want, torch.Tensor) else w, rtol, scale) is not None, \
        f"{msg}: element {i} moved by {rel:g} * max|want| passed"
