"""GPU tests of the products with a cuBLASLt epilogue (backends/cuda/cublaslt.py): ``matmul``
with a bias, ``linear`` (bias, GELU, a residual through C), ``matmul_gelu`` (GELU's input as the
auxiliary output) and ``weight_grads`` (BGRADA: the bias gradient from the weight gradient's
product), in float32 and bf16, against the float64 specification; each test also checks that
cuBLASLt really ran (a counter around ``lt_matmul``), that the ``FORGE_CUBLASLT`` switch off
gives the old path's values, that a pointer cuBLASLt cannot take falls back, and that a capture
replays. The CuPy pool is refilled with NaN bytes first, so an element left unwritten shows.
"""
from __future__ import annotations

import numpy as np
import pytest

import forge_ml as fm
import reference as ref
from forge_ml import flags, ops

from _gpu_checks import check, poison_device_memory, round_bf16
from test_cuda_flash import gpu, rs  # noqa: F401 (the fixtures: the GPU with bf16, a logged seed)

pytestmark = pytest.mark.cuda
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


@pytest.fixture
def lt_calls(gpu, monkeypatch):
    """How many products cuBLASLt took (calls of lt_matmul that returned True)."""
    import importlib
    cublaslt = importlib.import_module("forge_ml.backends.cuda.cublaslt")
    linear = importlib.import_module("forge_ml.backends.cuda.linear")   # the module, not the op
    poison_device_memory(1 << 28)
    done = []
    real = cublaslt.lt_matmul

    def counting(*a, **k):
        ok = real(*a, **k)
        done.append(ok)
        return ok
    monkeypatch.setattr(linear, "lt_matmul", counting)
    return done


def vals(rs, shape, dtype, scale=1.0):
    a = rs.standard_normal(shape) * scale
    return (round_bf16(a) if dtype == "bfloat16" else a.astype(np.float32)).astype(np.float64)


def T(a, dtype):
    return fm.tensor(np.asarray(a, np.float32), device="cuda").to(dtype)


def H(t):
    return t.to("float32").numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("M,K,N", [(64, 768, 2304), (300, 96, 40)])
def test_matmul_with_bias_takes_the_bias_epilogue(lt_calls, rs, dtype, M, K, N):
    x, w, b = vals(rs, (M, K), dtype), vals(rs, (K, N), dtype, 0.05), vals(rs, (N,), dtype)
    got = ops.matmul(T(x, dtype), T(w, dtype), T(b, dtype), alpha=0.5)
    assert lt_calls == [True]
    check("matmul + bias", H(got), ref.matmul(x, w, b, alpha=0.5), TOL[dtype])
    with flags.override(FORGE_CUBLASLT=False):
        old = ops.matmul(T(x, dtype), T(w, dtype), T(b, dtype), alpha=0.5)
    assert lt_calls == [True, False]
    check("matmul + bias, cuBLASLt vs the old path", H(got), H(old), TOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("act,res,ln", [(None, True, False), ("gelu", False, True),
                                        (None, False, True), ("gelu", True, False)])
def test_linear_with_epilogue(lt_calls, rs, dtype, act, res, ln):
    M, K, N = 64, 128, 96     # a batch of rows: past the gemv kernel's four
    x, w, b = vals(rs, (M, K), dtype), vals(rs, (K, N), dtype, 0.1), vals(rs, (N,), dtype)
    g, beta, r = vals(rs, (K,), dtype), vals(rs, (K,), dtype), vals(rs, (M, N), dtype)
    want = ref.layernorm(x, g, beta, 1e-5) if ln else x
    if ln and dtype == "bfloat16":   # the kernel rounds LN's output to bf16 before the product
        want = round_bf16(want).astype(np.float64)
    want = ref.matmul(want, w, b)
    want = ref.gelu(want) if act else want
    want = want + r if res else want
    got = ops.linear(T(x, dtype), T(w, dtype), T(b, dtype), act=act,
                     residual=T(r, dtype) if res else None,
                     ln=(T(g, dtype), T(beta, dtype)) if ln else None)
    check(f"linear act={act} residual={res} ln={ln}", H(got), want, TOL[dtype])
    # one product through cuBLASLt; GELU with a residual (cuBLASLt would add C before GELU)
    # takes it with the bias only, then gelu and add
    assert lt_calls == [True]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matmul_gelu_writes_gelu_and_its_input(lt_calls, rs, dtype):
    M, K, N = 256, 768, 3072
    x, w, b = vals(rs, (M, K), dtype), vals(rs, (K, N), dtype, 0.05), vals(rs, (N,), dtype)
    y, pre = ops.matmul_gelu(T(x, dtype), T(w, dtype), T(b, dtype))
    assert lt_calls == [True]
    want = ref.matmul(x, w, b)
    check("matmul_gelu pre", H(pre), want, TOL[dtype])
    check("matmul_gelu y", H(y), ref.gelu(want), TOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("M,K,N", [(4096, 768, 3072), (333, 40, 24)])
def test_weight_grads_sum_the_bias_gradient_in_the_product(lt_calls, rs, dtype, M, K, N):
    x, dy = vals(rs, (M, K), dtype), vals(rs, (M, N), dtype, 0.1)
    dw, db = ops.weight_grads(T(x, dtype), T(dy, dtype), alpha=0.25)
    assert lt_calls == [True]
    check("weight_grads dw", H(dw), 0.25 * x.T @ dy, TOL[dtype])
    check("weight_grads db", H(db), dy.sum(0), TOL[dtype])


def test_an_unaligned_operand_falls_back(lt_calls, rs):
    """An operand 4 bytes into its buffer (cuBLASLt's plans want 16) takes the old path, with
    the same values."""
    import cupy
    import importlib
    linear = importlib.import_module("forge_ml.backends.cuda.linear")
    x, w, b = vals(rs, (64, 64), "bfloat16"), vals(rs, (64, 32), "bfloat16"), vals(rs, (32,), "bfloat16")
    X = T(x, "bfloat16").data
    buf = cupy.empty(X.size + 2, X.dtype)
    xs = buf[2:].reshape(X.shape)
    xs[...] = X
    assert xs.data.ptr % 16 != 0 and xs.flags.c_contiguous
    got = linear.matmul(xs, T(w, "bfloat16").data, T(b, "bfloat16").data, False, False, 1.0, None)
    assert lt_calls == [False]
    check("matmul from an unaligned operand", cupy.asnumpy(got.astype(np.float32)).astype(np.float64),
          ref.matmul(x, w, b), TOL["bfloat16"])


def test_a_captured_product_with_epilogues_replays(gpu, rs):
    from forge_ml.backends import load
    bk = load("cuda")
    x, w, b = vals(rs, (64, 128), "bfloat16"), vals(rs, (128, 256), "bfloat16", 0.1), vals(rs, (256,), "bfloat16")
    r = vals(rs, (64, 256), "bfloat16")
    X, W, Bv, R = T(x, "bfloat16"), T(w, "bfloat16"), T(b, "bfloat16"), T(r, "bfloat16")
    out = []
    g = bk.capture_graph(lambda: out.append(ops.linear(X, W, Bv, residual=R)))
    g.replay()
    gpu.synchronize()
    check("replayed linear + residual", H(out[-1]), ref.matmul(x, w, b) + r, TOL["bfloat16"])


def test_a_launch_cublaslt_declines_falls_back_to_cublas(lt_calls, rs, monkeypatch):
    """A plan whose launch the library declines (NOT_SUPPORTED on some GPU) is dropped: that
    call and the later ones of its shape take the old path, with the same values."""
    import importlib
    cublaslt = importlib.import_module("forge_ml.backends.cuda.cublaslt")
    lt = cublaslt._lt()
    monkeypatch.setattr(cublaslt, "_plans", {})
    monkeypatch.setattr(lt, "matmul", lambda *args: 15)       # CUBLAS_STATUS_NOT_SUPPORTED
    x, w, b = vals(rs, (64, 48), "bfloat16"), vals(rs, (48, 32), "bfloat16"), vals(rs, (32,), "bfloat16")
    for _ in range(2):
        got = ops.matmul(T(x, "bfloat16"), T(w, "bfloat16"), T(b, "bfloat16"))
        check("matmul after a declined launch", H(got), ref.matmul(x, w, b), TOL["bfloat16"])
    assert lt_calls == [False, False] and list(cublaslt._plans.values()) == [None]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemm_tune_times_once_then_keeps_the_choice(lt_calls, rs, dtype, tmp_path, monkeypatch):
    """FORGE_GEMM_TUNE=on: a new plan times the heuristic's candidates once (the product is
    still right), writes its choice to the cache folder, and a later plan of the same product
    takes it from there without timing: the same algorithm, so the same bits. A damaged cache
    file is an empty cache and is written whole again."""
    import importlib
    import json
    L = importlib.import_module("forge_ml.backends.cuda.cublaslt")
    x, w = vals(rs, (256, 768), dtype), vals(rs, (768, 2304), dtype, 0.05)
    b = vals(rs, (2304,), dtype)
    timed = []
    real_pick = L._tune_pick
    monkeypatch.setattr(L, "_tune_pick", lambda t: timed.append(t) or real_pick(t))
    monkeypatch.setattr(L, "_TUNE_MIN_ROWS", 256)     # this product counts as training-sized
    monkeypatch.setattr(L, "_TUNE_MIN_WORK", 256 * 768 * 2304)
    saved = dict(L._plans)
    try:
        with flags.override(FORGE_GEMM_TUNE="on", FORGE_CACHE_DIR=str(tmp_path)):
            L._plans.clear()
            first = ops.matmul(T(x, dtype), T(w, dtype), T(b, dtype))
            check("tuned matmul + bias", H(first), ref.matmul(x, w, b), TOL[dtype])
            assert len(timed) == 1 and all(t > 0 for t in timed[0])
            path = tmp_path / "gemm" / "lt_algos.json"
            data = json.loads(path.read_text())
            assert len(data) == 1 and len(next(iter(data.values()))) == 128
            L._plans.clear()
            again = ops.matmul(T(x, dtype), T(w, dtype), T(b, dtype))
            assert len(timed) == 1                       # from the cache: no timing
            assert H(again).tobytes() == H(first).tobytes()
            path.write_text("{not json")
            L._plans.clear()
            third = ops.matmul(T(x, dtype), T(w, dtype), T(b, dtype))
            assert len(timed) == 2 and json.loads(path.read_text()).keys() == data.keys()
            check("re-tuned matmul + bias", H(third), ref.matmul(x, w, b), TOL[dtype])
    finally:
        L._plans.clear()
        L._plans.update(saved)


def test_gemm_tune_leaves_decoding_products_alone(lt_calls, rs, tmp_path, monkeypatch):
    """FORGE_GEMM_TUNE=on times training's products only: a 64-row product (batch-64 decoding)
    keeps the heuristic's first algorithm and writes no cache entry."""
    import importlib
    L = importlib.import_module("forge_ml.backends.cuda.cublaslt")
    timed = []
    monkeypatch.setattr(L, "_tune_pick", lambda t: timed.append(t) or 0)
    x, w, b = vals(rs, (64, 768), "bfloat16"), vals(rs, (768, 2304), "bfloat16", 0.05), \
        vals(rs, (2304,), "bfloat16")
    saved = dict(L._plans)
    try:
        with flags.override(FORGE_GEMM_TUNE="on", FORGE_CACHE_DIR=str(tmp_path)):
            L._plans.clear()
            got = ops.matmul(T(x, "bfloat16"), T(w, "bfloat16"), T(b, "bfloat16"))
            check("untuned matmul + bias", H(got), ref.matmul(x, w, b), TOL["bfloat16"])
            assert timed == [] and not (tmp_path / "gemm" / "lt_algos.json").exists()
            plan = next(p for p in L._plans.values() if p is not None)
            assert plan.algo is plan.candidates[0]
    finally:
        L._plans.clear()
        L._plans.update(saved)
