"""Sampling on the device: ``greedy_next``, the argmax of a decoding step's logits, and
``sample_next``, a sampled choice (temperature, top-k, top-p, min-p, repetition penalty: the
rule of ``forge_ml.sampling.sample_row``), each written into the next step's ids (and a
chain's token buffer) with the position advanced, so that captured steps chain without the
host; ``penalize_logits``, OpenAI's presence and frequency penalties and logit bias applied
to the logits before ``sample_next`` (``forge_ml.sampling.adjusted``, one element a thread).
Kernels: greedy.cu, sample.cu (the row staged in shared memory where it fits,
``sample_next_smem_f32``; else ``sample_next_f32``, every pass over global memory;
``sample_next_cluster_f32``, a thread-block cluster of 8 blocks a row, each with an eighth of
it staged, for batches of up to 16 rows on Hopper; ``sample_advance_pos``, a position shared
by several rows advanced after they all read it; and ``sample_weights_f32``, the integer
weights every kernel draws from, for tests). All three choose the same token.

One block of 1024 threads per row; the staged kernel's block takes a whole SM's shared memory,
so up to one row per SM (132 on an H200) runs at once: nothing in a call grows with the
batch below that, and each further 132 rows take another round. A small batch leaves most
SMs idle and a row's passes one block's latency each: the cluster kernel splits each row over
8 SMs (a batch of one: 8 blocks), which meet once a cut's digit.
"""
from __future__ import annotations

from ...errors import ShapeError
from .memory import _c, _pos_array
from .runtime import F32, _guarded, _i32, _launch, _launcher_ex, _set_max_shared, _takes, cupy


@_guarded
def greedy_next(logits, vocab_size, ids, pos, out=None):
    """In place: ``ids[b] = argmax(logits[b, :vocab_size])`` (numpy.argmax's ties and NaNs)
    for float32 logits (B, Vp), also written to ``out`` (B int32, e.g. a row of a chain's
    token buffer; -1 for a row whose largest logit is not finite) when given, then ``pos +=
    1`` (every element: one shared position, or one per row) (greedy.cu)."""
    if logits.dtype != F32 or logits.ndim != 2 or ids.size != logits.shape[0]:
        raise ShapeError(f"greedy_next: float32 logits (B, Vp) and B ids expected, got "
                         f"{logits.dtype} {logits.shape} and {ids.size} ids")
    B, Vp = logits.shape
    if out is None:
        out = ids
    elif out.size != B or out.dtype != ids.dtype or not out.flags.c_contiguous:
        raise ShapeError(f"greedy_next: out must be {B} contiguous {ids.dtype} values, got "
                         f"{out.dtype} {out.shape}")
    pos = _pos_array(pos, B)
    _launch("greedy", "greedy_next_f32", (B,), 1024,
            (_c(logits), _i32(vocab_size), _i32(Vp), ids, out, pos, _i32(pos.size)))


_SAMPLE_THREADS = 1024   # sample.cu: one block of 1024 threads per row
_STAGE = True            # tests set it False to run the global-memory kernel on the same rows
_CLUSTER_BLOCKS, _CLUSTER_THREADS = 8, 512   # sample.cu: SC_BLOCKS, SC_THREADS
_CLUSTER_ROWS = 16       # batches up to this many rows sample with a cluster a row (tests change it)


def _cluster_shared(vocab_size) -> int:
    """``sample_next_cluster_f32``'s dynamic shared memory for rows of ``vocab_size``: the
    block's part of the row, 4 bytes an id (V / 8 rounded up to a multiple of 4).

    >>> _cluster_shared(50257)
    25136
    """
    return 4 * ((-(-int(vocab_size) // _CLUSTER_BLOCKS) + 3) & ~3)


def _cluster(B, vocab_size) -> int:
    """The dynamic shared memory of ``sample_next_cluster_f32`` where it samples these rows,
    else 0: at most ``_CLUSTER_ROWS`` rows (a batch of one, where a row's one block is the whole
    call: 8 blocks read and cut an eighth of the row each), a GPU with thread-block clusters
    (Hopper), ``_STAGE`` on and the part fitting a block's shared memory (``runtime._takes``;
    sample.cu not compiling is a no here too, but its one-block kernels then fail as well).
    Where it is 0 the one-block kernels choose the same tokens."""
    if B > _CLUSTER_ROWS or not _STAGE or vocab_size <= 0 or not _launcher_ex():
        return 0
    nbytes = _cluster_shared(vocab_size)
    return nbytes if _takes("sample", "sample_next_cluster_f32", nbytes) else 0


def _sample_kernel(vocab_size):
    """sample.cu's kernel for rows of ``vocab_size`` logits, and its dynamic shared memory:
    ``sample_next_smem_f32`` with the row staged in 4 bytes an id where this GPU lets a block
    take that much (GPT-2's 50,257: 201 KB, on Hopper), else ``sample_next_f32``. Both choose
    the same token."""
    nbytes = 4 * int(vocab_size)
    if _STAGE and nbytes > 0 and _set_max_shared("sample", "sample_next_smem_f32", nbytes):
        return "sample_next_smem_f32", nbytes
    return "sample_next_f32", 0


@_guarded
def sample_next(logits, vocab_size, ids, pos, knobs, keys, seen=None, out=None):
    """In place: ``ids[b]`` = row b's sampled token (sample.cu; ``forge_ml.sampling.sample_row``'s rule)
    for float32 logits (B, Vp), ``knobs`` (B, 5) float32, ``keys`` (B, 2) int32, ``seen``
    (B, Vp) int32 or None; also into ``out`` when given (-1 for a row whose logit at its
    argmax is not finite); ``seen[b, token] = 1``; then ``pos``
    (one element, or one per row) goes up by one."""
    if logits.dtype != F32 or logits.ndim != 2 or ids.size != logits.shape[0]:
        raise ShapeError(f"sample_next: float32 logits (B, Vp) and B ids expected, got "
                         f"{logits.dtype} {logits.shape} and {ids.size} ids")
    B, Vp = logits.shape
    if knobs.shape != (B, 5) or knobs.dtype != F32 or keys.shape != (B, 2):
        raise ShapeError(f"sample_next: knobs must be float32 (B, 5) and keys (B, 2), got "
                         f"{knobs.dtype} {knobs.shape} and {keys.shape}")
    if seen is not None and seen.shape != (B, Vp):
        raise ShapeError(f"sample_next: seen must be ({B}, {Vp}), got {seen.shape}")
    if out is None:
        out = ids
    elif out.size != B or out.dtype != ids.dtype or not out.flags.c_contiguous:
        raise ShapeError(f"sample_next: out must be {B} contiguous {ids.dtype} values, got "
                         f"{out.dtype} {out.shape}")
    pos = _pos_array(pos, B)
    args = (_c(logits), _i32(vocab_size), _i32(Vp), _c(knobs), _c(keys),
            ids if seen is None else seen, _i32(seen is not None), ids, out, pos, _i32(pos.size))
    writes = (ids, out, pos) + (() if seen is None else (seen,))
    shared = _cluster(B, vocab_size)
    if shared:
        _launch("sample", "sample_next_cluster_f32", (B * _CLUSTER_BLOCKS,), _CLUSTER_THREADS,
                args, shared=shared, pdl=True, writes=writes, cluster=(_CLUSTER_BLOCKS, 1, 1))
    else:
        name, shared = _sample_kernel(vocab_size)
        _launch("sample", name, (B,), _SAMPLE_THREADS, args, shared=shared, pdl=True,
                writes=writes)
    if pos.size == 1 and B > 1:   # every row reads the shared position: advanced after them all
        _launch("sample", "sample_advance_pos", (1,), 1, (pos,))


@_guarded
def _sample_weights(logits, vocab_size, knobs, seen=None):
    """For tests: the (B, vocab_size) uint32 weights ``w_j = uint32(expf((z_j - max z) / T) *
    2^24)`` that ``sample_next``'s cuts and draw read for float32 ``logits (B, Vp)`` (the
    penalty applied; 0 for a row that is not sampled), computed by sample.cu's own arithmetic,
    so that the host can check the integer part of the rule (top-k, top-p, min-p, the draw)
    exactly."""
    B, Vp = logits.shape
    w = cupy.empty((B, int(vocab_size)), dtype=cupy.uint32)
    _launch("sample", "sample_weights_f32", (B,), _SAMPLE_THREADS,
            (_c(logits), _i32(vocab_size), _i32(Vp), _c(knobs), w if seen is None else _c(seen),
             _i32(seen is not None), w))
    return w


_PENALIZE_THREADS = 256


@_guarded
def penalize_logits(logits, vocab_size, seen, penalties, bias=None):
    """In place: the first ``vocab_size`` of each row of float32 ``logits (B, Vp)`` get
    ``bias`` (float32 ``(B, Vp)`` or None) added, then ``frequency * (seen >> 1)`` and, where
    that count is above 0, ``presence`` taken away (``penalties`` float32 ``(B, 2)``: presence,
    frequency; ``seen`` int32 ``(B, Vp)``), each operation rounded on its own
    (``sample.cu``'s ``penalize_logits_f32``, ``forge_ml.sampling.adjusted``'s bits)."""
    if logits.dtype != F32 or logits.ndim != 2:
        raise ShapeError(f"penalize_logits: float32 logits (B, Vp) expected, got {logits.dtype} "
                         f"{logits.shape}")
    B, Vp = logits.shape
    if seen.shape != (B, Vp) or penalties.shape != (B, 2) or penalties.dtype != F32 or (
            bias is not None and (bias.shape != (B, Vp) or bias.dtype != F32)):
        raise ShapeError(f"penalize_logits: seen ({B}, {Vp}), float32 penalties ({B}, 2) and "
                         f"bias ({B}, {Vp}) or None expected, got {seen.shape}, "
                         f"{penalties.dtype} {penalties.shape} and "
                         f"{None if bias is None else (bias.dtype, bias.shape)}")
    if B == 0 or vocab_size <= 0:
        return
    grid = (-(-int(vocab_size) // _PENALIZE_THREADS), B)
    _launch("sample", "penalize_logits_f32", grid, _PENALIZE_THREADS,
            (logits, _i32(vocab_size), _i32(Vp), _c(seen), _c(penalties),
             logits if bias is None else _c(bias), _i32(bias is not None)),
            pdl=True, writes=(logits,))
