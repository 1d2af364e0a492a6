"""GPU tests: every function of the CUDA backend against the float64 specification
(tests/reference.py) and, where the CPU backend has the function, against the CPU backend, at
GPT-2 124M shapes (T=1024, C=768, H=12, V=50257) on fresh random inputs.

Every test marked ``cuda`` skips where CuPy or a GPU is missing. Before each test the CuPy
memory pool is emptied and refilled with NaN bytes, so an output element that a kernel forgets
to write shows up as NaN; every output is then checked to be finite and to match.

Tolerances (‖got - ref‖ / ‖ref‖): float32 1e-5 (products through cuBLAS 1e-4), bfloat16 1e-2
(reference computed from the bf16-rounded inputs), float64 1e-12. Dropout masks must match
``forge_ml.rng`` bit for bit.
"""
from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

from forge_ml import rng
from forge_ml.device import Device
from forge_ml.errors import CompileError, DeviceError, OutOfMemoryError

import reference
from _gpu_checks import check, cuda_or_skip, host, round_bf16

cuda = pytest.mark.cuda

T, C, H, V, VP = 1024, 768, 12, 50257, 50304
HS = C // H
FLOATS = ["float32", "bfloat16", "float64"]
TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float64": 1e-12}
TOL_MM = {"float32": 1e-4, "bfloat16": 1e-2, "float64": 1e-12}
POISON_BYTES = 1 << 30


def _gpu_count() -> int:
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


@pytest.fixture(scope="module")
def gpu():
    return cuda_or_skip()


def _poison():
    """Empty CuPy's pool, then hand it one NaN-filled block that later allocations split."""
    import cupy
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    buf = cupy.empty(POISON_BYTES, dtype=cupy.uint8)
    buf.fill(0xFF)  # 0xff.. is NaN in bf16, float32 and float64
    del buf


@pytest.fixture
def be(gpu):
    _poison()
    return gpu


@pytest.fixture
def rs():
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    print(f"random seed {seed}")
    return np.random.default_rng(seed)


def _cpu(name):
    try:
        from forge_ml.backends import cpu
    except Exception:
        return None
    return getattr(cpu, name, None)


def values(rs, shape, dtype, scale=1.0):
    """Random host values exactly representable in ``dtype`` (float64 copy for references)."""
    a = rs.standard_normal(shape) * scale
    if dtype == "float32":
        a = a.astype(np.float32)
    elif dtype == "bfloat16":
        a = round_bf16(a)
    return a.astype(np.float64)


def dev(be, a, dtype):
    return be.from_host(np.asarray(a), dtype)


def cpu_check(name, args, got, tol, pick=None):
    """Compare with the CPU backend when it has ``name`` (prepare ``args`` with cpu_args64)."""
    fn = _cpu(name)
    if fn is None:
        return
    try:
        out = fn(*args)
    except NotImplementedError:
        return
    if pick is not None:
        out = pick(out)
    check(f"{name} vs CPU backend", got, np.asarray(out, dtype=np.float64), tol)


def cpu_args64(args, dtype):
    """Inputs for the CPU backend: float64 when testing float64, else float32 (bf16 values
    are exact in float32)."""
    if dtype == "float64":
        return list(args)
    return [a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a
            for a in args]


def sample_rows(n_rows, most=512):
    """Evenly spaced row indices, the first and the last included: where the reference of a
    row-wise op (softmax_bwd builds each row's Jacobian) is too slow for every row of a
    GPT-2-sized input, a spread of rows is checked against it and every row against the CPU
    backend."""
    return np.unique(np.linspace(0, n_rows - 1, min(n_rows, most)).astype(np.int64))


def _pad_queries(x, tk):
    """x (..., Tq, hs) with Tk - Tq zero rows in front."""
    pad = np.zeros(x.shape[:-2] + (tk - x.shape[-2], x.shape[-1]))
    return np.concatenate([pad, x], axis=-2)


def reference_attention(q, k, v, scale):
    """reference.attention for Tq <= Tk queries, the last Tq of Tk positions (a KV cache
    ahead of them: query i sees keys j <= i + Tk - Tq): the queries padded in front to Tk
    rows, the last Tq rows of out and lse kept."""
    tq, tk = q.shape[-2], k.shape[-2]
    out, lse = reference.attention(_pad_queries(q, tk), k, v, scale)
    return out[..., tk - tq:, :], lse[..., tk - tq:]


def reference_attention_bwd(q, k, v, dout, scale):
    """reference.attention_bwd the same way: the padded queries get a zero cotangent, so they
    add nothing to dk and dv; the last Tq rows of dq kept."""
    tq, tk = q.shape[-2], k.shape[-2]
    dq, dk, dv = reference.attention_bwd(_pad_queries(q, tk), k, v, _pad_queries(dout, tk), scale)
    return dq[..., tk - tq:, :], dk, dv


# ----------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_memory_roundtrip(be, rs, dtype):
    a = values(rs, (3, 1000), dtype)
    x = dev(be, a, dtype)
    assert str(x.dtype) == dtype
    check("to_host(from_host)", host(be, x), a, 0.0)
    z = be.zeros((5, 7), dtype)
    assert (host(be, z) == 0).all()
    y = be.copy(x)
    check("copy", host(be, y), a, 0.0)
    for other in FLOATS:
        c = be.cast(x, other)
        assert str(c.dtype) == other
        want = round_bf16(a) if other == "bfloat16" else a.astype(np.float32 if other == "float32" else np.float64)
        check(f"cast {dtype}->{other}", host(be, c), want, 0.0)
    i = be.cast(dev(be, np.arange(10), "int64"), dtype)
    check("cast int64->float", host(be, i), np.arange(10), 0.0)


@cuda
def test_from_host_rounds_to_nearest_even(be):
    a = np.array([1.0, 1.00390625, 1.0078125, 1.005859375, -2.71828, 3.3e38], np.float32)
    got = host(be, be.from_host(a, "bfloat16"))
    check("bf16 rounding", got, round_bf16(a), 0.0)


# ----------------------------------------------------------------------------------------------
# matmul
# ----------------------------------------------------------------------------------------------

MATMUL_CASES = {
    # name: (a shape, b shape, trans_a, trans_b, bias?, alpha, b_rows)
    "qkv_bias": ((2 * T, C), (C, 3 * C), False, False, True, 1.0, None),
    "mlp_3d_at_2d": ((2, T, C), (C, 4 * C), False, False, True, 1.0, None),
    "dW_trans_a": ((2 * T, C), (2 * T, 4 * C), True, False, False, 1.0, None),
    "dx_trans_b": ((2 * T, 4 * C), (C, 4 * C), False, True, False, 1.0, None),
    "lm_head": ((128, C), (VP, C), False, True, False, 1.0, None),
    "scores_batched": ((2, H, T, HS), (2, H, T, HS), False, True, False, 0.125, None),
    "pv_batched": ((2, H, T, T), (2, H, T, HS), False, False, False, 1.0, None),
    "kv_scores_b_rows": ((2, H, 1, HS), (2, H, T, HS), False, True, False, 0.125, 300),
    "kv_values_b_rows": ((2, H, 1, 300), (2, H, T, HS), False, False, False, 1.0, 300),
    # a few rows (decoding): gemv.cu for float32 and bf16 when N fits its vectors
    "gemv_m1_bias": ((1, C), (C, 3 * C), False, False, True, 1.0, None),
    "gemv_m3_alpha": ((3, 4 * C), (4 * C, C), False, False, False, 0.5, None),
    "gemv_m4_n100": ((4, C), (C, 100), False, False, True, 1.0, None),  # bf16: cuBLAS (100 % 8)
    "gemv_m5_cublas": ((5, C), (C, C), False, False, True, 1.0, None),
}


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", sorted(MATMUL_CASES))
def test_matmul(be, rs, dtype, case):
    ashape, bshape, ta, tb, has_bias, alpha, b_rows = MATMUL_CASES[case]
    a = values(rs, ashape, dtype)
    b = values(rs, bshape, dtype)
    n_out = (bshape[-2] if b_rows is None else b_rows) if tb else bshape[-1]
    bias = values(rs, (n_out,), dtype) if has_bias else None
    got = be.matmul(dev(be, a, dtype), dev(be, b, dtype),
                    dev(be, bias, dtype) if has_bias else None, ta, tb, alpha, b_rows)
    bb = b if b_rows is None else b[..., :b_rows, :]
    opa = np.swapaxes(a, -1, -2) if ta else a
    opb = np.swapaxes(bb, -1, -2) if tb else bb
    ref = alpha * (opa @ opb) + (bias if has_bias else 0.0)
    check(f"matmul {case}", host(be, got), ref, TOL_MM[dtype])
    if case.startswith("gemv"):  # same bits on every run (fixed summation order)
        again = be.matmul(dev(be, a, dtype), dev(be, b, dtype),
                          dev(be, bias, dtype) if has_bias else None, ta, tb, alpha, b_rows)
        assert np.array_equal(host(be, again), host(be, got))
    if dtype != "bfloat16" and case in ("qkv_bias", "scores_batched", "kv_scores_b_rows"):
        cpu_check("matmul", cpu_args64([a, b, bias], dtype) + [ta, tb, alpha, b_rows],
                  host(be, got), TOL_MM[dtype])


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("act,res,ln,rows", [(None, True, False, 1), ("gelu", False, True, 1),
                                             (None, False, True, 3), ("gelu", True, False, 4)])
def test_linear_fused_epilogue(be, rs, dtype, act, res, ln, rows):
    """The decoding step's layers in one gemv kernel: layernorm of x (c_attn, c_fc), bias,
    then GELU (c_fc) or the residual (c_proj)."""
    K, N = (C, 4 * C) if act else (4 * C, C)
    x, w, b = values(rs, (rows, K), dtype, 2.0), values(rs, (K, N), dtype, 0.05), values(rs, (N,), dtype)
    r = values(rs, (rows, N), dtype)
    g, beta = values(rs, (K,), dtype) * 0.1 + 1.0, values(rs, (K,), dtype)
    xn = reference.layernorm(x, g, beta, 1e-5) if ln else x
    y = xn @ w + b
    if act:
        y = reference.gelu(y)
    if res:
        y = y + r
    got = be.linear(dev(be, x, dtype), dev(be, w, dtype), dev(be, b, dtype), act,
                    dev(be, r, dtype) if res else None,
                    (dev(be, g, dtype), dev(be, beta, dtype), 1e-5) if ln else None)
    check(f"linear act={act} residual={res} ln={ln}", host(be, got), y, TOL_MM[dtype])
    again = be.linear(dev(be, x, dtype), dev(be, w, dtype), dev(be, b, dtype), act,
                      dev(be, r, dtype) if res else None,
                      (dev(be, g, dtype), dev(be, beta, dtype), 1e-5) if ln else None)
    assert np.array_equal(host(be, again), host(be, got))   # same bits every run


@cuda
def test_gemv_waits_for_a_weight_the_previous_kernel_wrote(be, rs):
    """Programmatic dependent launch: a gemv loads its first rows of W before the previous
    kernel has finished, unless that kernel wrote W. Here each product's W is the previous
    product's output, and the stale bits in its buffer (the last round's) differ."""
    x, w0, z = values(rs, (4, C), "float32"), values(rs, (C, 256), "float32", 0.05), values(rs, (2, 4), "float32")
    dw0, dz = dev(be, w0, "float32"), dev(be, z, "float32")
    for i in range(1, 30):
        y1 = be.matmul(dev(be, x * i, "float32"), dw0)     # (4, 256), gemv
        assert be._pdl_wrote(y1)
        y2 = be.matmul(dz, y1)                                # (2, 256), W = y1: gemv, waits
        check(f"gemv after gemv, round {i}", host(be, y2), z @ ((x * i) @ w0), TOL_MM["float32"])
        check(f"first gemv, round {i}", host(be, y1), (x * i) @ w0, TOL_MM["float32"])


@cuda
def test_gemv_waits_for_a_bias_or_layernorm_weight_the_previous_kernel_wrote(be, rs):
    """The gemv also loads its first bias values and the layernorm's gamma and beta before the
    previous kernel has finished; where that kernel wrote them (here rows of the previous
    gemv's output, different every round), it waits first."""
    x, w0 = values(rs, (4, C), "float32"), values(rs, (C, 2 * C), "float32", 0.05)
    w1, z = values(rs, (C, 256), "float32", 0.05), values(rs, (2, C), "float32")
    dw0, dw1, dz = dev(be, w0, "float32"), dev(be, w1, "float32"), dev(be, z, "float32")
    for i in range(1, 20):
        xi = x * i
        y1 = be.matmul(dev(be, xi, "float32"), dw0)             # (4, 2C), gemv
        want1 = xi @ w0
        assert be._pdl_wrote(y1[0])
        got = be.linear(dz, dw1, y1[0, :256], None, None, None)   # bias = y1's row: waits
        check(f"bias from the previous gemv, round {i}", host(be, got), z @ w1 + want1[0, :256],
              TOL_MM["float32"])
        y1 = be.matmul(dev(be, xi, "float32"), dw0)
        gamma, beta = y1[1, :C], y1[2, C:]
        got = be.linear(dz, dw1, None, None, None, (gamma, beta, 1e-5))   # gamma, beta: waits
        want = reference.layernorm(z, want1[1, :C], want1[2, C:], 1e-5) @ w1
        check(f"layernorm weights from the previous gemv, round {i}", host(be, got), want,
              TOL_MM["float32"])


# ----------------------------------------------------------------------------------------------
# Elementwise and reductions
# ----------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_add(be, rs, dtype):
    a, b = values(rs, (2, T, C), dtype), values(rs, (2, T, C), dtype)
    got = host(be, be.add(dev(be, a, dtype), dev(be, b, dtype)))
    check("add", got, reference.add(a, b), TOL[dtype])
    cpu_check("add", cpu_args64([a, b], dtype), got, TOL[dtype])
    # views one element in: unaligned for vector loads, and a length that is not a multiple of 4
    a, b = values(rs, (4003,), dtype), values(rs, (4003,), dtype)
    got = host(be, be.add(dev(be, a, dtype)[1:], dev(be, b, dtype)[1:]))
    check("add unaligned", got, reference.add(a[1:], b[1:]), TOL[dtype])


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_sum_rows(be, rs, dtype):
    x = values(rs, (2, T, 3 * C), dtype)
    got = host(be, be.sum_rows(dev(be, x, dtype)))
    check("sum_rows", got, reference.sum_rows(x), TOL[dtype])
    cpu_check("sum_rows", cpu_args64([x], dtype), got, TOL[dtype])
    odd = values(rs, (77, 33), dtype)  # partial tiles in both directions
    check("sum_rows odd", host(be, be.sum_rows(dev(be, odd, dtype))), reference.sum_rows(odd),
          TOL[dtype])


@cuda
@pytest.mark.parametrize("rows,cols", [(4096, 3072), (1000, 264), (37, 16), (5, 8), (17, 2056)])
def test_sum_rows_16_byte_kernel(be, rs, rows, cols):
    """reduce.cu's sum_rows8_partial_bf16 (bf16 rows of a multiple of 8 columns on a 16-byte
    boundary: the MLP's bias gradient after the DGELU product): against float64 (row counts
    that leave a lone last row and partial chunks; column counts that leave part of a block),
    and a view 2 bytes into its buffer (the scalar kernel) gives the same sums within rounding."""
    x = values(rs, (rows + 1, cols), "bfloat16", scale=2.0)
    xd = dev(be, x, "bfloat16")
    got = host(be, be.sum_rows(xd[:rows]))
    check("sum_rows8", got, reference.sum_rows(x[:rows]), TOL["bfloat16"])
    flat = xd.reshape(-1)
    off = flat[1:1 + rows * cols].reshape(rows, cols)   # rows 2 bytes off a 16-byte boundary
    want = reference.sum_rows(x.reshape(-1)[1:1 + rows * cols].reshape(rows, cols))
    check("sum_rows unaligned", host(be, be.sum_rows(off)), want, TOL["bfloat16"])


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_sumsq(be, rs, dtype):
    x = values(rs, (C, 4 * C + 3), dtype)
    out = be.sumsq(dev(be, x, dtype))
    assert out.shape == ()
    assert str(out.dtype) == ("float64" if dtype == "float64" else "float32")
    got = float(be.to_host(out))
    check("sumsq", got, float(reference.sumsq(x)), TOL[dtype] if dtype != "bfloat16" else 1e-5)
    cpu_check("sumsq", cpu_args64([x], dtype), got, TOL[dtype] if dtype != "bfloat16" else 1e-5)


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_gelu(be, rs, dtype):
    x = values(rs, (2, T, 4 * C), dtype, scale=2.0)
    dy = values(rs, (2, T, 4 * C), dtype)
    y = host(be, be.gelu(dev(be, x, dtype)))
    check("gelu", y, reference.gelu(x), TOL[dtype])
    dx = host(be, be.gelu_bwd(dev(be, x, dtype), dev(be, dy, dtype)))
    check("gelu_bwd", dx, reference.gelu_bwd(x, dy), TOL[dtype])
    cpu_check("gelu", cpu_args64([x], dtype), y, TOL[dtype])
    cpu_check("gelu_bwd", cpu_args64([x, dy], dtype), dx, TOL[dtype])
    x, dy = values(rs, (4002,), dtype), values(rs, (4002,), dtype)  # unaligned views, odd tail
    xv, dyv = dev(be, x, dtype)[1:], dev(be, dy, dtype)[1:]
    check("gelu unaligned", host(be, be.gelu(xv)), reference.gelu(x[1:]), TOL[dtype])
    check("gelu_bwd unaligned", host(be, be.gelu_bwd(xv, dyv)),
          reference.gelu_bwd(x[1:], dy[1:]), TOL[dtype])


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_gelu_far_out_takes_the_limits(be, dtype):
    """|x| from 1e6 to 3e38 (bf16 too): gelu -0 far left and x far right, gelu' 0 and 1, as the
    CPU kernels give; the elementwise kernels (gelu_d: 0 * inf NaN past |x| = 1.8e19) and the
    16-byte bf16 kernel (gelu_d_fast: its clamped exponential gave 3600 at 1e13 and -360 at
    -1e13); a NaN stays NaN."""
    from forge_ml.backends.cuda import rows as cuda_rows
    mags = [1e6, 1e11, 1e12, 2e12, 1e13, 1e20, 1e30, 3e38]
    # the values the device holds: rounded to bf16 or float32 (1e11 is 99999997952 in float32)
    held = {"bfloat16": lambda a: round_bf16(a).astype(np.float64),
            "float32": lambda a: a.astype(np.float32).astype(np.float64)}.get(dtype, lambda a: a)
    x = held(np.array([-m for m in mags] + mags + [np.nan] * 8, np.float64))
    x = np.tile(x, (4, 1))                                  # (4, 24): 16-byte rows for bf16
    dy = held(np.tile(np.linspace(0.5, 2.0, 24), (4, 1)))
    n = len(mags)
    want_y = np.concatenate([np.zeros(n), x[0, n:2 * n], np.full(8, np.nan)])
    want_dx = np.concatenate([np.zeros(n), dy[0, n:2 * n], np.full(8, np.nan)])
    xd, dyd = dev(be, x, dtype), dev(be, dy, dtype)
    y = host(be, be.gelu(xd))
    np.testing.assert_array_equal(y, np.broadcast_to(want_y, y.shape))
    assert np.signbit(y[:, :n]).all()
    outs = [host(be, be.gelu_bwd(xd, dyd))]
    colsum = cuda_rows.gelu_bwd_colsum(xd, dyd)
    if colsum is not None:
        outs.append(host(be, colsum[0]))
    for dx in outs:
        np.testing.assert_array_equal(dx, np.broadcast_to(want_dx, dx.shape))


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("M,K,N", [(2048, 4 * C, C), (333, 40, 24), (50, 30, 8)])
def test_matmul_dgelu(be, rs, dtype, M, K, N):
    """GELU's backward through the product after it, with the bias gradient summed as the
    gradient is written (gelu_bwd_colsum; K = 30 is not a multiple of 4: the composed path),
    against float64, and the same values as the composed ops on this GPU."""
    from forge_ml.backends import compose
    dy, w, pre = values(rs, (M, N), dtype, 0.5), values(rs, (K, N), dtype, 0.1), values(rs, (M, K), dtype, 2.0)
    args = (dev(be, dy, dtype), dev(be, w, dtype), dev(be, pre, dtype))
    dpre, db = be.matmul_dgelu(*args)
    want = reference.gelu_bwd(pre, reference.matmul(dy, w, trans_b=True))
    check("matmul_dgelu dpre", host(be, dpre), want, TOL_MM[dtype])
    check("matmul_dgelu db", host(be, db), want.sum(0), TOL_MM[dtype])
    cdpre, cdb = compose.matmul_dgelu(be, *args)
    check("matmul_dgelu vs composed", host(be, dpre), host(be, cdpre), TOL[dtype])
    check("matmul_dgelu db vs composed", host(be, db), host(be, cdb), TOL[dtype])


@cuda
def test_matmul_dgelu_takes_cublaslt_dgelu_epilogue(be, rs, monkeypatch):
    """At GPT-2's MLP shape in bf16 the product and GELU's derivative are one cuBLASLt call
    (the DGELU epilogue, reading GELU's input as aux) and the bias gradient is the sums of what
    it wrote; where this GPU's cuBLASLt declines, the two-pass path runs (skip)."""
    # the module (the package's name `linear` is its function)
    linear = importlib.import_module("forge_ml.backends.cuda.linear")
    calls = []
    real = linear.lt_matmul

    def spy(*a, **k):
        ok = real(*a, **k)
        calls.append((k.get("epilogue"), ok))
        return ok
    monkeypatch.setattr(linear, "lt_matmul", spy)
    M, K, N = 512, 4 * C, C
    dy, w = values(rs, (M, N), "bfloat16", 0.5), values(rs, (K, N), "bfloat16", 0.1)
    pre = values(rs, (M, K), "bfloat16", 2.0)
    dpre, db = be.matmul_dgelu(*(dev(be, a, "bfloat16") for a in (dy, w, pre)))
    assert [e for e, _ in calls] == ["dgelu"], calls
    if not calls[0][1]:
        pytest.skip("this GPU's cuBLASLt has no DGELU algorithm for the shape")
    got = host(be, dpre)
    check("dgelu epilogue", got, reference.gelu_bwd(pre, reference.matmul(dy, w, trans_b=True)),
          TOL_MM["bfloat16"])
    np.testing.assert_allclose(host(be, db), got.sum(0), rtol=1e-2,
                               atol=1e-2 * np.abs(got.sum(0)).max())


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_dropout_matches_rng_bit_for_bit(be, rs, dtype):
    n = 2 * T * C + 3  # not a multiple of 4
    x = values(rs, (n,), dtype)
    seed = (1 << 40) + int(rs.integers(0, 1 << 31))  # both key words in use
    p = 0.1
    y = host(be, be.dropout(dev(be, x, dtype), p, seed))
    keep = rng.dropout_keep(seed, n, p)
    gpu_keep = y != 0
    nz = x != 0
    assert np.array_equal(gpu_keep[nz], keep[nz]), (
        f"dropout mask differs from forge_ml.rng at {int((gpu_keep[nz] != keep[nz]).sum())} places")
    scale = rng.dropout_scale(p)
    if dtype == "float32":
        want = (x.astype(np.float32) * keep * scale).astype(np.float32)
        assert np.array_equal(y.astype(np.float32), want), "float32 dropout is not bit-exact"
    else:
        check("dropout", y, x * keep * np.float64(scale), TOL[dtype])
    # backward regenerates the same mask
    y2 = host(be, be.dropout(dev(be, x, dtype), p, seed))
    assert np.array_equal(y, y2)
    # an unaligned view draws the mask of its own element indices
    y3 = host(be, be.dropout(dev(be, x, dtype)[1:], p, seed))
    assert np.array_equal(y3 != 0, rng.dropout_keep(seed, n - 1, p) & (x[1:] != 0))
    cpu = _cpu("dropout")
    if cpu is not None and dtype == "float32":
        assert np.array_equal(np.asarray(cpu(x.astype(np.float32), p, seed), np.float32),
                              y.astype(np.float32)), "dropout differs from the CPU backend"


@cuda
def test_dropout_small_and_edge(be, rs):
    x = (values(rs, (8,), "float32") + 10.0).astype(np.float32).astype(np.float64)
    y = host(be, be.dropout(dev(be, x, "float32"), 0.5, 7))
    assert ((y != 0) == rng.dropout_keep(7, 8, 0.5)).all()
    y0 = host(be, be.dropout(dev(be, x, "float32"), 0.0, 7))
    assert np.array_equal(y0, x)


# ----------------------------------------------------------------------------------------------
# LayerNorm and softmax
# ----------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows", [1, 3, 100])
def test_layernorm_few_rows_block_per_row(be, rs, dtype, rows):
    """Fewer rows than SMs (a decoding step) take the block-per-row kernel."""
    eps = 1e-5
    x = values(rs, (rows, C), dtype, scale=3.0) + 0.5
    g, b = values(rs, (C,), dtype) + 1.0, values(rs, (C,), dtype)
    y = host(be, be.layernorm(dev(be, x, dtype), dev(be, g, dtype), dev(be, b, dtype), eps))
    check(f"layernorm {rows} rows", y, reference.layernorm(x, g, b, eps), TOL[dtype])


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_layernorm(be, rs, dtype):
    eps = 1e-5
    x = values(rs, (2, T, C), dtype, scale=3.0) + 0.5
    g = values(rs, (C,), dtype) + 1.0
    b = values(rs, (C,), dtype)
    dy = values(rs, (2, T, C), dtype)
    y = host(be, be.layernorm(dev(be, x, dtype), dev(be, g, dtype), dev(be, b, dtype), eps))
    check("layernorm", y, reference.layernorm(x, g, b, eps), TOL[dtype])
    dx, dg, db = be.layernorm_bwd(dev(be, x, dtype), dev(be, g, dtype), dev(be, dy, dtype), eps)
    rdx, rdg, rdb = reference.layernorm_bwd(x, g, dy, eps)
    check("layernorm_bwd dx", host(be, dx), rdx, TOL[dtype])
    check("layernorm_bwd dgamma", host(be, dg), rdg, TOL[dtype])
    check("layernorm_bwd dbeta", host(be, db), rdb, TOL[dtype])
    cpu_check("layernorm", cpu_args64([x, g, b], dtype) + [eps], y, TOL[dtype])
    for i, name in enumerate(("dx", "dgamma", "dbeta")):
        cpu_check("layernorm_bwd", cpu_args64([x, g, dy], dtype) + [eps],
                  host(be, (dx, dg, db)[i]), TOL[dtype], pick=lambda o, i=i: o[i])


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows", [3, 5000])
def test_layernorm_of_a_constant_row_is_beta(be, rs, dtype, rows):
    """Constant rows (values near 1000 and 1e5 too): the corrected two-pass statistics
    (common.cuh's ln_correct, as the CPU backend's) centre them to zeros, so y is beta exactly,
    and dgamma is 0, as torch gives; the plain mean's rounding error, times 1/sqrt(eps), left y
    off beta by up to 0.2. A few rows take the block-per-row kernel, many rows the warp-per-row
    kernel (bf16: the vector kernels), forward and backward."""
    eps, cols = 1e-5, 768
    g, b = values(rs, (cols,), dtype) + 1.0, values(rs, (cols,), dtype)
    for v in (0.1, 123.456, 1000.1, 1e5 + 0.3):
        x = np.zeros((rows, cols), np.float64)
        x[:] = v * (1.0 + np.arange(rows)[:, None] % 3)           # each row its own constant
        if dtype == "bfloat16":
            x = round_bf16(x)
        y = host(be, be.layernorm(dev(be, x, dtype), dev(be, g, dtype), dev(be, b, dtype), eps))
        want = np.broadcast_to(host(be, dev(be, b, dtype)), y.shape)
        np.testing.assert_array_equal(y, want, err_msg=f"{dtype} rows of {v}")
        dy = values(rs, (rows, cols), dtype)
        dx, dg, db = be.layernorm_bwd(dev(be, x, dtype), dev(be, g, dtype), dev(be, dy, dtype), eps)
        assert np.isfinite(host(be, dx)).all() and not host(be, dg).any()


@cuda
@pytest.mark.parametrize("rows,cols", [(5000, 768), (2999, 1600), (3001, 200), (600, 8), (300, 2048)])
def test_layernorm_bf16_vector_rows(be, rs, rows, cols):
    """bf16 rows held in 16-byte vectors (layernorm.cu's _vec and _fused kernels): widths that
    fill every lane's vectors (768, 2048), leave some lanes a vector short (1600, 200) or hold
    one vector (8); more rows than the grid's warps, so each warp takes several and the
    parameters' sums run over many rows; float64 reference."""
    eps = 1e-5
    x = values(rs, (rows, cols), "bfloat16", scale=3.0) + 0.5
    g, b = values(rs, (cols,), "bfloat16") + 1.0, values(rs, (cols,), "bfloat16")
    dy = values(rs, (rows, cols), "bfloat16")
    y = host(be, be.layernorm(dev(be, x, "bfloat16"), dev(be, g, "bfloat16"), dev(be, b, "bfloat16"), eps))
    check("layernorm", y, reference.layernorm(x, g, b, eps), TOL["bfloat16"])
    dx, dg, db = be.layernorm_bwd(dev(be, x, "bfloat16"), dev(be, g, "bfloat16"), dev(be, dy, "bfloat16"), eps)
    rdx, rdg, rdb = reference.layernorm_bwd(x, g, dy, eps)
    check("layernorm_bwd dx", host(be, dx), rdx, TOL["bfloat16"])
    check("layernorm_bwd dgamma", host(be, dg), rdg, TOL["bfloat16"])
    check("layernorm_bwd dbeta", host(be, db), rdb, TOL["bfloat16"])


@cuda
@pytest.mark.parametrize("rows,cols", [(5000, 768), (2999, 1600), (300, 200)])
def test_layernorm_bwd_add_kernel(be, rs, rows, cols):
    """layernorm.cu's _add_ kernels (the backend's layernorm_bwd_add): dx + add in the
    backward's pass, against float64 and against the composed backward then add."""
    from forge_ml.backends import compose
    eps = 1e-5
    x = values(rs, (rows, cols), "bfloat16", scale=3.0) + 0.5
    g = values(rs, (cols,), "bfloat16") + 1.0
    dy, add = values(rs, (rows, cols), "bfloat16"), values(rs, (rows, cols), "bfloat16")
    args = (dev(be, x, "bfloat16"), dev(be, g, "bfloat16"), dev(be, dy, "bfloat16"), eps,
            dev(be, add, "bfloat16"))
    got = be.layernorm_bwd_add(*args)
    want = reference.layernorm_bwd(x, g, dy, eps)
    check("layernorm_bwd_add dx", host(be, got[0]), add + want[0], TOL["bfloat16"])
    check("layernorm_bwd_add dgamma", host(be, got[1]), want[1], TOL["bfloat16"])
    check("layernorm_bwd_add dbeta", host(be, got[2]), want[2], TOL["bfloat16"])
    composed = compose.layernorm_bwd_add(be, *args)
    for name, a, b in zip(("dx", "dgamma", "dbeta"), got, composed):
        check(f"layernorm_bwd_add {name} vs composed", host(be, a), host(be, b), TOL["bfloat16"])


@cuda
@pytest.mark.parametrize("rows,cols,with_add", [(5000, 768, True), (2999, 1600, True),
                                                (3001, 200, False), (300, 2048, False)])
def test_layernorm_bwd_sums_kernel(be, rs, rows, cols, with_add):
    """layernorm.cu's _sums kernels (the backend's layernorm_bwd_sums): dx (+ add) and the
    parameters' gradients as the kernels without sums give them, bit for bit, and dx's row
    sums: against float64, and against sum_rows of the dx the kernel wrote (the sums are of
    the rounded values the linear layer's backward reads) within one bf16 rounding."""
    eps = 1e-5
    x = values(rs, (rows, cols), "bfloat16", scale=3.0) + 0.5
    g = values(rs, (cols,), "bfloat16") + 1.0
    dy, add = values(rs, (rows, cols), "bfloat16"), values(rs, (rows, cols), "bfloat16")
    args = (dev(be, x, "bfloat16"), dev(be, g, "bfloat16"), dev(be, dy, "bfloat16"), eps)
    a = dev(be, add, "bfloat16") if with_add else None
    got = be.layernorm_bwd_sums(*args, a)
    plain = be.layernorm_bwd_add(*args, a) if with_add else be.layernorm_bwd(*args)
    for name, u, v in zip(("dx", "dgamma", "dbeta"), got, plain):
        assert np.array_equal(host(be, u), host(be, v)), f"{name} differs from the kernel without sums"
    want_dx = reference.layernorm_bwd(x, g, dy, eps)[0] + (add if with_add else 0.0)
    check("layernorm_bwd_sums sums", host(be, got[3]), reference.sum_rows(want_dx), TOL["bfloat16"])
    written = host(be, be.sum_rows(got[0]))
    np.testing.assert_allclose(host(be, got[3]), written, rtol=1e-2, atol=1e-2 * np.abs(written).max())


@cuda
@pytest.mark.parametrize("rows,cols", [(4096, 3072), (1000, 264), (37, 16), (5, 8)])
def test_gelu_bwd_colsum_16_byte_kernel(be, rs, rows, cols):
    """gelu.cu's gelu_bwd_colsum8_bf16 (bf16, K a multiple of 8: GPT-2's MLP backward): dx
    against float64 within bf16's rounding (its tanh is 1 - 2 / (1 + e^2u), not tanhf), the
    same dx as the 4-wide kernel within one bf16 step, and db the sums of the dx it wrote."""
    from forge_ml.backends.cuda import rows as cuda_rows
    x = values(rs, (rows, cols), "bfloat16", scale=2.0)
    dy = values(rs, (rows, cols), "bfloat16", scale=0.5)
    xd, dyd = dev(be, x, "bfloat16"), dev(be, dy, "bfloat16")
    dx, db = cuda_rows.gelu_bwd_colsum(xd, dyd)
    got = host(be, dx)
    check("gelu_bwd_colsum8 dx", got, reference.gelu_bwd(x, dy), TOL["bfloat16"])
    written = got.sum(0)
    np.testing.assert_allclose(host(be, db), written, rtol=1e-2, atol=1e-2 * np.abs(written).max())
    old = host(be, be.gelu_bwd(xd, dyd))   # the elementwise kernel: tanhf
    # one bf16 step apart, or (where tanh is within float32's spacing of -1, x < -5 or so,
    # and both forms are inexact) a few 1e-7 of the largest value
    assert np.all(np.abs(got - old) <= 2.0 ** -7 * np.abs(old) + 1e-6 * np.abs(old).max())


@cuda
def test_layernorm_bf16_rows_off_a_16_byte_boundary(be, rs):
    """bf16 rows that start 2 bytes into a buffer (a view, C-contiguous) cannot take the 16-byte
    vector kernels: the warp-per-row kernels give the float64 reference's values."""
    rows, cols, eps = 300, 768, 1e-5
    x = values(rs, (rows, cols), "bfloat16", scale=3.0) + 0.5
    g, b = values(rs, (cols,), "bfloat16") + 1.0, values(rs, (cols,), "bfloat16")
    dy = values(rs, (rows, cols), "bfloat16")

    def shifted(a):   # the same values, one element into a flat buffer
        flat = dev(be, np.concatenate([[0.0], a.reshape(-1)]), "bfloat16")
        v = flat[1:].reshape(a.shape)
        assert v.data.ptr % 16 != 0 and v.flags.c_contiguous
        return v
    y = host(be, be.layernorm(shifted(x), shifted(g), shifted(b), eps))
    check("layernorm, shifted rows", y, reference.layernorm(x, g, b, eps), TOL["bfloat16"])
    dx, dg, db = be.layernorm_bwd(shifted(x), shifted(g), shifted(dy), eps)
    rdx, rdg, rdb = reference.layernorm_bwd(x, g, dy, eps)
    check("layernorm_bwd dx, shifted rows", host(be, dx), rdx, TOL["bfloat16"])
    check("layernorm_bwd dgamma, shifted rows", host(be, dg), rdg, TOL["bfloat16"])
    check("layernorm_bwd dbeta, shifted rows", host(be, db), rdb, TOL["bfloat16"])


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", ["causal", "causal_off", "plain", "causal_long", "short"])
def test_softmax(be, rs, dtype, mode):
    causal = not mode.startswith(("plain", "short"))
    # rows <= 256 and <= 1024 long sit in registers; longer rows take the online pass
    shape, off = {"causal": ((1, H, T, T), 0), "causal_off": ((2, 3, 40, 300), 260),
                  "plain": ((2, 3, 40, 1000), 0), "causal_long": ((3, 50, 1500), 1470),
                  "short": ((2, 7, 33, 200), 0)}[mode]
    x = values(rs, shape, dtype, scale=3.0)
    dy = values(rs, shape, dtype)
    y = host(be, be.softmax(dev(be, x, dtype), causal, off))
    ref = reference.softmax(x, causal, off)
    check(f"softmax {mode}", y, ref, TOL[dtype])
    if causal:
        masked = ~np.broadcast_to(reference.causal_mask(shape[-2], shape[-1], off), shape)
        assert (y[masked] == 0).all(), "masked softmax outputs must be exact zeros"
    yd = dev(be, y if dtype != "float64" else ref, dtype)
    yh = host(be, yd)
    dx = host(be, be.softmax_bwd(yd, dev(be, dy, dtype)))
    L = shape[-1]
    rows = sample_rows(dx.size // L)
    check(f"softmax_bwd {mode}", dx.reshape(-1, L)[rows],
          reference.softmax_bwd(yh.reshape(-1, L)[rows], dy.reshape(-1, L)[rows]), TOL[dtype])
    cpu_check("softmax", cpu_args64([x], dtype) + [causal, off], y, TOL[dtype])
    cpu_check("softmax_bwd", cpu_args64([yh, dy], dtype), dx, TOL[dtype])


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("mode", ["causal", "causal_off", "plain", "causal_long"])
def test_logsumexp(be, rs, dtype, mode):
    """The softmax kernels' per-row lse, masked as softmax is: rows held in registers (up to
    256 and 1024 long) and the online pass (longer)."""
    causal = mode != "plain"
    shape, off = {"causal": ((2, 3, 200, 200), 0), "causal_off": ((2, 3, 40, 300), 260),
                  "plain": ((2, 3, 40, 1000), 0), "causal_long": ((3, 50, 1500), 1470)}[mode]
    x = values(rs, shape, dtype, scale=3.0)
    out = be.logsumexp(dev(be, x, dtype), causal, off)
    assert out.shape == shape[:-1]
    assert str(out.dtype) == ("float64" if dtype == "float64" else "float32")
    got = host(be, out)
    tol = 1e-5 if dtype != "float64" else 1e-12
    check(f"logsumexp {mode}", got, reference.logsumexp(x, causal, off), tol)
    cpu_check("logsumexp", cpu_args64([x], dtype) + [causal, off], got, tol)


# ----------------------------------------------------------------------------------------------
# Heads, attention, KV cache
# ----------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_heads(be, rs, dtype):
    qkv = values(rs, (2, T, 3 * C), dtype)
    q, k, v = be.split_heads(dev(be, qkv, dtype), H)
    rq, rk, rv = reference.split_heads(qkv, H)
    for name, got, ref in (("q", q, rq), ("k", k, rk), ("v", v, rv)):
        assert got.shape == (2, H, T, HS)
        check(f"split_heads {name}", host(be, got), ref, 0.0)
    for which in range(3):
        dy = values(rs, (2, H, T, HS), dtype)
        got = host(be, be.unsplit_head(dev(be, dy, dtype), which))
        check(f"unsplit_head {which}", got, reference.unsplit_head(dy, which), 0.0)
    x = values(rs, (2, H, T, HS), dtype)
    merged = host(be, be.merge_heads(dev(be, x, dtype)))
    check("merge_heads", merged, reference.merge_heads(x), 0.0)
    back = host(be, be.unmerge_heads(dev(be, merged, dtype), H))
    check("unmerge_heads", back, reference.unmerge_heads(merged, H), 0.0)
    check("unmerge_heads(merge_heads(x))", back, x, 0.0)
    cpu_check("merge_heads", cpu_args64([x], dtype), merged, 0.0)


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", ["gpt2", "decode"])
def test_attention(be, rs, dtype, shape):
    if shape == "gpt2":
        qs, ks = (1, H, T, HS), (1, H, T, HS)
    else:  # queries are the last 16 of 100 positions (a KV cache ahead of them)
        qs, ks = (2, 3, 16, HS), (2, 3, 100, HS)
    scale = 1.0 / math.sqrt(HS)
    q, k, v = values(rs, qs, dtype), values(rs, ks, dtype), values(rs, ks, dtype)
    dout = values(rs, qs, dtype)
    out, lse = be.attention(dev(be, q, dtype), dev(be, k, dtype), dev(be, v, dtype), scale)
    rout, rlse = reference_attention(q, k, v, scale)
    tol = TOL_MM[dtype]
    check("attention out", host(be, out), rout, tol)
    check("attention lse", host(be, lse), rlse, 1e-5 if dtype != "float64" else 1e-12)
    dq, dk, dv = be.attention_bwd(dev(be, q, dtype), dev(be, k, dtype), dev(be, v, dtype), out,
                                  lse, dev(be, dout, dtype), scale)
    # the backward's reference builds a Jacobian per row: at GPT-2's size it checks the first
    # and the last of the twelve heads (each head is computed alone)
    hsel = [0, H - 1] if shape == "gpt2" else list(range(qs[1]))
    rdq, rdk, rdv = reference_attention_bwd(q[:, hsel], k[:, hsel], v[:, hsel], dout[:, hsel],
                                            scale)
    bwd_tol = tol if dtype != "bfloat16" else 2e-2
    check("attention_bwd dq", host(be, dq)[:, hsel], rdq, bwd_tol)
    check("attention_bwd dk", host(be, dk)[:, hsel], rdk, bwd_tol)
    check("attention_bwd dv", host(be, dv)[:, hsel], rdv, bwd_tol)
    if dtype != "bfloat16" and shape == "gpt2":
        cpu_check("attention", cpu_args64([q, k, v], dtype) + [scale], host(be, out), tol,
                  pick=lambda o: o[0])


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_kv_append(be, rs, dtype):
    cache0 = values(rs, (2, H, T, HS), dtype)
    new = values(rs, (2, H, 5, HS), dtype)
    cache = dev(be, cache0, dtype)
    be.kv_append(cache, dev(be, new, dtype), 300)
    check("kv_append", host(be, cache), reference.kv_append(cache0, new, 300), 0.0)


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("pos", [0, 5, 700, T - 1])
def test_decode_attention(be, rs, dtype, pos):
    import cupy
    B = 2
    k0 = values(rs, (B, H, T, HS), dtype)
    v0 = values(rs, (B, H, T, HS), dtype)
    qkv = values(rs, (B, 3 * C), dtype)
    scale = 1.0 / math.sqrt(HS)
    want_y, want_k, want_v = reference.decode_attention(qkv, k0, v0, pos, H, scale)
    kc, vc = dev(be, k0, dtype), dev(be, v0, dtype)
    pos_dev = cupy.asarray(np.array([pos], np.int32))       # read by the kernel
    y = be.decode_attention(dev(be, qkv, dtype), kc, vc, pos_dev, H, scale)
    check("decode_attention y", host(be, y), want_y, TOL[dtype])
    check("decode_attention k_cache", host(be, kc), want_k, 0.0)
    check("decode_attention v_cache", host(be, vc), want_v, 0.0)
    if dtype != "bfloat16":
        cpu_y = _cpu("decode_attention")(*cpu_args64([qkv, k0, v0], dtype), pos, H, scale)
        check("decode_attention vs CPU backend", host(be, y), cpu_y, TOL[dtype])


def _decode_attention_case(be, rs, dtype, B, Hn, hs, Tmax, pos, scale):
    """Random caches (B, Hn, Tmax, hs) and a qkv row per batch row: ``(run, want_y, want_k,
    want_v)``, ``run()`` calling the backend on fresh device copies of the caches (``(y,
    k_cache, v_cache)``) and the rest the float64 reference's."""
    import cupy
    k0, v0 = values(rs, (B, Hn, Tmax, hs), dtype), values(rs, (B, Hn, Tmax, hs), dtype)
    qkv = values(rs, (B, 3 * Hn * hs), dtype)

    def run():
        kc, vc = dev(be, k0, dtype), dev(be, v0, dtype)
        y = be.decode_attention(dev(be, qkv, dtype), kc, vc,
                                cupy.asarray(np.array([pos], np.int32)), Hn, scale)
        return y, kc, vc
    return (run,) + tuple(reference.decode_attention(qkv, k0, v0, pos, Hn, scale))


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("Tmax,pos", [(300, 0), (300, 131), (300, 299), (129, 128)])
def test_decode_attention_keys_split_among_blocks(be, rs, dtype, Tmax, pos):
    """Caches longer than 128 rows split their keys among several blocks per head (a
    cluster on Hopper), blocks without keys included; a head size of 20 (40-byte bf16 rows:
    no 16-byte loads) and 3 heads."""
    run, want_y, want_k, _ = _decode_attention_case(be, rs, dtype, 2, 3, 20, Tmax, pos, 0.3)
    y, kc, _ = run()
    check(f"decode_attention Tmax={Tmax} pos={pos}", host(be, y), want_y, TOL[dtype])
    check("decode_attention k_cache", host(be, kc), want_k, 0.0)
    again, _, _ = run()
    assert np.array_equal(host(be, again), host(be, y))    # same bits every run


@cuda
@pytest.mark.parametrize("dtype,hs", [("bfloat16", 128), ("float32", 8), ("bfloat16", 8),
                                      ("float64", 64), ("bfloat16", 48), ("float32", 256)])
@pytest.mark.parametrize("Tmax,pos,scale", [(300, 257, 0.125), (1030, 1029, 2.0), (64, 0, 1.0)])
def test_decode_attention_one_pass_and_two_pass_head_sizes(be, rs, dtype, hs, Tmax, pos, scale):
    """Head sizes whose rows are 16-byte multiples of 32 chunks or fewer take the one-pass
    kernel (16, 2 and 1 lanes a key row: 16 to 256 key groups a block; float64 too); 48 bf16
    (6 lanes) and 256 float32 (64 chunks) take the two-pass one. A large scale makes the
    running maximum of the one-pass groups jump (their sums rescaled many times); position 0
    leaves the split blocks but one without keys."""
    run, want_y, want_k, want_v = _decode_attention_case(be, rs, dtype, 2, 3, hs, Tmax, pos,
                                                         scale)
    y, kc, vc = run()
    # a score's rounding grows with its size, scale * q.k ~ scale * sqrt(hs) here, and the
    # softmax passes it on: 1.01e-5 at hs 256, scale 2 in float32 for one random draw (2026-12-06)
    tol = TOL[dtype] * max(1.0, scale * math.sqrt(hs) / 8)
    check(f"decode_attention hs={hs} Tmax={Tmax} pos={pos}", host(be, y), want_y, tol)
    check("decode_attention k_cache", host(be, kc), want_k, 0.0)
    check("decode_attention v_cache", host(be, vc), want_v, 0.0)
    again, _, _ = run()
    assert np.array_equal(host(be, again), host(be, y))    # same bits every run


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_attention_a_wide_batch_takes_one_block_per_head(be, rs, dtype):
    """A batch whose rows x heads already fill the GPU twice over does not split its keys
    (one block per head reads a long cache whole); batch 1 still splits."""
    import importlib
    cuda_attention = importlib.import_module("forge_ml.backends.cuda.attention")   # the module
    from forge_ml.backends.cuda.runtime import _dev, _launcher_ex, _sm_count
    sms = _sm_count(_dev())
    Hn, hs, Tmax, pos = 12, 64, 300, 257
    B = -(-2 * sms // Hn)
    assert cuda_attention._decode_split(B, Hn, Tmax) == 1
    assert cuda_attention._decode_split(1, Hn, Tmax) == (3 if _launcher_ex() else 1)
    run, want_y, _, want_v = _decode_attention_case(be, rs, dtype, B, Hn, hs, Tmax, pos, 0.125)
    y, _, vc = run()
    check(f"decode_attention B={B}", host(be, y), want_y, TOL[dtype])
    check("decode_attention v_cache", host(be, vc), want_v, 0.0)


@cuda
def test_decode_attention_position_out_of_range_gives_nan_and_writes_nothing(be, rs):
    import cupy
    k0 = values(rs, (1, 2, 8, 16), "float32")
    kc = dev(be, k0, "float32")
    vc = dev(be, k0, "float32")
    for bad in (8, -1):
        y = be.decode_attention(dev(be, values(rs, (1, 96), "float32"), "float32"), kc, vc,
                                cupy.asarray(np.array([bad], np.int32)), 2, 0.25)
        assert np.isnan(host(be, y)).all()
        check("cache untouched", host(be, kc), k0, 0.0)


@cuda
def test_greedy_next_matches_numpy_argmax(be, rs):
    """Ties go to the lowest id, a NaN wins (numpy.argmax), padded columns are never chosen;
    the position advances by one."""
    import cupy
    B = 5
    logits = values(rs, (B, VP), "float32").astype(np.float32)
    logits[1, 100] = logits[1, 7] = 1e9                    # a tie: 7 wins
    logits[2, 3000] = np.nan                               # a NaN wins
    logits[2, 4000] = np.nan
    logits[3, V:] = 1e30                                   # padding: ignored
    logits[4, :] = -np.inf                                 # all equal: 0
    ids = cupy.zeros((B, 1), np.int32)
    pos = cupy.asarray(np.array([41], np.int32))
    be.greedy_next(cupy.asarray(logits), V, ids, pos)
    assert cupy.asnumpy(ids)[:, 0].tolist() == np.argmax(logits[:, :V], axis=1).tolist()
    assert cupy.asnumpy(ids)[:3, 0].tolist()[1:] == [7, 3000]
    assert int(cupy.asnumpy(pos)[0]) == 42


# ----------------------------------------------------------------------------------------------
# Embedding
# ----------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_embedding(be, rs, dtype, id_dtype):
    wte = values(rs, (VP, C), dtype)
    wpe = values(rs, (T, C), dtype)
    ids = rs.integers(0, V, size=(2, 200))
    pos = 17
    got = host(be, be.embedding(dev(be, ids, id_dtype), dev(be, wte, dtype), dev(be, wpe, dtype),
                                pos))
    ref = reference.embedding(ids, wte, wpe, pos)
    check("embedding", got, ref, TOL[dtype])
    cpu_check("embedding", [ids] + cpu_args64([wte, wpe], dtype) + [pos], got, TOL[dtype])
    import cupy                                 # the position read by the kernel: same result
    at = host(be, be.embedding(dev(be, ids, id_dtype), dev(be, wte, dtype), dev(be, wpe, dtype),
                               cupy.asarray(np.array([pos], np.int32))))
    check("embedding, device position", at, got, 0.0)
    past = host(be, be.embedding(dev(be, ids, id_dtype), dev(be, wte, dtype), dev(be, wpe, dtype),
                                 cupy.asarray(np.array([T - 100], np.int32))))
    assert np.isnan(past).all()                 # positions past wpe: NaN rows, never garbage


@cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_scatter_add_rows(be, rs, dtype):
    rows = 2000
    dst0 = values(rs, (rows, C), dtype)
    ids = rs.integers(0, 50, size=(2, T))  # many repeats
    ids[0, :300] = 7  # one long run
    src = values(rs, (2, T, C), dtype)
    dst = dev(be, dst0, dtype)
    be.scatter_add_rows(dst, dev(be, ids, "int64"), dev(be, src, dtype))
    got = host(be, dst)
    check("scatter_add_rows", got, reference.scatter_add_rows(dst0, ids, src), TOL[dtype])
    dst2 = dev(be, dst0, dtype)
    be.scatter_add_rows(dst2, dev(be, ids, "int32"), dev(be, src, dtype))
    assert np.array_equal(host(be, dst2), got), "scatter_add_rows is not deterministic"
    fn = _cpu("scatter_add_rows")
    if fn is not None and dtype != "bfloat16":
        d = cpu_args64([dst0], dtype)[0].copy()
        try:
            fn(d, ids, cpu_args64([src], dtype)[0])
        except NotImplementedError:
            return
        check("scatter_add_rows vs CPU backend", got, d, TOL[dtype])


@cuda
@pytest.mark.parametrize("pattern", ["one run", "aligned runs", "a run per piece edge"])
def test_scatter_add_rows_runs_across_pieces(be, rs, pattern):
    """Runs of equal ids that cross the 32-row pieces the kernels share out (embedding.cu):
    one run over every row, runs that start and end on piece edges, and runs that end just past
    them; float32 against float64, and the same bits on a second call."""
    N = 1000
    ids = {"one run": np.full(N, 5),
           "aligned runs": np.repeat(np.arange(N // 64 + 1), 64)[:N],
           "a run per piece edge": np.repeat(np.arange(N // 33 + 1), 33)[:N]}[pattern]
    ids = rs.permutation(ids)
    dst0 = values(rs, (40, C), "float32")
    src = values(rs, (N, C), "float32")
    got = []
    for _ in range(2):
        dst = dev(be, dst0, "float32")
        be.scatter_add_rows(dst, dev(be, ids, "int64"), dev(be, src, "float32"))
        got.append(host(be, dst))
    check("scatter_add_rows", got[0], reference.scatter_add_rows(dst0, ids, src), TOL["float32"])
    assert np.array_equal(got[0], got[1]), "scatter_add_rows is not deterministic"


# ----------------------------------------------------------------------------------------------
# Cross entropy
# ----------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("padded", [False, True])
def test_cross_entropy(be, rs, dtype, padded):
    n = 300
    cols = VP if padded else V
    logits = values(rs, (3, n // 3, cols), dtype, scale=2.0)
    targets = rs.integers(0, V, size=(3, n // 3))
    vocab = V
    x = dev(be, logits, dtype)
    loss = be.cross_entropy(x, dev(be, targets, "int64"), vocab)
    assert loss.shape == ()
    assert str(loss.dtype) == ("float64" if dtype == "float64" else "float32")
    l2, t1 = logits.reshape(-1, cols), targets.reshape(-1)  # the reference takes 2-D
    ref = float(reference.cross_entropy(l2, t1, vocab))
    check("cross_entropy", float(be.to_host(loss)), ref, 1e-6 if dtype != "float64" else 1e-12)
    dl = be.cross_entropy_bwd(x, dev(be, targets, "int32"), 1.0, vocab)
    got = host(be, dl)
    check("cross_entropy_bwd", got,
          reference.cross_entropy_bwd(l2, t1, 1.0, vocab).reshape(logits.shape), TOL[dtype])
    if padded:
        assert (got[..., V:] == 0).all(), "columns >= vocab_size must get zero gradient"
    # the upstream gradient as a device scalar
    g = be.from_host(np.array(0.37), "float64" if dtype == "float64" else "float32")
    assert g.shape == ()
    got2 = host(be, be.cross_entropy_bwd(x, dev(be, targets, "int64"), g, vocab))
    check("cross_entropy_bwd dloss", got2,
          reference.cross_entropy_bwd(l2, t1, 0.37, vocab).reshape(logits.shape), TOL[dtype])
    if dtype != "bfloat16":
        cpu_check("cross_entropy", cpu_args64([l2], dtype) + [t1, vocab],
                  float(be.to_host(loss)), 1e-5 if dtype == "float32" else 1e-12)
        cpu_check("cross_entropy_bwd", cpu_args64([l2], dtype) + [t1, 1.0, vocab], got,
                  TOL[dtype], pick=lambda o: np.asarray(o).reshape(got.shape))


# ----------------------------------------------------------------------------------------------
# AdamW
# ----------------------------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("gdtype", ["float32", "bfloat16", "float64"])
def test_adamw_update(be, rs, gdtype):
    pdtype = "float64" if gdtype == "float64" else "float32"
    n = C * 4 * C + 5
    p0 = values(rs, (n,), pdtype)
    g = values(rs, (n,), gdtype, scale=0.1)
    m0 = values(rs, (n,), pdtype, scale=0.01)
    v0 = np.abs(values(rs, (n,), pdtype, scale=0.001))
    hp = dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7, grad_scale=0.5)
    p, m, v = dev(be, p0, pdtype), dev(be, m0, pdtype), dev(be, v0, pdtype)
    lowp = be.zeros((n,), "bfloat16") if gdtype == "bfloat16" else None
    be.adamw_update(p, dev(be, g, gdtype), m, v, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"],
                    hp["weight_decay"], hp["step"], hp["grad_scale"], lowp)
    rp, rm, rv = reference.adamw_update(p0, g, m0, v0, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"],
                           hp["weight_decay"], hp["step"], hp["grad_scale"])
    tol = TOL[pdtype]
    check("adamw p", host(be, p), rp, tol)
    check("adamw m", host(be, m), rm, tol)
    check("adamw v", host(be, v), rv, tol)
    if lowp is not None:
        check("adamw p_lowp", host(be, lowp), round_bf16(host(be, p)), 0.0)
    fn = _cpu("adamw_update")
    if fn is not None and gdtype != "bfloat16":
        cp, cm, cv = (a.astype(np.float32 if pdtype == "float32" else np.float64)
                      for a in (p0, m0, v0))
        cg = g.astype(cp.dtype)
        try:
            fn(cp, cg, cm, cv, hp["lr"], hp["beta1"], hp["beta2"], hp["eps"],
               hp["weight_decay"], hp["step"], hp["grad_scale"], None)
        except NotImplementedError:
            return
        check("adamw p vs CPU backend", host(be, p), cp, tol)


# ----------------------------------------------------------------------------------------------
# Errors: out of memory, compile errors, devices
# ----------------------------------------------------------------------------------------------

@cuda
def test_out_of_memory_is_reported_and_recoverable(be, rs):
    with pytest.raises(OutOfMemoryError) as info:
        be.zeros((1 << 42,), "float32")  # 16 TiB
    msg = str(info.value)
    assert "bytes" in msg and "free" in msg, msg
    assert f"{(1 << 42) * 4:,}" in msg, msg
    # the process goes on: allocate and compute
    a = values(rs, (T, C), "float32")
    got = host(be, be.add(dev(be, a, "float32"), dev(be, a, "float32")))
    check("add after OOM", got, 2 * a, 1e-6)


@cuda
def test_compile_error_carries_the_log(be):
    src = 'extern "C" __global__ void broken(float* x) { x[0] = not_declared_anywhere; }'
    with pytest.raises(CompileError) as info:
        be.compile_source(src, "broken.cu")
    assert "not_declared_anywhere" in str(info.value)
    assert "broken.cu" in str(info.value)


@cuda
def test_a_kernel_file_that_does_not_compile_is_compiled_once(be, monkeypatch):
    """runtime._function keeps a failed compile: asked again, a CompileError with the same
    message at once (a fresh one: raising the kept one again grew its traceback each time), no
    second NVRTC run; runtime._takes (the layers step's check, asked on every op-by-op step)
    says no, and the kernel-per-op step runs."""
    from forge_ml.backends.cuda import decoder, runtime
    real_source, real_compile = runtime.kernel_source, runtime.compile_source
    broken = {"decode_layers", "forge_test_broken"}
    compiles = []

    def source(stem):
        if stem in broken:
            return 'extern "C" __global__ void k(float* x) { x[0] = not_declared_here; }'
        return real_source(stem)

    def compile_source(src, label, *a, **k):
        compiles.append(label)
        return real_compile(src, label, *a, **k)

    monkeypatch.setattr(runtime, "kernel_source", source)
    monkeypatch.setattr(runtime, "compile_source", compile_source)
    monkeypatch.setattr(runtime, "_modules", {})
    monkeypatch.setattr(runtime, "_functions", {})
    monkeypatch.setattr(runtime, "_shared_room", {})
    monkeypatch.setattr(decoder, "_ok", {})   # its answer here must not outlive the test
    errors = []
    for _ in range(2):
        with pytest.raises(CompileError, match="not_declared_here") as info:
            runtime._function("forge_test_broken", "k")
        errors.append(info.value)
    assert compiles == ["backends/cuda/forge_test_broken.cu"], compiles
    assert errors[0] is not errors[1] and str(errors[0]) == str(errors[1])
    assert runtime._takes("forge_test_broken", "k", 0) is False
    for _ in range(3):   # the layers step's check: no, and decode_layers.cu compiled once
        assert decoder._layers_ok(runtime.F32, 768) is False
    hopper = runtime._cc_major(runtime._dev()) == 9 and runtime._launcher_ex()
    assert compiles.count("backends/cuda/decode_layers.cu") == (1 if hopper else 0), compiles


@cuda
def test_all_kernel_files_compile(be):
    from pathlib import Path
    kdir = Path(be.__file__).parent       # the .cu files sit beside their launcher modules
    stems = sorted(p.stem for p in kdir.glob("*.cu"))
    assert stems
    for stem in stems:
        be.compile_source(be.kernel_source(stem), f"backends/cuda/{stem}.cu")


@cuda
def test_lineinfo_switch_compiles_with_line_table(be):
    """FORGE_CUDA_LINEINFO=on asks NVRTC for -lineinfo (a profiler's source page); its kernels
    compile and run as without it."""
    from forge_ml import flags
    from forge_ml.backends.cuda import runtime
    assert "-lineinfo" not in runtime._compile_options()
    with flags.override(FORGE_CUDA_LINEINFO="on"):
        opts = runtime._compile_options()
        assert "-lineinfo" in opts
        mod = be.compile_source(be.kernel_source("elementwise"), "backends/cuda/elementwise.cu", opts)
        assert mod is not None


@cuda
def test_unknown_device_index(be):
    from forge_ml.backends import get
    with pytest.raises(DeviceError, match="cuda:99"):
        get(Device("cuda", 99))
    with pytest.raises(DeviceError):
        be.select(-1)
    be.select(0)


@pytest.mark.skipif(_gpu_count() > 0, reason="a GPU is present")
def test_no_gpu_gives_device_error():
    """Without CuPy, or with CuPy but no GPU, asking for cuda is a clear DeviceError."""
    from forge_ml.backends import get
    with pytest.raises(DeviceError):
        get(Device("cuda", 0))


@cuda
def test_host_copies_keep_their_host_arrays_until_they_run(be):
    """A pinned host array handed to ``Tensor.copy_from_host`` or ``copy_to_host`` and dropped
    at once stays alive until its copy has run: dropped early, it would go back to CuPy's
    pinned pool, whose next allocation of its size takes it at once, so a queued copy would
    read the next array's values (or write into it)."""
    import gc
    import cupy
    import forge_ml as fm
    spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long n) {
        const long long t0 = clock64();
        while (clock64() - t0 < n) {}
    }''', "spin")
    n = 4096
    t = fm.zeros((n,), "float32", device="cuda")
    spin((1,), (1,), (np.int64(100_000_000),))   # the stream busy for about 50 ms
    src = fm.host_buffer((n,), "float32", "cuda")
    src[:] = 1.0
    t.copy_from_host(src)                          # queued behind the spin
    del src
    gc.collect()
    other = fm.host_buffer((n,), "float32", "cuda")   # the same size: the dropped block, if free
    other[:] = 2.0
    assert np.all(t.numpy() == 1.0)

    u = fm.full((n,), 3.0, "float32", "cuda")
    spin((1,), (1,), (np.int64(100_000_000),))
    out = fm.host_buffer((n,), "float32", "cuda")
    handle = u.copy_to_host(out)                   # queued behind the spin, then dropped
    del out, handle
    gc.collect()
    mine = fm.host_buffer((n,), "float32", "cuda")
    mine[:] = 4.0
    cupy.cuda.Device().synchronize()
    assert np.all(mine == 4.0) and np.all(other == 2.0)
