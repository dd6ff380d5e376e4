"""tests/python/tolerance.py: |got - want| <= rtol (|want| + scale), scale = max|want|.

A different summation order (another SIMD width, thread count, blocking) passes; an error
of 1e-4 relative to the reference's magnitude, a wrong sign and a missing term fail."""
import pytest
import torch

from tolerance import assert_catches_injected_errors, assert_close, close_report


def terms(n=100_000, seed=0):
    """n fp32 terms of magnitude ~20 (both signs: the sum cancels)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 20


def test_reordered_fp32_sums_pass():
    x = terms()
    exact = x.double().sum().float()
    scale = x.abs().sum()  # a cancelling reduction: relative to the sum of its |terms|
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))
    orders = {
        "ATen": x.sum(),
        "reversed": x.flip(0).sum(),
        "permuted": x[perm].sum(),
        "8 lanes": x.view(-1, 8).sum(0).sum(),
        "16 lanes": x.view(-1, 16).sum(0).sum(),
        "1000 blocks": x.view(1000, -1).sum(1).sum(),
        "sorted": x.sort().values.sum(),
    }
    for name, got in orders.items():
        assert_close(got, exact, scale=scale, msg=name)
        assert_close(got, orders["ATen"], scale=scale, msg=name)
    # All positive terms: the sum is its own scale, no scale argument needed.
    p = x.abs()
    for got in (p.sum(), p.flip(0).sum(), p.view(-1, 16).sum(0).sum(), p[perm].sum()):
        assert_close(got, p.double().sum().float())


def test_reordered_gemms_pass():
    """A gradient-like product, [64, 1000] x [1000, 48] with terms ~20: fp32 GEMM (any
    blocking) against the same product in double, and in two halves of k."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(64, 1000, generator=g) * 20, torch.randn(1000, 48, generator=g)
    exact = (a.double() @ b.double()).float()
    assert_close(a @ b, exact)
    assert_close(a[:, :500] @ b[:500] + a[:, 500:] @ b[500:], a @ b)
    assert_close((b.t() @ a.t()).t(), a @ b)


def test_python_numbers_and_lists():
    assert_close(5.000001, 5.0)
    assert_close([1.0, 2.0, 20.0], [1.0, 2.0 + 1e-4, 20.0])  # 1e-4 <= 1e-5 (2 + 20)
    with pytest.raises(AssertionError):
        assert_close([1.0, 2.0, 20.0], [1.0, 2.0 + 1e-3, 20.0])
    with pytest.raises(AssertionError):
        assert_close(5.001, 5.0)


def test_injected_relative_error_fails():
    x = terms(1000)
    want = x.view(10, 100).sum(1)
    got = x.view(10, 100).flip(1).sum(1)
    assert_close(got, want)
    with pytest.raises(AssertionError):
        assert_close(got * (1 + 1e-4), want)
    moved = got.clone()
    moved[3] += 1e-4 * want.abs().max()
    with pytest.raises(AssertionError):
        assert_close(moved, want)
    assert_catches_injected_errors(got, want)
    assert_catches_injected_errors(x.view(10, 100).t(), x.view(10, 100).t().clone())  # non-contiguous
    assert_catches_injected_errors(torch.zeros(3), torch.zeros(3))  # all zero: one element moved by 1e-4
    # The check itself refuses an injected error a correct comparison may pass.
    with pytest.raises(AssertionError, match="below 2 rtol"):
        assert_catches_injected_errors(got, want, rtol=1e-4)


def test_wrong_sign_and_missing_term_fail():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(64, 32, generator=g) * 20, torch.randn(64, 16, generator=g)
    want = x.t() @ y  # a weight gradient: a sum over 64 rows
    assert_close(x.t().double() @ y.double(), want.double())
    with pytest.raises(AssertionError):
        assert_close(-want, want)
    wrong = want.clone()
    wrong[5, 7] = -wrong[5, 7]
    with pytest.raises(AssertionError):
        assert_close(wrong, want)
    with pytest.raises(AssertionError):
        assert_close(x[1:].t() @ y[1:], want)  # one row's contribution missing
    with pytest.raises(AssertionError):
        assert_close(x[:, :-1].sum(1), x.sum(1), scale=x.abs().sum(1))  # one term of each row's sum missing


def test_a_shard_off_by_one_fails():
    want = torch.randn(4, 8, generator=torch.Generator().manual_seed(5)) * 3
    with pytest.raises(AssertionError):
        assert_close(want.roll(1, 0), want)


def test_scale_given_per_row_and_as_a_number():
    x = terms(4 * 1000).view(4, 1000)
    exact = x.double().sum(1).float()
    assert_close(x.flip(1).sum(1), exact, scale=x.abs().sum(1))
    # scale 0: rtol |want| alone (what a cancelling sum must not be held to).
    assert close_report(exact * (1 + 1e-6), exact, scale=0.0) is None
    assert close_report(exact * (1 + 1e-4), exact, scale=0.0) is not None
    # An elementwise op over a wide range: scale 1, not max|want| = 200.
    assert_close(torch.tensor([1e-3, 200.0]), torch.tensor([1e-3 + 1e-8, 200.0]), scale=1.0)
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([1e-3, 200.0]), torch.tensor([1e-3 + 1e-4, 200.0]), scale=1.0)


def test_failure_message_names_max_diff_scale_and_allowed():
    want = torch.tensor([1.0, 20.0, -3.0])
    got = want.clone()
    got[2] += 2 ** -7
    with pytest.raises(AssertionError) as err:
        assert_close(got, want, msg="grad of w")
    text = str(err.value)
    assert text.startswith("grad of w: 1 of 3 elements")
    assert "max |got - want| = 7.812e-03" in text and "max|want| = 2.000e+01" in text
    assert "worst at (2,)" in text and "allowed 2.300e-04" in text


def test_shapes_dtypes_and_non_finite_values():
    with pytest.raises(AssertionError, match="shapes differ"):
        assert_close(torch.zeros(3), torch.zeros(1, 3))
    with pytest.raises(AssertionError, match="dtypes differ"):
        assert_close(torch.zeros(3), torch.zeros(3, dtype=torch.float64))
    inf, nan = float("inf"), float("nan")
    assert_close(torch.tensor([1.0, -inf, nan]), torch.tensor([1.0, -inf, nan]))
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0]))
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, inf]))
    assert_close(torch.zeros(0), torch.zeros(0))
    assert_close(torch.zeros(3), torch.zeros(3))  # scale 0: only equal passes
    with pytest.raises(AssertionError):
        assert_close(torch.tensor([0.0, 1e-30]), torch.zeros(2))


def test_bf16_is_compared_in_double():
    want = torch.randn(100, generator=torch.Generator().manual_seed(6)).bfloat16()
    got = (want.float() * (1 + 2 ** -9)).bfloat16()  # within one rounding
    assert_close(got, want, rtol=2e-2)
    with pytest.raises(AssertionError):
        assert_close(-got, want, rtol=2e-2)
