"""GPU tests of the fused causal attention (backends/cuda/flash_attention.cu: bfloat16, head size
64, forward and backward on the tensor cores) against float64 NumPy formulas (the spec) and
against the composed path (cuBLAS products around the softmax kernels) of the same backend.

Every test skips where CuPy or a GPU is missing. Before each test the CuPy memory pool is
emptied and refilled with NaN bytes, so an output element a kernel forgets to write shows up as
NaN; every output is checked to be finite.

Tolerances (‖got - ref‖ / ‖ref‖): 2e-2 for out, dq, dk, dv, against the reference computed in
float64 from the bf16-rounded inputs and against the composed path (P is rounded to bf16 for the tensor cores
and the results are bf16); lse within 1e-3 absolute (it stays float32 throughout).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from forge_ml import flags

from _gpu_checks import check, cuda_or_skip, host, poison_device_memory, round_bf16

pytestmark = pytest.mark.cuda

HS = 64
TOL = 2e-2
LSE_TOL = 1e-3
POISON_BYTES = 1 << 30

# (q shape, k/v shape): GPT-2 124M at T=1024; a ragged T (77: one full block and a partial
# one); a KV-cache offset (16 queries after 84 cached keys); single rows and columns; exactly
# one block; one past a block; 2-D inputs (no lead dims); Tq = 64 after 14 cached keys, where
# a warp's keys cross the diagonal inside a whole query block.
SHAPES = {
    "gpt2": ((2, 12, 1024, HS), (2, 12, 1024, HS)),
    "ragged77": ((1, 2, 77, HS), (1, 2, 77, HS)),
    "decode": ((2, 3, 16, HS), (2, 3, 100, HS)),
    "t1": ((1, 1, 1, HS), (1, 1, 1, HS)),
    "q1_k65": ((1, 3, 1, HS), (1, 3, 65, HS)),
    "t64": ((1, 2, 64, HS), (1, 2, 64, HS)),
    "t65": ((3, 65, HS), (3, 65, HS)),
    "2d": ((130, HS), (130, HS)),
    "off14": ((1, 1, 64, HS), (1, 1, 78, HS)),
}


@pytest.fixture(scope="module")
def gpu():
    return cuda_or_skip(bf16=True)


def _poison():
    poison_device_memory(POISON_BYTES)


@pytest.fixture
def be(gpu):
    _poison()
    with flags.override(FORGE_ATTENTION="flash"):   # whatever the environment says
        yield gpu


@pytest.fixture
def rs():
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def bf16_values(rs, shape, scale=1.0):
    """Random values exactly representable in bf16 (rounded to nearest even), as float64."""
    return round_bf16(rs.standard_normal(shape) * scale).astype(np.float64)


def dev(be, a):
    return be.from_host(np.asarray(a), "bfloat16")


def check_abs(name, got, ref, tol):
    got = np.asarray(got, dtype=np.float64)
    assert np.all(np.isfinite(got)), f"{name}: not all finite"
    err = np.max(np.abs(got - ref)) if got.size else 0.0
    assert err <= tol, f"{name}: max abs error {err:.3e} > {tol:.0e}"


def ref_attention(q, k, v, dout, scale):
    """float64: out, lse, dq, dk, dv of causal attention with query i seeing keys j <= i + off,
    off = Tk - Tq (Dao 2023's backward: dS = P * (dP - rowsum(P * dP)))."""
    tq, tk = q.shape[-2], k.shape[-2]
    s = scale * q @ np.swapaxes(k, -1, -2)
    masked = np.arange(tk)[None, :] > np.arange(tq)[:, None] + (tk - tq)
    s = np.where(masked, -np.inf, s)
    m = s.max(-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(-1, keepdims=True))
    p = np.exp(s - lse)
    out = p @ v
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    return out, lse[..., 0], scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, dv


def inputs(rs, qs, ks, qscale=1.0):
    return (bf16_values(rs, qs, qscale), bf16_values(rs, ks), bf16_values(rs, ks),
            bf16_values(rs, qs))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_flash_attention_vs_reference_and_composed(be, rs, shape):
    qs, ks = SHAPES[shape]
    scale = 1.0 / math.sqrt(HS)
    q, k, v, dout = inputs(rs, qs, ks)
    dq_, dk_, dv_, ddo = dev(be, q), dev(be, k), dev(be, v), dev(be, dout)
    assert be._flash_wanted(dq_, dk_, dv_), "bf16 at head size 64 should take the flash path"
    rout, rlse, rdq, rdk, rdv = ref_attention(q, k, v, dout, scale)

    out, lse = be.attention(dq_, dk_, dv_, scale)
    assert str(out.dtype) == "bfloat16" and str(lse.dtype) == "float32"
    assert lse.shape == qs[:-1]
    check("flash out", host(be, out), rout, TOL)
    check_abs("flash lse", host(be, lse), rlse, LSE_TOL)
    out1, lse1 = be._attention_composed(dq_, dk_, dv_, scale)
    check("flash out vs composed", host(be, out), host(be, out1), TOL)
    check_abs("flash lse vs composed", host(be, lse), host(be, lse1), LSE_TOL)

    grads = be.attention_bwd(dq_, dk_, dv_, out, lse, ddo, scale)
    grads1 = be._attention_bwd_composed(dq_, dk_, dv_, out1, lse1, ddo, scale)
    for name, got, ref, comp in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv), grads1):
        assert got.shape == ref.shape and str(got.dtype) == "bfloat16"
        check(f"flash {name}", host(be, got), ref, TOL)
        check(f"flash {name} vs composed", host(be, got), host(be, comp), TOL)


def test_flash_peaked_softmax(be, rs):
    """Large scores (q x 8): the running max moves by tens between key blocks, so the online
    rescaling of the output and the sum must be right, not just harmless."""
    qs = ks = (1, 2, 300, HS)
    scale = 1.0 / math.sqrt(HS)
    q, k, v, dout = inputs(rs, qs, ks, qscale=8.0)
    rout, rlse, rdq, rdk, rdv = ref_attention(q, k, v, dout, scale)
    dq_, dk_, dv_ = dev(be, q), dev(be, k), dev(be, v)
    out, lse = be.attention(dq_, dk_, dv_, scale)
    check("flash out", host(be, out), rout, TOL)
    check_abs("flash lse", host(be, lse), rlse, LSE_TOL)
    grads = be.attention_bwd(dq_, dk_, dv_, out, lse, dev(be, dout), scale)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        check(f"flash {name}", host(be, got), ref, TOL)


def test_flash_default_scale_and_composed_lse(be, rs):
    """scale=None means 1/sqrt(64); a backward fed the composed path's lse agrees with one fed
    flash's."""
    qs = ks = (2, 4, 200, HS)
    q, k, v, dout = inputs(rs, qs, ks)
    dq_, dk_, dv_, ddo = dev(be, q), dev(be, k), dev(be, v), dev(be, dout)
    out, lse = be.attention(dq_, dk_, dv_, None)
    rout, _, rdq, rdk, rdv = ref_attention(q, k, v, dout, 1.0 / math.sqrt(HS))
    check("flash out (scale None)", host(be, out), rout, TOL)
    _, lse1 = be._attention_composed(dq_, dk_, dv_, None)
    grads = be.attention_bwd(dq_, dk_, dv_, out, lse1, ddo, None)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (rdq, rdk, rdv)):
        check(f"flash {name} from composed lse", host(be, got), ref, TOL)


def test_flash_is_deterministic(be, rs):
    """No atomics: two runs give the same bits, forward and backward."""
    qs = ks = (2, 3, 333, HS)
    q, k, v, dout = (dev(be, a) for a in inputs(rs, qs, ks))
    runs = []
    for _ in range(2):
        out, lse = be.attention(q, k, v, 0.125)
        grads = be.attention_bwd(q, k, v, out, lse, dout, 0.125)
        runs.append([host(be, x) for x in (out, lse) + tuple(grads)])
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


def test_flash_selection(be, rs):
    """flash for bf16 at head size 64 unless FORGE_ATTENTION=composed (or its old name v1);
    the composed path for everything else."""
    qs = ks = (1, 2, 100, HS)
    q, k, v, dout = inputs(rs, qs, ks)
    dq_, dk_, dv_, ddo = dev(be, q), dev(be, k), dev(be, v), dev(be, dout)
    assert be._flash_wanted(dq_, dk_, dv_)
    with flags.override(FORGE_ATTENTION="v1"):
        assert not be._flash_wanted(dq_, dk_, dv_)
    with flags.override(FORGE_ATTENTION="composed"):
        assert not be._flash_wanted(dq_, dk_, dv_)
        out, lse = be.attention(dq_, dk_, dv_, 0.125)
        out1, lse1 = be._attention_composed(dq_, dk_, dv_, 0.125)
        assert np.array_equal(host(be, out), host(be, out1))
        assert np.array_equal(host(be, lse), host(be, lse1))
        got = be.attention_bwd(dq_, dk_, dv_, out, lse, ddo, 0.125)
        want = be._attention_bwd_composed(dq_, dk_, dv_, out, lse, ddo, 0.125)
        for a, b in zip(got, want):
            assert np.array_equal(host(be, a), host(be, b))
    f32 = be.from_host(q.astype(np.float32), "float32")
    assert not be._flash_wanted(f32, f32, f32)
    h32 = dev(be, bf16_values(rs, (1, 2, 100, 32)))
    assert not be._flash_wanted(h32, h32, h32)
    empty = dev(be, np.zeros((1, 2, 0, HS)))
    assert not be._flash_wanted(empty, empty, empty)


# -- the same kernels on GPT-2's fused layout: q, k, v read in place from (B, T, 3C) rows, y
# written (B, T, C), dq, dk, dv written into their thirds of dqkv ---------------------------

def _fused_reference(qkv, dy, H, scale):
    """float64 y, lse, dqkv of attention_qkv, through ref_attention on the split heads."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // H
    split = [qkv[..., i * C:(i + 1) * C].reshape(B, T, H, hs).transpose(0, 2, 1, 3) for i in range(3)]
    dout = dy.reshape(B, T, H, hs).transpose(0, 2, 1, 3)
    out, lse, dq, dk, dv = ref_attention(*split, dout, scale)
    merge = lambda x: x.transpose(0, 2, 1, 3).reshape(B, T, C)  # noqa: E731
    return merge(out), lse, np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)


@pytest.mark.parametrize("B,T,H", [(2, 1024, 12), (1, 77, 3), (3, 1, 2)])
def test_flash_on_fused_qkv_layout(be, rs, B, T, H):
    C = H * HS
    scale = 1.0 / math.sqrt(HS)
    qkv, dy = bf16_values(rs, (B, T, 3 * C)), bf16_values(rs, (B, T, C))
    ry, rlse, rdqkv = _fused_reference(qkv, dy, H, scale)
    dqkv_in = dev(be, qkv)
    assert be._qkv_flash_ok(dqkv_in, H)
    y, lse = be.attention_qkv(dqkv_in, H, scale)
    assert y.shape == (B, T, C) and lse.shape == (B, H, T)
    check("fused y", host(be, y), ry, TOL)
    check_abs("fused lse", host(be, lse), rlse, LSE_TOL)
    dqkv = be.attention_qkv_bwd(dqkv_in, y, lse, dev(be, dy), H, scale)
    assert dqkv.shape == qkv.shape
    check("fused dqkv", host(be, dqkv), rdqkv, TOL)
    # the head-major kernels on split copies give the same bits
    q, k, v = be.split_heads(dqkv_in, H)
    out, lse2 = be.attention(q, k, v, scale)
    assert np.array_equal(host(be, be.merge_heads(out)), host(be, y))
    assert np.array_equal(host(be, lse2), host(be, lse))


def test_fused_qkv_fallback_float32(be, rs):
    """float32 (and FORGE_ATTENTION=composed) compose split_heads, the composed attention and
    merge_heads."""
    B, T, H, hs = 2, 50, 2, 16
    C = H * hs
    qkv = rs.standard_normal((B, T, 3 * C)).astype(np.float32)
    dy = rs.standard_normal((B, T, C)).astype(np.float32)
    ry, rlse, rdqkv = _fused_reference(qkv.astype(np.float64), dy.astype(np.float64), H, 0.25)
    x = be.from_host(qkv, "float32")
    assert not be._qkv_flash_ok(x, H)
    y, lse = be.attention_qkv(x, H, 0.25)
    check("fallback y", host(be, y), ry, 1e-5)
    dqkv = be.attention_qkv_bwd(x, y, lse, be.from_host(dy, "float32"), H, 0.25)
    check("fallback dqkv", host(be, dqkv), rdqkv, 1e-5)
