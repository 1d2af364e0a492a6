"""The CUDA backend's memory: allocation, host copies, casts, in-place assignment.

zeros, from_host, to_host (bfloat16 comes back as float32), cast (float <-> bfloat16 on the
device, rounded to nearest even, by the ``cast_*`` kernels of elementwise.cu), copy, assign,
pinned_empty and to_host_async (``_Copy``: a device-to-host copy in flight). Also the
argument helpers every room uses: ``_c`` (C-contiguous), ``_like`` (in a given dtype),
``_ids`` (token ids as int32/int64), ``_pos_array`` (a position held on the device).
"""
from __future__ import annotations

import collections
import math
import threading

import numpy as np

from ...errors import ShapeError
from .runtime import (BF16, F32, _FLOATS, _SFX, _THREADS, _dtype, _empty, _grid, _guarded, _i64,
                      _launch, cupy)


def _c(x):
    """The contract promises C-contiguous arrays; copy if a caller broke that promise."""
    return x if x.flags.c_contiguous else copy(x)


def _like(x, dt):
    """``x`` in dtype ``dt`` (itself when it already is)."""
    return x if x.dtype == dt else cast(x, dt.name)


def _ids(ids):
    ids = _c(ids)
    if ids.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        ids = ids.astype(np.int64)
    return ids


def _pos_array(pos, rows=1):
    """A position given as a device array, read by the kernel itself: int32, one element
    (shared by every row) or ``rows`` elements (one per row: continuous batching)."""
    if pos.size not in (1, rows) or pos.dtype != np.dtype(np.int32):
        raise ShapeError(f"a device position must be int32 with one element or one per row "
                         f"({rows}), got {pos.dtype} of shape {pos.shape}")
    return _c(pos)


@_guarded
def zeros(shape, dtype_name):
    return cupy.zeros(tuple(int(s) for s in shape), dtype=_dtype(dtype_name))


@_guarded
def from_host(np_array, dtype_name):
    dt = _dtype(dtype_name)
    a = np.asarray(np_array)
    if dt == BF16:
        # round on the device (to nearest even), the same code path as every other cast
        return cast(cupy.asarray(np.asarray(a, dtype=np.float32, order="C")), "bfloat16")
    return cupy.asarray(np.asarray(a, dtype=dt, order="C"))  # keeps 0-d arrays 0-d


@_guarded
def to_host(array) -> np.ndarray:
    if array.dtype == BF16:
        array = cast(array, "float32")
    return cupy.asnumpy(array)


@_guarded
def cast(array, dtype_name):
    dt = _dtype(dtype_name)
    x = _c(array)
    if x.dtype == dt:
        return copy(x)
    if BF16 is not None and BF16 in (x.dtype, dt):
        if x.dtype in _FLOATS and dt in _FLOATS:
            out = _empty(x.shape, dt)
            if x.size:
                _launch("elementwise", f"cast_{_SFX[x.dtype]}_{_SFX[dt]}", _grid(x.size),
                        _THREADS, (x, out, _i64(x.size)))
            return out
        # integers <-> bf16 go through float32
        mid = x.astype(F32) if x.dtype != BF16 else cast(x, "float32")
        return cast(mid, dt.name) if dt == BF16 else mid.astype(dt)
    return x.astype(dt)


@_guarded
def copy(array):
    out = cupy.empty(array.shape, dtype=array.dtype)
    if array.size:
        if array.flags.c_contiguous:
            out.data.copy_from_device_async(array.data, array.nbytes)
        elif array.dtype != BF16:
            out[...] = array
        else:  # strided bf16: copy the raw 2-byte words
            out.view(np.uint16)[...] = array.view(np.uint16)
    return out


@_guarded
def assign(dst, values):
    """dst[...] = values (a NumPy array), in place, queued on the current stream."""
    if not dst.flags.c_contiguous:
        raise ShapeError("assign: dst must be C-contiguous (it is written in place)")
    if dst.dtype == BF16:  # rounded on the device, as from_host does
        src = from_host(values, "bfloat16")
        dst.data.copy_from_device_async(src.data, dst.nbytes)
    else:  # one host-to-device copy
        dst.set(np.ascontiguousarray(values, dtype=dst.dtype))


@_guarded
def from_host_async(dst, src):
    """Queue a copy of the host array ``src`` (pinned, ``dst``'s size and dtype) into ``dst``
    on the current stream: it runs after the work queued before it, and the host returns at
    once (``src`` must stay as it is until the copy has run; it is kept alive until then,
    so a caller may drop it at once)."""
    if not dst.flags.c_contiguous or dst.dtype == BF16:
        raise ShapeError("from_host_async: dst must be C-contiguous and not bfloat16")
    if src.nbytes != dst.nbytes or src.dtype != dst.dtype:
        raise ShapeError(f"from_host_async: {src.dtype} {src.shape} into {dst.dtype} {dst.shape}")
    if dst.nbytes:
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.ctypes.data, dst.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        _keep_until_done(stream, src)


# Host arrays of copies queued and maybe not run yet, with the event after each copy. A
# pinned array dropped by its caller goes back to CuPy's pinned pool, whose next allocation
# of its size takes it at once: a copy still queued would then read (or write) another
# array's memory. Each entry keeps its array until its event is done.
_in_flight: collections.deque = collections.deque()
_in_flight_lock = threading.Lock()   # (the server's threads may copy at once)


def _keep_until_done(stream, host, event=None):
    """Keep ``host`` alive until the work queued on ``stream`` so far has run (``event``, or
    a new one recorded now); returns the event, or None while ``stream`` is capturing a graph
    (the graph reads ``host`` at every replay: its owner keeps it). Entries already done are
    dropped, oldest first (not while capturing: querying an event then is an error)."""
    if stream.is_capturing():
        return None
    if event is None:
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
    with _in_flight_lock:
        while _in_flight and _in_flight[0][0].done:
            _in_flight.popleft()
        _in_flight.append((event, host))
    return event


class _Copy:
    """A device-to-host copy in flight: ``synchronize()`` waits for it."""

    def __init__(self, event):
        self._event = event

    def synchronize(self):
        self._event.synchronize()


def release_cached() -> None:
    """Give the free blocks CuPy's default pool caches back to the device (a graph's memory is
    its own pool's; evaluation between graph replays would otherwise keep a second copy)."""
    cupy.get_default_memory_pool().free_all_blocks()


def pinned_empty(shape, dtype):
    """A NumPy array in page-locked host memory (device copies into it run asynchronously)."""
    dt = np.dtype(dtype)
    n = int(math.prod(shape))
    mem = cupy.cuda.alloc_pinned_memory(max(1, n * dt.itemsize))
    return np.frombuffer(mem, dt, n).reshape(shape)


@_guarded
def to_host_async(array, out):
    """Queue a copy of ``array`` into the host array ``out`` (pinned, same size and dtype) on
    the current stream; returns a handle whose ``synchronize()`` waits for it (``out`` is
    kept alive until the copy has run, so the device never writes memory given back)."""
    array = _c(array)
    if out.nbytes != array.nbytes or out.dtype != array.dtype:
        raise ShapeError(f"to_host_async: {array.dtype} {array.shape} into {out.dtype} {out.shape}")
    stream = cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memcpyAsync(out.ctypes.data, array.data.ptr, array.nbytes,
                                  cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
    event = cupy.cuda.Event(block=False, disable_timing=True)
    event.record(stream)
    _keep_until_done(stream, out, event)
    return _Copy(event)
