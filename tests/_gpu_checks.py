"""Helpers shared by the GPU test files: the GPU's backend or a skip, bf16 rounding on the
host, device-to-host copies, and the norm-wise comparison that also reports unwritten
(non-finite) outputs."""
from __future__ import annotations

import numpy as np
import pytest


def cuda_or_skip(bf16: bool = False):
    """The loaded backend of cuda:0, or a pytest skip saying why there is none (no CuPy, no
    driver, no device; with ``bf16``, a CuPy without bfloat16)."""
    cupy = pytest.importorskip("cupy")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CuPy without a driver or a GPU
        pytest.skip(f"no usable CUDA device: {e}")
    if n == 0:
        pytest.skip("no CUDA device")
    from forge_ml.backends import get
    from forge_ml.device import Device
    be = get(Device("cuda", 0))
    if bf16 and not be.bf16:
        pytest.skip("this CuPy has no bfloat16 (install ml_dtypes)")
    return be


def poison_device_memory(nbytes: int) -> None:
    """Fill ``nbytes`` of fresh device memory with 0xFF (NaN in bf16 and float32) and give it
    back to CuPy's pool, so that an output a kernel forgets to write shows up as NaN."""
    import cupy
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    buf = cupy.empty(nbytes, dtype=cupy.uint8)
    buf.fill(0xFF)
    del buf


def round_bf16(a):
    """Round float32 values to the nearest bf16 (ties to even), returned as float32."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    try:
        import ml_dtypes
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)
    except ImportError:
        u = a.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
        return u.astype(np.uint32).view(np.float32)


def host(be, x):
    """A backend array as a float64 NumPy array."""
    return np.asarray(be.to_host(x), dtype=np.float64)


def check(name, got, ref, tol):
    """Every element finite, and ||got - ref|| / ||ref|| <= tol; names the worst element."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, expected {ref.shape}"
    bad = ~np.isfinite(got)
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {got.size} elements are not finite "
                           f"(first at {np.argwhere(bad)[0].tolist()})")
    denom = np.linalg.norm(ref)
    err = np.linalg.norm(got - ref) / (denom if denom > 0 else 1.0)
    worst = np.unravel_index(np.argmax(np.abs(got - ref)), got.shape) if got.size else ()
    assert err <= tol, (f"{name}: relative error {err:.3e} > {tol:.0e}; worst at {list(worst)}: "
                        f"got {got[worst] if got.size else None}, want {ref[worst] if got.size else None}")
