"""An optimizer step's per-tensor ops over a whole model in a few launches (many.cu):
``sumsq_total`` (the gradients' global sum of squares, for clipping: two launches) and
``adamw_update_many_at`` (``adamw_update_at`` over every parameter: one launch). GPT-2 124M's
148 parameters took 590 launches a step one tensor at a time.

The kernels read a table of the tensors' addresses and sizes. A table is built once per set of
addresses (``_table``: an int64 array copied from page-locked host memory on the current
stream, so a graph capture records the copy as one of its nodes) and cached by those
addresses; a training step that is replayed, or whose gradients come back at the same
addresses from CuPy's pool, reuses it.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ...errors import ShapeError
from .. import compose as _compose
from .memory import _c, pinned_empty
from .pointwise import _adamw_arrays, adamw_update_at
from .runtime import (BF16, F32, F64, _THREADS, _dev, _empty, _guarded, _i32, _launch, _package,
                      cupy)

_CHUNK = 16384          # elements a block owns (many.cu: MANY_CHUNK)
_KEEP = 64              # tables kept besides those a captured graph copies from
_tables: "OrderedDict[tuple, tuple]" = OrderedDict()   # key -> (device, host, event, forever)


def _chunks(n: int) -> int:
    return -(-n // _CHUNK)


def _table(rows: list) -> "cupy.ndarray":
    """The device copy of ``rows`` (equal-length tuples of ints), cached by their values.

    A table made or used while the stream is capturing a graph is kept for good: the graph
    reads it (and its host buffer, through the copy node, when it was made then) at every
    replay. Others are dropped oldest first beyond ``_KEEP``, once their copy has run (its
    event), so a host buffer is never reused early."""
    key = (_dev(),) + tuple(rows)
    stream = cupy.cuda.get_current_stream()
    capturing = stream.is_capturing()
    hit = _tables.get(key)
    if hit is not None:
        if capturing and not hit[3]:   # a graph now reads it: never evicted from here on
            hit = _tables[key] = hit[:3] + (True,)
        _tables.move_to_end(key)
        return hit[0]
    host = pinned_empty((len(rows), len(rows[0])), np.int64)
    host[...] = np.asarray(rows, np.int64)
    dev = cupy.empty(host.shape, np.int64)
    # the runtime's own call: CuPy refuses any host-to-device copy while a stream captures,
    # but CUDA records one from page-locked memory as a graph node
    cupy.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, host.nbytes,
                                  cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
    forever = capturing
    event = None
    if not forever:
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
    _tables[key] = (dev, host, event, forever)
    spare = [k for k, v in _tables.items() if not v[3]]
    for k in spare[:max(0, len(spare) - _KEEP)]:
        _tables.pop(k)[2].synchronize()
    return dev


def _clear_tables() -> None:
    """Empty the table cache (for tests), once the device is done with every table: a
    table's host buffer goes back to CuPy's pinned pool, whose next allocation of its size
    takes it at once, so a copy still queued behind other work would read the next table's
    rows (``_table`` waits for a table's copy before it evicts one for the same reason). A
    table a graph still replays must not be dropped: only for tests whose graphs are gone."""
    cupy.cuda.Device().synchronize()
    _tables.clear()


def _grid_of(sizes) -> tuple:
    """Each tensor's first chunk (the tables' ``chunk0``) and the number of chunks."""
    first, total = [], 0
    for n in sizes:
        first.append(total)
        total += _chunks(n)
    return first, total


@_guarded
def sumsq_total(xs):
    """The sum of squares of every element of every array in ``xs``, a 0-d float32 array: each
    chunk's sum (float32), then one block adds them all in double and rounds once. The same
    bits on every run. float64 or mixed dtypes: the composed default (``sumsq`` each, added in
    order; float64 when any is float64)."""
    xs = [_c(x) for x in xs]
    dts = {x.dtype for x in xs}
    xs = [x for x in xs if x.size]
    if not xs or len(dts) != 1 or next(iter(dts)) not in (F32, BF16):
        return _compose.sumsq_total(_package(), xs)
    first, nb = _grid_of([x.size for x in xs])
    tab = _table([(x.data.ptr, x.size, c0) for x, c0 in zip(xs, first)])
    sfx = "bf16" if xs[0].dtype == BF16 else "f32"
    part = _empty((nb,), F32)
    out = _empty((), F32)
    _launch("many", f"sumsq_many_partial_{sfx}", (nb,), _THREADS, (tab, _i32(len(xs)), part))
    _launch("many", "sumsq_many_finish", (1,), 1024, (part, np.int64(nb), out))
    return out


@_guarded
def adamw_update_many_at(ps, gs, ms, vs, beta1, beta2, eps, weight_decays, scalars,
                         p_lowps=None):
    """``adamw_update_at`` on every parameter in one launch: float32 masters whose gradients
    share one dtype (bfloat16 or float32); anything else takes one ``adamw_update_at`` each.
    Per element the arithmetic is adamw_update_at's, so the bits are too."""
    k = len(ps)
    lows = [None] * k if p_lowps is None else list(p_lowps)
    gs = [_adamw_arrays(p, g, m, v, lp) for p, g, m, v, lp in zip(ps, gs, ms, vs, lows)]
    if scalars.dtype != F64 or scalars.size < 6 or not scalars.flags.c_contiguous:
        raise ShapeError(f"adamw_update_many_at: scalars must be 6 contiguous float64, got "
                         f"{scalars.shape} {scalars.dtype}")
    live = [i for i in range(k) if ps[i].size]
    gdt = {gs[i].dtype for i in live}
    if not live or len(gdt) != 1 or any(ps[i].dtype != F32 for i in live) \
            or gdt.pop() not in (F32, BF16):
        for i in live:
            adamw_update_at(ps[i], gs[i], ms[i], vs[i], beta1, beta2, eps, weight_decays[i],
                            scalars, lows[i])
        return None
    first, nb = _grid_of([ps[i].size for i in live])
    rows = []
    for i, c0 in zip(live, first):
        wd = int(np.array(float(weight_decays[i]), np.float64).view(np.int64))
        rows.append((ps[i].data.ptr, gs[i].data.ptr, ms[i].data.ptr, vs[i].data.ptr,
                     0 if lows[i] is None else lows[i].data.ptr, ps[i].size, wd, c0))
    tab = _table(rows)
    sfx = "bf16" if gs[live[0]].dtype == BF16 else "f32"
    _launch("many", f"adamw_many_at_{sfx}", (nb,), _THREADS,
            (tab, _i32(len(live)), scalars, np.float32(beta1), np.float32(beta2),
             np.float32(eps)))
    return None
