"""The fused C kernels of the CPU backend (backends/cpu/kernels.c) and their NumPy fallback
(backends/cpu/reference.py).

Every float32 kernel that has a C version runs here twice, once on each path
(``flags.override(FORGE_CPU_KERNELS="c")`` / ``"numpy"``), against the float64 spec in
tests/reference.py; backward kernels are fed a random cotangent ``dy``. The dispatch itself is
checked with a spy on the loaded library, and the loader's fallbacks (no compiler, a failed
compile, a corrupt cached library, ``FORGE_CPU_KERNELS=numpy``) in fresh subprocesses.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import reference as ref
from forge_ml import flags
from forge_ml.backends import cpu
from forge_ml.backends.cpu import native
from forge_ml.errors import ConfigError

F32_TOL = dict(rtol=1e-5, atol=1e-5)
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(params=["c", "numpy"])
def path(request):
    """Runs the test on the C kernels, then on NumPy; the C run fails if a compiler exists
    but the kernels do not build."""
    if request.param == "c" and native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    with flags.override(FORGE_CPU_KERNELS=request.param):
        yield request.param


def randn(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def close(actual, expected):
    assert actual.dtype == np.float32
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, **F32_TOL)


# ============================================================================== dispatch

class _Spy:
    """Stands in for the loaded library and records which kernels were called; with
    ``fail``, every kernel that returns a status reports failure (-1) without running."""

    def __init__(self, lib, fail=False):
        self.lib, self.calls, self.fail = lib, [], fail

    def __getattr__(self, name):
        self.calls.append(name)
        if self.fail and getattr(self.lib, name).restype is not None:
            return lambda *args: -1
        return getattr(self.lib, name)


def _spy(monkeypatch, fail=False):
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    with flags.override(FORGE_CPU_KERNELS="c"):
        s = _Spy(native.lib(), fail)
    monkeypatch.setitem(native._state, "lib", s)
    return s


@pytest.fixture
def spy(monkeypatch):
    s = _spy(monkeypatch)
    with flags.override(FORGE_CPU_KERNELS="c"):
        yield s


def _call_every_kernel(dtype, contiguous=True):
    x = randn((6, 16), 1).astype(dtype)
    if not contiguous:
        x = np.asfortranarray(x)
    g = randn((16,), 2).astype(dtype)
    cpu.gelu(x), cpu.gelu_bwd(x, x)
    cpu.layernorm(x, g, g, 1e-5), cpu.layernorm_bwd(x, g, x, 1e-5)
    cpu.layernorm_bwd_add(x, g, x, 1e-5, x)
    q = randn((2, 5, 4), 3).astype(dtype)
    out, lse = cpu.attention(q, q, q, 0.5)
    cpu.attention_bwd(q, q, q, out, lse, q, 0.5)
    qkv = randn((2, 5, 24), 4).astype(dtype)
    y, lse = cpu.attention_qkv(qkv, 2, 0.5)
    cpu.attention_qkv_bwd(qkv, y, lse, y, 2, 0.5)
    y, lse = cpu.attention_qkv_dropout(qkv, 2, 0.5, 0.3, 9)
    cpu.attention_qkv_dropout_bwd(qkv, y, lse, y, 2, 0.5, 0.3, 9)
    p = x.copy()
    cpu.adamw_update(p, x, np.zeros_like(p), np.zeros_like(p), 1e-3, 0.9, 0.99, 1e-8, 0.1, 1, 1.0)
    cpu.sumsq(x)
    cpu.dropout(x, 0.3, 5)


def test_float32_runs_the_c_kernels(spy):
    _call_every_kernel(np.float32)
    assert spy.calls == ["gelu_f32", "gelu_bwd_f32", "layernorm_f32", "layernorm_bwd_f32",
                         "layernorm_bwd_f32", "attention_f32", "attention_bwd_f32", "attention_qkv_f32",
                         "attention_qkv_bwd_f32", "attention_qkv_dropout_f32",
                         "attention_qkv_dropout_bwd_f32", "adamw_f32", "sumsq_f32", "dropout_f32"]


def test_float64_and_strided_arrays_run_numpy(spy):
    _call_every_kernel(np.float64)
    x = np.asfortranarray(randn((6, 16), 1))
    cpu.gelu(x), cpu.gelu_bwd(x, x)
    assert spy.calls == []


def test_empty_arrays_run_numpy(spy):
    x = np.zeros((0, 16), np.float32)
    assert cpu.gelu(x).shape == (0, 16) and cpu.sumsq(x) == 0.0
    g = np.ones(16, np.float32)
    assert cpu.layernorm(x, g, g, 1e-5).shape == (0, 16)
    assert spy.calls == []


def test_a_declining_kernel_falls_back_to_numpy(monkeypatch):
    """A kernel that reports failure (its scratch allocation) hands the call to the reference."""
    spy = _spy(monkeypatch, fail=True)
    x, dy = randn((6, 16), 1), randn((6, 16), 2)
    g = randn((16,), 3)
    q, k, v = (randn((2, 5, 4), s) for s in (4, 5, 6))
    qkv, dout = randn((2, 5, 24), 7), randn((2, 5, 4), 8)
    with flags.override(FORGE_CPU_KERNELS="c"):
        lbwd = cpu.layernorm_bwd(x, g, dy, 1e-5)
        out, lse = cpu.attention(q, k, v, 0.5)
        grads = cpu.attention_bwd(q, k, v, out, lse, dout, 0.5)
        y, ylse = cpu.attention_qkv(qkv, 2, 0.5)
        dqkv = cpu.attention_qkv_bwd(qkv, y, ylse, y, 2, 0.5)
    assert spy.calls == ["layernorm_bwd_f32", "attention_f32", "attention_bwd_f32",
                         "attention_qkv_f32", "attention_f32", "attention_qkv_bwd_f32"]
    for mine, spec in zip(lbwd, ref.layernorm_bwd(x, g, dy, 1e-5)):
        close(mine, spec)
    close(out, ref.attention(q, k, v, 0.5)[0])
    for mine, spec in zip(grads, ref.attention_bwd(q, k, v, dout, 0.5)):
        close(mine, spec)
    with flags.override(FORGE_CPU_KERNELS="numpy"):
        close(y, cpu.attention_qkv(qkv, 2, 0.5)[0])
        close(dqkv, cpu.attention_qkv_bwd(qkv, y, ylse, y, 2, 0.5))


def test_ops_keep_the_reference_signature_and_doc():
    for op in (cpu.gelu, cpu.layernorm_bwd, cpu.attention, cpu.adamw_update, cpu.sumsq):
        assert op.reference.__name__ == op.__name__
        assert op.__doc__ == op.reference.__doc__ and op.__module__ == "forge_ml.backends.cpu"


def test_numpy_mode_never_loads():
    with flags.override(FORGE_CPU_KERNELS="numpy"):
        assert native.lib() is None


def test_unknown_mode_is_an_error():
    with pytest.raises(ConfigError, match="auto|numpy|c"):
        with flags.override(FORGE_CPU_KERNELS="fortran"):
            pass


# ============================================================================== exp_f32

def test_exp_f32_accuracy_and_edges():
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    with flags.override(FORGE_CPU_KERNELS="c"):
        lib = native.lib()
        x = np.linspace(-87.0, 88.0, 1_000_003).astype(np.float32)
        y = np.empty_like(x)
        lib.exp_f32_array(x.ctypes.data, y.ctypes.data, x.size)
        e = np.exp(x.astype(np.float64))
        assert np.max(np.abs(y - e) / e) < 2.5e-7          # ~1 ulp of float32 (5.96e-8 = 1/2 ulp)
        edges = np.array([np.nan, -np.inf, -1e4, -100.0, 0.0, 1.0, 100.0, np.inf], np.float32)
        out = np.empty_like(edges)
        lib.exp_f32_array(edges.ctypes.data, out.ctypes.data, edges.size)
    assert np.isnan(out[0])
    assert np.all(out[1:4] <= 1.2e-38) and np.all(out[1:4] >= 0.0)   # clamped at e^-87.3
    assert out[4] == 1.0 and abs(out[5] - math.e) <= 2.5e-7 * math.e
    assert np.all(np.isfinite(out[6:])) and np.all(out[6:] > 2e38)   # clamped at e^88.38


# ============================================================================== gelu

@pytest.mark.parametrize("shape", [(7,), (3, 37), (768, 512), (5, 100_003)])
def test_gelu_vs_reference(path, shape):
    x, dy = randn(shape, 1, scale=3.0), randn(shape, 2)
    close(cpu.gelu(x), ref.gelu(x))
    close(cpu.gelu_bwd(x, dy), ref.gelu_bwd(x, dy))


def test_gelu_extremes(path):
    x = np.array([-1e4, -88.0, -50.0, -10.0, -1e-30, 0.0, 1e-30, 10.0, 50.0, 1e4], np.float32)
    dy = randn(x.shape, 3)
    y, dx = cpu.gelu(x), cpu.gelu_bwd(x, dy)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx))
    np.testing.assert_allclose(y, ref.gelu(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, ref.gelu_bwd(x, dy), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_far_out_takes_the_limits(path, dtype):
    """|x| from 1e6 to float32's largest: gelu is -0 far left and x far right, gelu' 0 and 1
    (float64 reference, torch's values). The clamped exp gave gelu(-3e38) = -1.2 and
    gelu'(-1e13) = -0.9, gelu'(1e13) = 3.5 (C), gelu'(-1e13) = -3863 and NaN past 1.2e13
    (NumPy)."""
    mags = np.array([1e6, 1e11, 1e12, 2e12, 1e13, 1e20, 1e30, 3e38], np.float32)
    x = np.concatenate([-mags, mags]).astype(dtype)
    dy = np.linspace(0.5, 2.0, x.size).astype(dtype)
    with np.errstate(over="raise", invalid="raise", divide="raise"):   # and no warning on the way
        y, dx = cpu.gelu(x), cpu.gelu_bwd(x, dy)
    n = mags.size
    assert np.all(y[:n] == 0) and np.all(np.signbit(y[:n]))
    np.testing.assert_array_equal(y[n:], x[n:])
    np.testing.assert_array_equal(dx, np.concatenate([np.zeros(n), dy[n:]]).astype(dtype))


def test_gelu_bwd_at_the_clamps(path):
    """Around x = -10.046 and 10.001, where -2u crosses exp_f32's clamps (the C loop works an x
    past them as 0, whose subnormal E or s made x86 7x slower, before it takes the limit):
    every value against the reference, both sides of both clamps, and the product's dgelu
    epilogue (the same loop on each block) equal to the op. Treating an x short of a clamp as
    past it gives gelu' 0.5 there instead of about 0 or 1."""
    x = np.concatenate([np.linspace(-10.2, -9.9, 30000), np.linspace(9.85, 10.15, 30000)])
    x = x.astype(np.float32).reshape(-1, 3)
    dy = randn(x.shape, 5)
    dx = cpu.gelu_bwd(x, dy)
    close(dx, ref.gelu_bwd(x, dy))
    dpre, _ = cpu.matmul_dgelu(dy, np.eye(3, dtype=np.float32), x)   # dy @ I^T = dy exactly
    np.testing.assert_array_equal(dpre, dx)


def test_gelu_nan_propagates(path):
    x = np.array([1.0, np.nan, -2.0], np.float32)
    assert np.isnan(cpu.gelu(x)).tolist() == [False, True, False]
    assert np.isnan(cpu.gelu_bwd(x, np.ones_like(x))).tolist() == [False, True, False]


# ============================================================================== layernorm

@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (3, 4, 128), (64, 768)])
def test_layernorm_vs_reference(path, shape):
    c = shape[-1]
    x = randn(shape, 1, scale=2.0) + 0.5
    gamma, beta, dy = randn((c,), 2), randn((c,), 3), randn(shape, 4)
    close(cpu.layernorm(x, gamma, beta, 1e-5), ref.layernorm(x, gamma, beta, 1e-5))
    dx, dgamma, dbeta = cpu.layernorm_bwd(x, gamma, dy, 1e-5)
    edx, edgamma, edbeta = ref.layernorm_bwd(x, gamma, dy, 1e-5)
    close(dx, edx)
    close(dgamma, edgamma)
    close(dbeta, edbeta)
    assert dx.shape == x.shape and dgamma.shape == dbeta.shape == (c,)


@pytest.mark.parametrize("shape", [(1, 5), (17, 7), (3, 40, 128), (768, 128)])
@pytest.mark.parametrize("with_add", [False, True])
def test_layernorm_bwd_sums_are_dx_row_sums(path, shape, with_add):
    """layernorm_bwd_sums: the backward's dx, dgamma, dbeta as layernorm_bwd(_add) gives them,
    and sum_rows(dx) against float64 (on the C path summed into the row blocks' sums as each
    row is written; rows not a multiple of its 16-row blocks included)."""
    c = shape[-1]
    x, gamma, dy = randn(shape, 1, scale=2.0) + 0.5, randn((c,), 2), randn(shape, 3)
    add = randn(shape, 4) if with_add else None
    dx, dgamma, dbeta, sums = cpu.layernorm_bwd_sums(x, gamma, dy, 1e-5, add)
    want = (cpu.layernorm_bwd(x, gamma, dy, 1e-5) if add is None
            else cpu.layernorm_bwd_add(x, gamma, dy, 1e-5, add))
    for got, w in zip((dx, dgamma, dbeta), want):
        np.testing.assert_array_equal(got, w)
    assert sums.dtype == np.float32 and sums.shape == (c,)
    d64 = dx.astype(np.float64).reshape(-1, c)
    err = np.abs(sums - d64.sum(axis=0))
    assert np.all(err <= 1e-6 * np.abs(d64).sum(axis=0) + 1e-12), err.max()


def test_layernorm_bwd_many_rows_accumulates_accurately(path):
    """dgamma and dbeta sum 65,536 rows. The rows repeat one block of 16, so every block's
    partial sums are equal and a float32 running sum over the 4,096 blocks rounds the same way
    at each addition: its error grows with the number of blocks (kernels.c adding its blocks
    in float misses dgamma by 9 times the bound, dbeta by 15), where the blocks' float sums
    added in double stay within a few units of roundoff u (30 to 45 times below the bounds).
    The bound is what double accumulation gives (ACC_K of tests/backends/error_bounds.py):
    64u of the sum of |dy xhat|, plus xhat's own float32 error in each term ((C/2 + 6) u |xhat|
    and (C + 1) u rstd mean|x|). dbeta is held as tightly on the C path; the NumPy path sums it
    with sum_rows, a float32 BLAS product whose running sums grow the same way, so there only
    to the bound of a sum in any order, (rows + 1) u sum |dy|."""
    c, blk, reps = 16, 16, 4096
    rs = np.random.default_rng(5)
    base = rs.permutation(np.linspace(-1.5, 1.5, c))         # one sign per column: little cancels
    xb = (base + 0.3 * rs.standard_normal((blk, c))).astype(np.float32)
    dyb = (rs.standard_normal(c) + 0.1 * rs.standard_normal((blk, c))).astype(np.float32)
    gamma = randn((c,), 3)
    x, dy = np.tile(xb, (reps, 1)), np.tile(dyb, (reps, 1))
    _, dgamma, dbeta = cpu.layernorm_bwd(x, gamma, dy, 1e-5)
    _, edgamma, edbeta = ref.layernorm_bwd(xb, gamma, dyb, 1e-5)   # one block; reps = 2^12: exact
    xb64, ady = xb.astype(np.float64), np.abs(dyb.astype(np.float64))   # the bounds, per block
    mu = xb64.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((xb64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    axhat = np.abs(xb64 - mu) * rstd
    e_xhat = axhat * (c / 2 + 6) + rstd * np.abs(xb64).mean(-1, keepdims=True) * (c + 1)
    u = 2.0 ** -24
    bound_g = reps * u * (64 * (ady * axhat).sum(0) + (ady * e_xhat).sum(0))
    bound_b = reps * u * (64 if path == "c" else blk * reps + 1) * ady.sum(0)
    for name, got, want, bound in (("dgamma", dgamma, edgamma * reps, bound_g),
                                   ("dbeta", dbeta, edbeta * reps, bound_b)):
        err = np.abs(got.astype(np.float64) - want)
        assert np.all(err <= bound), (f"{name}: error {err.max():.3g}, "
                                      f"{(err / bound).max():.3g} x the bound")


def test_layernorm_of_a_constant_row_is_beta(path):
    """A constant (or near-constant) row: the plain mean's rounding error, times 1/sqrt(eps),
    gave y off beta by 0.2 (C) and 1.1 (NumPy) at values near 1000, where torch gives beta
    exactly. The corrected two-pass statistics centre such a row to zeros."""
    gamma, beta = randn((768,), 3), randn((768,), 4)
    for v in (0.1, 123.456, 1000.1, 1e5 + 0.3):
        x = np.full((3, 768), v, np.float32)
        np.testing.assert_array_equal(cpu.layernorm(x, gamma, beta, 1e-5), np.broadcast_to(beta, x.shape))
        dx, dgamma, _ = cpu.layernorm_bwd(x, gamma, randn((3, 768), 5), 1e-5)
        assert np.all(np.isfinite(dx)) and not dgamma.any()   # xhat is 0: no gamma gradient


def test_layernorm_large_mean_is_stable(path):
    x = (1000.0 + randn((4, 64), 1)).astype(np.float32)
    gamma, beta = np.ones(64, np.float32), np.zeros(64, np.float32)
    np.testing.assert_allclose(cpu.layernorm(x, gamma, beta, 1e-5),
                               ref.layernorm(x, gamma, beta, 1e-5), atol=2e-3)


# ============================================================================== attention

@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 5, 3), (2, 3, 17, 20), (12, 4, 64, 32),
                                   (1, 2, 300, 8), (1, 1, 33, 64)])
def test_attention_vs_reference(path, shape):
    q, k, v = (randn(shape, s) for s in (1, 2, 3))
    dout = randn(shape, 4)
    scale = 1.0 / math.sqrt(shape[-1])
    out, lse = cpu.attention(q, k, v, scale)
    eout, else_ = ref.attention(q, k, v, scale)
    assert out.shape == shape and lse.shape == shape[:-1] and lse.dtype == np.float32
    close(out, eout)
    close(lse, else_)
    for mine, spec in zip(cpu.attention_bwd(q, k, v, out, lse, dout, scale),
                          ref.attention_bwd(q, k, v, dout, scale)):
        assert mine.shape == shape
        close(mine, spec)


def _heads(x, n_head):
    """(B, T, C) -> (B, H, T, hs)."""
    B, T, C = x.shape
    return x.reshape(B, T, n_head, C // n_head).transpose(0, 2, 1, 3)


# (B, T, H, hs): rows read in place (T % 4 == 0 and hs % 16 == 0: no padded copies) and not
@pytest.mark.parametrize("B,T,H,hs", [(2, 64, 4, 32), (1, 48, 3, 16), (2, 17, 2, 20), (1, 1, 2, 8)])
def test_attention_qkv_vs_reference(path, B, T, H, hs):
    """Heads read in place from GPT-2's fused (B, T, 3C) rows, y and dqkv written in place."""
    C = H * hs
    qkv, dy = randn((B, T, 3 * C), 5), randn((B, T, C), 6)
    scale = 1.0 / math.sqrt(hs)
    q, k, v = (_heads(qkv[..., i * C:(i + 1) * C], H) for i in range(3))
    y, lse = cpu.attention_qkv(qkv, H, scale)
    eout, else_ = ref.attention(q, k, v, scale)
    close(y, eout.transpose(0, 2, 1, 3).reshape(B, T, C))
    close(lse, else_)
    dqkv = cpu.attention_qkv_bwd(qkv, y, lse, dy, H, scale)
    grads = ref.attention_bwd(q, k, v, _heads(dy, H), scale)
    want = np.concatenate([g.transpose(0, 2, 1, 3).reshape(B, T, C) for g in grads], axis=-1)
    close(dqkv, want)
    # with its row sums (the C kernel: each head's columns summed as it finishes them)
    dqkv2, sums = cpu.attention_qkv_bwd_sums(qkv, y, lse, dy, H, scale)
    np.testing.assert_array_equal(dqkv2, dqkv)
    d64 = dqkv.astype(np.float64).reshape(-1, 3 * C)
    assert sums.dtype == np.float32 and sums.shape == (3 * C,)
    np.testing.assert_allclose(sums, d64.sum(axis=0), rtol=0,
                               atol=1e-6 * np.abs(d64).sum(axis=0).max())


@pytest.mark.parametrize("B,T,H,hs", [(2, 5, 2, 4), (1, 64, 3, 16), (2, 67, 2, 24), (1, 130, 2, 64)])
def test_attention_qkv_dropout_vs_reference(path, B, T, H, hs):
    """Dropout on the probabilities inside the fused kernel: forward and backward (a random
    cotangent) against the float64 spec, the mask forge_ml.rng's over (B, H, T, T)."""
    qkv = randn((B, T, 3 * H * hs), 11)
    dy = randn((B, T, H * hs), 12)
    scale, p = 1.0 / math.sqrt(hs), 0.3
    for seed in (3, 2**63 + 5):
        y, lse = cpu.attention_qkv_dropout(qkv, H, scale, p, seed)
        q, k, v = (ref.split_heads(qkv.astype(np.float64), H)[i] for i in range(3))
        want_o, want_lse = ref.attention_dropout(q, k, v, scale, p, seed)
        close(y, ref.merge_heads(want_o))
        close(lse, want_lse)
        got = cpu.attention_qkv_dropout_bwd(qkv, y, lse, dy, H, scale, p, seed)
        dq, dk, dv = ref.attention_dropout_bwd(q, k, v, ref.unmerge_heads(dy, H), scale, p, seed)
        want = ref.unsplit_head(dq, 0) + ref.unsplit_head(dk, 1) + ref.unsplit_head(dv, 2)
        close(got, want)


def test_attention_peaked_scores(path):
    """Scores up to ~150: exp overflows unless the row max is subtracted first. Scores this
    large cost float32 ~1e-5 relative per score, so the check is norm-wise."""
    shape = (2, 2, 19, 8)
    q, k, v, dout = randn(shape, 1, 6.0), randn(shape, 2, 6.0), randn(shape, 3), randn(shape, 4)
    out, lse = cpu.attention(q, k, v, 1.0)
    eout, else_ = ref.attention(q, k, v, 1.0)
    assert np.abs(else_).max() > 100.0
    np.testing.assert_allclose(out, eout, atol=1e-4 * np.abs(eout).max())
    np.testing.assert_allclose(lse, else_, rtol=1e-5)
    for mine, spec in zip(cpu.attention_bwd(q, k, v, out, lse, dout, 1.0),
                          ref.attention_bwd(q, k, v, dout, 1.0)):
        np.testing.assert_allclose(mine, spec, atol=1e-4 * np.abs(spec).max())


def test_attention_nan_stays_in_its_rows(path):
    q, k, v = (randn((1, 6, 4), s) for s in (1, 2, 3))
    q[0, 3, 1] = np.nan
    out, lse = cpu.attention(q, k, v, 0.5)
    assert np.isnan(out[0, 3]).all() and np.isnan(lse[0, 3])
    rows = [0, 1, 2, 4, 5]
    assert np.isfinite(out[0, rows]).all() and np.isfinite(lse[0, rows]).all()


# Where a NaN or inf at position tf must not reach (the causal mask hides it), by which input
# holds it: the rows of out, lse, dq and of dk, dv that equal the spec's on finite inputs. A key
# or value at tf is masked for every earlier query; a query or cotangent row at tf for every
# later key. (dv does not read v, so it is the spec's everywhere when v holds the value.)
_UNREACHED = {"k": dict(out="<", lse="<", dq="<", dk="", dv=""),
              "v": dict(out="<", lse="all", dq="<", dk="", dv="all"),
              "q": dict(out="!=", lse="!=", dq="!=", dk=">", dv=">"),
              "dout": dict(out="all", lse="all", dq="!=", dk=">", dv=">")}


@pytest.mark.parametrize("shape", [(2, 2, 16, 16), (1, 2, 7, 5), (1, 1, 300, 8)])
@pytest.mark.parametrize("which", sorted(_UNREACHED))
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_attention_masked_nonfinite_does_not_leak(path, shape, which, bad, dt):
    """A masked entry is skipped, not multiplied by its zero probability (0 * NaN is NaN):
    forward and backward, the rows that cannot see the bad value equal the float64 spec's
    on finite inputs. tf is inside a 4-row block of the C kernel (not its first row) and, at
    T = 300, inside the reference's second row chunk; float64 runs the reference."""
    t = shape[-2]
    tf = t // 8 * 4 + 2
    scale = 1.0 / math.sqrt(shape[-1])
    clean = {n: randn(shape, s).astype(dt) for n, s in (("q", 1), ("k", 2), ("v", 3), ("dout", 4))}
    given = {n: a.copy() for n, a in clean.items()}
    given[which][..., tf, 1] = bad
    out, lse = cpu.attention(given["q"], given["k"], given["v"], scale)
    got = dict(zip(("dq", "dk", "dv"), cpu.attention_bwd(given["q"], given["k"], given["v"], out,
                                                         lse, given["dout"], scale)))
    got.update(out=out, lse=lse)
    want = dict(zip(("out", "lse"), ref.attention(clean["q"], clean["k"], clean["v"], scale)))
    want.update(zip(("dq", "dk", "dv"), ref.attention_bwd(clean["q"], clean["k"], clean["v"],
                                                          clean["dout"], scale)))
    idx = np.arange(t)
    rows = {"<": idx < tf, "!=": idx != tf, ">": idx > tf, "all": idx >= 0, "": idx < 0}
    tol = F32_TOL if dt == np.float32 else dict(rtol=1e-10, atol=1e-10)
    for name, where in _UNREACHED[which].items():
        keep = rows[where]
        mine = got[name][..., keep] if name == "lse" else got[name][..., keep, :]
        spec = want[name][..., keep] if name == "lse" else want[name][..., keep, :]
        assert mine.dtype == dt
        np.testing.assert_allclose(np.asarray(mine, np.float64), spec, **tol, err_msg=name)


# ============================================================================== AdamW

@pytest.mark.parametrize("lr, wd, grad_scale", [(1e-2, 0.1, 0.5), (3e-4, 0.0, 1.0), (0.0, 0.1, 2.0)])
def test_adamw_vs_reference(path, lr, wd, grad_scale):
    hyper = dict(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=wd)
    p = randn((37, 11), 1)
    m, v = np.zeros_like(p), np.zeros_like(p)
    ep, em, ev = p.astype(np.float64), m.astype(np.float64), v.astype(np.float64)
    for step in range(1, 6):
        g = randn(p.shape, 10 + step)
        before = p.astype(np.float64)
        cpu.adamw_update(p, g, m, v, step=step, grad_scale=grad_scale, **hyper)
        ep, em, ev = ref.adamw_update(before, g, em, ev, step=step, grad_scale=grad_scale,
                                      **hyper)
        close(p, ep)
        close(m, em)
        close(v, ev)
        # the step itself (p is ~100x larger, so close(p, ep) alone would hide a wrong step)
        np.testing.assert_allclose(p - before, ep - before, rtol=1e-4,
                                   atol=2 * np.spacing(np.abs(p).max()))



@pytest.mark.parametrize("lr", [1e-2, 0.0])
def test_adamw_update_many_is_the_one_tensor_op(path, lr):
    """The whole model's step in one call gives the bits of one adamw_update per tensor, each
    tensor with its own step and weight decay; a second set of arrays (the pointers kept
    between steps must not be reused for them) too."""
    shapes = [(37, 11), (5,), (1, 64), (3, 3, 7)]
    for trial in range(2):
        ps = [randn(sh, 100 * trial + i) for i, sh in enumerate(shapes)]
        ms = [np.abs(randn(sh, 200 + i, scale=0.1)) for i, sh in enumerate(shapes)]
        vs = [np.abs(randn(sh, 300 + i, scale=0.1)) for i, sh in enumerate(shapes)]
        want = [[a.copy() for a in arrs] for arrs in (ps, ms, vs)]
        steps, wds = [3, 1, 3, 7], [0.1, 0.0, 0.1, 0.05]
        for step in range(2):
            gs = [randn(sh, 400 + 10 * step + i) for i, sh in enumerate(shapes)]
            cpu.adamw_update_many(ps, gs, ms, vs, lr, 0.9, 0.95, 1e-8, wds,
                                  [st + step for st in steps], 0.5)
            for i in range(len(shapes)):
                cpu.adamw_update(want[0][i], gs[i], want[1][i], want[2][i], lr, 0.9, 0.95, 1e-8,
                                 wds[i], steps[i] + step, 0.5)
            for got, exp in zip(ps + ms + vs, want[0] + want[1] + want[2]):
                np.testing.assert_array_equal(got, exp)


def test_sumsq_many_is_the_one_tensor_op(path):
    xs = [randn(sh, i, scale=3.0) for i, sh in enumerate([(7, 3), (1,), (65, 128)])]
    got = cpu.sumsq_many(xs)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.array([cpu.sumsq(x) for x in xs], np.float32))
    x64 = [x.astype(np.float64) for x in xs]
    np.testing.assert_array_equal(cpu.sumsq_many(x64), [cpu.sumsq(x) for x in x64])

# ============================================================================== sumsq

@pytest.mark.parametrize("shape", [(1,), (7, 3), (128,), (65, 128), (1000, 513)])
def test_sumsq_vs_reference(path, shape):
    x = randn(shape, 1, scale=3.0)
    s = cpu.sumsq(x)
    assert s.shape == () and s.dtype == np.float32
    np.testing.assert_allclose(float(s), ref.sumsq(x), rtol=1e-6)


# ============================================================================== dropout

@pytest.mark.parametrize("n", [1, 3, 4, 5, 63, 64, 65, 1001, 100_003])
def test_dropout_is_the_philox_mask_bit_for_bit(path, n):
    """The mask is forge_ml.rng's stream on both paths (the C kernel runs 16 Philox counters
    at a time: counts around a block's end included), against the float64 spec."""
    x = randn((n,), 7, scale=2.0)
    for seed in (0, 7, 2**63 + 99, 2**64 - 1):
        for p in (0.1, 0.5, 0.999):
            got = cpu.dropout(x, p, seed)
            want = ref.dropout(x.astype(np.float64), p, seed)
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got == 0, want == 0, err_msg=f"mask n={n} seed={seed} p={p}")
            close(got, want)
    assert np.array_equal(cpu.dropout(x, 0.0, 3), x)


def test_sumsq_large_input_stays_accurate(path):
    """4M elements of mixed magnitude: a float32 running sum would be off by ~1e-4."""
    x = randn((4_000_003,), 2) * np.float32(10.0) ** randn((4_000_003,), 3).round()
    np.testing.assert_allclose(float(cpu.sumsq(x)), ref.sumsq(x), rtol=2e-7)


# ============================================================================== the loader

def _fresh(code, **env):
    """Run ``code`` in a new interpreter with ``env`` added; returns the completed process."""
    full = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **env)
    for name in ("FORGE_CPU_KERNELS", "FORGE_CACHE_DIR"):
        full.pop(name, None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=300)


_GELU_CHECK = """
import warnings, numpy as np
from forge_ml.backends import cpu
from forge_ml.backends.cpu import native
x = np.linspace(-5, 5, 101, dtype=np.float32)
y = cpu.gelu(x)
ref = 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x.astype(np.float64) ** 3)))
assert np.allclose(y, ref, rtol=1e-5, atol=1e-6)
print("lib" if native._state["lib"] is not None else "numpy", native.why_not())
"""


def test_no_compiler_falls_back_with_one_warning(tmp_path):
    r = _fresh(_GELU_CHECK, CC=str(tmp_path / "no-such-cc"), FORGE_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("numpy")
    assert r.stderr.count("C CPU kernels are unavailable") == 1


def test_compile_failure_falls_back_and_says_why(tmp_path):
    cc = tmp_path / "badcc"
    cc.write_text("#!/bin/sh\necho 'badcc: pretend error' >&2\nexit 1\n")
    cc.chmod(0o755)
    r = _fresh(_GELU_CHECK, CC=str(cc), FORGE_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("numpy") and "pretend error" in r.stdout
    assert "pretend error" in r.stderr


def test_unwritable_cache_builds_for_the_process(tmp_path):
    """A cache that cannot be written (a read-only home) costs a build per process, not the C
    kernels: the library is built in a temporary folder, removed at exit, with one warning."""
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(blocker), TMPDIR=str(tmp))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("lib None"), r.stdout
    assert r.stderr.count("cannot be written") == 1 and "FORGE_CACHE_DIR" in r.stderr
    assert "unavailable" not in r.stderr
    assert list(tmp.iterdir()) == []          # the temporary build is gone


def test_unwritable_cache_and_temp_fall_back(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    no_temp = f"import tempfile; tempfile.tempdir = {str(blocker / 'tmp')!r}\n"
    r = _fresh(no_temp + _GELU_CHECK, FORGE_CACHE_DIR=str(blocker))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("numpy")
    assert r.stderr.count("C CPU kernels are unavailable") == 1
    assert "nor a temporary folder" in r.stderr


def test_mode_c_without_compiler_is_an_error(tmp_path):
    r = _fresh(_GELU_CHECK, CC=str(tmp_path / "no-such-cc"), FORGE_CACHE_DIR=str(tmp_path),
               FORGE_CPU_KERNELS="c")
    assert r.returncode != 0 and "NativeKernelError" in r.stderr


def test_env_numpy_never_compiles(tmp_path):
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="numpy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("numpy") and r.stderr == ""
    assert not (tmp_path / "cpu").exists()


def test_concurrent_first_builds_share_one_library(tmp_path):
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    full = dict(os.environ, PYTHONPATH=SRC, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    procs = [subprocess.Popen([sys.executable, "-c", _GELU_CHECK], env=full, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out.startswith("lib")
    built = sorted(x.name for x in (tmp_path / "cpu").iterdir())
    assert len(built) == 1 and built[0].startswith("kernels-") and built[0].endswith(".so")


def _built(cache):
    """The files in the cache folder (the build leaves the library and nothing else)."""
    return sorted((cache / "cpu").iterdir())


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_cached_library_is_rebuilt(tmp_path, damage):
    """A cached library that does not load is deleted and built again, without a warning;
    the next run loads the rebuilt file as it is."""
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0 and r.stdout.startswith("lib"), r.stderr
    (so,) = _built(tmp_path)
    good = so.read_bytes()
    so.write_bytes(b"not an ELF file\n" * 64 if damage == "garbage" else good[:4096])
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("lib None"), r.stdout
    assert "unavailable" not in r.stderr and "Warning" not in r.stderr
    assert _built(tmp_path) == [so] and so.stat().st_size == len(good)
    mtime = so.stat().st_mtime_ns
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0 and r.stdout.startswith("lib"), r.stderr
    assert so.stat().st_mtime_ns == mtime          # loaded as it was, not built a third time


def test_corrupt_cached_library_that_cannot_be_rebuilt_warns_once(tmp_path):
    """The rebuild fails too (the compiler now refuses): NumPy runs, with one warning."""
    cc = _wrapper(tmp_path, 'if [ -n "$REFUSE" ] && [ "$1" != "--version" ]; then\n'
                            '  echo "cc-wrapper: refusing" >&2; exit 1\nfi')
    cache = tmp_path / "cache"
    r = _fresh(_GELU_CHECK, CC=str(cc), FORGE_CACHE_DIR=str(cache), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0 and r.stdout.startswith("lib"), r.stderr
    (so,) = _built(cache)
    so.write_bytes(b"garbage")
    r = _fresh(_GELU_CHECK, CC=str(cc), FORGE_CACHE_DIR=str(cache), REFUSE="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("numpy") and "refusing" in r.stdout
    assert r.stderr.count("C CPU kernels are unavailable") == 1
    assert _built(cache) == []                      # the bad file is gone, no temporaries left


def _wrapper(tmp_path, body):
    """A compiler wrapper script around the real compiler: ``body`` is shell run first, with
    ``$REAL`` the compiler and ``$LOG`` a file each call is appended to."""
    real = native.compiler()
    if real is None:
        pytest.skip("no C compiler on this machine")
    cc = tmp_path / "cc-wrapper"
    cc.write_text(f'#!/bin/sh\nREAL="{real}"\nLOG="{tmp_path / "calls.log"}"\n'
                  f'echo "$*" >> "$LOG"\n{body}\nexec "$REAL" "$@"\n')
    cc.chmod(0o755)
    return cc


def test_cc_with_an_unclosed_quote_warns(tmp_path):
    """CC="gcc 'x" raised shlex's ValueError from the first kernel, a traceback; now the
    compiler 'cannot run' and NumPy runs, with one warning, as for any compiler that fails."""
    r = _fresh(_GELU_CHECK, CC="gcc 'x", FORGE_CACHE_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("numpy") and "cannot run" in r.stdout
    assert r.stderr.count("C CPU kernels are unavailable") == 1


def test_cc_may_be_a_command_line(tmp_path):
    """CC="ccache gcc" (or "gcc -m64") was taken as one program's name: "cannot run", NumPy."""
    cc = _wrapper(tmp_path, "")
    r = _fresh(_GELU_CHECK, CC=f"env FORGE_WRAPPED=1 {cc}", FORGE_CACHE_DIR=str(tmp_path / "c"),
               FORGE_CPU_KERNELS="c")
    assert r.returncode == 0 and r.stdout.startswith("lib None"), r.stderr
    assert "-O3" in (tmp_path / "calls.log").read_text()


def test_a_library_cached_under_a_later_flag_set_is_found_before_compiling(tmp_path):
    """A compiler that refuses the first flag set was asked again at every start (2 s a start
    for a slow one) before the cache was looked in for the second set's library."""
    cc = _wrapper(tmp_path, 'case "$*" in *-fno-thread-jumps*) exit 1;; esac')
    env = dict(CC=str(cc), FORGE_CACHE_DIR=str(tmp_path / "c"), FORGE_CPU_KERNELS="c")
    r = _fresh(_GELU_CHECK, **env)
    assert r.returncode == 0 and r.stdout.startswith("lib None"), r.stderr
    (so,) = _built(tmp_path / "c")
    assert so.stat().st_mode & 0o777 == 0o755          # other users of a shared cache load it
    (tmp_path / "calls.log").write_text("")
    r = _fresh(_GELU_CHECK, **env)
    assert r.returncode == 0 and r.stdout.startswith("lib None"), r.stderr
    assert (tmp_path / "calls.log").read_text().split("\n")[:-1] == ["--version"]


def test_a_cached_library_that_loads_but_lacks_a_kernel_is_replaced(tmp_path):
    """The rebuilt library, at the path of the one already loaded, was never used: the
    loader handed back the first (an 'undefined symbol', then NumPy)."""
    real = native.compiler()
    if real is None:
        pytest.skip("no C compiler on this machine")
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0, r.stderr
    (so,) = _built(tmp_path)
    stub = tmp_path / "stub.c"
    stub.write_text("int forge_stub(void) { return 1; }\n")
    subprocess.run([*native._argv(real), "-shared", "-fPIC", "-o", str(so), str(stub)], check=True)
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0 and r.stdout.startswith("lib None"), r.stderr
    assert "Warning" not in r.stderr
    assert _built(tmp_path) == [so] and b"gelu_f32" in so.read_bytes()   # the cache mended


_NOT_MINE = """
import pathlib
from forge_ml.backends.cpu import native
# another user's library in a shared cache: this user may neither read nor delete it
real_whole, real_unlink = native._whole, pathlib.Path.unlink
def whole(path):
    if path.parent.name == "cpu" and "forge-ml-cpu-" not in str(path):
        raise PermissionError(13, "Permission denied", str(path))
    return real_whole(path)
def unlink(self, missing_ok=False):
    raise PermissionError(13, "Permission denied", str(self))
native._whole, pathlib.Path.unlink = whole, unlink
"""


def test_another_users_library_in_a_shared_cache_is_built_for_the_process(tmp_path):
    """A library this user cannot read (another user's, mode 0711 as it was written) gave
    'Permission denied' and NumPy kernels; now this process builds its own, with one warning."""
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    r = _fresh(_GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0, r.stderr
    (so,) = _built(tmp_path)
    r = _fresh(_NOT_MINE + _GELU_CHECK, FORGE_CACHE_DIR=str(tmp_path), FORGE_CPU_KERNELS="c")
    assert r.returncode == 0 and r.stdout.startswith("lib None"), r.stderr
    assert r.stderr.count("neither load nor replace") == 1
    assert _built(tmp_path) == [so]


def test_the_temporary_cache_is_used_only_while_it_is_this_users_alone(tmp_path, monkeypatch):
    """With no home folder the cache was /tmp/forge-ml-cache-<uid>, used whoever made it:
    another user could plant a library there that forge-ml then loaded."""
    import tempfile
    from forge_ml import flags
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(flags, "_process_cache", [])
    shared = tmp_path / f"forge-ml-cache-{os.getuid()}"
    assert flags._private_temp_cache() == shared
    assert shared.stat().st_mode & 0o777 == 0o700
    shared.chmod(0o777)                        # open to others: not trusted
    own = flags._private_temp_cache()
    assert own != shared and own.is_dir() and own.parent == tmp_path
    shared.rmdir()
    shared.symlink_to(own)                     # a link planted there is not followed
    assert flags._private_temp_cache() == own


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    """The XDG spec says to ignore a relative XDG_CACHE_HOME; the cache went under the
    working folder, wherever that was."""
    from forge_ml import flags
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relcache")
    monkeypatch.delenv("FORGE_CACHE_DIR", raising=False)
    assert flags.cache_root("cpu") == tmp_path / "home" / ".cache" / "forge-ml" / "cpu"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert flags.cache_root("cpu") == tmp_path / "x" / "forge-ml" / "cpu"


# ============================================================================== cross-entropy, scatter

@pytest.mark.parametrize("n,vp,v", [(1, 1, 1), (7, 65, 65), (12, 128, 65), (5, 3000, 2999)])
def test_cross_entropy_vs_reference(path, n, vp, v):
    """The loss and its gradient (a random dloss, the padded columns zero) against float64."""
    logits = randn((n, vp), n + vp, scale=4.0)
    t = np.random.default_rng(v).integers(0, v, n)
    vocab = None if v == vp else v
    loss = cpu.cross_entropy(logits, t, vocab)
    assert loss.dtype == np.float32 and loss.shape == ()
    np.testing.assert_allclose(float(loss), ref.cross_entropy(logits, t, vocab), rtol=2e-6, atol=2e-6)
    dloss = 0.37
    close(cpu.cross_entropy_bwd(logits, t, dloss, vocab), ref.cross_entropy_bwd(logits, t, dloss, vocab))


def test_cross_entropy_large_logits_stay_finite(path):
    logits = np.array([[1e4, -1e4, 0.0], [-3e4, -3e4 + 1.0, -3e4 - 2.0]], np.float32)
    t = np.array([1, 0])
    loss = cpu.cross_entropy(logits, t, None)
    np.testing.assert_allclose(float(loss), ref.cross_entropy(logits, t), rtol=1e-6)
    dl = cpu.cross_entropy_bwd(logits, t, 1.0, None)
    assert np.isfinite(dl).all()
    close(dl, ref.cross_entropy_bwd(logits, t))


def test_cross_entropy_target_outside_the_vocabulary_is_the_references_behaviour():
    """The C kernel declines a target outside [0, V): the NumPy reference runs and decides (an
    IndexError past the padded row), the same on both paths."""
    logits, t = randn((3, 8), 1), np.array([0, 9, 2])
    for mode in ("c", "numpy"):
        with flags.override(FORGE_CPU_KERNELS=mode):
            with pytest.raises(IndexError):
                cpu.cross_entropy(logits, t, 6)
            with pytest.raises(IndexError):
                cpu.cross_entropy_bwd(logits, t, 1.0, 6)


@pytest.mark.parametrize("rows,n,c", [(65, 768, 128), (5, 3, 1), (50, 50, 7), (1000, 4, 64)])
def test_scatter_add_rows_c_and_numpy_agree(rows, n, c):
    """Repeated ids summed first, then added, on both paths (NumPy's reduceat sums pairwise,
    the C kernel in order: the same to float rounding), both against float64."""
    ids = np.random.default_rng(rows).integers(0, rows, n)
    src = randn((n, c), 2)
    out = {}
    for mode in ("c", "numpy"):
        dst = randn((rows, c), 3)
        with flags.override(FORGE_CPU_KERNELS=mode):
            assert cpu.scatter_add_rows(dst, ids.astype(np.int32), src) is None
        out[mode] = dst
    np.testing.assert_allclose(out["c"], out["numpy"], rtol=1e-6, atol=1e-5)
    close(out["c"], ref.scatter_add_rows(randn((rows, c), 3), ids, src))


def test_scatter_add_rows_bad_id_leaves_dst_to_the_reference():
    dst, src = randn((4, 3), 1), randn((2, 3), 2)
    before = dst.copy()
    with flags.override(FORGE_CPU_KERNELS="c"), pytest.raises(IndexError):
        cpu.scatter_add_rows(dst, np.array([1, 7]), src)
    np.testing.assert_array_equal(dst, before)     # nothing added before the error


@pytest.mark.parametrize("chunk_rows", [None, 5])
def test_linear_cross_entropy_vs_reference(path, monkeypatch, chunk_rows):
    n, c, vp, v = 23, 16, 72, 65
    x, w = randn((n, c), 1), randn((vp, c), 2, 0.5)
    t = np.random.default_rng(3).integers(0, v, n)
    if chunk_rows:
        monkeypatch.setattr(cpu, "LCE_CHUNK_BYTES", chunk_rows * vp * 4)
    loss, dx, dw = cpu.linear_cross_entropy(x, w, t, v, True)
    e_loss, e_dx, e_dw = ref.linear_cross_entropy(x, w, t, v)
    np.testing.assert_allclose(float(loss), e_loss, rtol=2e-6, atol=2e-6)
    close(dx, e_dx)
    close(dw, e_dw)
    loss_only, none_dx, none_dw = cpu.linear_cross_entropy(x, w, t, v, False)
    assert none_dx is None and none_dw is None
    np.testing.assert_allclose(float(loss_only), e_loss, rtol=2e-6, atol=2e-6)
