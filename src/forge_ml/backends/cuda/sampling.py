"""Sampling on the device: ``greedy_next``, the argmax of a decoding step's logits written
into the next step's ids (and a chain's token buffer), and the position advanced, so that
captured steps chain without the host. Kernels: greedy.cu.
"""
from __future__ import annotations

from ...errors import ShapeError
from .memory import _c, _pos_array
from .runtime import F32, _guarded, _i32, _launch


@_guarded
def greedy_next(logits, vocab_size, ids, pos, out=None):
    """In place: ``ids[b] = argmax(logits[b, :vocab_size])`` (numpy.argmax's ties and NaNs)
    for float32 logits (B, Vp), also written to ``out`` (B int32, e.g. a row of a chain's
    token buffer) when given, then ``pos += 1`` (every element: one shared position, or one
    per row) (greedy.cu)."""
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
