"""flash_hopper.cu, the causal attention forward and backward on Hopper's wgmma (the backend's
flash path there unless FORGE_WGMMA_ATTENTION=off), against float64 NumPy and against flash_attention.cu's kernels, on the shapes test_cuda_flash.py
uses (ragged lengths, a KV-cache offset, single rows) and on GPT-2's fused (B, T, 3C) rows.
Runs on compute capability 9.0 only; the memory pool is filled with NaN bytes first, so an
output the kernel does not write shows up. Tolerances as test_cuda_flash.py's."""
from __future__ import annotations

import math

import numpy as np
import pytest

from forge_ml import flags

from _gpu_checks import check, host
from test_cuda_flash import (HS, LSE_TOL, SHAPES, TOL, _poison, bf16_values, check_abs, dev,
                             ref_attention, rs)  # noqa: F401 (rs: the fixture)

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu():
    from _gpu_checks import cuda_or_skip
    be = cuda_or_skip(bf16=True)
    if not be._hopper_ok():
        pytest.skip("the wgmma forward needs compute capability 9.0")
    return be


@pytest.fixture
def be(gpu):
    _poison()
    # the backend's own kernels stay flash_attention.cu's, whatever the environment says
    with flags.override(FORGE_ATTENTION="flash", FORGE_WGMMA_ATTENTION="off"):
        yield gpu


# query rows a block of the forward and of the dq kernel: one warpgroup or two on a k, v tile
ROWS = [64, 128]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_wgmma_forward_vs_reference_and_mma_sync_kernel(be, rs, shape, rows):
    qs, ks = SHAPES[shape]
    scale = 1.0 / math.sqrt(HS)
    q, k, v = bf16_values(rs, qs), bf16_values(rs, ks), bf16_values(rs, ks)
    rout, rlse = ref_attention(q, k, v, np.zeros(qs), scale)[:2]
    dq_, dk_, dv_ = dev(be, q), dev(be, k), dev(be, v)
    out, lse = be._attention_flash_hopper(dq_, dk_, dv_, scale, rows=rows)
    assert out.shape == qs and lse.shape == qs[:-1]
    check("wgmma out", host(be, out), rout, TOL)
    check_abs("wgmma lse", host(be, lse), rlse, LSE_TOL)
    out1, lse1 = be.attention(dq_, dk_, dv_, scale)   # flash_attention.cu's kernel
    check("wgmma out vs mma.sync", host(be, out), host(be, out1), TOL)
    check_abs("wgmma lse vs mma.sync", host(be, lse), host(be, lse1), LSE_TOL)


@pytest.mark.parametrize("rows", ROWS)
def test_wgmma_forward_peaked_softmax(be, rs, rows):
    """Scores x 8: the running max moves between key blocks, so the rescaling must be right."""
    qs = ks = (1, 2, 300, HS)
    scale = 1.0 / math.sqrt(HS)
    q, k, v = bf16_values(rs, qs, 8.0), bf16_values(rs, ks), bf16_values(rs, ks)
    rout, rlse = ref_attention(q, k, v, np.zeros(qs), scale)[:2]
    out, lse = be._attention_flash_hopper(dev(be, q), dev(be, k), dev(be, v), scale, rows=rows)
    check("wgmma out, peaked", host(be, out), rout, TOL)
    check_abs("wgmma lse, peaked", host(be, lse), rlse, LSE_TOL)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("B,T,H", [(2, 1024, 12), (1, 77, 4), (3, 130, 2)])
def test_wgmma_forward_on_fused_rows(be, rs, B, T, H, rows):
    """GPT-2's (B, T, 3C) rows read in place, as attention_qkv's forward."""
    C = H * HS
    qkv = bf16_values(rs, (B, T, 3 * C))
    scale = 1.0 / math.sqrt(HS)
    heads = qkv.reshape(B, T, 3, H, HS).transpose(2, 0, 3, 1, 4)   # 3 x (B, H, T, 64)
    rout, rlse = ref_attention(heads[0], heads[1], heads[2], np.zeros(heads[0].shape), scale)[:2]
    y, lse = be._qkv_flash_fwd_hopper(dev(be, qkv), H, scale, rows=rows)
    check("wgmma fused y", host(be, y), rout.transpose(0, 2, 1, 3).reshape(B, T, C), TOL)
    check_abs("wgmma fused lse", host(be, lse), rlse, LSE_TOL)
    y1, lse1 = be.attention_qkv(dev(be, qkv), H, scale)
    check("wgmma fused y vs mma.sync", host(be, y), host(be, y1), TOL)


@pytest.mark.parametrize("shape", [(2, 4, 333, HS), (1, 3, 64, HS), (2, 2, 200, HS)])
def test_wgmma_forward_same_bits_every_run_and_for_either_rows_a_block(be, rs, shape):
    """Each row sees the same key tiles in the same order whichever block holds it, so the
    128-row kernel gives the 64-row one's bits."""
    q, k, v = (dev(be, bf16_values(rs, shape)) for _ in range(3))
    a = be._attention_flash_hopper(q, k, v, rows=64)
    b = be._attention_flash_hopper(q, k, v, rows=64)
    c = be._attention_flash_hopper(q, k, v, rows=128)
    for x, y, z in zip(a, b, c):
        assert host(be, x).tobytes() == host(be, y).tobytes()
        assert host(be, x).tobytes() == host(be, z).tobytes()


# (qd_shared, kv_shared, rows): the backward's kernels with the block's own operands in
# registers, or in shared memory (dq's q and dout, dk/dv's k and v); the dq kernel of 128 rows
# (two warpgroups) exists with q and dout shared
SHARED = [(False, False, 64), (False, True, 64), (True, False, 64), (True, True, 64),
          (True, False, 128), (True, True, 128)]


def _backward_case(be, rs, shape, scale):
    """A backward test's inputs for SHAPES[shape]: the float64 reference's (dq, dk, dv), the
    device's q, k, v, dout, and the mma.sync forward's out and lse."""
    qs, ks = SHAPES[shape]
    q, k, v, dout = (bf16_values(rs, qs), bf16_values(rs, ks), bf16_values(rs, ks),
                     bf16_values(rs, qs))
    ref = ref_attention(q, k, v, dout, scale)[2:]
    on = (dev(be, q), dev(be, k), dev(be, v), dev(be, dout))
    return ref, on, be.attention(on[0], on[1], on[2], scale)


@pytest.mark.parametrize("qd_shared,kv_shared,rows", SHARED)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_wgmma_backward_vs_reference_and_mma_sync_kernels(be, rs, shape, qd_shared, kv_shared,
                                                          rows):
    """dq, dk, dv from the wgmma kernels, given the mma.sync forward's out and lse (so a wrong
    forward cannot hide a right backward, or the other way round)."""
    scale = 1.0 / math.sqrt(HS)
    (rdq, rdk, rdv), (dq_, dk_, dv_, ddo), (out, lse) = _backward_case(be, rs, shape, scale)
    got = be._attention_bwd_flash_hopper(dq_, dk_, dv_, out, lse, ddo, scale,
                                         qd_shared=qd_shared, kv_shared=kv_shared, rows=rows)
    want = be.attention_bwd(dq_, dk_, dv_, out, lse, ddo, scale)   # flash_attention.cu's
    for name, g, ref, w in zip(("dq", "dk", "dv"), got, (rdq, rdk, rdv), want):
        assert g.shape == ref.shape and str(g.dtype) == "bfloat16"
        check(f"wgmma {name}", host(be, g), ref, TOL)
        check(f"wgmma {name} vs mma.sync", host(be, g), host(be, w), TOL)


@pytest.mark.parametrize("qd_shared,kv_shared,rows", SHARED)
@pytest.mark.parametrize("B,T,H", [(2, 1024, 12), (1, 77, 4)])
def test_wgmma_backward_on_fused_rows_and_same_bits(be, rs, B, T, H, qd_shared, kv_shared,
                                                    rows):
    C = H * HS
    scale = 1.0 / math.sqrt(HS)
    qkv, dy = dev(be, bf16_values(rs, (B, T, 3 * C))), dev(be, bf16_values(rs, (B, T, C)))
    y, lse = be.attention_qkv(qkv, H, scale)
    got = be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale, qd_shared, kv_shared, rows)
    want = be.attention_qkv_bwd(qkv, y, lse, dy, H, scale)
    check("wgmma dqkv vs mma.sync", host(be, got), host(be, want), TOL)
    again = be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale, qd_shared, kv_shared, rows)
    assert host(be, again).tobytes() == host(be, got).tobytes()
    # a kernel the variant leaves as it is gives the default's bits: dq (the first third) or
    # dk and dv (the other two)
    plain, got = host(be, be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale)), host(be, got)
    if not qd_shared:
        assert plain[..., :C].tobytes() == got[..., :C].tobytes()
    if not kv_shared:
        assert plain[..., C:].tobytes() == got[..., C:].tobytes()


@pytest.mark.parametrize("qd_shared,kv_shared,rows", SHARED)
@pytest.mark.parametrize("B,T,H", [(2, 1024, 12), (3, 77, 4), (1, 64, 2)])
def test_wgmma_backward_column_sums(be, rs, B, T, H, qd_shared, kv_shared, rows):
    """With sums the kernels also sum the dq, dk and dv they write over rows (GPT-2's c_attn
    bias gradient): dqkv keeps its bits, the sums are those of the dqkv written (float64 over
    its bf16 values) within bf16's rounding of the result (the pool's NaN bytes show a partial
    row left unwritten; T = 64 with 128 rows a block has a warpgroup past the last row), and
    the backend's attention_qkv_bwd_sums takes them when the switch says wgmma."""
    C = H * HS
    scale = 1.0 / math.sqrt(HS)
    qkv, dy = dev(be, bf16_values(rs, (B, T, 3 * C))), dev(be, bf16_values(rs, (B, T, C)))
    y, lse = be.attention_qkv(qkv, H, scale)
    plain = be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale, qd_shared, kv_shared, rows)
    dqkv, sums = be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale, qd_shared, kv_shared, rows,
                                          sums=True)
    assert host(be, dqkv).tobytes() == host(be, plain).tobytes()
    d = host(be, dqkv).astype(np.float64).reshape(-1, 3 * C)
    want, got = d.sum(axis=0), host(be, sums).astype(np.float64)
    assert got.shape == (3 * C,) and str(sums.dtype) == "bfloat16"
    err = np.abs(got - want)
    bound = np.abs(want) * 2.0 ** -8 + 1e-5 * np.abs(d).sum(axis=0)
    assert np.all(err <= bound), (f"column sums: worst {err.max():.3g} at column "
                                  f"{int(np.argmax(err - bound))}")
    with flags.override(FORGE_WGMMA_ATTENTION="on"):
        d2, s2 = be.attention_qkv_bwd_sums(qkv, y, lse, dy, H, scale)
    default = be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale, True, True, 128, sums=True)
    assert host(be, d2).tobytes() == host(be, default[0]).tobytes()
    assert host(be, s2).tobytes() == host(be, default[1]).tobytes()


def test_the_switch_sends_the_backend_ops_to_the_wgmma_kernels(be, rs):
    """FORGE_WGMMA_ATTENTION=on: attention, attention_bwd, attention_qkv(_bwd) without dropout
    take flash_hopper.cu (the same bits as calling it directly); with dropout they stay on
    flash_attention.cu's kernels."""
    qs = (1, 2, 130, HS)
    q, k, v, dout = (dev(be, bf16_values(rs, qs)) for _ in range(4))
    direct = be._attention_flash_hopper(q, k, v)
    direct_bwd = be._attention_bwd_flash_hopper(q, k, v, direct[0], direct[1], dout)
    with flags.override(FORGE_WGMMA_ATTENTION="on"):
        out, lse = be.attention(q, k, v)
        grads = be.attention_bwd(q, k, v, out, lse, dout)
    for a, b in zip((out, lse) + tuple(grads), direct + tuple(direct_bwd)):
        assert host(be, a).tobytes() == host(be, b).tobytes()


def test_a_scale_that_is_not_positive_runs_the_mma_sync_forward(be, rs):
    """The wgmma forward scales each tile's max, so it takes scale > 0; the backend's forward
    with FORGE_WGMMA_ATTENTION=on still gives the reference for a negative scale."""
    qs = (1, 2, 100, HS)
    q, k, v = bf16_values(rs, qs), bf16_values(rs, qs), bf16_values(rs, qs)
    rout, rlse = ref_attention(q, k, v, np.zeros(qs), -0.125)[:2]
    with flags.override(FORGE_WGMMA_ATTENTION="on"):
        out, lse = be.attention(dev(be, q), dev(be, k), dev(be, v), -0.125)
    check("out, scale < 0", host(be, out), rout, TOL)
    check_abs("lse, scale < 0", host(be, lse), rlse, LSE_TOL)


def test_the_sm_90a_build_is_kept_on_disk_and_a_damaged_copy_is_rebuilt(be, tmp_path):
    """compile_for_arch writes the cubin under FORGE_CACHE_DIR/cuda, loads it from there in a
    later call, and compiles again over a damaged file."""
    from forge_ml import flags
    from forge_ml.backends.cuda import runtime
    src = ('extern "C" __global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }\n'
           f"// {tmp_path.name}\n")   # a source no earlier run has cached

    def run(module):
        import cupy
        x = cupy.arange(4, dtype=cupy.float32)
        module.get_function("twice")((1,), (4,), (x,))
        return x.get().tolist()

    with flags.override(FORGE_CACHE_DIR=str(tmp_path)):
        assert run(runtime.compile_for_arch(src, "probe_twice.cu", "sm_90a")) == [0, 2, 4, 6]
        kept = list((tmp_path / "cuda").glob("probe_twice-sm_90a-*.cubin"))
        assert len(kept) == 1 and kept[0].stat().st_size > 0
        stamp = kept[0].stat().st_mtime_ns
        assert run(runtime.compile_for_arch(src, "probe_twice.cu", "sm_90a")) == [0, 2, 4, 6]
        assert kept[0].stat().st_mtime_ns == stamp            # loaded, not written again
        kept[0].write_bytes(b"not a cubin")
        assert run(runtime.compile_for_arch(src, "probe_twice.cu", "sm_90a")) == [0, 2, 4, 6]
        assert kept[0].read_bytes() != b"not a cubin"           # rebuilt and replaced
        assert not list((tmp_path / "cuda").glob("*.tmp"))


# ---- the dk/dv kernel for 128 keys a block (FORGE_WGMMA_DKDV=r128h) -----------------------------

WIDE = ["r128h"]


@pytest.mark.parametrize("dkdv", WIDE)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_wgmma_dkdv_128_keys_vs_reference_and_64_key_kernel(be, rs, shape, dkdv):
    """dk and dv from two warpgroups on each q and dout tile (r128h: the scores in halves of 32
    queries) within the tolerance of float64 and of the one-warpgroup kernel on every shape (a
    last block whose second warpgroup starts past Tk, a KV-cache offset, single rows); dq comes
    from the same dq kernel, so its bytes are the default's."""
    scale = 1.0 / math.sqrt(HS)
    (rdq, rdk, rdv), (dq_, dk_, dv_, ddo), (out, lse) = _backward_case(be, rs, shape, scale)
    got = be._attention_bwd_flash_hopper(dq_, dk_, dv_, out, lse, ddo, scale, qd_shared=True,
                                         kv_shared=True, rows=128, dkdv=dkdv)
    base = be._attention_bwd_flash_hopper(dq_, dk_, dv_, out, lse, ddo, scale, qd_shared=True,
                                          kv_shared=True, rows=128)
    for name, g, ref, b in zip(("dq", "dk", "dv"), got, (rdq, rdk, rdv), base):
        assert g.shape == ref.shape and str(g.dtype) == "bfloat16"
        check(f"{dkdv} {name}", host(be, g), ref, TOL)
        check(f"{dkdv} {name} vs 64 keys", host(be, g), host(be, b), TOL)
    assert host(be, got[0]).tobytes() == host(be, base[0]).tobytes()


@pytest.mark.parametrize("dkdv", WIDE)
@pytest.mark.parametrize("B,T,H", [(2, 1024, 12), (3, 77, 4), (1, 64, 2), (2, 200, 3)])
def test_wgmma_dkdv_128_keys_on_fused_rows_sums_and_same_bits(be, rs, B, T, H, dkdv):
    """GPT-2's fused rows with the column sums: dqkv within the tolerance of the one-warpgroup
    kernel's, the same bytes on every run and with or without sums, and the sums those of the
    dqkv written (a second warpgroup past the last key writes no row of them)."""
    C = H * HS
    scale = 1.0 / math.sqrt(HS)
    qkv, dy = dev(be, bf16_values(rs, (B, T, 3 * C))), dev(be, bf16_values(rs, (B, T, C)))
    y, lse = be.attention_qkv(qkv, H, scale)
    base = host(be, be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale, True, True, 128))
    dqkv, sums = be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale, True, True, 128, sums=True,
                                          dkdv=dkdv)
    got = host(be, dqkv)
    check(f"{dkdv} dqkv vs 64 keys", got, base, TOL)
    for again in (be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale, True, True, 128,
                                           dkdv=dkdv),
                  be._qkv_flash_bwd_hopper(qkv, y, lse, dy, H, scale, True, True, 128,
                                           sums=True, dkdv=dkdv)[0]):
        assert host(be, again).tobytes() == got.tobytes()
    d = got.astype(np.float64).reshape(-1, 3 * C)
    want, s = d.sum(axis=0), host(be, sums).astype(np.float64)
    err = np.abs(s - want)
    bound = np.abs(want) * 2.0 ** -8 + 1e-5 * np.abs(d).sum(axis=0)
    assert np.all(err <= bound), (f"column sums: worst {err.max():.3g} at column "
                                  f"{int(np.argmax(err - bound))}")
    with flags.override(FORGE_WGMMA_ATTENTION="on", FORGE_WGMMA_DKDV=dkdv):
        d2 = be.attention_qkv_bwd(qkv, y, lse, dy, H, scale)
    assert host(be, d2).tobytes() == got.tobytes()
