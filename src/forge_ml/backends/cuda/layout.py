"""Kernels that move elements without arithmetic, or add rows: the head permutations of
multi-head attention (heads.cu: ``split_heads``, ``unsplit_head``, ``merge_heads``,
``unmerge_heads``, bit copies by element size, so one kernel serves every dtype), and the
embedding lookup and its backward (embedding.cu: ``embedding`` with the position given on the
host or read on the device, ``scatter_add_rows`` over sorted ids, deterministic). Kernels:
heads.cu, embedding.cu.
"""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from .memory import _c, _ids, _like, _pos_array
from .runtime import (_THREADS, _acc_dtype, _empty, _float_sfx, _grid, _guarded, _i32, _i64,
                      _launch, _sfx, _word, cupy)


# ----------------------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------------------

@_guarded
def split_heads(qkv, n_head):
    qkv = _c(qkv)
    H = int(n_head)
    *lead, T, C3 = qkv.shape
    if C3 % 3 or (C3 // 3) % H:
        raise ShapeError(f"split_heads: last dim {C3} is not 3 * n_head ({H}) * head size")
    C = C3 // 3
    hs = C // H
    shape = tuple(lead) + (H, T, hs)
    q, k, v = (_empty(shape, qkv.dtype) for _ in range(3))
    if qkv.size:
        _launch("heads", f"split_heads_{_word(qkv)}", _grid(qkv.size), _THREADS,
                (qkv, q, k, v, _i64(qkv.size), _i32(T), _i32(H), _i32(hs)))
    return q, k, v


_WHICH = {"q": 0, "k": 1, "v": 2}


@_guarded
def unsplit_head(dy, which):
    dy = _c(dy)
    w = _WHICH.get(which, which) if isinstance(which, str) else int(which)
    if w not in (0, 1, 2):
        raise ShapeError(f"unsplit_head: which must be 0, 1, 2 (or 'q', 'k', 'v'), got {which!r}")
    *lead, H, T, hs = dy.shape
    out = _empty(tuple(lead) + (T, 3 * H * hs), dy.dtype)
    if out.size:
        _launch("heads", f"unsplit_head_{_word(dy)}", _grid(out.size), _THREADS,
                (dy, out, _i64(out.size), _i32(T), _i32(H), _i32(hs), _i32(w)))
    return out


@_guarded
def merge_heads(x):
    x = _c(x)
    *lead, H, T, hs = x.shape
    out = _empty(tuple(lead) + (T, H * hs), x.dtype)
    if out.size:
        _launch("heads", f"merge_heads_{_word(x)}", _grid(out.size), _THREADS,
                (x, out, _i64(out.size), _i32(T), _i32(H), _i32(hs)))
    return out


@_guarded
def unmerge_heads(dy, h):
    dy = _c(dy)
    H = int(h)
    *lead, T, C = dy.shape
    if C % H:
        raise ShapeError(f"unmerge_heads: {C} channels do not split into {H} heads")
    hs = C // H
    out = _empty(tuple(lead) + (H, T, hs), dy.dtype)
    if out.size:
        _launch("heads", f"unmerge_heads_{_word(dy)}", _grid(out.size), _THREADS,
                (dy, out, _i64(out.size), _i32(T), _i32(H), _i32(hs)))
    return out


# ----------------------------------------------------------------------------------------------
# Embedding
# ----------------------------------------------------------------------------------------------

@_guarded
def embedding(ids, wte, wpe, pos=0):
    ids = _ids(ids)
    wte = _c(wte)
    wpe = _like(_c(wpe), wte.dtype)
    C = wte.shape[-1]
    T = ids.shape[-1] if ids.ndim else 1
    out = _empty(ids.shape + (C,), wte.dtype)
    if not out.size:
        return out
    sfx = f"{_float_sfx(wte)}_{_sfx(ids.dtype)}"
    if isinstance(pos, cupy.ndarray):  # read on the device (CUDA-graph replays)
        rows = ids.size // T if T else 1
        pos = _pos_array(pos, rows)
        _launch("embedding", f"embedding_at_fwd_{sfx}", _grid(out.size), _THREADS,
                (ids, wte, wpe, out, _i64(out.size), _i32(T), _i32(C), pos,
                 _i32(wpe.shape[0]), _i32(pos.size)))
    else:
        _launch("embedding", f"embedding_fwd_{sfx}", _grid(out.size), _THREADS,
                (ids, wte, wpe, out, _i64(out.size), _i32(T), _i32(C), _i32(int(pos))))
    return out


_SCATTER_PIECE = 32   # embedding.cu: SCATTER_PIECE, sorted rows a block adds


@_guarded
def scatter_add_rows(dst, ids, src):
    if not dst.flags.c_contiguous:
        raise ShapeError("scatter_add_rows: dst must be C-contiguous (it is updated in place)")
    ids = _ids(ids).reshape(-1)
    C = dst.shape[-1]
    src = _like(_c(src), dst.dtype).reshape(-1, C) if C else _c(src)
    N = ids.size
    if src.shape[0] != N:
        raise ShapeError(f"scatter_add_rows: {N} ids but src has {src.shape[0]} rows")
    if N == 0 or C == 0:
        return None
    # Sort the ids, then add each piece of SCATTER_PIECE sorted rows run by run, and the runs
    # that cross pieces from their parts: no atomics, deterministic (embedding.cu).
    order = cupy.argsort(ids).astype(np.int64, copy=False)
    sorted_ids = ids[order].astype(np.int64, copy=False)
    threads = 256 if C >= 256 else 32 * max(1, -(-C // 32))
    pieces = -(-N // _SCATTER_PIECE)
    part = _empty((pieces * 2 * C,), _acc_dtype(dst.dtype))
    sfx = _float_sfx(dst)
    _launch("embedding", f"scatter_add_pieces_{sfx}", (pieces,), threads,
            (dst, src, sorted_ids, order, part, _i64(N), _i32(C)))
    if pieces > 1:
        _launch("embedding", f"scatter_add_spans_{sfx}", (pieces,), threads,
                (dst, sorted_ids, part, _i64(N), _i32(C)))
    return None
