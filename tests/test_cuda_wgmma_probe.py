"""Hopper's warpgroup products (wgmma, sm_90a) on one 64 x 64 x 64 bf16 tile, against NumPy
(tests/cuda_probes/wgmma_probe.cu, with flash_hopper.cu's wrappers pasted in): the shared-memory
descriptors, the 128-byte swizzle, the
accumulator layout and the transposed MN-major operand that a FlashAttention-3-style kernel
is built from. Each probe runs flash_hopper.cu's own descriptor strides (its WG_* defines);
on a failure it tries the in-bounds alternatives and says which agree, so the message names
the right constants. (A stride that reaches past the 8 KiB tile faults the context, so none is
tried.) Runs on compute capability 9.0 only."""
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from _gpu_checks import cuda_or_skip

pytestmark = pytest.mark.cuda

PROBE = Path(__file__).with_name("cuda_probes") / "wgmma_probe.cu"


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    cuda_or_skip()
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("wgmma needs compute capability 9.0 (sm_90a)")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("the probe is compiled by nvcc for sm_90a (NVRTC gets CuPy's -arch)")
    from forge_ml.backends.cuda import runtime
    kdir = Path(runtime.__file__).parent
    common = (kdir / "common.cuh").read_text()
    hopper = (kdir / "flash_hopper.cu").read_text()
    helpers = hopper[hopper.index("#if defined(__CUDA_ARCH_FEAT_SM90_ALL)"):
                     hopper.index("// ---- end of the wgmma helpers")] + "#endif\n"
    source = PROBE.read_text().replace('#include "common.cuh"', common, 1)
    source = source.replace("// WGMMA_HELPERS\n", helpers, 1)
    out = tmp_path_factory.mktemp("wgmma")
    (out / "probe.cu").write_text(source)
    run = subprocess.run([nvcc, "-arch=sm_90a", "--std=c++17", "-cubin", "-o", str(out / "probe.cubin"),
                          str(out / "probe.cu")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return cupy.RawModule(path=str(out / "probe.cubin"))


def _kernel_strides(kind):
    """flash_hopper.cu's (lbo, sbo, k step bytes) for its K-major or MN-major tiles."""
    from forge_ml.backends.cuda import runtime
    text = (Path(runtime.__file__).parent / "flash_hopper.cu").read_text()
    return tuple(int(re.search(rf"#define WG_{kind}_{name} (\d+)", text).group(1))
                 for name in ("LBO", "SBO", "STEP"))


def _check(module, name, a, b, want, kernel, alternatives):
    """The kernel's strides agree with NumPy; if not, which in-bounds alternatives would."""
    if _close(_run(module, name, a, b, *kernel), want):
        return
    ok = {c: _close(_run(module, name, a, b, *c), want) for c in alternatives if c != kernel}
    pytest.fail(f"{name}: flash_hopper.cu's (lbo, sbo, k step bytes) {kernel} disagree with "
                f"NumPy; alternatives that agree: {[c for c, v in ok.items() if v] or 'none'}")


def _bf16(rs, shape):
    """Random bf16 values as (device uint16 bits, their float64 values)."""
    import cupy
    f = rs.standard_normal(shape).astype(np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    values = (rounded.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return cupy.asarray(rounded), values


def _run(module, name, a, b, lbo, sbo, kstep):
    import cupy
    c = cupy.full((64, 64), np.nan, np.float32)
    module.get_function(name)((1,), (128,), (a, b, c, np.uint32(lbo), np.uint32(sbo),
                                             np.uint32(kstep)))
    cupy.cuda.Device().synchronize()
    return c.get().astype(np.float64)


def _close(got, want):
    return np.all(np.isfinite(got)) and np.abs(got - want).max() <= 1e-3 * (1 + np.abs(want).max())


def test_wgmma_both_operands_k_major_swizzled(module):
    rs = np.random.default_rng(0)
    (a, av), (b, bv) = _bf16(rs, (64, 64)), _bf16(rs, (64, 64))
    want = av @ bv.T
    _check(module, "probe_ss", a, b, want, _kernel_strides("K"),
           [(0, 1024, 32), (1024, 1024, 32), (16, 1024, 16)])


def test_wgmma_a_in_registers_b_k_major(module):
    rs = np.random.default_rng(2)
    (a, av), (b, bv) = _bf16(rs, (64, 64)), _bf16(rs, (64, 64))
    want = av @ bv.T
    _check(module, "probe_rk", a, b, want, _kernel_strides("K"), [(0, 1024, 32), (16, 1024, 16)])


def test_wgmma_a_in_registers_b_mn_major_transposed(module):
    rs = np.random.default_rng(1)
    (a, av), (b, bv) = _bf16(rs, (64, 64)), _bf16(rs, (64, 64))
    want = av @ bv
    _check(module, "probe_rs", a, b, want, _kernel_strides("MN"), [(1024, 1024, 2048), (16, 1024, 1024)])
