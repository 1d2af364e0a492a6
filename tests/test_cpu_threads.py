"""The CPU kernels' thread pool (backends/cpu/kernels.c) and the matrix products it runs
(``gemm_f32``: one single-threaded OpenBLAS call per block of rows, or of columns for a few
rows (sgemv for one), a bias or residual added inside the product, GELU or its backward
applied to each block as it is written).

Two promises are checked. The products and their epilogues agree with float64 (tests/
reference.py) for every transpose, odd shapes and fused extras. And the thread count never
changes a bit: every threaded kernel gives the same bits on 1, 2 and 3 threads, including
kernels that sum across their items (layernorm's dgamma, the optimizer's chunks). The pool's
corners: two Python threads calling kernels at once, a fork()ed child, ``blas.set_threads``
driving both the pool and OpenBLAS.
"""
from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import reference as ref
from forge_ml import blas, flags
from forge_ml.backends import cpu
from forge_ml.backends.cpu import native


@pytest.fixture(autouse=True)
def c_kernels():
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    with flags.override(FORGE_CPU_KERNELS="c"):
        native.lib()
        before = native.threads()
        yield
        native.set_threads(before)


@pytest.fixture
def pool_gemm(c_kernels):
    if not native.owns_products():
        pytest.skip("the kernels' pool does not run the products here (no OpenBLAS sgemm "
                    "found, or FORGE_CPU_GEMM=openblas)")


needs_pool_gemm = pytest.mark.usefixtures("pool_gemm")


def randn(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def on_threads(fn, counts=(1, 2, 3)):
    """``fn()`` with the pool at each count: the list of its results."""
    out = []
    for n in counts:
        native.set_threads(n)
        out.append(fn())
    return out


def same_bits(results):
    first = results[0]
    for other in results[1:]:
        for a, b in zip(first if isinstance(first, tuple) else (first,),
                        other if isinstance(other, tuple) else (other,)):
            np.testing.assert_array_equal(a, b)


# ============================================================================== products

SHAPES = [(1, 1, 1), (1, 64, 1000), (3, 40, 200), (5, 3, 7), (17, 33, 65), (100, 128, 129),
          (768, 128, 512), (37, 512, 16)]


@needs_pool_gemm
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_matmul_on_the_pool_vs_float64(m, k, n, trans_a, trans_b):
    a = randn((k, m) if trans_a else (m, k), 1)
    b = randn((n, k) if trans_b else (k, n), 2)
    bias = randn((n,), 3)
    for kw in (dict(), dict(bias=bias, alpha=0.5)):
        got = on_threads(lambda: cpu.matmul(a, b, trans_a=trans_a, trans_b=trans_b, **kw))
        same_bits(got)
        np.testing.assert_allclose(got[0], ref.matmul(a, b, trans_a=trans_a, trans_b=trans_b, **kw),
                                   rtol=2e-5, atol=2e-5 * np.sqrt(k))


@pytest.fixture
def own_product(pool_gemm):
    """gemm.c's own AVX-512 product switched on (a function: ``own(False)`` gives the blocks
    to OpenBLAS's sgemm), restored after the test."""
    if not native.own_product():
        pytest.skip("gemm.c's own product is not in this build (no AVX-512, or "
                    "FORGE_CPU_GEMM=pool-openblas)")
    lib = native.lib()
    yield lambda on: lib.forge_gemm_own(int(on))
    lib.forge_gemm_own(1)


# tiles of 12 x 32, panels of 256 values of k, 1,024 columns at a time, A packed for a last
# tile of fewer rows; blocks of at least 64 rows (blocks of rows: m >= 64 x the blocks, up to
# 16 cores; blocks of columns: m rows each, B not transposed), beside sgemm's either side of
# that line (63 and 64 rows); with A transposed the blocks are sgemm's either way
OWN_SHAPES = [(1030, 257, 33), (1100, 600, 17), (64, 300, 2100), (130, 31, 600), (63, 40, 70),
              (64, 40, 70), (13, 257, 33), (2, 5, 1)]


@pytest.mark.parametrize("m,k,n", OWN_SHAPES)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_own_product_at_its_tile_panel_and_block_edges(own_product, m, k, n, trans_a, trans_b):
    a = randn((k, m) if trans_a else (m, k), 1)
    b = randn((n, k) if trans_b else (k, n), 2)
    bias, res = randn((n,), 3), randn((m, n), 4)
    lib = cpu._gemm_lib()
    want64 = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    tol = dict(rtol=2e-5, atol=2e-5 * np.sqrt(k))
    cases = {"plain": (dict(), want64),
             "alpha, bias and residual": (dict(alpha=0.5, bias=bias, res=res),
                                          0.5 * want64 + bias + res)}
    for name, (kw, want) in cases.items():
        got = on_threads(lambda: cpu._gemm(lib, a, b, trans_a, trans_b, **kw))
        same_bits(got)
        np.testing.assert_allclose(got[0], want, err_msg=name, **tol)
        own_product(False)
        theirs = cpu._gemm(lib, a, b, trans_a, trans_b, **kw)
        own_product(True)
        np.testing.assert_allclose(got[0], theirs, err_msg=name, **tol)


@pytest.mark.parametrize("choice", ["pool", "pool-openblas", "openblas"])
def test_cpu_gemm_switch_picks_who_runs_the_products(choice, tmp_path):
    """FORGE_CPU_GEMM, read when the library loads (a fresh process each): the pool runs the
    products with gemm.c's own kernel where the build has it (pool), with OpenBLAS's sgemm
    (pool-openblas), or leaves them to OpenBLAS's threads (openblas); the numerics say which
    kernel, and a product's result is within float32 rounding of float64 either way."""
    code = ("import numpy as np; from forge_ml.backends import cpu; "
            "from forge_ml.backends.cpu import native; "
            "a = np.random.default_rng(1).standard_normal((200, 70)).astype(np.float32); "
            "b = np.random.default_rng(2).standard_normal((70, 90)).astype(np.float32); "
            "e = np.abs(cpu.matmul(a, b) - a.astype(np.float64) @ b).max(); "
            "print(native.owns_products(), native.own_product(), cpu.numerics()['gemm'], e < 1e-4)")
    env = dict(os.environ, FORGE_CPU_GEMM=choice, FORGE_CPU_KERNELS="c")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    owns, own, kernel, close = r.stdout.split()
    assert close == "True"
    assert owns == str(choice != "openblas")
    if choice != "pool":
        assert own == "False" and kernel == "openblas"
    else:   # the own kernel where this machine's build has AVX-512
        assert (own, kernel) in (("True", "forge-avx512"), ("False", "openblas"))


def test_own_product_keeps_non_finite_values_where_they_belong(own_product):
    """A NaN or inf in A or B reaches exactly the results it feeds (the zero rows and
    columns a tile is padded with never reach C), and C's uninitialised memory is never read
    where nothing is added to it."""
    a, b = randn((13, 40), 1), randn((40, 33), 2)
    a[5, 7], b[3, 32] = np.nan, np.inf
    got = cpu._gemm(cpu._gemm_lib(), a, b)
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-5, atol=1e-4)


def test_gemm_benchmark_runs_every_product_of_the_step(own_product, capsys):
    """benchmarks/gemm_cpu.py (one round, one repetition): a line for each of the nanoGPT CPU
    step's 15 products with both kernels' errors against float64 small, and the total."""
    from _scripts import load
    load("benchmarks/gemm_cpu.py").main(["--rounds", "1", "--reps", "1", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [ln for ln in lines if re.search(r" \d+x\d+x\d+ ", ln)]
    assert len(rows) == 15, lines
    for ln in rows:
        errs = [float(e) for e in ln.split()[-3::2]]
        assert all(e < 1e-3 for e in errs), ln
    assert lines[-1].startswith("all (one of each)")
    assert native.own_product()   # the benchmark leaves the own kernel on


@needs_pool_gemm
def test_matmul_rows_of_a_batch_and_what_the_pool_declines(monkeypatch):
    a, b = randn((2, 7, 5), 1), randn((5, 3), 2)
    np.testing.assert_allclose(cpu.matmul(a, b), ref.matmul(a, b), rtol=1e-5, atol=1e-5)
    calls = []
    real = native.lib()
    spy = type("Spy", (), {"__getattr__": lambda self, name: (calls.append(name),
                                                              getattr(real, name))[1]})()
    monkeypatch.setattr(native, "lib", lambda: spy)
    cases = [(a.astype(np.float64), b),                        # float64: NumPy
             (np.asfortranarray(randn((7, 5), 3)), b),          # strided: NumPy
             (randn((4, 7, 5), 4), randn((4, 5, 3), 5)),        # batched b: NumPy
             (randn((7, 0), 6), randn((0, 3), 7))]              # empty k: NumPy
    for x, y in cases:
        np.testing.assert_allclose(cpu.matmul(x, y), ref.matmul(x, y), rtol=1e-5, atol=1e-5)
    assert "gemm_f32" not in calls
    cpu.matmul(randn((7, 5), 8), b)
    assert "gemm_f32" in calls


@needs_pool_gemm
@pytest.mark.parametrize("shape", [(1, 24, 300), (3, 5, 8), (64, 128, 512), (33, 16, 100)])
def test_linear_with_residual_and_gelu_epilogues(shape):
    rows, k, n = shape
    x, w, bias, res = randn((rows, k), 1), randn((k, n), 2, 0.2), randn((n,), 3), randn((rows, n), 4)
    pre = ref.matmul(x, w, bias)
    cases = {
        "bias + residual": (lambda: cpu.linear(x, w, bias, None, res), pre + res),
        "residual only": (lambda: cpu.linear(x, w, None, None, res), ref.matmul(x, w) + res),
        "gelu": (lambda: cpu.linear(x, w, bias, "gelu", None), ref.gelu(pre)),
        "3-D rows": (lambda: cpu.linear(x.reshape(1, rows, k), w, bias, None,
                                        res.reshape(1, rows, n)), (pre + res).reshape(1, rows, n)),
    }
    for name, (fn, want) in cases.items():
        got = on_threads(fn)
        same_bits(got)
        assert got[0].shape == want.shape, name
        np.testing.assert_allclose(got[0], want, rtol=3e-5, atol=3e-5, err_msg=name)


@needs_pool_gemm
@pytest.mark.parametrize("rows", [70, 300])   # the pool's blocks of columns, then of rows
def test_matmul_gelu_and_its_backward_on_the_pool(rows):
    k, n = 48, 96
    x, w, bias = randn((rows, k), 1), randn((k, n), 2, 0.3), randn((n,), 3)
    got = on_threads(lambda: cpu.matmul_gelu(x, w, bias))
    same_bits(got)
    y, pre = got[0]
    want_pre = ref.matmul(x, w, bias)
    np.testing.assert_allclose(pre, want_pre, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(y, ref.gelu(want_pre), rtol=2e-5, atol=2e-5)
    dy = randn((rows, k), 4)                   # the gradient at the product gelu(pre) @ w^T's output
    w2 = randn((n, k), 5, 0.3)                 # gelu(pre) (rows, n) @ w2 (n, k)
    got = on_threads(lambda: cpu.matmul_dgelu(dy, w2, pre))
    same_bits(got)
    dpre, dsum = got[0]
    want = ref.gelu_bwd(pre, ref.matmul(dy, w2, trans_b=True))
    np.testing.assert_allclose(dpre, want, rtol=3e-5, atol=3e-5)
    np.testing.assert_allclose(dsum, want.sum(0), rtol=1e-4, atol=1e-4)
    # the column sums are dpre's own, summed in double as each block is written
    d64 = dpre.astype(np.float64)
    assert np.all(np.abs(dsum - d64.sum(0)) <= 1e-6 * np.abs(d64).sum(0) + 1e-12)


# ============================================================================== every threaded kernel

def test_threaded_kernels_give_the_same_bits_on_any_thread_count():
    rng_x = randn((333, 96), 1)
    gamma, beta = randn((96,), 2), randn((96,), 3)
    dy = randn((333, 96), 4)
    same_bits(on_threads(lambda: cpu.layernorm(rng_x, gamma, beta, 1e-5)))
    same_bits(on_threads(lambda: cpu.layernorm_bwd(rng_x, gamma, dy, 1e-5)))
    same_bits(on_threads(lambda: cpu.layernorm_bwd_add(rng_x, gamma, dy, 1e-5, rng_x)))
    big = randn((100_003,), 5, 3.0)
    same_bits(on_threads(lambda: cpu.gelu(big)))
    same_bits(on_threads(lambda: cpu.gelu_bwd(big, big)))
    q = randn((12, 37, 16), 6)
    out, lse = cpu.attention(q, q * 0.5, q, 0.25)
    same_bits(on_threads(lambda: cpu.attention(q, q * 0.5, q, 0.25)))
    same_bits(on_threads(lambda: cpu.attention_bwd(q, q * 0.5, q, out, lse, q, 0.25)))
    qkv = randn((3, 64, 3 * 64), 7)
    y, lse = cpu.attention_qkv(qkv, 4, 0.25)
    same_bits(on_threads(lambda: cpu.attention_qkv(qkv, 4, 0.25)))
    same_bits(on_threads(lambda: cpu.attention_qkv_bwd(qkv, y, lse, y, 4, 0.25)))
    same_bits(on_threads(lambda: cpu.attention_qkv_dropout(qkv, 4, 0.25, 0.2, 11)))
    same_bits(on_threads(lambda: cpu.attention_qkv_dropout_bwd(qkv, y, lse, y, 4, 0.25, 0.2, 11)))
    xs = [randn(sh, 10 + i) for i, sh in enumerate([(7,), (300, 170), (40_000,), (3, 5)])]
    same_bits(on_threads(lambda: cpu.sumsq_many(xs)))
    same_bits(on_threads(lambda: cpu.dropout(big, 0.3, 12)))


def test_layernorm_bwd_on_threads_vs_float64():
    x, gamma, dy = randn((1000, 64), 1, 2.0), randn((64,), 2), randn((1000, 64), 3)
    native.set_threads(3)
    dx, dgamma, dbeta = cpu.layernorm_bwd(x, gamma, dy, 1e-5)
    want = ref.layernorm_bwd(x, gamma, dy, 1e-5)
    for got, exp in zip((dx, dgamma, dbeta), want):
        np.testing.assert_allclose(got, exp, rtol=1e-4, atol=1e-4)


def test_adamw_many_in_chunks_is_the_one_tensor_op_on_any_thread_count():
    """Tensors of several 16,384-element chunks, the chunks shared among threads: the bits
    of one adamw_update per tensor."""
    shapes = [(40_000,), (5,), (128, 300), (16_384,)]

    def run():
        ps = [randn(sh, i) for i, sh in enumerate(shapes)]
        ms = [np.abs(randn(sh, 10 + i, 0.1)) for i, sh in enumerate(shapes)]
        vs = [np.abs(randn(sh, 20 + i, 0.1)) for i, sh in enumerate(shapes)]
        gs = [randn(sh, 30 + i) for i, sh in enumerate(shapes)]
        cpu.adamw_update_many(ps, gs, ms, vs, 1e-2, 0.9, 0.95, 1e-8, [0.1, 0.0, 0.1, 0.05],
                              [3, 1, 3, 7], 0.5)
        return tuple(ps + ms + vs)

    results = on_threads(run)
    same_bits(results)
    ps = [randn(sh, i) for i, sh in enumerate(shapes)]
    ms = [np.abs(randn(sh, 10 + i, 0.1)) for i, sh in enumerate(shapes)]
    vs = [np.abs(randn(sh, 20 + i, 0.1)) for i, sh in enumerate(shapes)]
    for i, sh in enumerate(shapes):
        cpu.adamw_update(ps[i], randn(sh, 30 + i), ms[i], vs[i], 1e-2, 0.9, 0.95, 1e-8,
                         [0.1, 0.0, 0.1, 0.05][i], [3, 1, 3, 7][i], 0.5)
    same_bits([results[0], tuple(ps + ms + vs)])


# ============================================================================== the pool's corners

def test_two_python_threads_at_once_get_their_own_results():
    """A job that finds the pool busy runs on its caller alone; both callers' results are
    right."""
    native.set_threads(2)
    qkvs = [randn((4, 64, 3 * 64), 40 + i) for i in range(2)]
    want = [cpu.attention_qkv(q, 4, 0.25) for q in qkvs]
    errors = []

    def work(i):
        try:
            for _ in range(30):
                y, lse = cpu.attention_qkv(qkvs[i], 4, 0.25)
                np.testing.assert_array_equal(y, want[i][0])
                np.testing.assert_array_equal(lse, want[i][1])
        except AssertionError as e:          # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def _child_attention(q, conn):
    from forge_ml.backends import cpu as child_cpu
    conn.send(child_cpu.attention(q, q, q, 0.5))
    conn.close()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork()")
def test_a_forked_child_starts_its_own_workers():
    native.set_threads(2)
    q = randn((16, 40, 16), 50)
    want = cpu.attention(q, q, q, 0.5)           # the parent's workers are running
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child_attention, args=(q, child))
    p.start()
    got = parent.recv() if parent.poll(60) else None
    p.join(60)
    assert got is not None, "the child hung (its pool waited on the parent's workers)"
    same_bits([want, got])


def test_blas_set_threads_drives_the_pool_and_openblas():
    before = blas.get_threads()
    try:
        blas.set_threads(3)
        assert native.threads() == 3 and blas.get_threads() == 3
        if native.owns_products():
            assert blas.openblas_threads() in (1, None)   # the pool runs the products
        elif blas.openblas_threads() is not None:
            assert blas.openblas_threads() == 3
    finally:
        blas.set_threads(before)


def test_pool_size_is_clamped():
    native.set_threads(0)
    assert native.threads() == 1
    native.set_threads(1000)
    assert native.threads() == 16


def test_loss_and_scatter_give_the_same_bits_on_any_thread_count():
    logits, t = randn((300, 515), 60, 3.0), np.random.default_rng(61).integers(0, 500, 300)
    same_bits(on_threads(lambda: cpu.cross_entropy(logits, t, 500)))
    same_bits(on_threads(lambda: cpu.cross_entropy_bwd(logits, t, 1.0, 500)))
    x, w = randn((300, 32), 62), randn((515, 32), 63, 0.3)
    same_bits(on_threads(lambda: cpu.linear_cross_entropy(x, w, t, 500, True)))
    ids, src = np.random.default_rng(64).integers(0, 90, 5000), randn((5000, 24), 65)

    def scatter():
        dst = randn((90, 24), 66)
        cpu.scatter_add_rows(dst, ids, src)
        return dst

    same_bits(on_threads(scatter))
