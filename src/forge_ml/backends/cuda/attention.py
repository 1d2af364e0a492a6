"""Causal self-attention, training and decoding.

- flash (flash_attention.cu, after FlashAttention-2): fused forward and backward, no T x T
  matrix in memory, bfloat16 at head size 64 on the tensor cores; head-major ``(..., H, T,
  64)`` arrays (``attention``, ``attention_bwd``) or GPT-2's fused ``(B, T, 3C)`` rows read
  in place (``attention_qkv``, ``attention_qkv_bwd``), there also with dropout on the
  probabilities (``attention_qkv_dropout``, ``attention_qkv_dropout_bwd``: ops.dropout's mask,
  drawn in the kernels).
- composed (``_attention_composed``, ``_attention_bwd_composed``): cuBLAS batched products
  around the softmax kernels of rows.py, the T x T scores of each head materialized in float32
  (attention.cu rebuilds the probabilities from the saved lse in the backward). It serves every
  other dtype and head size, and everything when the FORGE_ATTENTION switch is 'composed'.
- decoding: ``kv_append`` (the KV-cache write) and ``decode_attention`` (one token: the cache
  write and the attention of every head in one kernel; on Hopper a thread-block cluster per
  head splits a long cache).

Kernels: attention.cu, flash_attention.cu, flash_hopper.cu (forward and backward without
dropout on Hopper's wgmma: the flash path on compute capability 9.0 unless
FORGE_WGMMA_ATTENTION=off; the same bits as flash_attention.cu's kernels on the H200).
"""
from __future__ import annotations

import math

import numpy as np

from ... import flags
from ... import rng as _rng
from ...errors import ShapeError
from .. import compose as _compose
from .cublas import _matmul_into
from .layout import merge_heads, split_heads, unmerge_heads
from .memory import _c, _like, _pos_array
from .rows import _colsum_finish, _softmax_bwd_into, _softmax_into
from .runtime import (BF16, F32, _SFX, _THREADS, _acc, _acc_dtype, _cc, _dev, _empty, _float_sfx,
                      _grid, _guarded, _i32, _i64, _launch, _launcher_ex, _package,
                      _set_max_shared, _sm_count, _word, cupy)


# ----------------------------------------------------------------------------------------------
# Training attention: flash and composed
# ----------------------------------------------------------------------------------------------

def _attn_shapes(q, k, v):
    if q.ndim < 2 or k.shape != v.shape or q.shape[:-2] != k.shape[:-2] \
            or q.shape[-1] != k.shape[-1]:
        raise ShapeError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} do not agree")
    Tq, Tk = q.shape[-2], k.shape[-2]
    if Tq > Tk:
        raise ShapeError(f"attention: {Tq} queries but only {Tk} keys")
    return Tq, Tk


def _as_batched(x):
    """(..., T, hs) as a batch of matrices for cuBLAS: at least 3-D."""
    return x if x.ndim >= 3 else x.reshape((1,) + x.shape)


_FLASH_HS = 64       # the one head size flash_attention.cu is written for (FA_D)
_FLASH_BLOCK = 64    # query rows / keys per block (FA_BLK)
_FLASH_THREADS = 128


def _flash_wanted(q, k, *others) -> bool:
    """Whether the fused kernels take this call: bfloat16, head size 64, something to do, at
    most 65535 blocks of rows (grid y), every array 16-byte aligned (cp.async), and
    the FORGE_ATTENTION switch is not 'composed' (asked at every call, so a run can switch
    it)."""
    if flags.get("FORGE_ATTENTION") == "composed":
        return False
    if BF16 is None or q.dtype != BF16 or q.shape[-1] != _FLASH_HS or q.size == 0:
        return False
    if -(-k.shape[-2] // _FLASH_BLOCK) > 65535:
        return False
    return all(x.data.ptr % 16 == 0 for x in (q, k) + others)


def _flash_grid(bh: int, rows: int):
    """(bh, blocks of _FLASH_BLOCK rows): the kernels read blockIdx.x as bh."""
    return (bh, -(-rows // _FLASH_BLOCK))


# flash_attention.cu's kernels are templates over DROP (dropout on the probabilities), so their
# instances have C++ names, which cuModuleGetFunction takes: "_Z", the name's length and the
# name, "ILb0EE" or "ILb1EE" (DROP), "v" (void) and the parameter types as the Itanium C++ ABI
# writes them (nvcc and NVRTC alike).
_FLASH_SIGS = {
    "flash_fwd_bf16_h64": "PK4bf16S2_S2_PS0_PfiifixxixxixxiPKyyjf",
    "flash_bwd_dq_bf16_h64": "PK4bf16S2_S2_S2_S2_PKfPfPS0_iifixxixxixxiPKyyjf",
    "flash_bwd_dkdv_bf16_h64": "PK4bf16S2_S2_S2_PKfS4_PS0_S5_iifixxixxixxiPKyyjf",
}


def _flash_kernel(name: str, drop: bool = False) -> str:
    """The symbol of ``name<drop>`` in flash_attention.cu.

    >>> _flash_kernel("flash_fwd_bf16_h64", True)[:26]
    '_Z18flash_fwd_bf16_h64ILb1'
    """
    return f"_Z{len(name)}{name}ILb{int(bool(drop))}EEv{_FLASH_SIGS[name]}"


# the dropout arguments of a launch without dropout (read by no instruction of DROP = false)
_NO_DROP = (np.uint64(0), np.uint64(0), np.uint32(0), np.float32(1.0))


def _drop_args(p, seed):
    """The dropout arguments of the DROP = true kernels: the seed's device address (0, a null
    pointer, for an int seed: the kernels then take the seed itself) and the seed or the site,
    the least Philox word kept, ``ceil(p 2^24) 2^8`` (the word w of a draw keeps it when
    ``(w >> 8) 2^-24 >= p``, as rng.dropout_keep), and ``rng.dropout_scale(p)``. ``seed``: an
    int, or ``(base, site)`` with ``base`` one int64 of the device (the stream is
    ``rng.mix(base[0], site)``)."""
    keep_min = math.ceil(float(np.float32(p)) * 2 ** 24) << 8
    scale = np.float32(_rng.dropout_scale(p))
    if isinstance(seed, tuple):
        base, site = seed
        if base.dtype != np.int64 or base.size != 1:
            raise ShapeError(f"attention dropout: the seed's base must be one int64, got "
                             f"{base.shape} {base.dtype}")
        return (base, np.uint64(site), np.uint32(keep_min), scale)
    return (np.uint64(0), np.uint64(seed), np.uint32(keep_min), scale)


def _flash_drop_ok(p) -> bool:
    """Whether the kernels can draw dropout at rate ``p``: below 1 once rounded to float32 (above
    1 - 2^-25 every draw is dropped, which keep_min cannot say)."""
    return float(np.float32(p)) < 1.0


@_guarded
def attention(q, k, v, scale=None):
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    if _flash_wanted(q, k, v):
        hs = q.shape[-1]
        scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
        return _attention_flash(q, k, v, scale, Tq, Tk)
    return _attention_composed(q, k, v, scale)


def _head_major(Tq, Tk):
    """The flash kernels' layout arguments for (BH, T, 64) q/out and (BH, Tk, 64) k/v:
    H, then (sb, sh, ld) for q and dq, for k, v, dk, dv, and for out and dout."""
    d = _FLASH_HS
    return (_i32(1), _i64(Tq * d), _i64(0), _i32(d), _i64(Tk * d), _i64(0), _i32(d),
            _i64(Tq * d), _i64(0), _i32(d))


def _fused_layout(T, C, n_head):
    """Layout arguments for GPT-2's fused rows: q, k, v (and dq, dk, dv) inside (B, T, 3C),
    out and dout (B, T, C), head h at channels h*64.."""
    d = _FLASH_HS
    return (_i32(n_head), _i64(T * 3 * C), _i64(d), _i32(3 * C), _i64(T * 3 * C), _i64(d),
            _i32(3 * C), _i64(T * C), _i64(d), _i32(C))


def _fa_fwd(q, k, v, out, lse, Tq, Tk, scale, bh, layout, drop, hopper):
    """One forward launch on layout ``layout`` (``_head_major`` or ``_fused_layout``): the
    mma.sync kernel of flash_attention.cu (with dropout when ``drop``), or, with ``hopper``,
    flash_hopper.cu's wgmma kernel (no dropout) of 64 or 128 query rows a block
    (``_hopper_opts``). The wgmma kernel scales each tile's max instead of every score, which
    takes a positive scale: any other scale runs the mma.sync kernel."""
    args = (q, k, v, out, lse, _i32(Tq), _i32(Tk), np.float32(scale)) + layout
    if hopper and scale > 0:
        if "r128" in _hopper_opts(hopper):
            _launch("flash_hopper", "flash_fwd_wgmma_r128_bf16_h64", _rows_grid(bh, Tq, 128),
                    2 * _FLASH_THREADS, args)
        else:
            _launch("flash_hopper", "flash_fwd_wgmma_bf16_h64", _flash_grid(bh, Tq),
                    _FLASH_THREADS, args)
    else:
        _launch("flash_attention", _flash_kernel("flash_fwd_bf16_h64", drop is not None),
                _flash_grid(bh, Tq), _FLASH_THREADS, args + (drop or _NO_DROP))


def _rows_grid(bh: int, rows: int, per_block: int):
    """(bh, blocks of ``per_block`` rows), as _flash_grid."""
    return (bh, -(-rows // per_block))


# flash_hopper.cu's backward kernels that read the block's own operands from shared memory
# instead of registers: dq with q and dout shared ("qd": 128 registers, four blocks an SM
# instead of three), dk/dv with k and v shared ("kv": 162 registers, three instead of two).
# The FORGE_WGMMA_BWD_SHARED switch picks them, default both: on the H200 (2026-12-04, ninth
# session) they give the register kernels' bits and the backward at T=4096, B=8 takes 2.33 ms
# instead of 2.93 (the trainer: +7.8% tokens/s at T=4096, +3.1% at T=1024 B=32). The ``*_hopper``
# entry points' qd_shared / kv_shared ask for them whatever the switch says (tests,
# benchmarks). The dk/dv one's dynamic shared memory: six 8 KiB tiles, lse and D rows, and
# 1 KiB to align the tiles.
_BWD_SHARED = {"none": frozenset(), "qd": frozenset({"qd"}), "kv": frozenset({"kv"}),
               "both": frozenset({"qd", "kv"})}
_DKDV_KVS_SMEM = 6 * 64 * 64 * 2 + 4 * 64 * 4 + 1024
# The forward and the dq kernel (with q and dout shared) for 128 query rows a block, two
# warpgroups sharing each k and v tile (FORGE_WGMMA_ROWS=128, the default): half the k and v
# bytes a query row reads from L2, the same bits. On the H200 (ninth session) the forward at
# T=4096 B=8 went 0.805 -> 0.758 ms (at T=1024 B=32 0.296 -> 0.311); the trainer +2.6% tok/s
# at T=4096 and +1.2% at T=1024 B=32. The dq one's eight 8 KiB tiles and 1 KiB to align them.
_DQ_R128_SMEM = 8 * 64 * 64 * 2 + 1024
# The dk/dv kernel (k and v shared) for 128 keys a block, two warpgroups reading each q and
# dout tile once, the scores in halves of 32 queries (127 registers, two blocks an SM;
# FORGE_WGMMA_DKDV=r128h). Its dynamic shared memory: eight 8 KiB tiles, lse and D rows, 1 KiB
# to align. Measured on an H100 (thirty-sixth session, B=32 T=1024): the backward with the dq
# kernel of 128 rows 0.731 ms (r64), 0.698 (r128h; 0.836 with the whole score tile, 195
# registers and one block an SM, since taken out); the trainer +0.9% tok/s: the default.
_DKDV_R128_SMEM = 8 * 64 * 64 * 2 + 4 * 64 * 4 + 1024
_DKDV_R128H = "flash_bwd_dkdv_wgmma_kvs_r128h_bf16_h64"


def _hopper_bwd(qd_shared=False, kv_shared=False, rows=64, dkdv="r64"):
    """The ``hopper`` value asking ``_fa_fwd`` / ``_fa_bwd`` for given kernels whatever the
    switches say: the set of the shared-operand ones asked for, the rows a block ("r64" or
    "r128") and the dk/dv kernel's keys a block ("dkdv-r64", "dkdv-r128h"; the
    wider ones with ``kv_shared``)."""
    names = {n for n, on in (("qd", qd_shared), ("kv", kv_shared)) if on}
    return frozenset(names | {f"r{int(rows)}", f"dkdv-{dkdv}"})


def _hopper_opts(hopper):
    """The options of flash_hopper.cu's kernels: ``hopper`` itself when a set
    (``_hopper_bwd``), else what FORGE_WGMMA_BWD_SHARED and FORGE_WGMMA_ROWS say."""
    if isinstance(hopper, frozenset):
        return hopper
    return _BWD_SHARED[flags.get("FORGE_WGMMA_BWD_SHARED")] | {
        "r" + flags.get("FORGE_WGMMA_ROWS"), "dkdv-" + flags.get("FORGE_WGMMA_DKDV")}


def _fa_bwd(q, k, v, out, dout, lse, dq, dk, dv, Tq, Tk, scale, bh, layout, drop, hopper,
            part=None):
    """The backward's two launches, dq (writing D = rowsum(dout * out)) then dk and dv (reading
    it), as ``_fa_fwd`` chooses its kernel; ``hopper`` a set (``_hopper_bwd``) names the
    shared-operand wgmma kernels to take. ``part`` (wgmma kernels on the fused layout only):
    a float32 ``(B * ceil(T / 64), 3C)`` array the kernels fill with the column sums of dq, dk
    and dv (each 64 rows of a batch a row; ``_qkv_flash_bwd`` adds them)."""
    D = _empty(lse.shape, F32)
    head_q, head_kv = (q, k, v, out, dout, lse, D, dq), (q, k, v, dout, lse, D, dk, dv)
    tail = (_i32(Tq), _i32(Tk), np.float32(scale)) + layout
    if hopper:   # the wgmma kernels take the sums' pointers and row stride after the outputs
        if part is None:   # part_ld 0: no sums (the pointers then only need to be valid)
            sums_q, sums_kv = (D, _i32(0)), (D, D, _i32(0))
        else:
            flat, C = part.reshape(-1), part.shape[1] // 3
            sums_q = (flat, _i32(part.shape[1]))
            sums_kv = (flat[C:], flat[2 * C:], _i32(part.shape[1]))
        dq_args, kv_args = head_q + sums_q + tail, head_kv + sums_kv + tail
        shared = _hopper_opts(hopper)
        if "qd" in shared and "r128" in shared:   # 128 rows: the shared-operand kernel only
            name = "flash_bwd_dq_wgmma_qds_r128_bf16_h64"
            if not _set_max_shared("flash_hopper", name, _DQ_R128_SMEM):
                raise ShapeError(f"{name} needs {_DQ_R128_SMEM} bytes of shared memory a block")
            _launch("flash_hopper", name, _rows_grid(bh, Tq, 128), 2 * _FLASH_THREADS, dq_args,
                    shared=_DQ_R128_SMEM)
        else:
            _launch("flash_hopper", "flash_bwd_dq_wgmma_qds_bf16_h64" if "qd" in shared else
                    "flash_bwd_dq_wgmma_bf16_h64", _flash_grid(bh, Tq), _FLASH_THREADS, dq_args)
        if "kv" in shared and "dkdv-r128h" in shared:
            if not _set_max_shared("flash_hopper", _DKDV_R128H, _DKDV_R128_SMEM):
                raise ShapeError(f"{_DKDV_R128H} needs {_DKDV_R128_SMEM} bytes of shared memory "
                                 "a block")
            _launch("flash_hopper", _DKDV_R128H, _rows_grid(bh, Tk, 128), 2 * _FLASH_THREADS,
                    kv_args, shared=_DKDV_R128_SMEM)
        elif "kv" in shared:
            name = "flash_bwd_dkdv_wgmma_kvs_bf16_h64"
            if not _set_max_shared("flash_hopper", name, _DKDV_KVS_SMEM):
                raise ShapeError(f"{name} needs {_DKDV_KVS_SMEM} bytes of shared memory a block")
            _launch("flash_hopper", name, _flash_grid(bh, Tk), _FLASH_THREADS, kv_args,
                    shared=_DKDV_KVS_SMEM)
        else:
            _launch("flash_hopper", "flash_bwd_dkdv_wgmma_bf16_h64", _flash_grid(bh, Tk),
                    _FLASH_THREADS, kv_args)
    else:
        if part is not None:
            raise ShapeError("the column sums of the attention backward need the wgmma kernels")
        dq_args, kv_args = head_q + tail, head_kv + tail
        extra = drop or _NO_DROP
        _launch("flash_attention", _flash_kernel("flash_bwd_dq_bf16_h64", drop is not None),
                _flash_grid(bh, Tq), _FLASH_THREADS, dq_args + extra)
        _launch("flash_attention", _flash_kernel("flash_bwd_dkdv_bf16_h64", drop is not None),
                _flash_grid(bh, Tk), _FLASH_THREADS, kv_args + extra)


def _wgmma(drop=None, hopper=None):
    """Whether a flash call takes flash_hopper.cu's kernels: ``hopper`` when given (the
    ``*_hopper`` entry points: True, or ``_hopper_bwd``'s set of kernel options), else the
    FORGE_WGMMA_ATTENTION switch on a GPU that can run them; never with dropout."""
    if drop is not None:
        return False
    if hopper is not None:
        return hopper
    return flags.get("FORGE_WGMMA_ATTENTION") == "on" and _hopper_ok()


def _attention_flash(q, k, v, scale, Tq, Tk, hopper=None):
    out = _empty(q.shape, q.dtype)  # (..., H, Tq, 64)
    lse = _empty(q.shape[:-1], F32)  # (..., H, Tq)
    _fa_fwd(q, k, v, out, lse, Tq, Tk, scale, math.prod(q.shape[:-2]), _head_major(Tq, Tk),
            None, _wgmma(hopper=hopper))
    return out, lse


def _hopper_ok() -> bool:
    """Whether flash_hopper.cu's wgmma kernels can run on the current GPU (compute
    capability 9.0: their sm_90a build)."""
    return _cc(_dev()) == "90"


def _hopper_check(ok: bool, what: str) -> None:
    if not (ok and _hopper_ok()):
        raise ShapeError(f"the wgmma {what} takes bf16 heads of 64 on compute capability 9.0")


def _attention_flash_hopper(q, k, v, scale=None, rows=None):
    """``attention``'s flash forward by flash_hopper.cu (Hopper's wgmma) on head-major bf16
    ``(..., H, T, 64)`` arrays: ``(out, lse)`` as ``_attention_flash``, whatever the
    FORGE_WGMMA_ATTENTION switch says (the backend's flash path takes these kernels while it is
    on, its default), for tests/test_cuda_flash_hopper.py and benchmarks/attention_cuda.py.
    ``rows``: 64 or 128 query rows a block (None: as FORGE_WGMMA_ROWS says).
    The other ``*_hopper`` functions are the same for the backward and the fused rows."""
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    _hopper_check(_flash_wanted(q, k, v), "forward")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _attention_flash(q, k, v, scale, Tq, Tk, hopper=_fwd_rows(rows))


def _fwd_rows(rows):
    """The forward's ``hopper`` value for ``rows`` (None: the switches')."""
    return True if rows is None else _hopper_bwd(rows=rows)


def _qkv_flash_fwd_hopper(qkv, n_head, scale, rows=None):
    qkv = _c(qkv)
    _hopper_check(_qkv_flash_ok(qkv, n_head), "forward")
    return _qkv_flash_fwd(qkv, n_head, scale, hopper=_fwd_rows(rows))


def _attention_bwd_flash_hopper(q, k, v, out, lse, dout, scale=None, qd_shared=False,
                                kv_shared=False, rows=64, dkdv="r64"):
    """``_attention_flash_hopper``'s backward: ``(dq, dk, dv)``, whatever the switches say;
    ``qd_shared`` / ``kv_shared``: the dq kernel with q and dout in shared memory / the dk/dv
    kernel with k and v there (false: their operands in registers); ``rows`` 128: the dq
    kernel of 128 rows a block (with ``qd_shared``); ``dkdv`` "r128h": the dk/dv
    kernel of 128 keys a block (with ``kv_shared``; ``_DKDV_R128H``)."""
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    out, dout = _like(_c(out), q.dtype), _like(_c(dout), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    _hopper_check(_flash_wanted(q, k, v, out, dout), "backward")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _attention_bwd_flash(q, k, v, out, _like(_c(lse), F32), dout, scale, Tq, Tk,
                                hopper=_hopper_bwd(qd_shared, kv_shared, rows, dkdv))


def _qkv_flash_bwd_hopper(qkv, y, lse, dy, n_head, scale, qd_shared=False, kv_shared=False,
                          rows=64, sums=False, dkdv="r64"):
    """``attention_qkv_bwd`` (``(dqkv, its column sums)`` with ``sums``) on the wgmma kernels
    ``_attention_bwd_flash_hopper``'s options name, whatever the switches say."""
    qkv = _c(qkv)
    y, dy = _like(_c(y), qkv.dtype), _like(_c(dy), qkv.dtype)
    _hopper_check(_qkv_flash_ok(qkv, n_head, y, dy), "backward")
    return _qkv_flash_bwd(qkv, y, lse, dy, n_head, scale,
                          hopper=_hopper_bwd(qd_shared, kv_shared, rows, dkdv), sums=sums)


def _qkv_flash_ok(qkv, n_head, *others) -> bool:
    """_flash_wanted for the fused layout: bfloat16, heads of 64, every array 16-byte aligned
    (the k and v thirds then are too: C * 2 bytes is a multiple of 128)."""
    if flags.get("FORGE_ATTENTION") == "composed":
        return False
    B, T, C3 = qkv.shape
    return (BF16 is not None and qkv.dtype == BF16 and C3 == 3 * n_head * _FLASH_HS
            and B * T > 0 and -(-T // _FLASH_BLOCK) <= 65535
            and all(x.data.ptr % 16 == 0 for x in (qkv,) + others))


def _thirds(x, C):
    """Flat views of (B, T, 3C) starting at channel 0, C and 2C (the kernels stride over rows
    themselves)."""
    flat = x.reshape(-1)
    return flat, flat[C:], flat[2 * C:]


@_guarded
def attention_qkv(qkv, n_head, scale):
    """Causal self-attention on GPT-2's fused rows: ``qkv (B, T, 3C) -> (y (B, T, C), lse
    (B, H, T) float32)``. The flash kernels read each head in place and write y with the heads
    merged; other dtypes and head sizes run split_heads, attention, merge_heads."""
    qkv = _c(qkv)
    if not _qkv_flash_ok(qkv, n_head):
        return _compose.attention_qkv(_package(), qkv, n_head, scale)
    return _qkv_flash_fwd(qkv, n_head, scale)


def _qkv_flash_fwd(qkv, n_head, scale, drop=None, hopper=None):
    """The flash forward on fused rows; ``drop``: None, or _drop_args(p, seed)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    y = _empty((B, T, C), qkv.dtype)
    lse = _empty((B, n_head, T), F32)
    q, k, v = _thirds(qkv, C)
    _fa_fwd(q, k, v, y, lse, T, T, scale, B * n_head, _fused_layout(T, C, n_head), drop,
            _wgmma(drop, hopper))
    return y, lse


@_guarded
def attention_qkv_bwd(qkv, y, lse, dy, n_head, scale):
    """``dqkv (B, T, 3C)`` of ``attention_qkv`` given its output y, lse and ``dL/dy``; the
    flash kernels write dq, dk, dv straight into their thirds of dqkv."""
    qkv = _c(qkv)
    y, dy = _like(_c(y), qkv.dtype), _like(_c(dy), qkv.dtype)
    if not _qkv_flash_ok(qkv, n_head, y, dy):
        C = qkv.shape[-1] // 3
        q, k, v = split_heads(qkv, n_head)
        dq, dk, dv = attention_bwd(q, k, v, unmerge_heads(y, n_head), lse,
                                   unmerge_heads(dy, n_head), scale)
        dqkv = _empty(qkv.shape, qkv.dtype)
        w = dqkv.view(np.uint16) if dqkv.dtype == BF16 else dqkv
        for i, g in enumerate((dq, dk, dv)):
            m = merge_heads(g)
            w[..., i * C:(i + 1) * C] = m.view(np.uint16) if m.dtype == BF16 else m
        return dqkv
    return _qkv_flash_bwd(qkv, y, lse, dy, n_head, scale)


@_guarded
def attention_qkv_bwd_sums(qkv, y, lse, dy, n_head, scale):
    """``(dqkv, sum_rows(dqkv))``: ``attention_qkv_bwd`` and dqkv's column sums, the bias
    gradient of the layer that made qkv (GPT-2's c_attn). flash_hopper.cu's kernels sum the
    dq, dk and dv they write (as rounded to bf16) in their last pass, so no kernel reads dqkv
    again for it; elsewhere the backward, then ``sum_rows``."""
    qkv = _c(qkv)
    y, dy = _like(_c(y), qkv.dtype), _like(_c(dy), qkv.dtype)
    if _qkv_flash_ok(qkv, n_head, y, dy) and _wgmma():
        return _qkv_flash_bwd(qkv, y, lse, dy, n_head, scale, sums=True)
    return _compose.attention_qkv_bwd_sums(_package(), qkv, y, lse, dy, n_head, scale)


def _qkv_flash_bwd(qkv, y, lse, dy, n_head, scale, drop=None, hopper=None, sums=False):
    """The flash backward on fused rows (dq kernel, then dk/dv): ``drop`` as _qkv_flash_fwd's;
    ``sums`` (the wgmma kernels): ``(dqkv, its column sums)``, the kernels' partial sums of
    each 64 rows added by one colsum_finish."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    dqkv = _empty(qkv.shape, qkv.dtype)
    (q, k, v), (dq, dk, dv) = _thirds(qkv, C), _thirds(dqkv, C)
    part = _empty((B * -(-T // 64), C3), F32) if sums else None
    _fa_bwd(q, k, v, y, dy, _like(_c(lse), F32), dq, dk, dv, T, T, scale, B * n_head,
            _fused_layout(T, C, n_head), drop, _wgmma(drop, hopper), part)
    if not sums:
        return dqkv
    out = _empty((C3,), qkv.dtype)
    _colsum_finish(part, out, part.shape[0], C3)
    return dqkv, out


@_guarded
def attention_qkv_dropout(qkv, n_head, scale, p, seed):
    """``attention_qkv`` with dropout at rate ``p`` on the probabilities, the mask of
    ``ops.dropout(P, p, seed)`` on the (B, H, T, T) probabilities of the composed path (``seed``:
    an int, or ``(base, site)``: see _drop_args): ``(y, lse)``, lse the softmax's (before
    dropout). The flash kernels draw the mask themselves; other dtypes and head sizes run the
    composed default."""
    qkv = _c(qkv)
    if not (_qkv_flash_ok(qkv, n_head) and _flash_drop_ok(p)):
        return _compose.attention_qkv_dropout(_package(), qkv, n_head, scale, p, seed)
    return _qkv_flash_fwd(qkv, n_head, scale, _drop_args(p, seed))


@_guarded
def attention_qkv_dropout_bwd(qkv, y, lse, dy, n_head, scale, p, seed):
    """``dqkv (B, T, 3C)`` of ``attention_qkv_dropout`` (the same ``p`` and ``seed``: the
    kernels draw the mask again)."""
    qkv = _c(qkv)
    y, dy = _like(_c(y), qkv.dtype), _like(_c(dy), qkv.dtype)
    if not (_qkv_flash_ok(qkv, n_head, y, dy) and _flash_drop_ok(p)):
        return _compose.attention_qkv_dropout_bwd(_package(), qkv, y, lse, dy, n_head, scale, p,
                                                  seed)
    return _qkv_flash_bwd(qkv, y, lse, dy, n_head, scale, _drop_args(p, seed))


@_guarded
def _attention_composed(q, k, v, scale=None):
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    hs = q.shape[-1]
    scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
    lead = q.shape[:-2]
    sdt = _acc_dtype(q.dtype)  # scores, lse: float32 (float64 for float64)
    qb, kb, vb = _as_batched(q), _as_batched(k), _as_batched(v)
    S = _empty(qb.shape[:-2] + (Tq, Tk), sdt)
    _matmul_into(qb, kb, S, False, True, scale, None)  # (BH, Tq, Tk) scaled scores
    P = _empty(S.shape, q.dtype)
    lse = _empty(S.shape[:-1], sdt)
    _softmax_into(S, P, lse, True, Tk - Tq)
    del S
    out = _empty(qb.shape, q.dtype)
    _matmul_into(P, vb, out, False, False, 1.0, None)  # (BH, Tq, hs)
    return out.reshape(q.shape), lse.reshape(lead + (Tq,))


@_guarded
def attention_bwd(q, k, v, out, lse, dout, scale=None):
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    out, dout = _like(_c(out), q.dtype), _like(_c(dout), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != q.shape[:-1]:
        raise ShapeError(f"attention_bwd: q {q.shape} needs out and dout of that shape and lse "
                         f"of {q.shape[:-1]}; got out {out.shape}, dout {dout.shape}, "
                         f"lse {lse.shape}")
    if _flash_wanted(q, k, v, out, dout):
        hs = q.shape[-1]
        scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
        return _attention_bwd_flash(q, k, v, out, _like(_c(lse), F32), dout, scale, Tq, Tk)
    return _attention_bwd_composed(q, k, v, out, lse, dout, scale)


def _attention_bwd_flash(q, k, v, out, lse, dout, scale, Tq, Tk, hopper=None):
    dq, dk, dv = _empty(q.shape, q.dtype), _empty(k.shape, q.dtype), _empty(v.shape, q.dtype)
    _fa_bwd(q, k, v, out, dout, lse, dq, dk, dv, Tq, Tk, scale, math.prod(q.shape[:-2]),
            _head_major(Tq, Tk), None, _wgmma(hopper=hopper))
    return dq, dk, dv


@_guarded
def _attention_bwd_composed(q, k, v, out, lse, dout, scale=None):
    q, k, v = _c(q), _like(_c(k), q.dtype), _like(_c(v), q.dtype)
    dout = _like(_c(dout), q.dtype)
    Tq, Tk = _attn_shapes(q, k, v)
    hs = q.shape[-1]
    scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
    sdt = _acc_dtype(q.dtype)
    lse = _like(_c(lse), sdt)
    qb, kb, vb, dob = _as_batched(q), _as_batched(k), _as_batched(v), _as_batched(dout)
    S = _empty(qb.shape[:-2] + (Tq, Tk), sdt)
    _matmul_into(qb, kb, S, False, True, scale, None)
    P = _empty(S.shape, q.dtype)
    _launch("attention", f"attn_probs_{_SFX[sdt]}_{_float_sfx(P)}", _grid(S.size), _THREADS,
            (S, lse, P, _i64(S.size), _i32(Tq), _i32(Tk), _i32(Tk - Tq)))
    dv = _empty(kb.shape, q.dtype)
    _matmul_into(P, dob, dv, True, False, 1.0, None)  # P^T dout: (BH, Tk, hs)
    dP = S  # reuse the scores' memory: (BH, Tq, Tk) in sdt
    _matmul_into(dob, vb, dP, False, True, 1.0, None)  # dout v^T
    dS = _empty(S.shape, q.dtype)
    _softmax_bwd_into(P, dP, dS)  # P * (dP - rowsum(P * dP)); masked entries stay 0
    del P, dP, S
    dq = _empty(qb.shape, q.dtype)
    _matmul_into(dS, kb, dq, False, False, scale, None)  # (BH, Tq, hs)
    dk = _empty(kb.shape, q.dtype)
    _matmul_into(dS, qb, dk, True, False, scale, None)  # (BH, Tk, hs)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


# ----------------------------------------------------------------------------------------------
# Decoding: the KV cache and one token's attention
# ----------------------------------------------------------------------------------------------

@_guarded
def kv_append(cache, new, pos):
    new = _like(_c(new), cache.dtype)
    if not cache.flags.c_contiguous:
        raise ShapeError("kv_append: the cache must be C-contiguous (it is written in place)")
    *lead_c, Tmax, hs = cache.shape
    *lead_n, Tn, hs_n = new.shape
    pos = int(pos)
    if math.prod(lead_c) != math.prod(lead_n) or hs != hs_n or not 0 <= pos <= Tmax - Tn:
        raise ShapeError(f"kv_append: cannot write new {new.shape} into cache {cache.shape} "
                         f"at position {pos}")
    if new.size:
        _launch("attention", f"kv_append_{_word(cache)}", _grid(new.size), _THREADS,
                (cache, new, _i64(new.size), _i32(Tn), _i32(Tmax), _i32(hs), _i32(pos)))


_DECODE_THREADS = 256  # the most threads a decode_attention block has (and the largest head)
# Threads of a block for heads up to 128 channels: at batch 64 (position 256-1,000) 128 threads
# a block (more blocks on an SM) read the cache 1-38% faster than 256 (the H200, 2026-12-04).
_DECODE_THREADS_SMALL = 128
_DECODE_SPLIT = 8  # blocks per head at most (a thread-block cluster: 8 is the portable size)
_DECODE_WAVES = 2  # blocks wanted per SM before the keys of a head are split


def _decode_split(B: int, H: int, Tmax: int) -> int:
    """Blocks per (row, head) of ``decode_attention``: 1 where the B * H heads already give
    every SM ``_DECODE_WAVES`` blocks (a batch), else up to 8 (a thread-block cluster on
    Hopper), no more than one per 128 rows of the cache."""
    if not _launcher_ex():
        return 1
    want = -(-_DECODE_WAVES * _sm_count(_dev()) // max(1, B * H))
    return max(1, min(_DECODE_SPLIT, -(-Tmax // 128), want))


@_guarded
def decode_attention(qkv, k_cache, v_cache, pos, n_head, scale):
    """One decoding step: write the new keys and values at row ``pos`` of the caches and
    return ``y (B, C)``; per (head, row) one block, or on Hopper a cluster of up to 8 blocks
    splitting the keys of a long cache (attention.cu)."""
    qkv = _like(_c(qkv), k_cache.dtype)
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ShapeError("decode_attention: the caches must be C-contiguous (written in place)")
    B, H, Tmax, hs = k_cache.shape
    if qkv.shape != (B, 3 * H * hs) or v_cache.shape != k_cache.shape or H != n_head:
        raise ShapeError(f"decode_attention: qkv {qkv.shape} and caches {k_cache.shape}, "
                         f"{v_cache.shape} do not fit {n_head} heads")
    if hs > _DECODE_THREADS:
        raise ShapeError(f"decode_attention: head size {hs} is over the kernel's "
                         f"{_DECODE_THREADS}")
    acc = _acc_dtype(qkv.dtype)
    P = _decode_split(B, H, Tmax)
    threads = _DECODE_THREADS_SMALL if hs <= _DECODE_THREADS_SMALL else _DECODE_THREADS
    shared = (2 * hs + -(-Tmax // P) + threads * (16 // qkv.dtype.itemsize)) * acc.itemsize
    if shared > 48 * 1024:
        raise ShapeError(f"decode_attention: a cache of {Tmax} rows needs {shared} bytes of "
                         "shared memory, over the 48 KiB a block may take")
    if isinstance(pos, cupy.ndarray):
        pos = _pos_array(pos, B)
    else:
        pos = cupy.asarray(np.array([int(pos)], np.int32))
    y = _empty((B, H * hs), qkv.dtype)
    if y.size:
        _launch("attention", f"decode_attention_{_float_sfx(qkv)}", (H * P, B), threads,
                (qkv, k_cache, v_cache, pos, y, _i32(H), _i32(Tmax), _i32(hs),
                 _acc(qkv.dtype, scale), _i32(P), _i32(pos.size)), shared=shared, pdl=True,
                writes=(y, k_cache, v_cache), cluster=(P, 1, 1) if P > 1 else None)
    return y

