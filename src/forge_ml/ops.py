"""The op set: one public function per op. Each checks shapes, dtypes and devices, says
what it expected and what it got, then dispatches to the backend of its inputs' device.

Each op's docstring is its contract, and its float64 formula in ``tests/reference.py`` the
specification every kernel is tested against. The backend functions the ops call are named
in ``forge_ml.backends.contract`` (``CORE``: every backend has its own; ``FUSED``: a default
in ``backends/compose.py`` where a backend has none); which file of each backend holds the
kernel is ``docs/architecture.md``'s account. Shapes: ``T`` tokens, ``C`` channels, ``H``
heads, ``hs = C / H``, optional leading batch dims.

>>> import numpy as np, forge_ml as fm
>>> a = fm.tensor(np.ones((2, 3), np.float32)); b = fm.tensor(np.ones((3, 4), np.float32))
>>> fm.ops.matmul(a, b).numpy()[0].tolist()
[3.0, 3.0, 3.0, 3.0]
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Tuple

import numpy as np

from . import dtype as _dt
from . import rng as _rng
from .backends import compose as _compose
from .errors import ConfigError, DeviceError, DTypeError, ShapeError
from .tensor import Tensor, _check_fits, _numbers_array, backend_of

# -- boundary checks -------------------------------------------------------------------


def _as_int(x):
    """A NumPy integer (shape arithmetic, np.argmax) as the int it is; anything else as it came,
    so that the caller's ``type(x) is int`` refuses a bool, a float and a string by their value."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    return x


def _whole(op, name, v) -> int:
    """``v`` as an int (a NumPy integer too), else a ShapeError that names its type: a position
    of 1.0 or a head count of "2" was refused as not fitting, by a value that fits."""
    v = _as_int(v)
    if type(v) is not int:
        raise ShapeError(f"{op}: {name} must be an int, got {type(v).__name__} {v!r}")
    return v


def _num(op, name, v) -> float:
    """``v`` as a float: a real number (a NumPy one too), not a bool or a string."""
    if type(v) is float:        # the usual case, on every optimizer step: no isinstance walk
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ConfigError(f"{op}: {name} must be a number, got {v!r:.40}")
    return float(v)


def _nums(op, name, vs) -> list:
    """``_num`` of each of ``vs``, the name ``name[i]`` formatted only for a bad one."""
    out = [v if type(v) is float else None for v in vs]
    for i, v in enumerate(out):
        if v is None:
            out[i] = _num(op, f"{name}[{i}]", vs[i])
    return out


def _tensor(op, name, x):
    if not isinstance(x, Tensor):
        raise DTypeError(f"{op}: {name} must be a forge_ml Tensor, got {type(x).__name__}")
    return x


def _float(op, name, x):
    if type(x) is not Tensor:
        _tensor(op, name, x)
    if not x._dtype.is_float:
        raise DTypeError(f"{op}: {name} must be a float tensor, got {x.dtype.name}")
    return x


def _int(op, name, x):
    _tensor(op, name, x)
    if x.dtype not in _dt.INTS:
        raise DTypeError(f"{op}: {name} must hold int32 or int64 token ids, got {x.dtype.name}")
    return x


def _same(op, **named):
    """All tensors on one device and (floats) of one dtype; returns the backend."""
    t0 = None
    for k, t in named.items():
        if t is None:
            continue
        if t0 is None:
            k0, t0 = k, t
            continue
        if t._device is not t0._device and t._device != t0._device:
            raise DeviceError(f"{op}: {k0} is on {t0.device} but {k} is on {t.device}; "
                              "move them to one device with .to()")
        if (t._dtype is not t0._dtype and t._dtype.is_float and t0._dtype.is_float
                and t._dtype != t0._dtype):
            raise DTypeError(f"{op}: {k0} is {t0.dtype.name} but {k} is {t.dtype.name}; "
                             "dtypes must agree")
    return backend_of(t0._device)


def _rank(op, name, x, lo, hi=None):
    if x.ndim < lo or (hi is not None and x.ndim > hi):
        want = f"rank {lo}" if hi == lo else (f"rank >= {lo}" if hi is None else f"rank {lo}..{hi}")
        raise ShapeError(f"{op}: {name} must have {want}, got shape {x.shape}")


def _shape_eq(op, na, a, nb, b):
    if a.shape != b.shape:
        raise ShapeError(f"{op}: {na} is {a.shape} but {nb} is {b.shape}; shapes must be equal")


def _one_value(op, name, t, device):
    """``t`` holds one value and lives on ``device`` (a scalar read where it is): a ShapeError
    for another number of values, else a DeviceError for another device."""
    if t.numel != 1 or t.device != device:
        kind = ShapeError if t.numel != 1 else DeviceError
        raise kind(f"{op}: {name} must be one value on {device}, got {t.shape} on {t.device}")


def _flag(op, name, v) -> bool:
    """A switch: a bool (a NumPy one too), not a string or a number (``trans_a="no"`` was a
    transpose: any non-empty string is true).

    >>> _flag("matmul", "trans_a", np.True_)
    True
    """
    if not isinstance(v, (bool, np.bool_)):
        raise ConfigError(f"{op}: {name} must be True or False, got {type(v).__name__} "
                          f"{v!r:.40}")
    return bool(v)


def _scalar(op, name, s, device):
    """A scale factor: a one-element Tensor on ``device`` (returned as it is, read there), or a
    number (a NumPy one too) as a float; a string, None or other object is a DTypeError."""
    if isinstance(s, Tensor):
        _one_value(op, name, s, device)
        return s
    if isinstance(s, (str, bytes, bool, np.bool_)) or not hasattr(s, "__float__"):
        raise DTypeError(f"{op}: {name} must be a number or a one-element Tensor, got "
                         f"{type(s).__name__} {s!r:.40}")
    return float(s)


def _wrap(x, arr):
    return Tensor(arr, x.device)


def _empty(x, shape, dtype=None) -> Tensor:
    """A tensor of ``shape`` (one with no elements) on x's device, x's dtype unless given: the
    result of an op over an empty axis, which the kernels' reductions are never asked for."""
    return Tensor(backend_of(x.device).zeros(tuple(shape), dtype or x.dtype.name), x.device)


def _stats_dtype(x) -> str:
    """The dtype of a row statistic (``lse``) of x: float64 for float64, else float32."""
    return "float64" if x.dtype == _dt.float64 else "float32"


def _lse_check(op, lse, q, qname, shape):
    """The ``lse`` an attention backward is given: a Tensor on ``q``'s device, of the dtype the
    forward wrote (``_stats_dtype(q)``), of ``shape``."""
    _tensor(op, "lse", lse)
    if lse.device != q.device:
        raise DeviceError(f"{op}: {qname} is on {q.device} but lse is on {lse.device}; "
                          "move them to one device with .to()")
    if lse.dtype.name != _stats_dtype(q):
        raise DTypeError(f"{op}: lse must be {_stats_dtype(q)} (the forward's, for {qname} "
                         f"{q.dtype.name}), got {lse.dtype.name}")
    if lse.shape != shape:
        raise ShapeError(f"{op}: lse must be {shape}, got {lse.shape}")


def _qkv_empty(qkv, n_head):
    """An attention over fused qkv rows of no tokens (or no rows): empty ``y`` and ``lse``."""
    B, T, c3 = qkv.shape
    return _empty(qkv, (B, T, c3 // 3)), _empty(qkv, (B, n_head, T), _stats_dtype(qkv))


def _ln_eps(op, eps) -> float:
    """A layernorm's ``eps`` as a float: a number >= 0 (a negative one makes var + eps
    negative: NaN, silently)."""
    v = _num(op, "eps", eps)
    if not v >= 0.0:
        raise ConfigError(f"{op}: eps must be >= 0, got {eps}")
    return v


# -- matmul ------------------------------------------------------------------------------


def matmul(a, b, bias=None, *, trans_a=False, trans_b=False, alpha=1.0, b_rows=None) -> Tensor:
    """``alpha * op(a) @ op(b) + bias``: 2-D x 2-D, or batched (both rank >= 3, equal leading
    dims). ``b_rows`` uses only the first ``b_rows`` rows of ``b`` as stored (a KV cache).

    >>> import numpy as np, forge_ml as fm
    >>> x = fm.tensor(np.eye(2, dtype=np.float32))
    >>> fm.ops.matmul(x, x, alpha=2.0).numpy().tolist()
    [[2.0, 0.0], [0.0, 2.0]]
    """
    _float("matmul", "a", a), _float("matmul", "b", b)
    trans_a, trans_b = _flag("matmul", "trans_a", trans_a), _flag("matmul", "trans_b", trans_b)
    if bias is not None:
        _float("matmul", "bias", bias)
    bk = _same("matmul", a=a, b=b, bias=bias)
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError(f"matmul: operands must be at least 2-D, got a {a.shape} and b {b.shape}")
    if not (a.ndim == b.ndim == 2 or (a.ndim == b.ndim and a.shape[:-2] == b.shape[:-2])):
        raise ShapeError(f"matmul: a is {a.shape} but b is {b.shape}; expected 2-D x 2-D or "
                         "equal-rank batched operands with equal leading dims")
    rows_b = b.shape[-2]
    if b_rows is not None:
        b_rows = _as_int(b_rows)
        if not (type(b_rows) is int and 0 < b_rows <= rows_b):
            raise ShapeError(f"matmul: b_rows must be in 1..{rows_b} (b is {b.shape}), got {b_rows}")
        rows_b = b_rows
    m, k = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], rows_b) if trans_b else (rows_b, b.shape[-1])
    if k != kb:
        eff_b = b.shape[:-2] + ((rows_b, b.shape[-1]) if not trans_b else (b.shape[-1], rows_b))
        raise ShapeError(f"matmul: op(a) is {a.shape[:-2] + (m, k)} but op(b) is {eff_b}; "
                         f"inner dims must agree (a {a.shape}, b {b.shape}, "
                         f"trans_a={trans_a}, trans_b={trans_b})")
    if bias is not None and bias.shape != (n,):
        raise ShapeError(f"matmul: bias must be ({n},) for an output of {n} columns, got {bias.shape}")
    out = bk.matmul(a.data, b.data, None if bias is None else bias.data,
                    bool(trans_a), bool(trans_b), _num("matmul", "alpha", alpha), b_rows)
    return _wrap(a, out)


# -- elementwise and reductions --------------------------------------------------------


def _layer_check(op, x, w, bias) -> int:
    """A linear layer's operands: ``x (M, K)``, ``w (K, N)``, ``bias`` None or ``(N,)``;
    returns N."""
    _rank(op, "x", x, 2, 2), _rank(op, "w", w, 2, 2)
    if x.shape[1] != w.shape[0]:
        raise ShapeError(f"{op}: x is {x.shape} but w is {w.shape}; inner dims must agree")
    n = w.shape[1]
    if bias is not None and bias.shape != (n,):
        raise ShapeError(f"{op}: bias must be ({n},), got {bias.shape}")
    return n


def linear(x, w, bias=None, *, act=None, residual=None, ln=None, eps=1e-5) -> Tensor:
    """``act(LN(x) @ w + bias) + residual``: a linear layer with its prologue and epilogue,
    for inference.

    ``x (M, K)``, ``w (K, N)``, ``bias (N,)``, ``residual (M, N)``, ``act`` None or "gelu",
    ``ln`` None or ``(gamma, beta)`` of a layernorm over x's rows (with ``eps``). It equals
    ``add(residual, gelu(matmul(layernorm(x, gamma, beta, eps), w, bias)))`` up to rounding:
    on the GPU, for a few rows (a decoding step), one kernel reads ``w`` once, normalises x as
    it reads it and applies the epilogue before rounding once. No backward (the tape composes
    the ops it is made of).

    >>> import numpy as np, forge_ml as fm
    >>> x = fm.tensor(np.ones((1, 2), np.float32)); w = fm.tensor(np.ones((2, 3), np.float32))
    >>> fm.ops.linear(x, w, residual=fm.tensor(np.full((1, 3), 10, np.float32))).numpy().tolist()
    [[12.0, 12.0, 12.0]]
    """
    op = "linear"
    _float(op, "x", x), _float(op, "w", w)
    if bias is not None:
        _float(op, "bias", bias)
    if residual is not None:
        _float(op, "residual", residual)
    if ln is not None and not (isinstance(ln, (tuple, list)) and len(ln) == 2):
        got = (f"a {type(ln).__name__} of {len(ln)}" if isinstance(ln, (tuple, list))
               else type(ln).__name__)
        raise ShapeError(f"{op}: ln must be None or (gamma, beta), got {got}")
    gamma, beta = (None, None) if ln is None else ln
    if ln is not None:
        _ln_check(op, x, gamma, beta, has_beta=True)
        if x.ndim and x.shape[-1] == 0:
            raise ShapeError(f"{op}: a layernorm over x {x.shape}'s 0 channels has no mean: expected "
                             f"at least one channel with ln")
    bk = _same(op, x=x, w=w, bias=bias, residual=residual, gamma=gamma, beta=beta)
    n = _layer_check(op, x, w, bias)
    if residual is not None and residual.shape != (x.shape[0], n):
        raise ShapeError(f"{op}: residual must be {(x.shape[0], n)}, got {residual.shape}")
    if act not in (None, "gelu"):
        raise ShapeError(f"{op}: act must be None or 'gelu', got {act!r}")
    return _wrap(x, bk.linear(x.data, w.data, None if bias is None else bias.data, act,
                              None if residual is None else residual.data,
                              None if ln is None else (gamma.data, beta.data, _ln_eps(op, eps))))


def matmul_gelu(x, w, bias) -> Tuple[Tensor, Tensor]:
    """A linear layer and GPT-2's GELU, for training: ``(y, pre)`` with ``pre = x @ w + bias``
    and ``y = gelu(pre)``; ``pre`` is what ``gelu_bwd`` needs in the backward. On the GPU one
    cuBLASLt product writes both (``GELU_AUX_BIAS``); elsewhere ``matmul`` then ``gelu``.

    >>> import numpy as np, forge_ml as fm
    >>> x = fm.tensor(np.ones((1, 2), np.float32)); w = fm.tensor(np.ones((2, 1), np.float32))
    >>> y, pre = fm.ops.matmul_gelu(x, w, fm.tensor(np.zeros(1, np.float32)))
    >>> pre.numpy().tolist(), round(float(y.numpy()[0, 0]), 4)
    ([[2.0]], 1.9546)
    """
    op = "matmul_gelu"
    _float(op, "x", x), _float(op, "w", w), _float(op, "bias", bias)
    bk = _same(op, x=x, w=w, bias=bias)
    _layer_check(op, x, w, bias)
    y, pre = bk.matmul_gelu(x.data, w.data, bias.data)
    return _wrap(x, y), _wrap(x, pre)


def matmul_dgelu(dy, w, pre) -> Tuple[Tensor, Tensor]:
    """The backward of GELU through the product after it, for training: ``(dpre, db)`` with
    ``dpre = gelu_bwd(pre, dy @ w^T)`` (the gradient at GELU's input ``pre`` of
    ``gelu(pre) @ w``) and ``db = sum_rows(dpre)`` (the bias gradient of the layer that made
    ``pre``), for ``dy (M, N)``, ``w (K, N)``, ``pre (M, K)``. On the GPU one cuBLASLt
    product that applies GELU's derivative as it writes (its DGELU epilogue), then the row
    sums; elsewhere ``matmul``, ``gelu_bwd`` and ``sum_rows``.

    >>> import numpy as np, forge_ml as fm
    >>> dy = fm.tensor(np.ones((2, 1), np.float32)); w = fm.tensor(np.ones((1, 1), np.float32))
    >>> dpre, db = fm.ops.matmul_dgelu(dy, w, fm.tensor(np.zeros((2, 1), np.float32)))
    >>> dpre.numpy().tolist(), db.numpy().tolist()
    ([[0.5], [0.5]], [1.0])
    """
    op = "matmul_dgelu"
    _float(op, "dy", dy), _float(op, "w", w), _float(op, "pre", pre)
    bk = _same(op, dy=dy, w=w, pre=pre)
    _rank(op, "dy", dy, 2, 2), _rank(op, "w", w, 2, 2), _rank(op, "pre", pre, 2, 2)
    if dy.shape[1] != w.shape[1] or pre.shape != (dy.shape[0], w.shape[0]):
        raise ShapeError(f"{op}: dy {dy.shape}, w {w.shape} and pre {pre.shape} do not fit: "
                         f"expected w (K, {dy.shape[1]}) and pre ({dy.shape[0]}, K)")
    dpre, db = bk.matmul_dgelu(dy.data, w.data, pre.data)
    return _wrap(dy, dpre), _wrap(dy, db)


def weight_grads(x, dy, alpha=1.0, dy_sums=None) -> Tuple[Tensor, Tensor]:
    """A linear layer's weight and bias gradients: ``(alpha x^T dy, sum_rows(dy))`` for
    ``x (M, K)`` and ``dy (M, N)``. On the GPU one cuBLASLt product also sums dy's rows
    (``BGRADA``: dy is read once); elsewhere ``matmul`` and ``sum_rows``. ``dy_sums``:
    ``sum_rows(dy)`` already made by the kernel that wrote dy (``layernorm_bwd(...,
    sums=True)``); then only the product runs, and dy_sums is the bias gradient.

    >>> import numpy as np, forge_ml as fm
    >>> x = fm.tensor(np.ones((3, 2), np.float32)); dy = fm.tensor(np.ones((3, 1), np.float32))
    >>> dw, db = fm.ops.weight_grads(x, dy)
    >>> dw.numpy().tolist(), db.numpy().tolist()
    ([[3.0], [3.0]], [3.0])
    """
    op = "weight_grads"
    _float(op, "x", x), _float(op, "dy", dy)
    bk = _same(op, x=x, dy=dy)
    _rank(op, "x", x, 2, 2), _rank(op, "dy", dy, 2, 2)
    if x.shape[0] != dy.shape[0]:
        raise ShapeError(f"{op}: x is {x.shape} but dy is {dy.shape}; their rows must agree")
    if dy_sums is not None:
        _same(op, x=x, dy_sums=dy_sums)
        if dy_sums.shape != (dy.shape[1],) or dy_sums.dtype != dy.dtype:
            raise ShapeError(f"{op}: dy_sums must be dy's row sums, {dy.dtype.name} "
                             f"{(dy.shape[1],)}; got {dy_sums.dtype.name} {dy_sums.shape}")
        return matmul(x, dy, trans_a=True, alpha=alpha), dy_sums
    dw, db = bk.weight_grads(x.data, dy.data, _num("weight_grads", "alpha", alpha))
    return _wrap(x, dw), _wrap(x, db)


def add(a, b) -> Tensor:
    """Elementwise ``a + b`` of two tensors of one shape (no broadcasting).

    >>> import forge_ml as fm
    >>> add(fm.tensor([1.0, 2.0]), fm.tensor([10.0, 20.0])).numpy().tolist()
    [11.0, 22.0]
    """
    _float("add", "a", a), _float("add", "b", b)
    bk = _same("add", a=a, b=b)
    _shape_eq("add", "a", a, "b", b)
    return _wrap(a, bk.add(a.data, b.data))


def sum_rows(x) -> Tensor:
    """Sum over every axis but the last: ``(…, C) -> (C,)`` (the bias gradient).

    >>> import forge_ml as fm
    >>> sum_rows(fm.tensor([[1.0, 2.0], [3.0, 4.0]])).numpy().tolist()
    [4.0, 6.0]
    """
    _float("sum_rows", "x", x)
    _rank("sum_rows", "x", x, 1)
    if x.numel == 0:
        return _empty(x, x.shape[-1:])
    return _wrap(x, backend_of(x.device).sum_rows(x.data))


def sumsq(x) -> Tensor:
    """Sum of squares of every element, a 0-d float32 tensor (float64 for float64 input).

    >>> import forge_ml as fm
    >>> sumsq(fm.tensor([[3.0], [4.0]])).item()
    25.0
    """
    _float("sumsq", "x", x)
    return _wrap(x, backend_of(x.device).sumsq(x.data))


def sumsq_total(xs) -> Tensor:
    """The sum of squares of every element of every tensor in ``xs`` (a model's gradients:
    clipping's global sum), a 0-d tensor on their device: float32 (float64 when any is
    float64). One backend call where the backend has ``sumsq_total`` (the GPU's two launches
    over a table of the tensors, the chunks' sums added in double), else ``sumsq`` each, added
    with ``add`` in order (``backends.compose.sumsq_total``).

    >>> import numpy as np, forge_ml as fm
    >>> sumsq_total([fm.tensor(np.array([3.0], np.float32)), fm.tensor(np.array([4.0], np.float32))]).item()
    25.0
    """
    if isinstance(xs, Tensor):
        raise ShapeError("sumsq_total: expected a list of tensors, got one Tensor (give [x], or use sumsq)")
    xs = list(xs)
    if not xs:
        raise ShapeError("sumsq_total: expected at least one tensor, got none")
    for i, x in enumerate(xs):
        _float("sumsq_total", f"xs[{i}]", x)
        if x.device != xs[0].device:
            raise DeviceError(f"sumsq_total: xs[0] is on {xs[0].device} but xs[{i}] is on "
                              f"{x.device}; move them to one device with .to()")
    bk = backend_of(xs[0].device)
    many = getattr(bk, "sumsq_total", None)
    arrays = [x.data for x in xs]
    return _wrap(xs[0], many(arrays) if many is not None else _compose.sumsq_total(bk, arrays))


def gelu(x) -> Tensor:
    """GPT-2's GELU, tanh approximation: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.

    >>> import forge_ml as fm
    >>> [round(v, 4) for v in gelu(fm.tensor([-1.0, 0.0, 1.0])).numpy().tolist()]
    [-0.1588, 0.0, 0.8412]
    """
    _float("gelu", "x", x)
    return _wrap(x, backend_of(x.device).gelu(x.data))


def gelu_bwd(x, dy) -> Tensor:
    """``dL/dx`` of ``gelu`` given ``x`` and ``dL/dy``.

    >>> import forge_ml as fm
    >>> gelu_bwd(fm.tensor([0.0]), fm.tensor([2.0])).numpy().tolist()   # gelu'(0) = 1/2
    [1.0]
    """
    _float("gelu_bwd", "x", x), _float("gelu_bwd", "dy", dy)
    bk = _same("gelu_bwd", x=x, dy=dy)
    _shape_eq("gelu_bwd", "x", x, "dy", dy)
    return _wrap(x, bk.gelu_bwd(x.data, dy.data))


# -- layernorm -------------------------------------------------------------------------


def _ln_check(op, x, gamma, beta=None, has_beta: bool = False):
    """x, gamma and (``has_beta``: it is the op's operand, not left out) beta checked."""
    _float(op, "x", x), _float(op, "gamma", gamma)
    if beta is not None or has_beta:
        _float(op, "beta", beta)
    _rank(op, "x", x, 1)
    c = x.shape[-1]
    for name, p in (("gamma", gamma), ("beta", beta)):
        if p is not None and p.shape != (c,):
            raise ShapeError(f"{op}: {name} must be ({c},) to match x {x.shape}, got {p.shape}")


def layernorm(x, gamma, beta, eps=1e-5) -> Tensor:
    """Layer norm over the last axis (biased variance): ``(x - mean) / sqrt(var + eps) * gamma + beta``.

    >>> import numpy as np, forge_ml as fm
    >>> y = layernorm(fm.tensor([[1.0, 3.0]]), fm.tensor([1.0, 1.0]), fm.tensor([0.0, 0.5]), eps=0.0)
    >>> y.numpy().tolist()
    [[-1.0, 1.5]]
    """
    _ln_check("layernorm", x, gamma, beta, has_beta=True)
    bk = _same("layernorm", x=x, gamma=gamma, beta=beta)
    if x.numel == 0:
        return _empty(x, x.shape)
    return _wrap(x, bk.layernorm(x.data, gamma.data, beta.data, _ln_eps("layernorm", eps)))


def layernorm_bwd(x, gamma, dy, eps=1e-5, add=None, sums=False):
    """Gradients of ``layernorm``: ``(dx, dgamma, dbeta)``. With ``add`` (x's shape), dx comes
    back as ``add + dx``: the gradient x already has from its other uses (the residual
    stream's, in GPT-2), added in the backward's own last pass rather than by an ``add``
    after it (the fused op ``layernorm_bwd_add``). With ``sums``, a fourth value:
    ``sum_rows(dx)`` (of the dx returned), summed as dx is written on the GPU (the fused op
    ``layernorm_bwd_sums``): the bias gradient of the linear layer whose output x is, when dx
    is x's whole gradient (the tape hands it to that layer's ``weight_grads``).

    >>> import numpy as np, forge_ml as fm
    >>> x = fm.tensor(np.array([[1.0, 2.0, 4.0]], np.float32)); g = fm.tensor(np.ones(3, np.float32))
    >>> dy = fm.tensor(np.array([[1.0, 0.0, 0.0]], np.float32))
    >>> dx, dgamma, _ = fm.ops.layernorm_bwd(x, g, dy)
    >>> dxa, _, _ = fm.ops.layernorm_bwd(x, g, dy, add=fm.tensor(np.ones((1, 3), np.float32)))
    >>> np.allclose(dxa.numpy(), dx.numpy() + 1.0), dgamma.shape
    (True, (3,))
    >>> fm.ops.layernorm_bwd(x, g, dy, add=fm.tensor(np.ones((1, 3), np.float32)), sums=True)[3].shape
    (3,)
    """
    _ln_check("layernorm_bwd", x, gamma)
    _float("layernorm_bwd", "dy", dy)
    sums = _flag("layernorm_bwd", "sums", sums)
    bk = _same("layernorm_bwd", x=x, gamma=gamma, dy=dy, add=add)
    _shape_eq("layernorm_bwd", "x", x, "dy", dy)
    if add is not None:
        _float("layernorm_bwd", "add", add)
        _shape_eq("layernorm_bwd", "x", x, "add", add)
    if x.numel == 0:
        c = x.shape[-1:]
        return (_empty(x, x.shape), _empty(x, c), _empty(x, c)) + ((_empty(x, c),) if sums else ())
    eps = _ln_eps("layernorm_bwd", eps)    # as the forward's: a negative eps gave NaN, silently
    if sums:
        dx, dg, db, ds = bk.layernorm_bwd_sums(x.data, gamma.data, dy.data, eps,
                                               None if add is None else add.data)
        return _wrap(x, dx), _wrap(x, dg), _wrap(x, db), _wrap(x, ds)
    if add is None:
        dx, dg, db = bk.layernorm_bwd(x.data, gamma.data, dy.data, eps)
    else:
        dx, dg, db = bk.layernorm_bwd_add(x.data, gamma.data, dy.data, eps, add.data)
    return _wrap(x, dx), _wrap(x, dg), _wrap(x, db)


# -- softmax ---------------------------------------------------------------------------


def softmax(x, causal=False, off=0) -> Tensor:
    """Softmax over the last axis. With ``causal``, column ``j`` of row ``i`` (``i`` along the
    second-to-last axis) is masked when ``j > i + off``; masked outputs are exact zeros.

    >>> import numpy as np, forge_ml as fm
    >>> fm.ops.softmax(fm.tensor(np.zeros((2, 2), np.float32)), causal=True).numpy().tolist()
    [[1.0, 0.0], [0.5, 0.5]]
    """
    _float("softmax", "x", x)
    causal = _flag("softmax", "causal", causal)
    _rank("softmax", "x", x, 2 if causal else 1)
    off = _as_int(off)
    if type(off) is not int or off < 0:
        raise ShapeError(f"softmax: off must be a non-negative int, got {off!r}")
    if causal and x.shape[-2] + off > x.shape[-1] and x.shape[-1] < 1:
        raise ShapeError(f"softmax: causal rows need at least one column, got {x.shape}")
    if x.numel == 0:
        return _empty(x, x.shape)
    return _wrap(x, backend_of(x.device).softmax(x.data, bool(causal), int(off)))


def softmax_bwd(y, dy) -> Tensor:
    """``dL/dx`` of ``softmax`` from its output ``y``: ``y * (dy - sum(y * dy))``.

    >>> import forge_ml as fm
    >>> softmax_bwd(fm.tensor([[0.5, 0.5]]), fm.tensor([[1.0, 0.0]])).numpy().tolist()
    [[0.25, -0.25]]
    """
    _float("softmax_bwd", "y", y), _float("softmax_bwd", "dy", dy)
    bk = _same("softmax_bwd", y=y, dy=dy)
    _rank("softmax_bwd", "y", y, 1)
    _shape_eq("softmax_bwd", "y", y, "dy", dy)
    return _wrap(y, bk.softmax_bwd(y.data, dy.data))


# -- heads -----------------------------------------------------------------------------


def split_heads(qkv, n_head):
    """``(…, T, 3C) -> q, k, v`` each ``(…, H, T, hs)``.

    >>> import numpy as np, forge_ml as fm
    >>> q, k, v = split_heads(fm.tensor(np.arange(12, dtype=np.float32).reshape(1, 12)), 2)
    >>> q.shape, q.numpy()[:, 0].tolist(), v.numpy()[1, 0].tolist()
    ((2, 1, 2), [[0.0, 1.0], [2.0, 3.0]], [10.0, 11.0])
    """
    _float("split_heads", "qkv", qkv)
    _rank("split_heads", "qkv", qkv, 2)
    n_head = _as_int(n_head)
    if type(n_head) is not int or n_head <= 0:
        raise ShapeError(f"split_heads: n_head must be a positive int, got {n_head!r}")
    c3 = qkv.shape[-1]
    if c3 % (3 * n_head):
        raise ShapeError(f"split_heads: last dim {c3} of qkv {qkv.shape} must be 3 * C with C "
                         f"divisible by n_head={n_head}")
    q, k, v = backend_of(qkv.device).split_heads(qkv.data, n_head)
    return _wrap(qkv, q), _wrap(qkv, k), _wrap(qkv, v)


def unsplit_head(dy, which) -> Tensor:
    """Gradient of one ``split_heads`` output: ``(…, H, T, hs) -> (…, T, 3C)``, zeros outside
    the ``which`` (0 = q, 1 = k, 2 = v) third.

    >>> import numpy as np, forge_ml as fm
    >>> unsplit_head(fm.tensor(np.ones((1, 1, 2), np.float32)), 1).numpy().tolist()
    [[0.0, 0.0, 1.0, 1.0, 0.0, 0.0]]
    """
    _float("unsplit_head", "dy", dy)
    _rank("unsplit_head", "dy", dy, 3)
    which = _as_int(which)
    if type(which) is not int or which not in (0, 1, 2):   # True == 1: a bool is no index
        raise ShapeError(f"unsplit_head: which must be 0, 1 or 2, got {which!r}")
    return _wrap(dy, backend_of(dy.device).unsplit_head(dy.data, which))


def merge_heads(x) -> Tensor:
    """``(…, H, T, hs) -> (…, T, H * hs)``.

    >>> import numpy as np, forge_ml as fm
    >>> merge_heads(fm.tensor(np.arange(4, dtype=np.float32).reshape(2, 1, 2))).numpy().tolist()
    [[0.0, 1.0, 2.0, 3.0]]
    """
    _float("merge_heads", "x", x)
    _rank("merge_heads", "x", x, 3)
    return _wrap(x, backend_of(x.device).merge_heads(x.data))


def unmerge_heads(dy, h) -> Tensor:
    """``(…, T, C) -> (…, H, T, C / H)``: the gradient of ``merge_heads``.

    >>> import numpy as np, forge_ml as fm
    >>> unmerge_heads(fm.tensor(np.arange(4, dtype=np.float32).reshape(1, 4)), 2).numpy().tolist()
    [[[0.0, 1.0]], [[2.0, 3.0]]]
    """
    _float("unmerge_heads", "dy", dy)
    _rank("unmerge_heads", "dy", dy, 2)
    h = _as_int(h)
    if type(h) is not int or h <= 0 or dy.shape[-1] % h:
        raise ShapeError(f"unmerge_heads: C={dy.shape[-1]} of {dy.shape} must be divisible by h={h!r}")
    return _wrap(dy, backend_of(dy.device).unmerge_heads(dy.data, h))


# -- fused causal attention --------------------------------------------------------------


def _attn_check(op, q, k, v):
    for n, t in (("q", q), ("k", k), ("v", v)):
        _float(op, n, t)
        _rank(op, n, t, 3)
    _shape_eq(op, "q", q, "k", k)
    _shape_eq(op, "q", q, "v", v)
    if q.shape[-1] == 0:
        raise ShapeError(f"{op}: q, k, v {q.shape} have a head size of 0; expected at least 1")


def attention(q, k, v, scale=None):
    """Causal self-attention ``softmax(mask(q k^T * scale)) v`` over ``(…, H, T, hs)``.

    Returns ``(out, lse)``: ``lse`` ``(…, H, T)`` float32 (float64 for float64 inputs) is the
    log-sum-exp of each query
    row's scaled, masked scores, which ``attention_bwd`` uses to rebuild the probabilities.
    ``scale`` defaults to ``1 / sqrt(hs)``.

    >>> import numpy as np, forge_ml as fm
    >>> v = fm.tensor(np.array([[[1.0], [3.0]]], np.float32))       # (H=1, T=2, hs=1)
    >>> out, lse = attention(fm.zeros((1, 2, 1)), fm.zeros((1, 2, 1)), v)
    >>> out.numpy().ravel().tolist(), [round(x, 4) for x in lse.numpy().ravel().tolist()]
    ([1.0, 2.0], [0.0, 0.6931])
    """
    _attn_check("attention", q, k, v)
    bk = _same("attention", q=q, k=k, v=v)
    if q.numel == 0:
        return _empty(q, q.shape), _empty(q, q.shape[:-1], _stats_dtype(q))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else _num("attention", "scale", scale)
    out, lse = bk.attention(q.data, k.data, v.data, scale)
    return _wrap(q, out), _wrap(q, lse)


def attention_bwd(q, k, v, out, lse, dout, scale=None):
    """Gradients ``(dq, dk, dv)`` of ``attention`` given its output, ``lse`` and ``dL/dout``.

    >>> import numpy as np, forge_ml as fm
    >>> q = k = fm.zeros((1, 2, 1)); v = fm.tensor(np.array([[[1.0], [3.0]]], np.float32))
    >>> out, lse = attention(q, k, v)
    >>> dq, dk, dv = attention_bwd(q, k, v, out, lse, fm.tensor(np.ones((1, 2, 1), np.float32)))
    >>> dv.numpy().ravel().tolist()        # row 0 sees v0; row 1 splits evenly over v0, v1
    [1.5, 0.5]
    """
    _attn_check("attention_bwd", q, k, v)
    _float("attention_bwd", "out", out), _float("attention_bwd", "dout", dout)
    bk = _same("attention_bwd", q=q, k=k, v=v, out=out, dout=dout)
    _shape_eq("attention_bwd", "q", q, "out", out)
    _shape_eq("attention_bwd", "q", q, "dout", dout)
    _lse_check("attention_bwd", lse, q, "q", q.shape[:-1])
    if q.numel == 0:                   # as attention's forward: nothing to compute
        return _empty(q, q.shape), _empty(q, q.shape), _empty(q, q.shape)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else _num("attention_bwd", "scale", scale)
    dq, dk, dv = bk.attention_bwd(q.data, k.data, v.data, out.data, lse.data, dout.data, scale)
    return _wrap(q, dq), _wrap(q, dk), _wrap(q, dv)


def _qkv_check(op, qkv, n_head):
    _float(op, "qkv", qkv)
    _rank(op, "qkv", qkv, 3, 3)
    c3 = qkv.shape[-1]
    n_head = _whole(op, "n_head", n_head)
    if n_head <= 0 or c3 % (3 * n_head) or c3 == 0:
        raise ShapeError(f"{op}: qkv's last dim {c3} is not 3 * n_head ({n_head}) * head size "
                         "(a head size of at least 1)")
    return c3 // (3 * n_head)


def attention_qkv(qkv, n_head, scale=None):
    """Causal self-attention straight from GPT-2's fused projection: ``qkv (B, T, 3C)`` holds
    each token's query, key and value (head ``h`` at channels ``h*hs…`` of each third).

    Returns ``(y, lse)``: ``y (B, T, C)`` with the heads merged, equal to
    ``merge_heads(attention(*split_heads(qkv, n_head))[0])``, and ``lse (B, H, T)`` as
    ``attention``'s. On the GPU (bf16, heads of 64) the flash kernels read the heads in place
    and write y merged: no split or merge copies, forward or backward.

    >>> import numpy as np, forge_ml as fm
    >>> qkv = fm.tensor(np.random.default_rng(0).standard_normal((1, 3, 6)).astype(np.float32))
    >>> y, lse = fm.ops.attention_qkv(qkv, n_head=1)
    >>> y.shape, lse.shape
    ((1, 3, 2), (1, 1, 3))
    """
    hs = _qkv_check("attention_qkv", qkv, n_head)
    bk = backend_of(qkv.device)
    if qkv.numel == 0:
        return _qkv_empty(qkv, n_head)
    scale = 1.0 / math.sqrt(hs) if scale is None else _num("attention_qkv", "scale", scale)
    y, lse = bk.attention_qkv(qkv.data, n_head, scale)
    return _wrap(qkv, y), _wrap(qkv, lse)


def attention_qkv_bwd(qkv, y, lse, dy, n_head, scale=None, sums=False):
    """``dL/dqkv (B, T, 3C)`` of ``attention_qkv`` given its output ``y``, ``lse`` and
    ``dL/dy``. With ``sums``, ``(dqkv, sum_rows(dqkv))`` (the fused op
    ``attention_qkv_bwd_sums``; on the GPU the kernels sum what they write): the bias gradient
    of the linear layer whose output qkv is, when dqkv is qkv's whole gradient (the tape hands
    it to that layer's ``weight_grads``).

    >>> import numpy as np, forge_ml as fm
    >>> qkv = fm.tensor(np.random.default_rng(0).standard_normal((1, 3, 6)).astype(np.float32))
    >>> y, lse = attention_qkv(qkv, 1)
    >>> dy = fm.tensor(np.ones((1, 3, 2), np.float32))
    >>> attention_qkv_bwd(qkv, y, lse, dy, 1).shape
    (1, 3, 6)
    >>> dqkv, s = attention_qkv_bwd(qkv, y, lse, dy, 1, sums=True)
    >>> s.shape, bool(np.allclose(s.numpy(), dqkv.numpy().sum(axis=(0, 1)), atol=1e-6))
    ((6,), True)
    """
    op = "attention_qkv_bwd"
    scale, bk = _qkv_bwd_check(op, qkv, y, lse, dy, n_head, scale)
    if _flag(op, "sums", sums):
        if qkv.numel == 0:
            return _empty(qkv, qkv.shape), _empty(qkv, qkv.shape[-1:])
        dqkv, s = bk.attention_qkv_bwd_sums(qkv.data, y.data, lse.data, dy.data, n_head, scale)
        return _wrap(qkv, dqkv), _wrap(qkv, s)
    return _wrap(qkv, bk.attention_qkv_bwd(qkv.data, y.data, lse.data, dy.data, n_head, scale))


def _qkv_bwd_check(op, qkv, y, lse, dy, n_head, scale):
    """The checks of the attention_qkv backwards: ``(scale, backend)``, the default scale
    ``1/sqrt(head size)``."""
    hs = _qkv_check(op, qkv, n_head)
    _float(op, "y", y), _float(op, "dy", dy)
    bk = _same(op, qkv=qkv, y=y, dy=dy)
    B, T, c3 = qkv.shape
    if y.shape != (B, T, c3 // 3):
        raise ShapeError(f"{op}: y must be {(B, T, c3 // 3)}, got {y.shape}")
    _shape_eq(op, "y", y, "dy", dy)
    _lse_check(op, lse, qkv, "qkv", (B, n_head, T))
    return (1.0 / math.sqrt(hs) if scale is None else _num("attention_qkv_bwd", "scale", scale)), bk


def attention_qkv_dropout(qkv, n_head, p, seed, scale=None):
    """``attention_qkv`` with inverted dropout at rate ``p`` on the attention probabilities:
    ``y`` equals ``merge_heads(dropout(softmax(mask(q k^T * scale)), p, seed) v)`` on the split
    heads, the mask exactly ``dropout``'s over the ``(B, H, T, T)`` probabilities; ``lse`` is
    ``attention_qkv``'s (before dropout). ``seed``: an int in [0, 2**64), or a ``SeedAt``. On
    the GPU (bf16, heads of 64) the flash kernels draw the mask in registers, so no T x T matrix
    is stored; elsewhere the composed ops run.

    >>> import numpy as np, forge_ml as fm
    >>> qkv = fm.tensor(np.random.default_rng(0).standard_normal((1, 3, 6)).astype(np.float32))
    >>> y, lse = fm.ops.attention_qkv_dropout(qkv, 1, p=0.5, seed=7)
    >>> y.shape, bool(np.allclose(lse.numpy(), fm.ops.attention_qkv(qkv, 1)[1].numpy()))
    ((1, 3, 2), True)
    """
    op = "attention_qkv_dropout"
    hs = _qkv_check(op, qkv, n_head)
    bk = backend_of(qkv.device)
    p, seed = _dropout_args(op, p, seed, qkv.device, bk)
    if qkv.numel == 0:                 # as attention_qkv's: nothing to attend over
        return _qkv_empty(qkv, n_head)
    scale = 1.0 / math.sqrt(hs) if scale is None else _num("attention_qkv_dropout", "scale", scale)
    y, lse = bk.attention_qkv_dropout(qkv.data, n_head, scale, p, seed)
    return _wrap(qkv, y), _wrap(qkv, lse)


def attention_qkv_dropout_bwd(qkv, y, lse, dy, n_head, p, seed, scale=None) -> Tensor:
    """``dL/dqkv (B, T, 3C)`` of ``attention_qkv_dropout`` (same ``p`` and ``seed``: the mask
    is drawn again, not stored) given its output ``y``, ``lse`` and ``dL/dy``.

    >>> import numpy as np, forge_ml as fm
    >>> qkv = fm.tensor(np.random.default_rng(0).standard_normal((1, 3, 6)).astype(np.float32))
    >>> y, lse = attention_qkv_dropout(qkv, 1, 0.5, 7)
    >>> dy = fm.tensor(np.ones((1, 3, 2), np.float32))
    >>> attention_qkv_dropout_bwd(qkv, y, lse, dy, 1, 0.5, 7).shape
    (1, 3, 6)
    """
    op = "attention_qkv_dropout_bwd"
    scale, bk = _qkv_bwd_check(op, qkv, y, lse, dy, n_head, scale)
    p, seed = _dropout_args(op, p, seed, qkv.device, bk)
    if qkv.numel == 0:                 # as attention_qkv_bwd's: nothing to compute
        return _empty(qkv, qkv.shape)
    return _wrap(qkv, bk.attention_qkv_dropout_bwd(qkv.data, y.data, lse.data, dy.data, n_head,
                                                   scale, p, seed))


def _dropout_args(op, p, seed, device, bk):
    """``(p, seed)`` of a dropout op as backends take them: ``p`` a float in [0, 1); the seed an
    int, or for a ``SeedAt`` ``(base array, site)``, except where arrays are host memory: there
    the base is read now and the seed is ``rng.mix(base[0], site)``."""
    if not (0.0 <= _num("dropout", "p", p) < 1.0) or np.float32(p) >= 1.0:
        # (the kernels take p as float32: a p within 6e-8 of 1 is 1 there, every element
        # dropped and the rest scaled by 1 / (1 - p), about 1e11)
        raise ShapeError(f"{op}: p must be in [0, 1) as a float32, got {p}")
    if isinstance(seed, SeedAt):
        base, site = seed
        if not isinstance(base, Tensor) or base.dtype != _dt.int64 or base.numel != 1:
            raise ShapeError(f"{op}: SeedAt.base must be a one-element int64 Tensor, got {base!r}")
        if base.device != device:
            raise DeviceError(f"{op}: the tensors are on {device} but the seed is on {base.device}")
        site = _as_int(site)
        if type(site) is not int or not 0 <= site < 1 << 64:
            raise ShapeError(f"{op}: SeedAt.site must be an int in [0, 2**64), got {site!r}")
        if bk.host_memory:      # reading the seed costs nothing here
            return float(p), _rng.mix(int(base.data.reshape(-1)[0]) & 0xFFFFFFFFFFFFFFFF, site)
        return float(p), (base.data, site)
    seed = _as_int(seed)
    if type(seed) is not int or not (0 <= seed < 1 << 64):
        raise ShapeError(f"{op}: seed must be an int in [0, 2**64) or a SeedAt, got {seed!r}")
    return float(p), seed


# -- embeddings and in-place row writes ------------------------------------------------


def embedding(ids, wte, wpe, pos=0) -> Tensor:
    """Token + position embedding: ``wte[ids] + wpe[pos + t]``; ``ids (…, T) -> (…, T, C)``.

    ``pos``: an int, or a device position (see ``decode_attention``): an int32 tensor on the
    same device, read by the kernel, so that a captured decoding step replays at the next
    position; one element shared by every row, or one per row of ``ids (B, T)`` (rows at
    different positions: continuous batching). One device position past the table raises where
    memory is the host's (the CPU), and gives NaN rows on a device (checking it there would
    wait for the device); per-row positions past it give NaN rows on every backend, as
    ``decode_attention``'s.

    >>> import numpy as np, forge_ml as fm
    >>> wte = fm.tensor(np.array([[1.0], [2.0], [3.0]], np.float32))
    >>> wpe = fm.tensor(np.array([[10.0], [20.0], [30.0]], np.float32))
    >>> embedding(fm.tensor([[2, 0]]), wte, wpe, pos=1).numpy().tolist()
    [[[23.0], [31.0]]]
    """
    _int("embedding", "ids", ids)
    _float("embedding", "wte", wte), _float("embedding", "wpe", wpe)
    bk = _same("embedding", wte=wte, wpe=wpe, ids=ids)
    _rank("embedding", "ids", ids, 1)
    _rank("embedding", "wte", wte, 2, 2), _rank("embedding", "wpe", wpe, 2, 2)
    if wte.shape[1] != wpe.shape[1]:
        raise ShapeError(f"embedding: wte is {wte.shape} but wpe is {wpe.shape}; channels must agree")
    t = ids.shape[-1]
    rows = ids.shape[0] if ids.ndim == 2 else 1
    at = _device_pos("embedding", pos, wte, rows) if isinstance(pos, Tensor) else _whole("embedding", "pos", pos)
    if at < 0 or at + t > wpe.shape[0]:
        raise ShapeError(f"embedding: positions {at}..{at + t - 1} do not fit the "
                         f"{wpe.shape[0]} rows of wpe (context length {wpe.shape[0]})")
    _check_ids("embedding", ids, wte.shape[0])
    return _wrap(wte, bk.embedding(ids._data, wte.data, wpe.data,
                                   pos._data if isinstance(pos, Tensor) else pos))


def _device_pos(op, pos, like, rows) -> int:
    """Check a device position (int32 on ``like``'s device: one element, or one per row of
    ``rows``); returns the furthest position where reading it costs no device wait (host
    memory), else 0 (the kernel checks it, row by row)."""
    if pos.dtype is not _dt.int32 or pos.numel not in (1, rows) or pos.ndim > 1:
        raise ShapeError(f"{op}: a tensor position must be int32 with one element, or one per "
                         f"row ({rows}), got {pos.dtype.name} of shape {pos.shape}")
    if pos.device != like.device:
        raise DeviceError(f"{op}: the position is on {pos.device} but the tensors are on "
                          f"{like.device}; move them to one device with .to()")
    if pos.numel > 1 or not backend_of(pos.device).host_memory:
        return 0   # the kernel checks each row; a row out of range gives NaN on every backend
    vals = pos._data.reshape(-1)
    lo, hi = int(vals.min()), int(vals.max())
    return lo if lo < 0 else hi


def decode_attention(qkv, k_cache, v_cache, pos, n_head, scale=None) -> Tensor:
    """One decoding step of causal self-attention over a KV cache, one new token per row.

    ``qkv (B, 3C)``: the new tokens' fused query, key and value rows (GPT-2's c_attn output);
    ``k_cache, v_cache (B, H, Tmax, hs)``: written in place at row ``pos`` with the new keys
    and values. Returns ``y (B, C)``: per head, ``softmax(scale * q k^T) v`` over cache rows
    ``0..pos``, heads merged (as ``merge_heads`` lays them out). ``scale`` defaults to
    ``1/sqrt(hs)``. Inference only (no backward); scores and probabilities stay in float32.

    ``pos``: an int, or an int32 tensor on the same device, read by the kernel itself: a
    decoding step captured once (a CUDA graph) replays at every position. One element is
    shared by every row; ``B`` elements give each row its own position (continuous batching:
    row ``b`` writes at ``pos[b]`` and attends over rows ``0..pos[b]`` of its cache). A shared
    device position outside ``0..Tmax-1`` raises where memory is the host's; on a device, and
    for per-row positions everywhere, nothing is written for such a row and its ``y`` is NaN
    (an idle row of a continuous batch). Copy-on-write as ``kv_append``.

    >>> import numpy as np, forge_ml as fm
    >>> kc, vc = fm.zeros((1, 1, 4, 2)), fm.zeros((1, 1, 4, 2))
    >>> qkv = fm.tensor(np.array([[1.0, 0.0, 1.0, 0.0, 3.0, 4.0]], np.float32))
    >>> fm.ops.decode_attention(qkv, kc, vc, 0, n_head=1).numpy().tolist()
    [[3.0, 4.0]]
    >>> vc.numpy()[0, 0, 0].tolist()
    [3.0, 4.0]
    """
    op = "decode_attention"
    _float(op, "qkv", qkv), _float(op, "k_cache", k_cache), _float(op, "v_cache", v_cache)
    bk = _same(op, qkv=qkv, k_cache=k_cache, v_cache=v_cache)
    _rank(op, "k_cache", k_cache, 4, 4)
    _shape_eq(op, "k_cache", k_cache, "v_cache", v_cache)
    B, H, tmax, hs = k_cache.shape
    if H != _whole(op, "n_head", n_head):
        raise ShapeError(f"{op}: the caches have {H} heads but n_head is {n_head}")
    if hs == 0:
        raise ShapeError(f"{op}: the caches {k_cache.shape} have a head size of 0 (at least 1)")
    if qkv.shape != (B, 3 * H * hs):
        raise ShapeError(f"{op}: qkv must be (B, 3C) = {(B, 3 * H * hs)} for caches "
                         f"{k_cache.shape}, got {qkv.shape}")
    at = _device_pos(op, pos, qkv, B) if isinstance(pos, Tensor) else _whole(op, "pos", pos)
    if not 0 <= at < tmax:
        raise ShapeError(f"{op}: position {at} does not fit a cache of {tmax} rows")
    scale = 1.0 / math.sqrt(hs) if scale is None else _num("decode_attention", "scale", scale)
    y = bk.decode_attention(qkv.data, k_cache._prepare_write(), v_cache._prepare_write(),
                            pos._data if isinstance(pos, Tensor) else pos, n_head, scale)
    return _wrap(qkv, y)


def decode_gpt2_ok(wte, n_head: int, k_cache) -> bool:
    """Whether ``decode_gpt2`` runs GPT-2's decoding step for a model whose token embedding is
    ``wte (Vp, C)`` with ``n_head`` heads and a KV cache layer shaped like ``k_cache``: the
    backend has the fused step (CUDA), float32 or bf16, head size 64 (every GPT-2 size), a
    batch it takes (one row; up to four with FORGE_FUSED_DECODE=layers, where they are the
    faster), and the FORGE_FUSED_DECODE switch on.

    >>> import forge_ml as fm
    >>> decode_gpt2_ok(fm.zeros((10, 64)), 1, fm.zeros((1, 1, 8, 64)))   # the CPU has none
    False
    """
    ok = getattr(backend_of(wte.device), "decode_gpt2_ok", None)
    return bool(ok is not None and wte.ndim == 2 and k_cache.ndim == 4
                and ok(wte.dtype.name, wte.shape[1], int(n_head), k_cache.shape[2],
                       k_cache.shape[0]))


def decode_gpt2(ids, pos, wte, wpe, lnf, head, layers, caches, n_head, eps, vocab_size, logits,
                out=None, row=None, greedy=False) -> None:
    """GPT-2's whole decoding step for B rows as one backend call, where ``decode_gpt2_ok``
    says so (CUDA: a few kernels for every layer and the LM head): writes ``logits (B, Vp)``
    (float32) for the tokens ``ids`` (int32, B elements) at position ``pos`` (int32, one
    element on the device, the same for every row, read by the kernels, so the step captures
    into a graph), and each token's keys and values at that position of its row of each
    layer's cache. ``layers``: each layer's 12 tensors in ``models.gpt2.Layer``'s order;
    ``caches``: each layer's ``(k, v)``, ``(B, H, Tmax, 64)``; ``lnf``: the final
    layernorm's ``(gamma, beta)``; ``head (Vp, C)``: the LM head. ``greedy``: then also
    ``greedy_next``'s work on those logits: ``ids[b] = argmax(logits[b, :vocab_size])`` (also
    into ``out``, row ``row`` of a ``(k, B)`` buffer) and ``pos += 1``. Equal to
    ``GPT2.decode_step`` within float32 rounding (the residual stream stays in float32
    between layers here).

    Example (on a GPU; ``inference.decode.DecodeStep`` makes this call)::

        cache = model.new_cache(1, 1024)
        P = model.params
        decode_gpt2(ids, pos, P["wte.weight"], P["wpe.weight"], (P["ln_f.weight"],
                    P["ln_f.bias"]), P["wte.weight"], layers(P, model.config),
                    list(zip(cache.k, cache.v)), 12, 1e-5, 50257, logits, greedy=True)
    """
    op = "decode_gpt2"
    if not decode_gpt2_ok(wte, n_head, caches[0][0]):
        raise DeviceError(f"{op}: the backend of {wte.device} has no fused decoding step for "
                          f"this model (ask decode_gpt2_ok first)")
    tensors = [ids, pos, wte, wpe, head, logits, *lnf] + [t for lw in layers for t in lw] + [
        t for kv in caches for t in kv] + ([out] if out is not None else [])
    for t in tensors:
        _tensor(op, "argument", t)
        if t.device != wte.device:
            raise DeviceError(f"{op}: wte is on {wte.device} but an argument is on {t.device}")
    if len(layers) != len(caches) or any(len(lw) != 12 for lw in layers):
        raise ShapeError(f"{op}: expected 12 tensors per layer and one (k, v) per layer, got "
                         f"{[len(lw) for lw in layers]} and {len(caches)} caches")
    for name, t in (("ids", ids), ("pos", pos)) + ((("out", out),) if out is not None else ()):
        if t.dtype is not _dt.int32:
            raise DTypeError(f"{op}: {name} must be int32, got {t.dtype.name}")
    B = caches[0][0].shape[0]
    if ids.numel != B or pos.numel != 1:
        raise ShapeError(f"{op}: the cache has {B} row(s): ids must hold {B} element(s) and pos "
                         f"one, got {ids.shape} and {pos.shape}")
    Vp = head.shape[0]
    if logits.dtype is not _dt.float32 or logits.numel != B * Vp:
        raise ShapeError(f"{op}: logits must be float32 with {B} x {Vp} elements, got "
                         f"{logits.dtype.name} {logits.shape}")
    vocab_size = _as_int(vocab_size)
    if type(vocab_size) is not int or not 0 < vocab_size <= Vp:
        raise ShapeError(f"{op}: vocab_size must be in 1..{Vp}, got {vocab_size!r}")
    dst = None if out is None else _choice_out(op, out, row, B)
    backend_of(wte.device).decode_gpt2(
        ids._prepare_write(), pos._prepare_write(), wte.data, wpe.data,
        [t.data for t in lnf], head.data, [[t.data for t in lw] for lw in layers],
        [(k._prepare_write(), v._prepare_write()) for k, v in caches], int(n_head), _num("decode_gpt2", "eps", eps),
        vocab_size, logits._prepare_write(), dst, greedy=bool(greedy))
    if greedy:
        ids._storage.id_range = (0, vocab_size - 1)


def assign(dst, values, row=None) -> None:
    """In place: ``dst[...] = values`` (a NumPy array, a nested list or a Tensor of ``dst``'s
    shape, cast to ``dst``'s dtype; a Tensor's values go through the host), or with ``row``
    only ``dst[row] = values`` (one row of a buffer of 2 or more axes, the rest untouched).
    Fills the fixed input buffers of a captured step; copy-on-write.

    >>> import forge_ml as fm
    >>> t = fm.zeros((2,), "int32"); fm.ops.assign(t, [3, 4]); t.numpy().tolist()
    [3, 4]
    >>> fm.ops.assign(t, fm.tensor([5, 6])); t.numpy().tolist()
    [5, 6]
    >>> m = fm.zeros((2, 3), "int32"); fm.ops.assign(m, [1, 2, 3], row=1); m.numpy().tolist()
    [[0, 0, 0], [1, 2, 3]]
    """
    _tensor("assign", "dst", dst)
    if isinstance(values, Tensor):   # np.asarray of a Tensor is a 0-d object array
        values = values.numpy()
    arr = _numbers_array(values, "assign", "numbers of one shape (an array, a nested list or a Tensor)")
    if row is not None:
        row = _as_int(row)
        if dst.ndim < 2 or type(row) is not int or not 0 <= row < dst.shape[0]:
            raise ShapeError(f"assign: row {row!r} is not a row of dst {dst.shape}")
    want = dst.shape if row is None else dst.shape[1:]
    if arr.shape != want:
        raise ShapeError(f"assign: dst{'' if row is None else f' row {row}'} is {want} but the "
                         f"values are {arr.shape}")
    if dst.dtype in _dt.INTS and arr.size:
        # as tensor(...) refuses them: a value past the dtype's range wrapped silently, and
        # the range cached for check_ids was the one before the cast
        _check_fits(arr, dst.dtype, "assign")
    bk = backend_of(dst.device)
    data = dst._prepare_write()
    bk.assign(data if row is None else data[row], arr)
    if row is None and dst.dtype in _dt.INTS and arr.size:
        kept = arr if arr.dtype == np.dtype(dst.dtype.name) else arr.astype(dst.dtype.name)
        dst._storage.id_range = (int(kept.min()), int(kept.max()))


def check_ids(op, ids, n_rows) -> None:
    """Token ids of ``ids`` must lie in ``0..n_rows-1``; a ShapeError naming ``op`` otherwise.
    Costs no device wait for ids made from host data (their range is cached).

    >>> import forge_ml as fm
    >>> check_ids("forward", fm.tensor([[1, 9]]), 8)
    Traceback (most recent call last):
    ...
    forge_ml.errors.ShapeError: forward: token id 9 is out of range; ids must be in 0..7
    """
    _int(op, "ids", ids)
    _check_ids(op, ids, n_rows)


def take_rows(x, t) -> Tensor:
    """``x[:, t]`` of ``x (B, T, C)`` as a new ``(B, C)`` tensor (a prefill's last position).

    >>> import numpy as np, forge_ml as fm
    >>> take_rows(fm.tensor(np.arange(12, dtype=np.float32).reshape(2, 3, 2)), 2).numpy().tolist()
    [[4.0, 5.0], [10.0, 11.0]]
    """
    _tensor("take_rows", "x", x)
    _rank("take_rows", "x", x, 3, 3)
    t = _as_int(t)
    if type(t) is not int or not 0 <= t < x.shape[1]:
        raise ShapeError(f"take_rows: row {t!r} is not in 0..{x.shape[1] - 1} of {x.shape}")
    return _wrap(x, backend_of(x.device).copy(x.data[:, t]))


def take_columns(x, n) -> Tensor:
    """The first ``n`` columns of the last axis, as a new tensor (padded vocab columns go).

    >>> import numpy as np, forge_ml as fm
    >>> take_columns(fm.tensor(np.ones((1, 4), np.float32)), 3).shape
    (1, 3)
    """
    _tensor("take_columns", "x", x)
    _rank("take_columns", "x", x, 1)
    n = _as_int(n)
    if type(n) is not int or not 0 < n <= x.shape[-1]:
        raise ShapeError(f"take_columns: n must be in 1..{x.shape[-1]}, got {n!r}")
    return _wrap(x, backend_of(x.device).copy(x.data[..., :n]))


def _check_ids(op, ids, n_rows):
    if ids.numel == 0:
        return
    rng = ids._id_range()
    if rng is None:
        # min/max work on NumPy and CuPy arrays alike (on the GPU this is one small sync);
        # ids made from host data carry their range already (Tensor's storage caches it;
        # _id_range never reads it once the array has been handed out).
        rng = ids._storage.id_range = (int(ids._data.min()), int(ids._data.max()))
    lo, hi = rng
    if lo < 0 or hi >= n_rows:
        bad = hi if hi >= n_rows else lo
        raise ShapeError(f"{op}: token id {bad} is out of range; ids must be in 0..{n_rows - 1}")


def _choice_out(op, out, row, B):
    """Where a decoding step's choices go besides ``ids``: None, ``out`` (B elements), or row
    ``row`` of ``out`` (k, B) (a chain's record of its tokens); written in place."""
    if out is None:
        return None
    dst = out._prepare_write()
    if row is not None:
        row = _whole(op, "row", row)
        if not (out.ndim == 2 and out.shape[1] == B and 0 <= row < out.shape[0]):
            raise ShapeError(f"{op}: row {row} of out {out.shape} is not a row of {B} ids")
        return dst[row]
    if out.numel != B:
        raise ShapeError(f"{op}: out must hold {B} elements, got {out.shape}")
    return dst


def greedy_next(logits, vocab_size, ids, pos, out=None, row=None) -> None:
    """A decoding step's greedy choice on the device, in place: ``ids[b] = argmax(logits[b,
    :vocab_size])`` (NumPy's ties: the lowest id) for float32 ``logits (B, Vp)`` and int32
    ``ids (B, 1)``; also written to ``out`` (int32; row ``row`` of a ``(k, B)`` buffer when
    ``row`` is given); then every element of the int32 position ``pos`` (1 or B elements)
    goes up by one. Nothing comes back to the host: captured in a graph, greedy steps chain.
    A row whose largest logit is not finite (a NaN, which numpy.argmax takes first, +inf, or
    every logit -inf) has no token to give: ``out`` gets -1 for it (the host's sign to stop),
    ``ids`` its argmax (an id the next step can read).

    >>> import numpy as np, forge_ml as fm
    >>> ids, pos = fm.zeros((1, 1), "int32"), fm.zeros((1,), "int32")
    >>> greedy_next(fm.tensor(np.array([[0.0, 2.0, 1.0]], np.float32)), 3, ids, pos)
    >>> ids.numpy().tolist(), pos.numpy().tolist()
    ([[1]], [1])
    """
    op = "greedy_next"
    _float(op, "logits", logits)
    _rank(op, "logits", logits, 2, 2)
    B, vp = logits.shape
    if logits.dtype is not _dt.float32:
        raise DTypeError(f"{op}: logits must be float32, got {logits.dtype.name}")
    for name, t in (("ids", ids), ("pos", pos)) + ((("out", out),) if out is not None else ()):
        _tensor(op, name, t)
        if t.dtype is not _dt.int32:
            raise DTypeError(f"{op}: {name} must be int32, got {t.dtype.name}")
        if t.device != logits.device:
            raise DeviceError(f"{op}: logits are on {logits.device} but {name} is on {t.device}")
    if ids.numel != B or pos.numel not in (1, B):
        raise ShapeError(f"{op}: ids must hold {B} elements and pos 1 or {B}, got {ids.shape} "
                         f"and {pos.shape}")
    vocab_size = _as_int(vocab_size)
    if type(vocab_size) is not int or not 0 < vocab_size <= vp:
        raise ShapeError(f"{op}: vocab_size must be in 1..{vp}, got {vocab_size!r}")
    dst = _choice_out(op, out, row, B)
    bk = backend_of(logits.device)
    bk.greedy_next(logits.data, vocab_size, ids._prepare_write(), pos._prepare_write(), dst)
    ids._storage.id_range = (0, vocab_size - 1)


def sample_next(logits, vocab_size, ids, pos, knobs, keys, seen=None, out=None, row=None) -> None:
    """A decoding step's sampled choice on the device, in place (``greedy_next``'s sampled
    twin): row ``b`` of float32 ``logits (B, Vp)`` picks a token by the rule of
    ``forge_ml.sampling.sample_row`` with its ``knobs[b]`` (float32 (B, 5): temperature, top_k,
    top_p, min_p, repetition_penalty; 0, 0, 1, 0, 1 turn each off), its Philox key ``keys[b]``
    (int32 (B, 2)) and the position of the token it chooses, ``pos + 1`` (``pos`` is the
    position fed; the Philox counter: the same seed at the same position draws the same token
    on every backend). ``seen`` (int32 (B, Vp) or None) marks the tokens the penalty applies
    to (where not 0: ``forge_ml.sampling.seen_row``'s marks) and gets 2 added at the chosen
    one (``penalize_logits`` reads the count). The token goes to ``ids`` (and ``out``, row
    ``row`` of a (k, B) buffer when given); then ``pos`` (1 or B elements) goes up by one.
    A row whose logit at its (penalised) argmax is not finite gets -1 in ``out``, as
    ``greedy_next`` (a penalty that only overflows finite logits takes the argmax, as
    ``forge_ml.sampling.sample_row`` does).

    >>> import numpy as np, forge_ml as fm
    >>> ids, pos = fm.zeros((1, 1), "int32"), fm.zeros((1,), "int32")
    >>> knobs = fm.tensor(np.array([[0.0, 0, 1, 0, 1]], np.float32))   # temperature 0: argmax
    >>> sample_next(fm.tensor(np.array([[0.0, 2.0, 1.0]], np.float32)), 3, ids, pos, knobs,
    ...             fm.zeros((1, 2), "int32"))
    >>> ids.numpy().tolist(), pos.numpy().tolist()
    ([[1]], [1])
    """
    op = "sample_next"
    _float(op, "logits", logits)
    _rank(op, "logits", logits, 2, 2)
    B, vp = logits.shape
    _tensor(op, "knobs", knobs)
    if logits.dtype is not _dt.float32 or knobs.dtype is not _dt.float32:
        raise DTypeError(f"{op}: logits and knobs must be float32, got {logits.dtype.name} and "
                         f"{knobs.dtype.name}")
    named = (("ids", ids), ("pos", pos), ("keys", keys)) + ((("seen", seen),) if seen is not None else ()) \
        + ((("out", out),) if out is not None else ())
    for name, t in named:
        _tensor(op, name, t)
        if t.dtype is not _dt.int32:
            raise DTypeError(f"{op}: {name} must be int32, got {t.dtype.name}")
    for name, t in named + (("knobs", knobs),):
        if t.device != logits.device:
            raise DeviceError(f"{op}: logits are on {logits.device} but {name} is on {t.device}")
    if ids.numel != B or pos.numel not in (1, B) or knobs.shape != (B, 5) or keys.shape != (B, 2):
        raise ShapeError(f"{op}: for {B} rows, ids must hold {B} elements, pos 1 or {B}, knobs "
                         f"be ({B}, 5) and keys ({B}, 2); got {ids.shape}, {pos.shape}, "
                         f"{knobs.shape}, {keys.shape}")
    if seen is not None and seen.shape != (B, vp):
        raise ShapeError(f"{op}: seen must be {(B, vp)} like the logits, got {seen.shape}")
    vocab_size = _as_int(vocab_size)
    if type(vocab_size) is not int or not 0 < vocab_size <= vp:
        raise ShapeError(f"{op}: vocab_size must be in 1..{vp}, got {vocab_size!r}")
    dst = _choice_out(op, out, row, B)
    bk = backend_of(logits.device)
    bk.sample_next(logits.data, vocab_size, ids._prepare_write(), pos._prepare_write(),
                   knobs.data, keys.data, None if seen is None else seen._prepare_write(), dst)
    ids._storage.id_range = (0, vocab_size - 1)


def penalize_logits(logits, vocab_size, seen, penalties, bias=None) -> None:
    """OpenAI's presence and frequency penalties and logit bias, in place, before a sampled
    choice (``sample_next``): the first ``vocab_size`` logits of each row of float32 ``logits
    (B, Vp)`` get ``bias[b]`` added (float32 ``(B, Vp)``, or None), then ``frequency * c``
    and, where ``c > 0``, ``presence`` taken away, where ``penalties[b] = (presence,
    frequency)`` (float32 ``(B, 2)``) and ``c = seen[b] >> 1`` (int32 ``(B, Vp)``: the times
    the row generated the id, ``forge_ml.sampling.seen_row``'s marks, which ``sample_next``
    keeps). Each operation is rounded to float32 on its own, as
    ``forge_ml.sampling.adjusted`` does it, so every backend gives the same bits.

    >>> import numpy as np, forge_ml as fm
    >>> z = fm.tensor(np.zeros((1, 4), np.float32))
    >>> seen = fm.tensor(np.array([[0, 1, 2, 6]], np.int32))   # id 2 once, id 3 three times
    >>> penalize_logits(z, 4, seen, fm.tensor(np.array([[0.5, 0.25]], np.float32)))
    >>> z.numpy().tolist()
    [[0.0, 0.0, -0.75, -1.25]]
    """
    op = "penalize_logits"
    _float(op, "logits", logits)
    _rank(op, "logits", logits, 2, 2)
    B, vp = logits.shape
    named = (("logits", logits, _dt.float32, (B, vp)), ("seen", seen, _dt.int32, (B, vp)),
             ("penalties", penalties, _dt.float32, (B, 2)))
    if bias is not None:
        named += (("bias", bias, _dt.float32, (B, vp)),)
    for name, t, dt, shape in named:
        _tensor(op, name, t)
        if t.dtype is not dt:
            raise DTypeError(f"{op}: {name} must be {dt.name}, got {t.dtype.name}")
        if t.device != logits.device:
            raise DeviceError(f"{op}: logits are on {logits.device} but {name} is on {t.device}")
        if t.shape != shape:
            raise ShapeError(f"{op}: for logits {(B, vp)}, {name} must be {shape}, got {t.shape}")
    vocab_size = _as_int(vocab_size)
    if type(vocab_size) is not int or not 0 < vocab_size <= vp:
        raise ShapeError(f"{op}: vocab_size must be in 1..{vp}, got {vocab_size!r}")
    bk = backend_of(logits.device)
    bk.penalize_logits(logits._prepare_write(), vocab_size, seen.data, penalties.data,
                       None if bias is None else bias.data)


def scatter_add_rows(dst, ids, src) -> None:
    """In place: ``dst[ids[i]] += src[i]`` for every row ``i`` (repeated ids add up).

    ``dst (V, C)``, ``ids (…,)``, ``src (…, C)``. Copy-on-write: views of ``dst`` taken before
    the call keep their values.

    >>> import numpy as np, forge_ml as fm
    >>> dst = fm.zeros((3, 1))
    >>> scatter_add_rows(dst, fm.tensor([2, 0, 2]), fm.tensor(np.ones((3, 1), np.float32)))
    >>> dst.numpy().ravel().tolist()
    [1.0, 0.0, 2.0]
    """
    _float("scatter_add_rows", "dst", dst), _int("scatter_add_rows", "ids", ids)
    _float("scatter_add_rows", "src", src)
    bk = _same("scatter_add_rows", dst=dst, src=src, ids=ids)
    _rank("scatter_add_rows", "dst", dst, 2, 2)
    if src.shape != ids.shape + (dst.shape[1],):
        raise ShapeError(f"scatter_add_rows: src must be ids.shape + (C,) = "
                         f"{ids.shape + (dst.shape[1],)}, got {src.shape}")
    _check_ids("scatter_add_rows", ids, dst.shape[0])
    bk.scatter_add_rows(dst._prepare_write(), ids._data, src.data)


def kv_append(cache, new, pos) -> None:
    """In place: write ``new (…, Tn, hs)`` into ``cache (…, Tmax, hs)`` at rows ``pos…``.

    Copy-on-write: views of ``cache`` taken before the call keep their values.

    >>> import numpy as np, forge_ml as fm
    >>> cache = fm.zeros((3, 1))
    >>> kv_append(cache, fm.tensor(np.array([[5.0], [6.0]], np.float32)), 1)
    >>> cache.numpy().ravel().tolist()
    [0.0, 5.0, 6.0]
    """
    _float("kv_append", "cache", cache), _float("kv_append", "new", new)
    bk = _same("kv_append", cache=cache, new=new)
    _rank("kv_append", "cache", cache, 2)
    if cache.ndim != new.ndim or cache.shape[:-2] != new.shape[:-2] or cache.shape[-1] != new.shape[-1]:
        raise ShapeError(f"kv_append: new {new.shape} does not match cache {cache.shape} "
                         "outside the row axis")
    tn, tmax = new.shape[-2], cache.shape[-2]
    pos = _whole("kv_append", "pos", pos)
    if pos < 0 or pos + tn > tmax:
        raise ShapeError(f"kv_append: rows {pos}..{pos + tn - 1} do not fit a cache of {tmax} rows")
    bk.kv_append(cache._prepare_write(), new.data, pos)


# -- dropout ---------------------------------------------------------------------------


class SeedAt(NamedTuple):
    """A dropout seed held in device memory: the stream is ``rng.mix(base[0], site)`` where
    ``base`` is a one-element int64 Tensor (the seed's 64 bits). A captured training step
    reads its seeds so, and a replay after ``assign``-ing a new base draws fresh masks.

    >>> import numpy as np, forge_ml as fm
    >>> x = fm.tensor(np.ones(8, np.float32))
    >>> at = fm.ops.dropout(x, 0.5, SeedAt(fm.tensor(np.array([7], np.int64)), 2)).numpy()
    >>> bool((at == fm.ops.dropout(x, 0.5, fm.rng.mix(7, 2)).numpy()).all())
    True
    """
    base: Tensor
    site: int


def dropout(x, p, seed) -> Tensor:
    """Inverted dropout: zero each element with probability ``p``, scale the rest by
    ``1/(1-p)``. The mask is a pure function of ``(seed, element index)`` (``forge_ml.rng``),
    identical on every backend. ``seed``: an int in [0, 2**64), or a ``SeedAt``.

    >>> import numpy as np, forge_ml as fm
    >>> fm.ops.dropout(fm.tensor(np.ones(4, np.float32)), 0.5, seed=7).numpy().tolist()
    [2.0, 2.0, 0.0, 0.0]
    """
    _float("dropout", "x", x)
    bk = backend_of(x.device)
    p, seed = _dropout_args("dropout", p, seed, x.device, bk)
    if isinstance(seed, tuple):       # a seed in device memory: the kernel mixes in the site
        return _wrap(x, _graph_member(bk, "dropout_at")(x.data, p, *seed))
    return _wrap(x, bk.dropout(x.data, p, seed))


def _graph_member(bk, name):
    """A backend member that reads step values from device memory (``contract.GRAPH``)."""
    fn = getattr(bk, name, None)
    if fn is None:
        raise DeviceError(f"{name}: the {bk.name} backend cannot read step values from device "
                          "memory (it lacks the contract's graph members)")
    return fn


# -- cross entropy ---------------------------------------------------------------------


def _ce_check(op, logits, targets, vocab_size):
    _float(op, "logits", logits), _int(op, "targets", targets)
    _same(op, logits=logits, targets=targets)
    _rank(op, "logits", logits, 2, 2)
    return _ce_targets(op, "logits", logits.shape, logits.shape[1], targets, vocab_size)


def _ce_targets(op, name, shape, vp, targets, vocab_size):
    """Targets ``(N,)`` for the rows of ``name`` (``shape``), the vocabulary size in 1..vp, the
    ids below it; returns the vocabulary size."""
    n = shape[0]
    if targets.shape != (n,):
        raise ShapeError(f"{op}: targets must be ({n},) for {name} {shape}, got {targets.shape}")
    if n == 0:
        raise ShapeError(f"{op}: {name} {shape} has no rows; the mean loss of an empty batch is "
                         "undefined: expected at least one row")
    if vp == 0:
        raise ShapeError(f"{op}: {name} {shape} has no columns: expected at least one logit a row")
    v = vp if vocab_size is None else vocab_size
    v = _as_int(v)
    if type(v) is not int or not (0 < v <= vp):
        raise ShapeError(f"{op}: vocab_size must be in 1..{vp}, got {vocab_size!r}")
    _check_ids(op, targets, v)
    return v


def cross_entropy(logits, targets, vocab_size=None) -> Tensor:
    """Mean over rows of ``-log softmax(logits[:, :V])[target]``; a 0-d float32 tensor
    (float64 for float64 logits).

    ``logits (N, Vp)``, ``targets (N,)``; columns ``>= vocab_size`` (padding) are ignored.
    Every target must be a class in ``0..V-1`` (no ignore index).

    >>> import numpy as np, forge_ml as fm
    >>> logits = fm.tensor(np.array([[0.0, 0.0, 9.0]], np.float32))   # column 2 is padding
    >>> round(cross_entropy(logits, fm.tensor([1]), vocab_size=2).item(), 4)
    0.6931
    """
    v = _ce_check("cross_entropy", logits, targets, vocab_size)
    return _wrap(logits, backend_of(logits.device).cross_entropy(logits.data, targets._data, v))


def cross_entropy_bwd(logits, targets, dloss=1.0, vocab_size=None) -> Tensor:
    """``dL/dlogits = dloss * (softmax(logits[:, :V]) - onehot(targets)) / N``; zero past ``V``.

    >>> import numpy as np, forge_ml as fm
    >>> logits = fm.tensor(np.array([[0.0, 0.0, 9.0]], np.float32))
    >>> cross_entropy_bwd(logits, fm.tensor([1]), 2.0, vocab_size=2).numpy().tolist()
    [[1.0, -1.0, 0.0]]
    """
    v = _ce_check("cross_entropy_bwd", logits, targets, vocab_size)
    bk = backend_of(logits.device)
    dloss = _scalar("cross_entropy_bwd", "dloss", dloss, logits.device)
    if isinstance(dloss, Tensor):
        if not bk.host_memory:   # the kernel reads it where it is: no wait for the forward
            return _wrap(logits, bk.cross_entropy_bwd(logits.data, targets._data, dloss.data, v))
        dloss = dloss.item()
    return _wrap(logits, bk.cross_entropy_bwd(logits.data, targets._data, float(dloss), v))



def linear_cross_entropy(x, w, targets, vocab_size=None, *, grad=True):
    """The LM head and its loss in one op: ``loss = cross_entropy(x @ w^T, targets,
    vocab_size)`` for ``x (N, C)`` and ``w (Vp, C)`` (the tied token embedding), without
    keeping the ``(N, Vp)`` logits: a backend may run it over chunks of rows (the CUDA one
    does). With ``grad`` (the default) the gradients of the loss for dloss = 1 come with it.
    Returns ``(loss, dx, dw)``: a 0-d float32 (float64 for float64) loss, and ``dx (N, C)``,
    ``dw (Vp, C)`` in x's dtype, or None and None without ``grad``.

    >>> import numpy as np, forge_ml as fm
    >>> x = fm.tensor(np.ones((2, 3), np.float32))
    >>> w = fm.tensor(np.zeros((4, 3), np.float32))
    >>> loss, dx, dw = linear_cross_entropy(x, w, fm.tensor([1, 2]))
    >>> round(loss.item(), 4), dx.shape, dw.shape        # uniform over 4 classes: log 4
    (1.3863, (2, 3), (4, 3))
    """
    op = "linear_cross_entropy"
    _float(op, "x", x), _float(op, "w", w), _int(op, "targets", targets)
    grad = _flag(op, "grad", grad)
    bk = _same(op, x=x, w=w, targets=targets)
    _rank(op, "x", x, 2, 2), _rank(op, "w", w, 2, 2)
    if w.shape[1] != x.shape[1]:
        raise ShapeError(f"{op}: x is {x.shape} but w is {w.shape}; w must be (vocab, {x.shape[1]})")
    v = _ce_targets(op, "x", x.shape, w.shape[0], targets, vocab_size)
    loss, dx, dw = bk.linear_cross_entropy(x.data, w.data, targets._data, v, bool(grad))
    if not grad:
        return _wrap(x, loss), None, None
    return _wrap(x, loss), _wrap(x, dx), _wrap(x, dw)


def scale(x, s) -> Tensor:
    """``s * x`` in x's dtype; ``s`` a number, or a one-element Tensor on x's device, read
    there (a loss's cotangent: no wait for the device).

    >>> import forge_ml as fm
    >>> scale(fm.tensor([1.0, -2.0]), fm.tensor(3.0)).numpy().tolist()
    [3.0, -6.0]
    """
    _float("scale", "x", x)
    bk = backend_of(x.device)
    s = _scalar("scale", "s", s, x.device)
    return _wrap(x, bk.scale(x.data, s.data if isinstance(s, Tensor) else s))


# -- optimizer step --------------------------------------------------------------------


STEP_SCALARS = ("lr", "bc1", "bc2", "grad_scale", "norm", "step")
"""The layout of an optimizer step's values in device memory (a float64 Tensor of six): the
learning rate, AdamW's bias corrections ``1 - beta**step``, the factor the gradients take
(accumulation and clipping: ``clip_scale`` writes it, NaN skips the update), the gradient norm
and the 1-based step. ``optim.AdamW.prepare`` writes the host's part before each step."""


def adamw_update(p, g, m, v, *, lr=None, beta1, beta2, eps, weight_decay, step=None,
                 grad_scale=1.0, p_lowp=None, scalars=None) -> None:
    """One fused AdamW step in place on float32 ``p``, ``m``, ``v`` (torch.optim.AdamW's math):
    ``g *= grad_scale``; moments; bias correction with ``step`` (1-based); decoupled weight
    decay. ``p_lowp`` (bf16, GPU) receives the updated weights rounded to bf16.

    ``scalars`` (a float64 Tensor laid out as ``STEP_SCALARS``) replaces ``lr``, ``step`` and
    ``grad_scale``: the kernel reads them from device memory, so a captured step replays with
    new values; a non-finite ``grad_scale`` there skips the update (nothing is written).

    >>> import numpy as np, forge_ml as fm
    >>> p, m, v = (fm.tensor(np.zeros((1, 1), np.float32)) for _ in range(3))
    >>> s = fm.tensor(np.array([0.5, 1 - 0.9, 1 - 0.999, 1.0, 0.0, 1.0]))
    >>> adamw_update(p, fm.tensor(np.full((1, 1), 3.0, np.float32)), m, v, beta1=0.9,
    ...              beta2=0.999, eps=1e-8, weight_decay=0.0, scalars=s)
    >>> round(p.item(), 4)
    -0.5
    """
    bk = _adamw_check("adamw_update", p, g, m, v, p_lowp)
    lowp = None if p_lowp is None else p_lowp._prepare_write()
    if scalars is not None:
        _step_scalars("adamw_update", scalars, p.device)
        if bk.host_memory:      # the values cost nothing to read here
            lr, _, _, grad_scale, _, step = (float(x) for x in scalars.data.reshape(-1))
            if not math.isfinite(grad_scale):
                return
            step = int(step)
        else:
            _graph_member(bk, "adamw_update_at")(
                p._prepare_write(), g.data, m._prepare_write(), v._prepare_write(),
                _num("adamw_update", "beta1", beta1), _num("adamw_update", "beta2", beta2),
                _num("adamw_update", "eps", eps), _num("adamw_update", "weight_decay", weight_decay),
                scalars.data, lowp)
            return
    if lr is None:
        raise ConfigError("adamw_update: expected lr and step (host values) or scalars (a device "
                          "Tensor laid out as STEP_SCALARS), got neither")
    step = _as_int(step)
    if type(step) is not int or step < 1:
        raise ShapeError(f"adamw_update: step must be an int >= 1, got {step!r}")
    bk.adamw_update(p._prepare_write(), g.data, m._prepare_write(), v._prepare_write(),
                    _num("adamw_update", "lr", lr), _num("adamw_update", "beta1", beta1),
                    _num("adamw_update", "beta2", beta2), _num("adamw_update", "eps", eps),
                    _num("adamw_update", "weight_decay", weight_decay), step,
                    _num("adamw_update", "grad_scale", grad_scale), lowp)


def _adamw_check(op, p, g, m, v, p_lowp=None):
    """float32 (or float64) p, m, v on one device with g, every shape p's; the backend."""
    for n, t in (("p", p), ("m", m), ("v", v)):
        _float(op, n, t)
        if t.dtype != _dt.float32 and t.dtype != _dt.float64:
            raise DTypeError(f"{op}: {n} must be float32 (master weights and moments), "
                             f"got {t.dtype.name}")
    _float(op, "g", g)
    bk = _same(op, p=p, m=m, v=v)
    if g.device != p.device:
        raise DeviceError(f"{op}: p is on {p.device} but g is on {g.device}")
    for n, t in (("g", g), ("m", m), ("v", v)) + ((("p_lowp", p_lowp),) if p_lowp is not None else ()):
        if t.shape != p.shape:
            raise ShapeError(f"{op}: {n} is {t.shape} but p is {p.shape}; shapes must be equal")
    return bk


def adamw_update_many(ps, gs, ms, vs, *, lr=None, beta1, beta2, eps, weight_decays, steps=None,
                      grad_scale=1.0, p_lowps=None, scalars=None) -> None:
    """``adamw_update`` for several parameters, each with its own weight decay and 1-based
    step (an optimizer's step over a whole model): one backend call where the backend has
    ``adamw_update_many`` (the CPU's C kernel), else one ``adamw_update`` each (always with
    ``p_lowps``, the bf16 copies that ``p_lowp`` takes one by one).

    ``scalars`` (``STEP_SCALARS``, as ``adamw_update``'s) replaces ``lr``, ``steps`` and
    ``grad_scale``: one launch over every parameter where the backend has
    ``adamw_update_many_at`` (the GPU's table of the tensors), else ``adamw_update`` each.

    >>> import numpy as np, forge_ml as fm
    >>> ps = [fm.tensor(np.zeros(2, np.float32)) for _ in range(2)]
    >>> ms, vs = [fm.zeros(2) for _ in ps], [fm.zeros(2) for _ in ps]
    >>> gs = [fm.tensor(np.full(2, 3.0, np.float32)) for _ in ps]
    >>> adamw_update_many(ps, gs, ms, vs, lr=0.5, beta1=0.9, beta2=0.999, eps=1e-8,
    ...                   weight_decays=[0.0, 0.0], steps=[1, 1])
    >>> [round(float(p.numpy()[0]), 4) for p in ps]
    [-0.5, -0.5]
    """
    for name, seq in (("ps", ps), ("gs", gs), ("ms", ms), ("vs", vs), ("weight_decays", weight_decays),
                      ("steps", steps), ("p_lowps", p_lowps)):
        if seq is not None and not isinstance(seq, (list, tuple)):
            raise ConfigError(f"adamw_update_many: {name} must be a list (one entry a parameter), "
                              f"got {type(seq).__name__}")
    k = len(ps)
    if scalars is None and (lr is None or steps is None):
        raise ConfigError("adamw_update_many: expected lr and steps (host values) or scalars "
                          "(STEP_SCALARS in device memory); got neither")
    nsteps = k if scalars is not None and steps is None else len(steps)
    if not len(gs) == len(ms) == len(vs) == len(weight_decays) == nsteps == k or (
            p_lowps is not None and len(p_lowps) != k):
        raise ShapeError(f"adamw_update_many: {k} parameters but {len(gs)} gradients, {len(ms)} "
                         f"and {len(vs)} moments, {len(weight_decays)} weight decays, "
                         f"{nsteps} steps" + ("" if p_lowps is None else f" and {len(p_lowps)} bf16 copies"))
    if k == 0:
        return
    bk = backend_of(ps[0].device)
    if scalars is not None:
        _adamw_many_at(bk, ps, gs, ms, vs, beta1, beta2, eps, weight_decays, p_lowps, scalars)
        return
    many = getattr(bk, "adamw_update_many", None)
    if many is None or p_lowps is not None:
        for i, (p, g, m, v, wd, st) in enumerate(zip(ps, gs, ms, vs, weight_decays, steps)):
            adamw_update(p, g, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                         step=st, grad_scale=grad_scale, p_lowp=None if p_lowps is None else p_lowps[i])
        return
    for p, g, m, v, st in zip(ps, gs, ms, vs, steps):
        if _adamw_check("adamw_update_many", p, g, m, v) is not bk:
            raise DeviceError(f"adamw_update_many: parameters on {ps[0].device} and {p.device}; "
                              "one device per call")
        st = _as_int(st)
        if type(st) is not int or st < 1:
            raise ShapeError(f"adamw_update_many: steps must be ints >= 1, got {st!r}")
    op = "adamw_update_many"
    many([p._prepare_write() for p in ps], [g.data for g in gs],
         [m._prepare_write() for m in ms], [v._prepare_write() for v in vs], _num(op, "lr", lr),
         _num(op, "beta1", beta1), _num(op, "beta2", beta2), _num(op, "eps", eps),
         _nums(op, "weight_decays", list(weight_decays)), list(steps),
         _num(op, "grad_scale", grad_scale))

def _adamw_many_at(bk, ps, gs, ms, vs, beta1, beta2, eps, weight_decays, p_lowps, scalars):
    """``adamw_update_many`` with ``scalars``: the backend's ``adamw_update_many_at`` where it
    has one (device memory), else ``adamw_update`` each."""
    lows = [None] * len(ps) if p_lowps is None else list(p_lowps)
    many = None if bk.host_memory else getattr(bk, "adamw_update_many_at", None)
    if many is None:
        for p, g, m, v, wd, lp in zip(ps, gs, ms, vs, weight_decays, lows):
            adamw_update(p, g, m, v, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                         scalars=scalars, p_lowp=lp)
        return
    _step_scalars("adamw_update_many", scalars, ps[0].device)
    for p, g, m, v, lp in zip(ps, gs, ms, vs, lows):
        if _adamw_check("adamw_update_many", p, g, m, v, lp) is not bk:
            raise DeviceError(f"adamw_update_many: parameters on {ps[0].device} and {p.device}; "
                              "one device per call")
    op = "adamw_update_many"
    many([p._prepare_write() for p in ps], [g.data for g in gs],
         [m._prepare_write() for m in ms], [v._prepare_write() for v in vs], _num(op, "beta1", beta1),
         _num(op, "beta2", beta2), _num(op, "eps", eps),
         _nums(op, "weight_decays", list(weight_decays)), scalars.data,
         None if p_lowps is None else [lp._prepare_write() for lp in lows])


def clip_scale(sumsq, scalars, max_norm: float, grad_scale: float = 1.0, check=None) -> None:
    """Global-norm clipping on the device, for a step that never waits for it: from ``sumsq``
    (0-d, the sum of every gradient's squares) writes ``scalars``' ``norm`` =
    ``|grad_scale| * sqrt(sumsq)`` and ``grad_scale`` = ``grad_scale * min(1, max_norm /
    (norm + 1e-6))`` (torch's coefficient; unclipped when ``max_norm <= 0``), in float64 as
    ``optim.clip_grad_norm`` computes them. A non-finite norm, or a non-finite ``check`` (the
    step's loss), writes NaN as the factor, which makes ``adamw_update`` skip.

    >>> import numpy as np, forge_ml as fm
    >>> s = fm.tensor(np.zeros(6))
    >>> clip_scale(fm.tensor(np.array(25.0, np.float32)), s, max_norm=1.0)
    >>> [round(x, 6) for x in s.numpy()[3:5].tolist()]
    [0.2, 5.0]
    """
    _float("clip_scale", "sumsq", sumsq)
    max_norm, grad_scale = _num("clip_scale", "max_norm", max_norm), _num("clip_scale", "grad_scale", grad_scale)
    if sumsq.numel != 1:
        raise ShapeError(f"clip_scale: sumsq must hold one value, got {sumsq.shape}")
    bk = backend_of(sumsq.device)
    _step_scalars("clip_scale", scalars, sumsq.device)
    if check is not None:
        _float("clip_scale", "check", check)
        _one_value("clip_scale", "check", check, sumsq.device)
        if check.dtype != sumsq.dtype:
            check = check.to(sumsq.dtype.name)
    if bk.host_memory:
        norm, scale = clip_from_sumsq(float(sumsq.data.reshape(-1)[0]), max_norm, grad_scale)
        ok = math.isfinite(norm) and (check is None or math.isfinite(float(check.data.reshape(-1)[0])))
        scale = scale if ok else float("nan")
        out = scalars._prepare_write().reshape(-1)
        out[3], out[4] = scale, norm
        return
    _graph_member(bk, "clip_scale")(sumsq.data, None if check is None else check.data,
                                    scalars._prepare_write(), float(max_norm), float(grad_scale))


def clip_from_sumsq(sq: float, max_norm: float, grad_scale: float = 1.0) -> tuple:
    """Global-norm clipping's arithmetic, on the host, from the gradients' sum of squares:
    ``(norm, scale)``, ``norm = |grad_scale| sqrt(sq)`` (NaN when ``sq`` is not a finite
    non-negative number) and ``scale = grad_scale * min(1, max_norm / (norm + 1e-6))``
    (torch's coefficient; ``grad_scale`` itself when ``max_norm <= 0`` or the norm is NaN).
    ``clip_scale`` computes the same on the device.

    >>> norm, scale = clip_from_sumsq(25.0, 1.0, 0.5)
    >>> norm, round(scale, 6)
    (2.5, 0.2)
    """
    gs = float(grad_scale)
    norm = abs(gs) * math.sqrt(sq) if math.isfinite(sq) and sq >= 0 else float("nan")
    scale = gs
    if max_norm > 0 and math.isfinite(norm):
        scale *= min(1.0, max_norm / (norm + 1e-6))
    return norm, scale


def _step_scalars(op, scalars, device) -> None:
    if not isinstance(scalars, Tensor) or scalars.dtype != _dt.float64 or scalars.shape != (len(STEP_SCALARS),):
        raise ShapeError(f"{op}: scalars must be a float64 Tensor of {len(STEP_SCALARS)} "
                         f"({', '.join(STEP_SCALARS)}), got {scalars!r}")
    if scalars.device != device:
        raise DeviceError(f"{op}: scalars are on {scalars.device} but the tensors on {device}")
