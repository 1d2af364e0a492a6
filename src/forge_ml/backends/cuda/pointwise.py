"""Per-element kernels: ``add`` and ``scale`` (elementwise.cu), ``gelu`` and ``gelu_bwd`` (gelu.cu: GPT-2's
tanh approximation), ``dropout`` (dropout.cu: forge_ml.rng's Philox mask, bit for bit) and
the fused optimizer step ``adamw_update`` (adamw.cu). Kernels: elementwise.cu (whose
``cast_*`` and ``bias_fill_*`` kernels memory.py and linear.py launch), gelu.cu, dropout.cu,
adamw.cu.
"""
from __future__ import annotations

import numpy as np

from ... import rng as _rng
from ...errors import DTypeError, ShapeError
from .memory import _c, _like, zeros
from .runtime import (BF16, F32, F64, _SFX, _THREADS, _acc, _acc_dtype, _empty, _float_sfx, _grid,
                      _guarded, _i32, _i64, _launch, cupy)


# ----------------------------------------------------------------------------------------------
# add, gelu, dropout
# ----------------------------------------------------------------------------------------------

@_guarded
def add(a, b):
    a, b = _c(a), _like(_c(b), a.dtype)
    if a.shape != b.shape:
        raise ShapeError(f"add: a is {a.shape} but b is {b.shape}; shapes must agree")
    out = _empty(a.shape, a.dtype)
    if a.size:
        _launch("elementwise", f"add_{_float_sfx(a)}", _grid(a.size), _THREADS,
                (a, b, out, _i64(a.size)))
    return out


@_guarded
def scale(x, s):
    """``s * x`` in x's dtype; ``s`` a float or a one-element array of the device, read there (a
    loss's cotangent inside a captured step: no wait for the host)."""
    x = _c(x)
    acc = _acc_dtype(x.dtype)
    if isinstance(s, cupy.ndarray):
        g = _like(_c(s.reshape(-1)[:1]), acc)
    else:
        g = cupy.full((1,), float(np.asarray(s).reshape(-1)[0]), dtype=acc)
    y = _empty(x.shape, x.dtype)
    if x.size:
        _launch("elementwise", f"scale_{_float_sfx(x)}", _grid(x.size), _THREADS,
                (x, g, y, _i64(x.size)))
    return y


@_guarded
def gelu(x):
    x = _c(x)
    y = _empty(x.shape, x.dtype)
    if x.size:
        _launch("gelu", f"gelu_fwd_{_float_sfx(x)}", _grid(x.size), _THREADS,
                (x, y, _i64(x.size)))
    return y


@_guarded
def gelu_bwd(x, dy):
    x, dy = _c(x), _like(_c(dy), x.dtype)
    dx = _empty(x.shape, x.dtype)
    if x.size:
        _launch("gelu", f"gelu_bwd_{_float_sfx(x)}", _grid(x.size), _THREADS,
                (x, dy, dx, _i64(x.size)))
    return dx


@_guarded
def dropout(x, p, seed):
    x = _c(x)
    p = float(p)
    if p >= 1.0:
        return zeros(x.shape, x.dtype.name)
    y = _empty(x.shape, x.dtype)
    n = x.size
    if n:
        k0, k1 = _rng.seed_key(seed)
        scale = _rng.dropout_scale(p)  # rounded once to float32, as on the CPU
        _launch("dropout", f"dropout_{_float_sfx(x)}", _grid((n + 3) // 4), _THREADS,
                (x, y, _i64(n), np.uint32(k0), np.uint32(k1), np.float32(p),
                 _acc(x.dtype, float(scale))))
    return y


@_guarded
def dropout_at(x, p, base, site):
    """``dropout`` with the seed ``rng.mix(base[0], site)`` read from device memory (``base``:
    one int64), so that a captured graph's replays draw the masks of the seed written last."""
    x = _c(x)
    p = float(p)
    if base.dtype != np.int64 or base.size != 1:
        raise ShapeError(f"dropout_at: base must be one int64, got {base.shape} {base.dtype}")
    if p >= 1.0:
        return zeros(x.shape, x.dtype.name)
    y = _empty(x.shape, x.dtype)
    n = x.size
    if n:
        scale = _rng.dropout_scale(p)
        _launch("dropout", f"dropout_at_{_float_sfx(x)}", _grid((n + 3) // 4), _THREADS,
                (x, y, _i64(n), base, np.uint64(site), np.float32(p), _acc(x.dtype, float(scale))))
    return y


# ----------------------------------------------------------------------------------------------
# AdamW
# ----------------------------------------------------------------------------------------------

def _adamw_arrays(p, g, m, v, p_lowp):
    """The checks both AdamW launchers make; returns g in the kernel's dtype."""
    for name, arr in (("p", p), ("m", m), ("v", v)):
        if not arr.flags.c_contiguous:
            raise ShapeError(f"adamw_update: {name} must be C-contiguous (updated in place)")
        if arr.dtype != p.dtype or arr.shape != p.shape:
            raise ShapeError(f"adamw_update: {name} is {arr.shape} {arr.dtype} but p is "
                             f"{p.shape} {p.dtype}")
    if p.dtype not in (F32, F64):
        raise DTypeError(f"adamw_update: master weights must be float32 (or float64), got {p.dtype}")
    g = _c(g)
    if g.size != p.size:
        raise ShapeError(f"adamw_update: g has {g.size} elements but p has {p.size}")
    if p.dtype == F64:
        g = _like(g, F64)
    elif g.dtype not in (F32, BF16):
        g = _like(g, F32)
    if p_lowp is not None and (p_lowp.dtype != BF16 or p_lowp.size != p.size
                               or not p_lowp.flags.c_contiguous):
        raise ShapeError(f"adamw_update: p_lowp must be a contiguous bfloat16 array of "
                         f"{p.size} elements, got {p_lowp.shape} {p_lowp.dtype}")
    return g


@_guarded
def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0,
                 p_lowp=None):
    g = _adamw_arrays(p, g, m, v, p_lowp)
    step = int(step)
    if step < 1:
        raise ValueError(f"adamw_update: step is 1-based, got {step}")
    has_lowp = p_lowp is not None
    if p.size == 0:
        return None
    bc1 = 1.0 - float(beta1) ** step
    bc2 = 1.0 - float(beta2) ** step
    s = (lambda x: np.float64(x)) if p.dtype == F64 else (lambda x: np.float32(x))
    _launch("adamw", f"adamw_update_{_SFX[p.dtype]}_{_SFX[g.dtype]}", _grid(p.size), _THREADS,
            (p, g, m, v, p_lowp if has_lowp else p, _i32(int(has_lowp)), _i64(p.size),
             s(lr), s(beta1), s(beta2), s(eps), s(weight_decay), s(bc1), s(bc2),
             s(grad_scale)))
    return None


@_guarded
def adamw_update_at(p, g, m, v, beta1, beta2, eps, weight_decay, scalars, p_lowp=None):
    """``adamw_update`` with lr, the bias corrections and grad_scale read from ``scalars``
    (float64, ``ops.STEP_SCALARS``' layout) in device memory; skipped when its grad_scale is
    not finite."""
    g = _adamw_arrays(p, g, m, v, p_lowp)
    if scalars.dtype != F64 or scalars.size < 6 or not scalars.flags.c_contiguous:
        raise ShapeError(f"adamw_update_at: scalars must be 6 contiguous float64, got "
                         f"{scalars.shape} {scalars.dtype}")
    if p.size == 0:
        return None
    has_lowp = p_lowp is not None
    s = (lambda x: np.float64(x)) if p.dtype == F64 else (lambda x: np.float32(x))
    _launch("adamw", f"adamw_update_at_{_SFX[p.dtype]}_{_SFX[g.dtype]}", _grid(p.size), _THREADS,
            (p, g, m, v, p_lowp if has_lowp else p, _i32(int(has_lowp)), _i64(p.size), scalars,
             s(beta1), s(beta2), s(eps), s(weight_decay)))
    return None


@_guarded
def clip_scale(sumsq, check, scalars, max_norm, grad_scale):
    """``ops.clip_scale`` in one thread: the norm and the clip factor into ``scalars``."""
    if sumsq.dtype not in (F32, F64) or sumsq.size != 1:
        raise DTypeError(f"clip_scale: sumsq must be one float32 or float64, got {sumsq.shape} {sumsq.dtype}")
    if check is not None and (check.dtype != sumsq.dtype or check.size != 1):
        raise DTypeError(f"clip_scale: check must be one {sumsq.dtype}, got {check.shape} {check.dtype}")
    if scalars.dtype != F64 or scalars.size < 6 or not scalars.flags.c_contiguous:
        raise ShapeError(f"clip_scale: scalars must be 6 contiguous float64, got {scalars.shape} {scalars.dtype}")
    _launch("adamw", f"clip_scale_{_SFX[sumsq.dtype]}", (1,), (1,),
            (_c(sumsq), _c(sumsq) if check is None else _c(check), _i32(int(check is not None)),
             scalars, np.float64(max_norm), np.float64(grad_scale)))
