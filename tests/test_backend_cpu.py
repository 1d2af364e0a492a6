"""The CPU backend against the float64 spec (tests/reference.py), finite differences, and torch.

Backward kernels are checked three ways: against the reference backward, against central
finite differences of the backend's own forward in float64, and against torch autograd. The
differentiated scalar is always sum(f(x) * r) for a random cotangent r, never a plain sum.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as ref
from forge_ml import flags, rng
from forge_ml.backends import contract, cpu
from forge_ml.errors import DTypeError, ShapeError

FLOATS = [np.float64, np.float32]
TOL = {np.float64: dict(rtol=1e-12, atol=1e-12), np.float32: dict(rtol=1e-5, atol=1e-5)}
FD_TOL = dict(rtol=1e-6, atol=1e-8)
HYPO = settings(max_examples=25, deadline=None)


def randn(shape, dtype=np.float64, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)


def check(actual, expected, dtype):
    """actual has dtype ``dtype`` and matches the float64 ``expected`` to that dtype's tolerance."""
    assert actual.dtype == np.dtype(dtype), (actual.dtype, dtype)
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, **TOL[dtype])


def fd_grad(f, x, r, eps=1e-6):
    """Central-difference d/dx of sum(f() * r); f reads x, which is perturbed in place."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        plus = np.sum(f() * r)
        x[idx] = old - eps
        minus = np.sum(f() * r)
        x[idx] = old
        g[idx] = (plus - minus) / (2 * eps)
    return g


def t64(x, grad=False):
    return torch.tensor(np.asarray(x, np.float64), requires_grad=grad)


# ============================================================================== the module

def test_capabilities_and_contract():
    assert (cpu.NAME, cpu.BF16, cpu.GRAPHS, cpu.HOST_MEMORY) == ("cpu", False, False, True)
    assert contract.missing(cpu) == [] and contract.missing(cpu.reference) == []
    from forge_ml.backends import load
    bk = load("cpu")
    assert all(callable(getattr(bk, n)) for n in contract.FUSED)
    # the sampling rule and OpenAI's adjustments run through the host (compose's defaults are
    # sampling.sample_row and sampling.adjusted themselves); the layernorm and attention
    # backwards' C kernels sum their gradient's rows as they write them
    assert bk.composed == ["sample_next", "penalize_logits"]
    assert cpu.synchronize() is None


class _FakeLibc:
    def __init__(self):
        self.calls = []
        self.mallopt = lambda *args: self.calls.append(args) or 1


@pytest.mark.parametrize("setting", ["tuned", "default"])
def test_start_tunes_malloc_only_when_asked(monkeypatch, setting):
    libc = _FakeLibc()
    monkeypatch.setattr(cpu.ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(cpu.sys, "platform", "linux")
    with flags.override(FORGE_CPU_MALLOC=setting):
        assert cpu.start() is None
    expected = [(-3, 32 << 20), (-1, 256 << 20)] if setting == "tuned" else []
    assert libc.calls == expected


# ============================================================================== memory

@pytest.mark.parametrize("name", ["float32", "float64", "int32", "int64"])
def test_memory_ops(name):
    z = cpu.zeros((2, 3), name)
    assert z.shape == (2, 3) and z.dtype == np.dtype(name) and not z.any()
    src = np.arange(6, dtype=np.float64).reshape(2, 3)
    a = cpu.from_host(src, name)
    src[0, 0] = 99
    assert a.dtype == np.dtype(name) and a[0, 0] == 0 and a.flags.c_contiguous
    h = cpu.to_host(a)
    h[0, 1] = 42
    assert a[0, 1] == 1
    c = cpu.cast(a, "float64")
    assert c.dtype == np.float64 and c is not a
    d = cpu.copy(a)
    d[1, 1] = -1
    assert a[1, 1] == 4


def test_from_host_makes_contiguous():
    src = np.arange(12, dtype=np.float32).reshape(3, 4).T
    a = cpu.from_host(src, "float32")
    assert a.flags.c_contiguous and np.array_equal(a, src)


def test_bfloat16_refused():
    for call in (lambda: cpu.zeros((2,), "bfloat16"),
                 lambda: cpu.from_host(np.zeros(2), "bfloat16"),
                 lambda: cpu.cast(np.zeros(2, np.float32), "bfloat16")):
        with pytest.raises(DTypeError, match="bfloat16 is a GPU storage type.*--device cuda"):
            call()


# ============================================================================== matmul

# (a shape, b shape, trans_a, trans_b, alpha, with bias, b_rows)
MATMUL_CASES = [
    ((5, 4), (4, 3), False, False, 1.0, False, None),
    ((5, 4), (4, 3), False, False, 1.0, True, None),
    ((4, 5), (4, 3), True, False, 1.0, False, None),
    ((5, 4), (3, 4), False, True, 0.125, True, None),
    ((4, 5), (3, 4), True, True, -2.0, False, None),
    ((2, 5, 4), (2, 4, 3), False, False, 1.0, True, None),
    ((2, 3, 5, 4), (2, 3, 6, 4), False, True, 0.5, False, None),
    ((2, 3, 1, 4), (2, 3, 9, 4), False, True, 0.5, False, 6),   # q @ K_cache[:6]^T
    ((2, 3, 1, 6), (2, 3, 9, 4), False, False, 1.0, False, 6),  # p @ V_cache[:6]
    ((5, 4), (7, 3), False, False, 1.0, True, 4),
    ((2, 4, 5), (2, 4, 3), True, False, 1.0, False, None),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", MATMUL_CASES)
def test_matmul_forward(case, dtype):
    sa, sb, ta, tb, alpha, with_bias, b_rows = case
    a, b = randn(sa, dtype, 1), randn(sb, dtype, 2)
    n = (sb[-2] if tb else sb[-1])
    bias = randn((n,), dtype, 3) if with_bias else None
    out = cpu.matmul(a, b, bias, ta, tb, alpha, b_rows)
    assert out.flags.c_contiguous
    check(out, ref.matmul(a, b, bias, ta, tb, alpha, b_rows), dtype)


def test_matmul_rank3_by_2d():
    a, b, bias = randn((2, 5, 4)), randn((4, 3), seed=1), randn((3,), seed=2)
    out = cpu.matmul(a, b, bias, False, False, 1.0, None)
    check(out, ref.matmul(a, b, bias), np.float64)


@pytest.mark.parametrize("case", MATMUL_CASES)
def test_matmul_reference_backward_vs_fd(case):
    """The spec's matmul_bwd (which the tape composes from matmul calls) vs finite diffs."""
    sa, sb, ta, tb, alpha, with_bias, b_rows = case
    a, b = randn(sa, seed=1), randn(sb, seed=2)
    n = (sb[-2] if tb else sb[-1])
    bias = randn((n,), seed=3) if with_bias else None
    out = cpu.matmul(a, b, bias, ta, tb, alpha, b_rows)
    r = randn(out.shape, seed=4)
    da, db, dbias = ref.matmul_bwd(a, b, r, bias, ta, tb, alpha, b_rows)
    fwd = lambda: cpu.matmul(a, b, bias, ta, tb, alpha, b_rows)
    np.testing.assert_allclose(da, fd_grad(fwd, a, r), **FD_TOL)
    np.testing.assert_allclose(db, fd_grad(fwd, b, r), **FD_TOL)
    if bias is not None:
        np.testing.assert_allclose(dbias, fd_grad(fwd, bias, r), **FD_TOL)


@pytest.mark.parametrize("dtype", FLOATS)
def test_matmul_backward_linear(dtype):
    """y = x @ W + b: dx = dy @ W^T, dW = x^T @ dy, db = sum_rows(dy), all through the backend."""
    x, w, b = randn((6, 4), dtype, 1), randn((4, 5), dtype, 2), randn((5,), dtype, 3)
    dy = randn((6, 5), dtype, 4)
    dx = cpu.matmul(dy, w, None, False, True, 1.0, None)
    dw = cpu.matmul(x, dy, None, True, False, 1.0, None)
    db = cpu.sum_rows(dy)
    edx, edw, edb = ref.matmul_bwd(x, w, dy, b)
    check(dx, edx, dtype)
    check(dw, edw, dtype)
    check(db, edb, dtype)
    if dtype == np.float64:
        fwd = lambda: cpu.matmul(x, w, b, False, False, 1.0, None)
        np.testing.assert_allclose(dx, fd_grad(fwd, x, dy), **FD_TOL)
        np.testing.assert_allclose(dw, fd_grad(fwd, w, dy), **FD_TOL)
        np.testing.assert_allclose(db, fd_grad(fwd, b, dy), **FD_TOL)


def test_matmul_backward_scores():
    """s = alpha q @ k^T (batched): dq = alpha ds @ k, dk = alpha ds^T @ q."""
    q, k = randn((2, 3, 5, 4), seed=1), randn((2, 3, 5, 4), seed=2)
    ds = randn((2, 3, 5, 5), seed=3)
    dq = cpu.matmul(ds, k, None, False, False, 0.5, None)
    dk = cpu.matmul(ds, q, None, True, False, 0.5, None)
    eq, ek, _ = ref.matmul_bwd(q, k, ds, None, False, True, 0.5)
    check(dq, eq, np.float64)
    check(dk, ek, np.float64)


def test_matmul_vs_torch():
    a, b, bias = randn((2, 6, 5), seed=1), randn((2, 4, 5), seed=2), randn((4,), seed=3)
    r = randn((2, 6, 4), seed=4)
    out = cpu.matmul(a, b, bias, False, True, 0.7, None)
    ta, tb, tbias = t64(a, True), t64(b, True), t64(bias, True)
    tout = 0.7 * ta @ tb.transpose(-1, -2) + tbias
    (tout * t64(r)).sum().backward()
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-12, atol=1e-12)
    eda, edb, edbias = ref.matmul_bwd(a, b, r, bias, False, True, 0.7)
    np.testing.assert_allclose(eda, ta.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(edb, tb.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(edbias, tbias.grad.numpy(), rtol=1e-12, atol=1e-12)
    # and the backend composition the tape uses: dA = alpha dY B, dB = alpha dY^T A
    np.testing.assert_allclose(cpu.matmul(r, b, None, False, False, 0.7, None),
                               ta.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cpu.matmul(r, a, None, True, False, 0.7, None),
                               tb.grad.numpy(), rtol=1e-12, atol=1e-12)


@HYPO
@given(m=st.integers(1, 6), k=st.integers(1, 6), n=st.integers(1, 6),
       lead=st.sampled_from([(), (2,), (2, 3)]), ta=st.booleans(), tb=st.booleans(),
       alpha=st.sampled_from([1.0, 0.5, -3.0]), with_bias=st.booleans(),
       extra_rows=st.integers(0, 3), use_b_rows=st.booleans())
def test_matmul_property(m, k, n, lead, ta, tb, alpha, with_bias, extra_rows, use_b_rows):
    sa = (*lead, k, m) if ta else (*lead, m, k)
    rows_b = n if tb else k
    b_rows = rows_b if use_b_rows else None
    stored_rows = rows_b + (extra_rows if use_b_rows else 0)
    sb = (*lead, stored_rows, k) if tb else (*lead, stored_rows, n)
    a, b = randn(sa, seed=m), randn(sb, seed=n)
    bias = randn((n,), seed=k) if with_bias else None
    out = cpu.matmul(a, b, bias, ta, tb, alpha, b_rows)
    assert out.shape == (*lead, m, n)
    check(out, ref.matmul(a, b, bias, ta, tb, alpha, b_rows), np.float64)


# ========================================================================= add, sum_rows, sumsq

@pytest.mark.parametrize("dtype", FLOATS)
def test_add_and_sum_rows(dtype):
    a, b = randn((2, 3, 4), dtype, 1), randn((2, 3, 4), dtype, 2)
    check(cpu.add(a, b), ref.add(a, b), dtype)
    s = cpu.sum_rows(a)
    assert s.shape == (4,)
    check(s, ref.sum_rows(a), dtype)


def test_add_vs_torch():
    a, b, r = randn((2, 3, 4), seed=1), randn((2, 3, 4), seed=2), randn((2, 3, 4), seed=3)
    ta, tb = t64(a, True), t64(b, True)
    ((ta + tb) * t64(r)).sum().backward()
    np.testing.assert_array_equal(cpu.add(a, b), (ta + tb).detach().numpy())
    # add's backward hands dy to both inputs unchanged
    np.testing.assert_array_equal(ta.grad.numpy(), r)
    np.testing.assert_array_equal(tb.grad.numpy(), r)
    np.testing.assert_allclose(fd_grad(lambda: cpu.add(a, b), a, r), r, **FD_TOL)


def test_sum_rows_vs_fd_and_torch():
    x, r = randn((3, 5, 4), seed=1), randn((4,), seed=2)
    # sum_rows is linear: its gradient wrt x is r broadcast to every row
    np.testing.assert_allclose(fd_grad(lambda: cpu.sum_rows(x), x, r),
                               np.broadcast_to(r, x.shape), **FD_TOL)
    np.testing.assert_allclose(cpu.sum_rows(x), t64(x).sum(dim=(0, 1)).numpy(), rtol=1e-12)


@pytest.mark.parametrize("dtype", FLOATS)
def test_sumsq(dtype):
    x = randn((7, 5), dtype, 1)
    s = cpu.sumsq(x)
    assert s.shape == () and s.dtype == np.dtype(dtype)
    check(s, ref.sumsq(x), dtype)
    np.testing.assert_allclose(s, torch.linalg.vector_norm(t64(x)).item() ** 2, rtol=1e-6)


def test_sumsq_float32_accurate_on_large_input():
    x = randn((3_000_001,), np.float32, 5, scale=3.0)
    exact = ref.sumsq(x)
    assert abs(float(cpu.sumsq(x)) - exact) / exact < 1e-7


def test_sumsq_grad_vs_fd():
    x, r = randn((4, 3), seed=1), 1.7  # 0-d output: the cotangent is a scalar
    np.testing.assert_allclose(fd_grad(lambda: cpu.sumsq(x), x, r), 2 * r * x, **FD_TOL)


# ============================================================================== gelu

@pytest.mark.parametrize("dtype", FLOATS)
def test_gelu_forward_backward(dtype):
    x = randn((3, 4, 8), dtype, 1, scale=3.0)
    dy = randn((3, 4, 8), dtype, 2)
    check(cpu.gelu(x), ref.gelu(x), dtype)
    check(cpu.gelu_bwd(x, dy), ref.gelu_bwd(x, dy), dtype)


def test_gelu_many_blocks():
    """Arrays longer than one cache block (2^18 elements), with a ragged last block."""
    x = randn((3, 100_003), np.float32, 1, scale=3.0)
    dy = randn((3, 100_003), np.float32, 2)
    check(cpu.gelu(x), ref.gelu(x), np.float32)
    check(cpu.gelu_bwd(x, dy), ref.gelu_bwd(x, dy), np.float32)


def test_gelu_extremes_finite():
    x = np.array([-1e4, -50.0, -10.0, 0.0, 10.0, 50.0, 1e4], np.float32)
    y = cpu.gelu(x)
    d = cpu.gelu_bwd(x, np.ones_like(x))
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(d))
    np.testing.assert_allclose(y, ref.gelu(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(d, ref.gelu_bwd(x, np.ones_like(x)), rtol=1e-6, atol=1e-6)


def test_gelu_bwd_vs_fd_and_torch():
    x, r = randn((4, 6), seed=1, scale=2.0), randn((4, 6), seed=2)
    dx = cpu.gelu_bwd(x, r)
    np.testing.assert_allclose(dx, fd_grad(lambda: cpu.gelu(x), x, r), **FD_TOL)
    tx = t64(x, True)
    ty = F.gelu(tx, approximate="tanh")
    (ty * t64(r)).sum().backward()
    np.testing.assert_allclose(cpu.gelu(x), ty.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-12, atol=1e-14)


@HYPO
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), seed=st.integers(0, 1000))
def test_gelu_property(shape, seed):
    x, dy = randn(shape, seed=seed, scale=4.0), randn(shape, seed=seed + 1)
    check(cpu.gelu(x), ref.gelu(x), np.float64)
    check(cpu.gelu_bwd(x, dy), ref.gelu_bwd(x, dy), np.float64)


# ============================================================================== layernorm

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 16)])
def test_layernorm_forward_backward(shape, dtype):
    c = shape[-1]
    x = randn(shape, dtype, 1, scale=2.0)
    gamma, beta = randn((c,), dtype, 2), randn((c,), dtype, 3)
    dy = randn(shape, dtype, 4)
    check(cpu.layernorm(x, gamma, beta, 1e-5), ref.layernorm(x, gamma, beta, 1e-5), dtype)
    dx, dgamma, dbeta = cpu.layernorm_bwd(x, gamma, dy, 1e-5)
    edx, edgamma, edbeta = ref.layernorm_bwd(x, gamma, dy, 1e-5)
    check(dx, edx, dtype)
    check(dgamma, edgamma, dtype)
    check(dbeta, edbeta, dtype)


def test_layernorm_bwd_vs_fd():
    x = randn((2, 3, 6), seed=1)
    gamma, beta, r = randn((6,), seed=2), randn((6,), seed=3), randn((2, 3, 6), seed=4)
    dx, dgamma, dbeta = cpu.layernorm_bwd(x, gamma, r, 1e-5)
    fwd = lambda: cpu.layernorm(x, gamma, beta, 1e-5)
    np.testing.assert_allclose(dx, fd_grad(fwd, x, r), **FD_TOL)
    np.testing.assert_allclose(dgamma, fd_grad(fwd, gamma, r), **FD_TOL)
    np.testing.assert_allclose(dbeta, fd_grad(fwd, beta, r), **FD_TOL)


def test_layernorm_vs_torch():
    x = randn((3, 4, 10), seed=1)
    gamma, beta, r = randn((10,), seed=2), randn((10,), seed=3), randn((3, 4, 10), seed=4)
    tx, tg, tb = t64(x, True), t64(gamma, True), t64(beta, True)
    ty = F.layer_norm(tx, (10,), tg, tb, 1e-5)
    (ty * t64(r)).sum().backward()
    np.testing.assert_allclose(cpu.layernorm(x, gamma, beta, 1e-5), ty.detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    dx, dgamma, dbeta = cpu.layernorm_bwd(x, gamma, r, 1e-5)
    for mine, theirs in ((dx, tx), (dgamma, tg), (dbeta, tb)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_layernorm_float32_large_mean_is_stable():
    """A one-pass E[x^2] - E[x]^2 loses everything here; the two-pass form does not."""
    x = (1000.0 + randn((4, 64), seed=1)).astype(np.float32)
    gamma, beta = np.ones(64, np.float32), np.zeros(64, np.float32)
    np.testing.assert_allclose(cpu.layernorm(x, gamma, beta, 1e-5),
                               ref.layernorm(x, gamma, beta, 1e-5), atol=2e-3)


@HYPO
@given(rows=st.integers(1, 4), c=st.integers(2, 12), seed=st.integers(0, 1000))
def test_layernorm_property(rows, c, seed):
    x, dy = randn((rows, c), seed=seed, scale=3.0), randn((rows, c), seed=seed + 1)
    gamma, beta = randn((c,), seed=seed + 2), randn((c,), seed=seed + 3)
    check(cpu.layernorm(x, gamma, beta, 1e-5), ref.layernorm(x, gamma, beta, 1e-5), np.float64)
    for mine, spec in zip(cpu.layernorm_bwd(x, gamma, dy, 1e-5),
                          ref.layernorm_bwd(x, gamma, dy, 1e-5)):
        np.testing.assert_allclose(mine, spec, rtol=1e-10, atol=1e-10)


# ============================================================================== softmax

SOFTMAX_CASES = [((4, 7), False, 0), ((2, 3, 5, 5), True, 0), ((2, 4, 7), True, 3),
                 ((3, 1, 6), True, 5), ((6, 6), True, 0)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,causal,off", SOFTMAX_CASES)
def test_softmax_forward_backward(shape, causal, off, dtype):
    x, dy = randn(shape, dtype, 1, scale=3.0), randn(shape, dtype, 2)
    y = cpu.softmax(x, causal, off)
    check(y, ref.softmax(x, causal, off), dtype)
    if causal:
        masked = ~ref.causal_mask(shape[-2], shape[-1], off)
        assert np.all(y[..., masked] == 0.0)
    check(cpu.softmax_bwd(y, dy), ref.softmax_bwd(y, dy), dtype)


@pytest.mark.parametrize("shape,causal,off", SOFTMAX_CASES[:3])
def test_softmax_bwd_vs_fd(shape, causal, off):
    x, r = randn(shape, seed=1), randn(shape, seed=2)
    dx = cpu.softmax_bwd(cpu.softmax(x, causal, off), r)
    np.testing.assert_allclose(dx, fd_grad(lambda: cpu.softmax(x, causal, off), x, r), **FD_TOL)


def test_softmax_large_inputs_stable():
    x = np.array([[1e4, 1e4 - 1.0, -1e4]], np.float32)
    y = cpu.softmax(x, False, 0)
    np.testing.assert_allclose(y, ref.softmax(x), rtol=1e-6, atol=1e-7)


def test_softmax_vs_torch():
    x, r = randn((2, 4, 9), seed=1), randn((2, 4, 9), seed=2)
    mask = torch.ones(4, 9, dtype=torch.bool).triu(diagonal=5 + 1)  # off = 5
    tx = t64(x, True)
    ty = torch.softmax(tx.masked_fill(mask, float("-inf")), dim=-1)
    (ty * t64(r)).sum().backward()
    y = cpu.softmax(x, True, 5)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(cpu.softmax_bwd(y, r), tx.grad.numpy(), rtol=1e-12, atol=1e-14)


@HYPO
@given(rows=st.integers(1, 6), cols=st.integers(1, 8), causal=st.booleans(),
       off=st.integers(0, 4), lead=st.sampled_from([(), (2,)]), seed=st.integers(0, 1000))
def test_softmax_property(rows, cols, causal, off, lead, seed):
    shape = (*lead, rows, cols)
    x, dy = randn(shape, seed=seed, scale=3.0), randn(shape, seed=seed + 1)
    y = cpu.softmax(x, causal, off)
    check(y, ref.softmax(x, causal, off), np.float64)
    check(cpu.softmax_bwd(y, dy), ref.softmax_bwd(y, dy), np.float64)


# ============================================================================== logsumexp

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,causal,off", SOFTMAX_CASES + [((5,), False, 0)])
def test_logsumexp(shape, causal, off, dtype):
    x = randn(shape, dtype, 1, scale=3.0)
    out = cpu.logsumexp(x, causal, off)
    assert out.shape == shape[:-1]
    check(out, ref.logsumexp(x, causal, off), dtype)


def test_logsumexp_large_scores_stable():
    """Scores in the thousands: exp overflows unless the row max is taken out first."""
    x = randn((3, 4, 9), np.float32, 1, scale=1e3)
    out = cpu.logsumexp(x, True, 2)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref.logsumexp(x, True, 2), rtol=1e-6)


def test_logsumexp_vs_torch_and_attention_lse():
    x = randn((2, 4, 9), seed=1, scale=2.0)
    mask = torch.ones(4, 9, dtype=torch.bool).triu(diagonal=5 + 1)  # off = 5
    theirs = torch.logsumexp(t64(x).masked_fill(mask, float("-inf")), dim=-1).numpy()
    np.testing.assert_allclose(cpu.logsumexp(x, True, 5), theirs, rtol=1e-12, atol=1e-14)
    q, k, v = (randn((2, 3, 6, 4), seed=s) for s in (2, 3, 4))
    scores = cpu.matmul(q, k, None, False, True, 0.3, None)
    np.testing.assert_allclose(cpu.logsumexp(scores, True, 0), cpu.attention(q, k, v, 0.3)[1],
                               rtol=1e-12)


@pytest.mark.parametrize("dtype", FLOATS)
def test_logsumexp_infinities_stay_in_their_rows(dtype):
    x = randn((5, 6), dtype, 1)
    x[1] = -np.inf                      # every column "masked": log(0)
    x[2, 3] = np.inf
    x[3, 0] = np.nan
    with np.errstate(all="raise"):      # no warnings either
        out = cpu.logsumexp(x, False, 0)
    assert out[1] == -np.inf and out[2] == np.inf and np.isnan(out[3])
    check(out[[0, 4]], ref.logsumexp(x[[0, 4]]), dtype)
    assert cpu.logsumexp(np.zeros((3, 0), dtype), False, 0).tolist() == [-np.inf] * 3


@HYPO
@given(rows=st.integers(1, 6), cols=st.integers(1, 8), causal=st.booleans(),
       off=st.integers(0, 4), lead=st.sampled_from([(), (2,)]), seed=st.integers(0, 1000))
def test_logsumexp_property(rows, cols, causal, off, lead, seed):
    x = randn((*lead, rows, cols), seed=seed, scale=5.0)
    check(cpu.logsumexp(x, causal, off), ref.logsumexp(x, causal, off), np.float64)


# ============================================================================== heads

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
def test_heads_forward(lead, dtype):
    h, t, hs = 3, 4, 2
    qkv = randn((*lead, t, 3 * h * hs), dtype, 1)
    for mine, spec in zip(cpu.split_heads(qkv, h), ref.split_heads(qkv, h)):
        assert mine.flags.c_contiguous and mine.shape == (*lead, h, t, hs)
        check(mine, spec, dtype)
    x = randn((*lead, h, t, hs), dtype, 2)
    merged = cpu.merge_heads(x)
    assert merged.flags.c_contiguous and merged.shape == (*lead, t, h * hs)
    check(merged, ref.merge_heads(x), dtype)
    dy = randn((*lead, t, h * hs), dtype, 3)
    check(cpu.unmerge_heads(dy, h), ref.unmerge_heads(dy, h), dtype)
    for which in range(3):
        out = cpu.unsplit_head(x, which)
        assert out.shape == (*lead, t, 3 * h * hs)
        check(out, ref.unsplit_head(x, which), dtype)


def test_heads_backward_vs_fd():
    h, t, hs = 2, 3, 2
    qkv = randn((2, t, 3 * h * hs), seed=1)
    rs = [randn((2, h, t, hs), seed=s) for s in (2, 3, 4)]
    # split_heads: d/dqkv of sum_i <split(qkv)_i, r_i> is the sum of unsplit_head(r_i, i)
    grad = sum(cpu.unsplit_head(r, i) for i, r in enumerate(rs))
    fwd = lambda: np.concatenate([part.ravel() for part in cpu.split_heads(qkv, h)])
    r_all = np.concatenate([r.ravel() for r in rs])
    np.testing.assert_allclose(grad, fd_grad(fwd, qkv, r_all), **FD_TOL)
    x, r = randn((2, h, t, hs), seed=5), randn((2, t, h * hs), seed=6)
    np.testing.assert_allclose(cpu.unmerge_heads(r, h),
                               fd_grad(lambda: cpu.merge_heads(x), x, r), **FD_TOL)


def test_heads_vs_torch():
    h, t, hs = 4, 5, 3
    qkv = randn((2, t, 3 * h * hs), seed=1)
    tq, tk, tv = t64(qkv).split(h * hs, dim=-1)
    for mine, theirs in zip(cpu.split_heads(qkv, h), (tq, tk, tv)):
        np.testing.assert_array_equal(mine, theirs.view(2, t, h, hs).transpose(1, 2).numpy())
    x = randn((2, h, t, hs), seed=2)
    np.testing.assert_array_equal(cpu.merge_heads(x),
                                  t64(x).transpose(1, 2).reshape(2, t, h * hs).numpy())


@HYPO
@given(h=st.integers(1, 4), t=st.integers(1, 5), hs=st.integers(1, 4),
       lead=st.sampled_from([(), (2,)]))
def test_heads_property(h, t, hs, lead):
    qkv = randn((*lead, t, 3 * h * hs), seed=h * t)
    parts = cpu.split_heads(qkv, h)
    for mine, spec in zip(parts, ref.split_heads(qkv, h)):
        np.testing.assert_array_equal(mine, spec)
    back = sum(cpu.unsplit_head(p, i) for i, p in enumerate(parts))
    np.testing.assert_array_equal(back, qkv)
    np.testing.assert_array_equal(cpu.unmerge_heads(cpu.merge_heads(parts[0]), h), parts[0])


# ============================================================================== attention

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 4, 3), (2, 3, 6, 4), (1, 300, 8)])
def test_attention_forward_backward(shape, dtype):
    q, k, v = (randn(shape, dtype, s) for s in (1, 2, 3))
    dout = randn(shape, dtype, 4)
    scale = 1.0 / math.sqrt(shape[-1])
    out, lse = cpu.attention(q, k, v, scale)
    eout, else_ = ref.attention(q, k, v, scale)
    assert lse.shape == shape[:-1]
    check(out, eout, dtype)
    check(lse, else_, dtype)
    grads = cpu.attention_bwd(q, k, v, out, lse, dout, scale)
    for mine, spec in zip(grads, ref.attention_bwd(q, k, v, dout, scale)):
        check(mine, spec, dtype)


def test_attention_bwd_vs_fd():
    shape = (2, 2, 5, 3)
    q, k, v, r = (randn(shape, seed=s) for s in (1, 2, 3, 4))
    out, lse = cpu.attention(q, k, v, 0.4)
    dq, dk, dv = cpu.attention_bwd(q, k, v, out, lse, r, 0.4)
    fwd = lambda: cpu.attention(q, k, v, 0.4)[0]
    np.testing.assert_allclose(dq, fd_grad(fwd, q, r), **FD_TOL)
    np.testing.assert_allclose(dk, fd_grad(fwd, k, r), **FD_TOL)
    np.testing.assert_allclose(dv, fd_grad(fwd, v, r), **FD_TOL)


@pytest.mark.parametrize("t", [7, 301])
def test_attention_vs_composed_backend_path(t):
    """attention == matmul + causal softmax + matmul through the backend's own ops."""
    shape = (2, t, 4)
    q, k, v, dout = (randn(shape, seed=s) for s in (1, 2, 3, 4))
    scale = 0.5
    s = cpu.matmul(q, k, None, False, True, scale, None)
    p = cpu.softmax(s, True, 0)
    out = cpu.matmul(p, v, None, False, False, 1.0, None)
    dv = cpu.matmul(p, dout, None, True, False, 1.0, None)
    ds = cpu.softmax_bwd(p, cpu.matmul(dout, v, None, False, True, 1.0, None))
    dq = cpu.matmul(ds, k, None, False, False, scale, None)
    dk = cpu.matmul(ds, q, None, True, False, scale, None)
    fout, flse = cpu.attention(q, k, v, scale)
    np.testing.assert_allclose(fout, out, rtol=1e-12, atol=1e-12)
    fgrads = cpu.attention_bwd(q, k, v, fout, flse, dout, scale)
    for mine, composed in zip(fgrads, (dq, dk, dv)):
        np.testing.assert_allclose(mine, composed, rtol=1e-11, atol=1e-12)


def test_attention_vs_torch():
    shape = (2, 3, 6, 4)
    q, k, v, r = (randn(shape, seed=s) for s in (1, 2, 3, 4))
    tq, tk, tv = t64(q, True), t64(k, True), t64(v, True)
    tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=0.3)
    (tout * t64(r)).sum().backward()
    out, lse = cpu.attention(q, k, v, 0.3)
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(cpu.attention_bwd(q, k, v, out, lse, r, 0.3), (tq, tk, tv)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-11, atol=1e-12)
    scores = 0.3 * t64(q) @ t64(k).transpose(-1, -2)
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    np.testing.assert_allclose(lse, torch.logsumexp(scores, -1).numpy(), rtol=1e-12)


@HYPO
@given(h=st.integers(1, 3), t=st.integers(1, 7), hs=st.integers(1, 5),
       lead=st.sampled_from([(), (2,)]), seed=st.integers(0, 1000))
def test_attention_property(h, t, hs, lead, seed):
    shape = (*lead, h, t, hs)
    q, k, v, dout = (randn(shape, seed=seed + i) for i in range(4))
    out, lse = cpu.attention(q, k, v, 0.6)
    eout, else_ = ref.attention(q, k, v, 0.6)
    check(out, eout, np.float64)
    check(lse, else_, np.float64)
    for mine, spec in zip(cpu.attention_bwd(q, k, v, out, lse, dout, 0.6),
                          ref.attention_bwd(q, k, v, dout, 0.6)):
        np.testing.assert_allclose(mine, spec, rtol=1e-10, atol=1e-11)


# ========================================================================= embedding, scatter, kv

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_embedding_forward(dtype, id_dtype):
    wte, wpe = randn((11, 4), dtype, 1), randn((9, 4), dtype, 2)
    ids = np.array([[3, 0, 10, 3], [7, 7, 1, 2]], id_dtype)
    out = cpu.embedding(ids, wte, wpe, 2)
    assert out.shape == (2, 4, 4)
    check(out, ref.embedding(ids, wte, wpe, 2), dtype)
    check(cpu.embedding(ids[0], wte, wpe, 0), ref.embedding(ids[0], wte, wpe, 0), dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_embedding_per_row_positions(dtype):
    """pos of one element per row: row b takes wpe[pos[b] + t], as the shared call would."""
    wte, wpe = randn((11, 4), dtype, 1), randn((9, 4), dtype, 2)
    ids = np.array([[3, 0], [7, 7], [1, 10], [2, 2]], np.int32)
    pos = np.array([0, 7, 3, 5], np.int32)
    out = cpu.embedding(ids, wte, wpe, pos)
    assert out.shape == (4, 2, 4) and out.dtype == np.dtype(dtype)
    for b in range(4):
        np.testing.assert_array_equal(out[b], cpu.embedding(ids[b:b + 1], wte, wpe, int(pos[b]))[0])
        check(out[b], ref.embedding(ids[b], wte, wpe, int(pos[b])), dtype)


def test_embedding_per_row_out_of_range_is_nan_in_that_row_only():
    wte, wpe = randn((11, 4), seed=1), randn((9, 4), seed=2)
    ids = np.array([[3, 0], [7, 7], [1, 10]], np.int32)
    out = cpu.embedding(ids, wte, wpe, np.array([1, 8, -1], np.int32))  # 8 + 2 > 9 rows
    assert np.isnan(out[1:]).all()
    np.testing.assert_array_equal(out[0], cpu.embedding(ids[:1], wte, wpe, 1)[0])


def test_embedding_one_element_pos_is_shared():
    wte, wpe = randn((11, 4), seed=1), randn((9, 4), seed=2)
    ids = np.array([[3, 0], [7, 7], [1, 10]], np.int32)
    np.testing.assert_array_equal(cpu.embedding(ids, wte, wpe, np.array([4], np.int32)),
                                  cpu.embedding(ids, wte, wpe, 4))
    assert np.isnan(cpu.embedding(ids, wte, wpe, np.array([8], np.int32))).all()
    with pytest.raises(ShapeError, match="pos has 2 positions but ids"):
        cpu.embedding(ids, wte, wpe, np.array([0, 1], np.int32))


def test_embedding_backward_vs_fd_and_torch():
    """dwte = scatter_add_rows(0, ids, dy); dwpe[pos:pos+T] = dy summed over the batch."""
    wte, wpe = randn((6, 3), seed=1), randn((8, 3), seed=2)
    ids = np.array([[1, 4, 1], [5, 1, 0]], np.int64)
    r = randn((2, 3, 3), seed=3)
    dwte = cpu.zeros(wte.shape, "float64")
    cpu.scatter_add_rows(dwte, ids, r)
    dwpe = cpu.zeros(wpe.shape, "float64")
    dwpe[2:5] = r.sum(axis=0)  # (T, C): positions pos..pos+T-1
    edwte, edwpe = ref.embedding_bwd(ids, 6, 8, r, 2)
    np.testing.assert_allclose(dwte, edwte, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dwpe, edwpe, rtol=1e-12, atol=1e-12)
    fwd = lambda: cpu.embedding(ids, wte, wpe, 2)
    np.testing.assert_allclose(dwte, fd_grad(fwd, wte, r), **FD_TOL)
    np.testing.assert_allclose(dwpe, fd_grad(fwd, wpe, r), **FD_TOL)
    twte, twpe = t64(wte, True), t64(wpe, True)
    tout = F.embedding(torch.from_numpy(ids), twte) + twpe[2:5]
    (tout * t64(r)).sum().backward()
    np.testing.assert_allclose(fwd(), tout.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(dwte, twte.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dwpe, twpe.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", FLOATS)
def test_scatter_add_rows_repeated_ids(dtype):
    dst = randn((7, 5), dtype, 1)
    ids = np.array([[3, 3, 0, 6], [3, 1, 6, 3]], np.int32)
    src = randn((2, 4, 5), dtype, 2)
    expected = ref.scatter_add_rows(dst, ids, src)
    before = dst.copy()
    assert cpu.scatter_add_rows(dst, ids, src) is None
    check(dst, expected, dtype)
    np.testing.assert_array_equal(dst[[2, 4, 5]], before[[2, 4, 5]])  # untouched rows


def test_scatter_add_rows_empty_and_vs_torch():
    dst = randn((4, 3), seed=1)
    before = dst.copy()
    cpu.scatter_add_rows(dst, np.zeros((0,), np.int64), np.zeros((0, 3)))
    np.testing.assert_array_equal(dst, before)
    ids = np.array([2, 0, 2, 2, 3], np.int64)
    src = randn((5, 3), seed=2)
    cpu.scatter_add_rows(dst, ids, src)
    theirs = t64(before).index_add_(0, torch.from_numpy(ids), t64(src))
    np.testing.assert_allclose(dst, theirs.numpy(), rtol=1e-12)


@HYPO
@given(v=st.integers(1, 6), n=st.integers(0, 20), c=st.integers(1, 4), seed=st.integers(0, 1000))
def test_scatter_add_rows_property(v, n, c, seed):
    gen = np.random.default_rng(seed)
    dst, src = randn((v, c), seed=seed), randn((n, c), seed=seed + 1)
    ids = gen.integers(0, v, size=n)
    expected = ref.scatter_add_rows(dst, ids, src)
    cpu.scatter_add_rows(dst, ids, src)
    np.testing.assert_allclose(dst, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", FLOATS)
def test_kv_append(dtype):
    cache = randn((2, 3, 8, 4), dtype, 1)
    new = randn((2, 3, 2, 4), dtype, 2)
    expected = ref.kv_append(cache, new, 5)
    assert cpu.kv_append(cache, new, 5) is None
    check(cache, expected, dtype)
    one = randn((2, 3, 1, 4), dtype, 3)
    cpu.kv_append(cache, one, 0)
    np.testing.assert_array_equal(cache[..., 0:1, :], one)


# ============================================================================== decoding step

def _decode_setup(dtype, B=4, H=2, tmax=8, hs=4, seed=0):
    qkv = randn((B, 3 * H * hs), dtype, seed)
    k0, v0 = randn((B, H, tmax, hs), dtype, seed + 1), randn((B, H, tmax, hs), dtype, seed + 2)
    return qkv, k0, v0


@pytest.mark.parametrize("dtype", FLOATS)
def test_decode_attention_per_row_positions(dtype):
    """Row b at its own position: the same y and cache rows as a shared-position call per row."""
    qkv, k0, v0 = _decode_setup(dtype)
    pos = np.array([0, 7, 3, 5], np.int32)
    kc, vc = k0.copy(), v0.copy()
    y = cpu.decode_attention(qkv, kc, vc, pos, 2, 0.5)
    assert y.shape == (4, 8) and y.dtype == np.dtype(dtype)
    for b in range(4):
        kb, vb = k0[b:b + 1].copy(), v0[b:b + 1].copy()
        yb = cpu.decode_attention(qkv[b:b + 1], kb, vb, int(pos[b]), 2, 0.5)
        np.testing.assert_allclose(y[b], yb[0], **TOL[dtype])
        np.testing.assert_array_equal(kc[b], kb[0])
        np.testing.assert_array_equal(vc[b], vb[0])
        spec = ref.decode_attention(qkv[b:b + 1], k0[b:b + 1], v0[b:b + 1], int(pos[b]), 2, 0.5)
        check(y[b], spec[0][0], dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_decode_attention_per_row_stale_nonfinite_past_position_does_not_leak(dtype, bad):
    """A NaN or inf left in a row's caches past its position (a slot's earlier request) is
    masked: that row's y equals the one from finite caches (0 * NaN is NaN, so it is skipped)."""
    qkv, k0, v0 = _decode_setup(dtype)
    pos = np.array([2, 7, 3, 5], np.int32)
    want = cpu.decode_attention(qkv, k0.copy(), v0.copy(), pos, 2, 0.5)
    kc, vc = k0.copy(), v0.copy()
    kc[0, :, 5], vc[0, :, 5], vc[2, 1, 6, 0] = bad, bad, bad
    y = cpu.decode_attention(qkv, kc, vc, pos, 2, 0.5)
    np.testing.assert_allclose(y, want, **TOL[dtype])


def test_decode_attention_per_row_out_of_range_writes_nothing_and_gives_nan():
    qkv, k0, v0 = _decode_setup(np.float64)
    kc, vc = k0.copy(), v0.copy()
    y = cpu.decode_attention(qkv, kc, vc, np.array([2, 8, -1, 6], np.int32), 2, 0.5)
    assert np.isnan(y[[1, 2]]).all() and np.isfinite(y[[0, 3]]).all()
    np.testing.assert_array_equal(kc[[1, 2]], k0[[1, 2]])
    np.testing.assert_array_equal(vc[[1, 2]], v0[[1, 2]])
    for b, p in ((0, 2), (3, 6)):
        kb, vb = k0[b:b + 1].copy(), v0[b:b + 1].copy()
        np.testing.assert_allclose(y[b], cpu.decode_attention(qkv[b:b + 1], kb, vb, p, 2, 0.5)[0],
                                   rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(kc[b], kb[0])
    kc, vc = k0.copy(), v0.copy()
    y = cpu.decode_attention(qkv, kc, vc, np.array([9, -2, 8, 100], np.int32), 2, 0.5)
    assert np.isnan(y).all() and np.array_equal(kc, k0) and np.array_equal(vc, v0)


def test_decode_attention_one_element_pos_is_shared():
    qkv, k0, v0 = _decode_setup(np.float64)
    kc, vc, kd, vd = k0.copy(), v0.copy(), k0.copy(), v0.copy()
    y = cpu.decode_attention(qkv, kc, vc, np.array([5], np.int32), 2, 0.5)
    np.testing.assert_array_equal(y, cpu.decode_attention(qkv, kd, vd, 5, 2, 0.5))
    np.testing.assert_array_equal(kc, kd)
    with pytest.raises(ShapeError, match="pos has 3 positions but qkv has 4 rows"):
        cpu.decode_attention(qkv, kc, vc, np.array([1, 2, 3], np.int32), 2, 0.5)


def test_greedy_next_per_row_positions():
    logits = randn((3, 10), np.float32, 1)
    ids, out = np.zeros((3, 1), np.int32), np.full(3, -1, np.int32)
    pos = np.array([0, 4, 2], np.int32)
    cpu.greedy_next(logits, 7, ids, pos, out)
    for b, start in enumerate((0, 4, 2)):
        ib, ob = np.zeros((1, 1), np.int32), np.full(1, -1, np.int32)
        pb = np.array([start], np.int32)
        cpu.greedy_next(logits[b:b + 1], 7, ib, pb, ob)
        assert ids[b, 0] == ib[0, 0] == ob[0] == out[b] == np.argmax(logits[b, :7])
        assert pos[b] == pb[0] == start + 1


# ============================================================================== dropout

def test_dropout_mask_is_the_rng_stream():
    x = np.ones((3, 5, 7), np.float32)
    y = cpu.dropout(x, 0.3, 1234)
    keep = ref.dropout_mask(x.shape, 0.3, 1234)
    np.testing.assert_array_equal(y != 0, keep)
    np.testing.assert_array_equal(keep.ravel(), rng.dropout_keep(1234, x.size, 0.3))
    assert np.all(y[keep] == np.float32(1.0) * rng.dropout_scale(0.3))


@pytest.mark.parametrize("dtype", FLOATS)
def test_dropout_forward_backward(dtype):
    x, dy = randn((4, 6), dtype, 1), randn((4, 6), dtype, 2)
    y = cpu.dropout(x, 0.25, 99)
    check(y, ref.dropout(x, 0.25, 99), dtype)
    # backward regenerates the mask: it is dropout of dy with the same (p, seed)
    check(cpu.dropout(dy, 0.25, 99), ref.dropout_bwd(x.shape, dy, 0.25, 99), dtype)
    assert not np.array_equal(cpu.dropout(x, 0.25, 100) != 0, y != 0)  # another seed, another mask


def test_dropout_p0_copies_and_fd():
    x = randn((3, 4), seed=1)
    y = cpu.dropout(x, 0.0, 5)
    assert y is not x and np.array_equal(y, x)
    r = randn((3, 4), seed=2)
    np.testing.assert_allclose(cpu.dropout(r, 0.4, 7),
                               fd_grad(lambda: cpu.dropout(x, 0.4, 7), x, r), **FD_TOL)


def test_dropout_vs_torch_with_same_mask():
    x, r = randn((5, 6), seed=1), randn((5, 6), seed=2)
    keep = torch.from_numpy(ref.dropout_mask(x.shape, 0.5, 3))
    tx = t64(x, True)
    ty = tx * keep / (1.0 - 0.5)  # torch's inverted dropout, given our mask
    (ty * t64(r)).sum().backward()
    np.testing.assert_allclose(cpu.dropout(x, 0.5, 3), ty.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(cpu.dropout(r, 0.5, 3), tx.grad.numpy(), rtol=1e-12)


@HYPO
@given(n=st.integers(1, 40), p=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
       seed=st.integers(0, 2**64 - 1))
def test_dropout_property(n, p, seed):
    x = randn((n,), np.float32, 1) + np.float32(5.0)  # no zeros of its own
    y = cpu.dropout(x, p, seed)
    np.testing.assert_array_equal(y != 0, ref.dropout_mask(x.shape, p, seed) if p else True)
    check(y, ref.dropout(x, p, seed), np.float32)


# ============================================================================== cross-entropy

@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("vocab_size", [None, 9])
def test_cross_entropy_forward_backward(dtype, vocab_size):
    logits = randn((6, 12), dtype, 1, scale=3.0)
    targets = np.array([0, 8, 3, 8, 1, 5], np.int64)
    loss = cpu.cross_entropy(logits, targets, vocab_size)
    assert loss.shape == () and loss.dtype == np.dtype(dtype)
    check(loss, ref.cross_entropy(logits, targets, vocab_size), dtype)
    d = cpu.cross_entropy_bwd(logits, targets, 0.75, vocab_size)
    check(d, ref.cross_entropy_bwd(logits, targets, 0.75, vocab_size), dtype)
    if vocab_size is not None:
        assert np.all(d[:, vocab_size:] == 0.0)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("grad", [True, False])
def test_linear_cross_entropy_over_chunks(monkeypatch, dtype, grad):
    """Chunks of 7 rows (the last one of 2) give the float64 spec's loss, dx and dw."""
    rs = np.random.default_rng(5)
    n, c, v, vp = 23, 6, 10, 12
    monkeypatch.setattr(cpu, "LCE_CHUNK_BYTES", 7 * vp * np.dtype(dtype).itemsize)
    x, w = rs.standard_normal((n, c)).astype(dtype), rs.standard_normal((vp, c)).astype(dtype)
    t = rs.integers(0, v, n)
    loss, dx, dw = cpu.linear_cross_entropy(x, w, t, v, grad)
    want = ref.linear_cross_entropy(x, w, t, v)
    assert loss.shape == () and loss.dtype == np.dtype(dtype)
    check(loss, want[0], dtype)
    if grad:
        check(dx, want[1], dtype)
        check(dw, want[2], dtype)
        assert np.all(dw[v:] == 0)
    else:
        assert dx is None and dw is None


@pytest.mark.parametrize("dtype", FLOATS)
def test_cross_entropy_many_row_blocks(dtype):
    """N * V over one cache block (2^18 elements): rows run in several blocks, the last short."""
    logits = randn((31, 20_011), dtype, 1, scale=2.0)
    targets = np.random.default_rng(2).integers(0, 20_000, size=31)
    check(cpu.cross_entropy(logits, targets, 20_000),
          ref.cross_entropy(logits, targets, 20_000), dtype)
    check(cpu.cross_entropy_bwd(logits, targets, 1.5, 20_000),
          ref.cross_entropy_bwd(logits, targets, 1.5, 20_000), dtype)


def test_cross_entropy_bwd_vs_fd_and_dloss_0d():
    logits = randn((5, 8), seed=1)
    targets = np.array([1, 0, 6, 6, 2], np.int32)
    r = 1.3  # the loss is 0-d: its cotangent is the scalar dloss
    d = cpu.cross_entropy_bwd(logits, targets, np.asarray(r), 7)
    fd = fd_grad(lambda: cpu.cross_entropy(logits, targets, 7), logits, r)
    np.testing.assert_allclose(d, fd, **FD_TOL)


def test_cross_entropy_stable_for_large_logits():
    logits = (randn((4, 10), seed=1) + 1e4).astype(np.float32)
    targets = np.array([0, 1, 2, 3])
    np.testing.assert_allclose(cpu.cross_entropy(logits, targets, None),
                               ref.cross_entropy(logits, targets), rtol=1e-5)
    assert np.all(np.isfinite(cpu.cross_entropy_bwd(logits, targets, 1.0, None)))


def test_cross_entropy_vs_torch():
    logits = randn((7, 13), seed=1, scale=2.0)
    targets = np.array([0, 10, 3, 10, 1, 5, 2], np.int64)
    tl = t64(logits, True)
    tloss = F.cross_entropy(tl[:, :11], torch.from_numpy(targets))
    (tloss * 0.6).backward()
    np.testing.assert_allclose(cpu.cross_entropy(logits, targets, 11), tloss.item(), rtol=1e-12)
    np.testing.assert_allclose(cpu.cross_entropy_bwd(logits, targets, 0.6, 11), tl.grad.numpy(),
                               rtol=1e-12, atol=1e-14)


@HYPO
@given(n=st.integers(1, 6), vp=st.integers(1, 10), cut=st.integers(0, 3), seed=st.integers(0, 1000))
def test_cross_entropy_property(n, vp, cut, seed):
    v = max(1, vp - cut)
    logits = randn((n, vp), seed=seed, scale=4.0)
    targets = np.random.default_rng(seed).integers(0, v, size=n)
    check(cpu.cross_entropy(logits, targets, v), ref.cross_entropy(logits, targets, v), np.float64)
    check(cpu.cross_entropy_bwd(logits, targets, 2.0, v),
          ref.cross_entropy_bwd(logits, targets, 2.0, v), np.float64)


# ============================================================================== AdamW

ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("dtype", FLOATS)
def test_adamw_vs_reference(dtype):
    p, m, v = randn((4, 5), dtype, 1), np.zeros((4, 5), dtype), np.zeros((4, 5), dtype)
    ep, em, ev = p.astype(np.float64), m.astype(np.float64), v.astype(np.float64)
    for step in range(1, 5):
        g = randn((4, 5), dtype, 10 + step)
        cpu.adamw_update(p, g, m, v, step=step, grad_scale=0.5, **ADAM)
        ep, em, ev = ref.adamw_update(ep, g, em, ev, step=step, grad_scale=0.5, **ADAM)
        check(p, ep, dtype)
        check(m, em, dtype)
        check(v, ev, dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_adamw_vs_torch(dtype):
    p = randn((6, 7), dtype, 1)
    m, v = np.zeros_like(p), np.zeros_like(p)
    tp = torch.tensor(p.copy(), requires_grad=True)
    opt = torch.optim.AdamW([tp], lr=ADAM["lr"], betas=(ADAM["beta1"], ADAM["beta2"]),
                            eps=ADAM["eps"], weight_decay=ADAM["weight_decay"])
    for step in range(1, 6):
        g = randn(p.shape, dtype, 20 + step)
        cpu.adamw_update(p, g, m, v, step=step, grad_scale=1.0, **ADAM)
        tp.grad = torch.tensor(g)
        opt.step()
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(p, tp.detach().numpy(), **tol)
    state = opt.state[tp]
    np.testing.assert_allclose(m, state["exp_avg"].numpy(), **tol)
    np.testing.assert_allclose(v, state["exp_avg_sq"].numpy(), **tol)


def test_adamw_zero_lr_moves_only_moments():
    p, g = randn((3, 4), seed=1), randn((3, 4), seed=2)
    m, v = np.zeros_like(p), np.zeros_like(p)
    ep, em, ev = ref.adamw_update(p, g, m, v, step=1, **dict(ADAM, lr=0.0))
    cpu.adamw_update(p, g, m, v, step=1, grad_scale=1.0, **dict(ADAM, lr=0.0))
    for mine, spec in ((p, ep), (m, em), (v, ev)):
        check(mine, spec, np.float64)


def test_adamw_refuses_p_lowp():
    p = np.zeros(3, np.float32)
    with pytest.raises(DTypeError):
        cpu.adamw_update(p, p.copy(), p.copy(), p.copy(), step=1, grad_scale=1.0,
                         p_lowp=np.zeros(3, np.float32), **ADAM)
