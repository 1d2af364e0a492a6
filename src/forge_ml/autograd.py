"""Tape-based reverse-mode autograd, after the Rust original's ``Tape``.

Define-by-run: the forward records one node per op on the ``Tape``; ``Tape.backward``
sweeps the nodes in reverse, each backward rule written with ``ops`` only (so one rule
serves every backend). Recording order is a topological order: no sort is needed.

>>> import numpy as np, forge_ml as fm
>>> tape = fm.Tape()
>>> x = tape.leaf(fm.tensor(np.array([[1.0, -2.0]], np.float32)))
>>> w = tape.leaf(fm.tensor(np.array([[3.0], [4.0]], np.float32)))
>>> y = tape.matmul(x, w)                          # (1, 1) = [[-5]]
>>> grads = tape.backward(y, fm.tensor(np.ones((1, 1), np.float32)))
>>> grads[w.id].numpy().ravel().tolist()           # dy/dw = x^T
[1.0, -2.0]
"""
from __future__ import annotations

from typing import Callable, Optional

from . import flags, ops
from .errors import DTypeError, ShapeError, TapeError
from .tensor import Tensor, ones_like, zeros


class TVar:
    """A tensor tracked on a tape: ``id`` is its node, ``t`` its value, ``tape_key`` the key of
    the tape that recorded it (node ids are per tape, so a TVar means nothing on another).
    The key is not the tape itself: a TVar kept after its forward (a loss, logits) must not
    keep the tape's saved activations alive.

    >>> import forge_ml as fm
    >>> tape = fm.Tape()
    >>> x = tape.leaf(fm.zeros((2, 3)))
    >>> x.id, x.shape, tape.gelu(x).id
    (0, (2, 3), 1)
    """

    __slots__ = ("id", "t", "tape_key")

    def __init__(self, id: int, t: Tensor, tape_key=None):
        self.id = id
        self.t = t
        self.tape_key = tape_key

    @property
    def shape(self):
        return self.t.shape

    def __repr__(self):
        return f"TVar(id={self.id}, shape={self.t.shape}, dtype={self.t.dtype.name})"


class _Saved:
    """A tensor kept for backward, with its version to catch in-place edits in between."""

    __slots__ = ("t", "version", "what")

    def __init__(self, t: Tensor, what: str):
        self.t, self.version, self.what = t, t.version, what

    def get(self) -> Tensor:
        if self.t.version != self.version:
            raise TapeError(f"backward: a tensor saved by {self.what} was modified in place "
                            "after the forward; backward would use the new values")
        return self.t


BackwardFn = Callable[[Tensor], list]


def _saved_seed(seed, what: str) -> Optional[_Saved]:
    """The base tensor of an ``ops.SeedAt`` dropout seed, kept as a ``_Saved``: a backward
    draws the mask again from it, so a base rewritten in between would draw another mask.
    None for an int seed (a value, nothing to watch)."""
    return _Saved(seed.base, what) if isinstance(seed, ops.SeedAt) else None


def _layer_grads(ia, ib, ibias, a: Tensor, b: Tensor, dy: Tensor, alpha: float = 1.0,
                 sums: Optional[Tensor] = None) -> list:
    """The gradients of a linear layer ``Y = alpha a @ b + bias`` (2-D ``a``): ``dA = alpha dY
    b^T`` to node ``ia``, and ``dB = alpha a^T dY`` with ``sum_rows(dY)`` from one
    ``ops.weight_grads`` to ``ib`` and ``ibias`` (``sums``: that sum, made already)."""
    da = ops.matmul(dy, b, trans_b=True, alpha=alpha)
    db, dbias = ops.weight_grads(a, dy, alpha, dy_sums=sums)
    return [(ia, da), (ib, db), (ibias, dbias)]


class Tape:
    """Records ops for one forward; ``backward`` returns the gradients.

    Each op method computes through ``ops`` and records a closure mapping ``dL/dout`` to
    ``[(parent_id, grad), …]``. ``Tape(grad=False)`` records no closures (evaluation,
    inference: torch's ``no_grad``): nothing is kept for a backward, so each activation is freed
    as soon as the forward no longer needs it, and ``backward`` is an error.

    >>> import forge_ml as fm
    >>> t = fm.Tape(grad=False)
    >>> y = t.gelu(t.leaf(fm.tensor([1.0])))
    >>> t.backward(y)
    Traceback (most recent call last):
    ...
    forge_ml.errors.TapeError: backward: this tape was made with grad=False and recorded nothing to sweep; record the forward on a Tape() to get gradients
    """

    def __init__(self, grad: bool = True):
        self._nodes: list[Optional[BackwardFn]] = []
        self._swept = False
        self.grads: list[Optional[Tensor]] = []
        self._key = object()  # what this tape's TVars carry: identity, no reference to the tape
        # a switch, as the ops' flags: Tape(grad="no") recorded (any non-empty string is true)
        self.records = ops._flag("Tape", "grad", grad)
        self._unit_seed = []  # [backward's default seed (ones)], for rules that skip a "* 1"
        self._into: dict[int, int] = {}   # node -> the parent whose gradient its rule takes in
        # nodes whose rule takes ``sums=`` (sum_rows of its dy where a layernorm backward made
        # it: _record's ``sums``), and node -> (that dy, its sums) once the layernorm has run
        self._sums_to: set[int] = set()
        self._sums: dict[int, tuple] = {}

    def __len__(self):
        return len(self._nodes)

    def leaf(self, t: Tensor) -> TVar:
        """Register a leaf (parameter or input); ``backward`` keeps its gradient.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> w = t.leaf(fm.tensor([2.0]))
        >>> t.backward(t.gelu(w))[w.id] is t.grad(w)
        True
        """
        if not isinstance(t, Tensor):
            raise TapeError(f"leaf: expected a Tensor, got {type(t).__name__}")
        if self._swept:
            raise TapeError("leaf: this tape was already swept by backward; record a new "
                            "forward on a new Tape")
        self._nodes.append(None)
        return TVar(len(self._nodes) - 1, t, self._key)

    def _record(self, t: Tensor, f: BackwardFn, into: Optional[int] = None,
                sums: bool = False) -> TVar:
        """A new node with backward rule ``f``. ``into``: the id of a parent whose gradient so
        far (from the uses of it swept before this node; None if none) the sweep hands to
        ``f(dy, acc)``, which returns that parent's gradient with ``acc`` already added (a
        kernel that adds it in its last pass, instead of an ``add`` after it). ``sums``: the
        rule is ``f(dy, sums=s)``, ``s`` None or ``sum_rows(dy)`` already made by the
        layernorm backward that wrote dy (a linear layer's bias gradient; see
        ``layernorm``)."""
        if self._swept:   # (a node recorded now could never be swept: refused where it is made)
            raise TapeError("this tape was already swept by backward; record a new forward on "
                            "a new Tape")
        self._nodes.append(f if self.records else None)
        node = len(self._nodes) - 1
        if into is not None and self.records:
            self._into[node] = into
        if sums and self.records:
            self._sums_to.add(node)
        return TVar(node, t, self._key)

    def _check(self, *vs):
        """Every operand is a TVar that this tape recorded. A TVar of another tape would name
        a node of this one by its id, and its gradient would go to that node.

        >>> import forge_ml as fm
        >>> a, b = fm.Tape(), fm.Tape()
        >>> x = a.leaf(fm.zeros((2,)))
        >>> _ = b.leaf(fm.zeros((2,))); b.gelu(x)
        Traceback (most recent call last):
        ...
        forge_ml.errors.TapeError: expected a TVar of this tape, got TVar(id=0, shape=(2,), dtype=float32), recorded on another Tape; record the forward on one tape (or register the value here with tape.leaf(v.t))
        """
        for v in vs:
            if v is None:
                continue
            if not isinstance(v, TVar):
                raise TapeError(f"expected a TVar of this tape, got {type(v).__name__}")
            if v.tape_key is not self._key:
                raise TapeError(f"expected a TVar of this tape, got {v!r}, recorded on another Tape; "
                                f"record the forward on one tape (or register the value here with "
                                f"tape.leaf(v.t))")

    # -- ops -------------------------------------------------------------------------------
    def add(self, a: TVar, b: TVar) -> TVar:
        """``a + b`` (same shape); the gradient flows to both unchanged.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> a, b = t.leaf(fm.tensor([1.0])), t.leaf(fm.tensor([2.0]))
        >>> g = t.backward(t.add(a, b), fm.tensor([5.0]))
        >>> g[a.id].numpy().tolist(), g[b.id].numpy().tolist()
        ([5.0], [5.0])
        """
        self._check(a, b)
        out = ops.add(a.t, b.t)
        ia, ib = a.id, b.id
        return self._record(out, lambda dy: [(ia, dy), (ib, dy)])

    def matmul(self, a: TVar, b: TVar, bias: Optional[TVar] = None, *, trans_b=False,
               alpha=1.0) -> TVar:
        """``alpha * a @ op(b) + bias`` for equal-rank operands (2-D, or batched rank >= 3).

        ``trans_a`` and ``b_rows`` are backward-only specs and are not taken here.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> a, w = t.leaf(fm.tensor([[1.0, 2.0]])), t.leaf(fm.tensor([[3.0, 4.0]]))
        >>> y = t.matmul(a, w, trans_b=True, alpha=2.0)               # 2 * a @ w^T = [[22]]
        >>> y.t.numpy().tolist(), t.backward(y)[w.id].numpy().tolist()
        ([[22.0]], [[2.0, 4.0]])
        """
        self._check(a, b, bias)
        if a.t.ndim != b.t.ndim:
            raise ShapeError(f"tape.matmul: a is {a.shape} but b is {b.shape}; the tape needs "
                             "equal-rank operands (reshape to 2-D first)")
        out = ops.matmul(a.t, b.t, None if bias is None else bias.t, trans_b=trans_b, alpha=alpha)
        ia, ib = a.id, b.id
        ibias = None if bias is None else bias.id
        sa, sb = _Saved(a.t, "matmul"), _Saved(b.t, "matmul")
        # a layer (2-D a, a bias): dB and sum_rows(dY) at once, or sum_rows(dY) as made by the
        # backward that wrote dY (``sums``: an attention backward, through a reshape)
        layer = ibias is not None and a.t.ndim == 2 and not trans_b

        def backward(dy, sums=None):
            at, bt = sa.get(), sb.get()
            if not trans_b:
                if layer:
                    return _layer_grads(ia, ib, ibias, at, bt, dy, alpha, sums=sums)
                da = ops.matmul(dy, bt, trans_b=True, alpha=alpha)   # Y = aAB:  dA = a dY B^T
                db = ops.matmul(at, dy, trans_a=True, alpha=alpha)   #           dB = a A^T dY
            else:
                da = ops.matmul(dy, bt, alpha=alpha)                 # Y = aAB^T: dA = a dY B
                db = ops.matmul(dy, at, trans_a=True, alpha=alpha)   #            dB = a dY^T A
            grads = [(ia, da), (ib, db)]
            if ibias is not None:
                grads.append((ibias, ops.sum_rows(dy)))
            return grads

        return self._record(out, backward, sums=layer)

    def matmul_add(self, a: TVar, b: TVar, bias: TVar, residual: TVar) -> TVar:
        """``residual + a @ b + bias`` for 2-D ``a``: a linear layer and the residual add after
        it as one node (``ops.linear``: on the GPU one product adds the residual in its
        epilogue). The same values and gradients as ``add(residual, matmul(a, b, bias))``.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> a, w = t.leaf(fm.tensor(np.ones((1, 2), np.float32))), t.leaf(fm.tensor(np.ones((2, 2), np.float32)))
        >>> y = t.matmul_add(a, w, t.leaf(fm.zeros((2,))), t.leaf(fm.tensor(np.ones((1, 2), np.float32))))
        >>> y.t.numpy().tolist()
        [[3.0, 3.0]]
        """
        self._check(a, b, bias, residual)
        out = ops.linear(a.t, b.t, bias.t, residual=residual.t)
        ia, ib, ibias, ir = a.id, b.id, bias.id, residual.id
        sa, sb = _Saved(a.t, "matmul_add"), _Saved(b.t, "matmul_add")
        return self._record(out, lambda dy, sums=None: _layer_grads(
            ia, ib, ibias, sa.get(), sb.get(), dy, sums=sums) + [(ir, dy)], sums=True)

    def matmul_gelu(self, a: TVar, b: TVar, bias: TVar) -> TVar:
        """``gelu(a @ b + bias)`` for 2-D ``a``: a linear layer and its GELU as one node
        (``ops.matmul_gelu``: on the GPU one product writes the output and GELU's input).
        The same values and gradients as ``gelu(matmul(a, b, bias))``.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> a, w = t.leaf(fm.tensor(np.ones((1, 2), np.float32))), t.leaf(fm.tensor(np.ones((2, 1), np.float32)))
        >>> y = t.matmul_gelu(a, w, t.leaf(fm.zeros((1,))))
        >>> round(float(y.t.numpy()[0, 0]), 4), t.backward(y)[w.id].numpy().shape
        (1.9546, (2, 1))
        """
        self._check(a, b, bias)
        if not self.records:   # nothing kept: GELU's input need not be written
            return self._record(ops.linear(a.t, b.t, bias.t, act="gelu"), None)
        out, pre = ops.matmul_gelu(a.t, b.t, bias.t)
        ia, ib, ibias = a.id, b.id, bias.id
        sa, sb, sp = _Saved(a.t, "matmul_gelu"), _Saved(b.t, "matmul_gelu"), _Saved(pre, "matmul_gelu")

        return self._record(out, lambda dy: _layer_grads(ia, ib, ibias, sa.get(), sb.get(),
                                                          ops.gelu_bwd(sp.get(), dy)))

    def mlp(self, x: TVar, w_fc: TVar, b_fc: TVar, w_proj: TVar, b_proj: TVar,
            residual: TVar) -> TVar:
        """``residual + gelu(x @ w_fc + b_fc) @ w_proj + b_proj`` for 2-D ``x``: GPT-2's MLP and
        the residual add after it as one node, the same values and gradients as
        ``matmul_add(matmul_gelu(x, w_fc, b_fc), w_proj, b_proj, residual)``. Its backward
        takes GELU's input gradient and the first layer's bias gradient from one
        ``ops.matmul_dgelu`` (on the GPU one product that applies GELU's backward as it
        writes, then one pass of 16-byte row sums for the bias).

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> one = lambda *s: t.leaf(fm.tensor(np.ones(s, np.float32)))
        >>> y = t.mlp(one(1, 2), one(2, 3), one(3), one(3, 2), one(2), one(1, 2))
        >>> [round(v, 4) for v in y.t.numpy()[0].tolist()], t.backward(y)[1].shape
        ([10.9891, 10.9891], (2, 3))
        """
        self._check(x, w_fc, b_fc, w_proj, b_proj, residual)
        if not self.records:
            h = ops.linear(x.t, w_fc.t, b_fc.t, act="gelu")
            return self._record(ops.linear(h, w_proj.t, b_proj.t, residual=residual.t), None)
        h, pre = ops.matmul_gelu(x.t, w_fc.t, b_fc.t)
        out = ops.linear(h, w_proj.t, b_proj.t, residual=residual.t)
        ix, iwf, ibf, iwp, ibp, ir = x.id, w_fc.id, b_fc.id, w_proj.id, b_proj.id, residual.id
        sx, swf, swp = _Saved(x.t, "mlp"), _Saved(w_fc.t, "mlp"), _Saved(w_proj.t, "mlp")
        sh, sp = _Saved(h, "mlp"), _Saved(pre, "mlp")

        def backward(dy, sums=None):
            dpre, dbf = ops.matmul_dgelu(dy, swp.get(), sp.get())
            dwp, dbp = ops.weight_grads(sh.get(), dy, dy_sums=sums)
            dx = ops.matmul(dpre, swf.get(), trans_b=True)
            dwf = ops.matmul(sx.get(), dpre, trans_a=True)
            return [(ix, dx), (iwf, dwf), (ibf, dbf), (iwp, dwp), (ibp, dbp), (ir, dy)]

        return self._record(out, backward, sums=True)

    def gelu(self, x: TVar) -> TVar:
        """GPT-2's tanh GELU.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> x = t.leaf(fm.tensor([0.0]))
        >>> t.backward(t.gelu(x), fm.tensor([4.0]))[x.id].numpy().tolist()
        [2.0]
        """
        self._check(x)
        out = ops.gelu(x.t)
        ix, sx = x.id, _Saved(x.t, "gelu")
        return self._record(out, lambda dy: [(ix, ops.gelu_bwd(sx.get(), dy))])

    def layernorm(self, x: TVar, gamma: TVar, beta: TVar, eps: float = 1e-5) -> TVar:
        """Layer norm over the last axis (``ops.layernorm``).

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> x = t.leaf(fm.tensor([[1.0, 3.0]]))
        >>> y = t.layernorm(x, t.leaf(fm.tensor([1.0, 1.0])), t.leaf(fm.tensor([0.0, 0.0])), 0.0)
        >>> y.t.numpy().tolist(), t.backward(y, fm.tensor([[1.0, 1.0]]))[x.id].numpy().tolist()
        ([[-1.0, 1.0]], [[0.0, 0.0]])
        """
        self._check(x, gamma, beta)
        out = ops.layernorm(x.t, gamma.t, beta.t, eps)
        ix, ig, ib = x.id, gamma.id, beta.id
        sx, sg = _Saved(x.t, "layernorm"), _Saved(gamma.t, "layernorm")
        # x made by a linear layer with a bias (matmul_add, mlp): this backward also sums the
        # dx it writes over rows, and the sweep hands the sums to that layer's rule when dx
        # is still x's whole gradient there (nothing added to it in between)
        sums = ix in self._sums_to and flags.on("FORGE_BIAS_SUMS")

        def backward(dy, acc=None):   # acc: x's gradient from its other uses (the residual)
            if sums:
                dx, dgamma, dbeta, s = ops.layernorm_bwd(sx.get(), sg.get(), dy, eps, add=acc,
                                                         sums=True)
                self._sums[ix] = (dx, s)
            else:
                dx, dgamma, dbeta = ops.layernorm_bwd(sx.get(), sg.get(), dy, eps, add=acc)
            return [(ix, dx), (ig, dgamma), (ib, dbeta)]

        return self._record(out, backward, into=ix)

    def softmax(self, x: TVar, causal: bool = False, off: int = 0) -> TVar:
        """Softmax over the last axis, optionally causal. Saves the output: masked outputs
        are exact zeros, so the backward needs no mask.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> x = t.leaf(fm.zeros((2, 2)))
        >>> y = t.softmax(x, causal=True)
        >>> y.t.numpy().tolist(), t.backward(y, fm.tensor([[1.0, 0.0], [1.0, 0.0]]))[x.id].numpy()[1].tolist()
        ([[1.0, 0.0], [0.5, 0.5]], [0.25, -0.25])
        """
        self._check(x)
        out = ops.softmax(x.t, causal, off)
        ix, sy = x.id, _Saved(out, "softmax")
        return self._record(out, lambda dy: [(ix, ops.softmax_bwd(sy.get(), dy))])

    def split_heads(self, qkv: TVar, n_head: int):
        """``(…, T, 3C) -> q, k, v`` of ``(…, H, T, hs)``: three nodes, as in the original.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> qkv = t.leaf(fm.zeros((5, 12)))
        >>> [v.shape for v in t.split_heads(qkv, 2)]
        [(2, 5, 2), (2, 5, 2), (2, 5, 2)]
        """
        self._check(qkv)
        q, k, v = ops.split_heads(qkv.t, n_head)
        iq = qkv.id

        def mk(which):
            return lambda dy: [(iq, ops.unsplit_head(dy, which))]

        return self._record(q, mk(0)), self._record(k, mk(1)), self._record(v, mk(2))

    def merge_heads(self, x: TVar) -> TVar:
        """``(…, H, T, hs) -> (…, T, C)``.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> t.merge_heads(t.leaf(fm.zeros((2, 5, 3)))).shape
        (5, 6)
        """
        self._check(x)
        out = ops.merge_heads(x.t)      # its shape checks first (a 2-D x raised an IndexError)
        h = x.t.shape[-3]
        ix = x.id
        return self._record(out, lambda dy: [(ix, ops.unmerge_heads(dy, h))])

    def reshape(self, x: TVar, *shape) -> TVar:
        """A view with another shape; the gradient is reshaped back.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> x = t.leaf(fm.zeros((2, 3)))
        >>> y = t.reshape(x, 3, -1)
        >>> y.shape, t.backward(y)[x.id].shape
        ((3, 2), (2, 3))
        """
        self._check(x)
        out = x.t.reshape(*shape)
        ix, old = x.id, x.t.shape
        # the last axis kept and x a layer's output whose rule takes its gradient's row sums:
        # sums made for this node's gradient are those of x's too, and pass through
        through = ix in self._sums_to and old[-1:] == out.shape[-1:] and len(old) > 0

        def backward(dy, sums=None):
            dx = dy.reshape(old)
            if sums is not None:
                self._sums[ix] = (dx, sums)
            return [(ix, dx)]

        return self._record(out, backward, sums=through)

    def attention(self, q: TVar, k: TVar, v: TVar, scale: Optional[float] = None) -> TVar:
        """Fused causal self-attention over ``(…, H, T, hs)``; saves q, k, v, out and the
        per-row log-sum-exp, never the T x T probabilities.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> q, k, v = (t.leaf(fm.zeros((2, 4, 8))) for _ in range(3))    # (H, T, hs)
        >>> y = t.attention(q, k, v)
        >>> y.shape, t.backward(y)[v.id].shape
        ((2, 4, 8), (2, 4, 8))
        """
        self._check(q, k, v)
        # scale goes to the ops as given: their checks come first (the default computed here
        # raised a ZeroDivisionError at a head size of 0, an IndexError for 0-d inputs)
        out, lse = ops.attention(q.t, k.t, v.t, scale)
        iq, ik, iv = q.id, k.id, v.id
        saved = [_Saved(t, "attention") for t in (q.t, k.t, v.t, out, lse)]

        def backward(dy):
            qt, kt, vt, ot, lt = (s.get() for s in saved)
            dq, dk, dv = ops.attention_bwd(qt, kt, vt, ot, lt, dy, scale)
            return [(iq, dq), (ik, dk), (iv, dv)]

        return self._record(out, backward)

    def attention_qkv(self, qkv: TVar, n_head: int, scale: Optional[float] = None,
                      p: float = 0.0, seed=None) -> TVar:
        """Causal self-attention from fused ``qkv (B, T, 3C)`` rows to ``y (B, T, C)``, heads
        merged: one node for split_heads + attention + merge_heads (``ops.attention_qkv``);
        saves qkv, y and the per-row log-sum-exp; the backward gives dqkv in one piece.

        ``p > 0``: dropout on the attention probabilities with the mask of ``seed`` (an int or
        an ``ops.SeedAt``), the one ``dropout`` after ``softmax`` would draw
        (``ops.attention_qkv_dropout``); the backward draws the mask again.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> qkv = t.leaf(fm.zeros((1, 4, 24)))                       # (B, T, 3C), C = 8
        >>> y = t.attention_qkv(qkv, n_head=2, p=0.1, seed=3)
        >>> y.shape, t.backward(y)[qkv.id].shape
        ((1, 4, 8), (1, 4, 24))
        """
        self._check(qkv)
        if p and seed is None:
            raise TapeError(f"attention_qkv: dropout p={p} needs a seed")
        if p:
            out, lse = ops.attention_qkv_dropout(qkv.t, n_head, p, seed, scale)
        else:
            out, lse = ops.attention_qkv(qkv.t, n_head, scale)
        iq = qkv.id
        saved = [_Saved(t, "attention_qkv") for t in (qkv.t, out, lse)]
        sseed = _saved_seed(seed, "attention_qkv") if p else None
        # qkv made by a linear layer with a bias (GPT-2's c_attn, through a reshape): as
        # layernorm's backward, this one also sums the dqkv it writes, for that layer's bias
        # gradient
        sums = not p and iq in self._sums_to and flags.on("FORGE_BIAS_SUMS")

        def backward(dy):
            qt, ot, lt = (s.get() for s in saved)
            if sseed is not None:
                sseed.get()
            if p:
                return [(iq, ops.attention_qkv_dropout_bwd(qt, ot, lt, dy, n_head, p, seed, scale))]
            if sums:
                dqkv, s = ops.attention_qkv_bwd(qt, ot, lt, dy, n_head, scale, sums=True)
                self._sums[iq] = (dqkv, s)
                return [(iq, dqkv)]
            return [(iq, ops.attention_qkv_bwd(qt, ot, lt, dy, n_head, scale))]

        return self._record(out, backward)

    def embedding(self, ids: Tensor, wte: TVar, wpe: TVar, pos: int = 0) -> TVar:
        """Token + position embedding. ``dwte`` is a scatter-add over the ids; ``dwpe`` the
        upstream gradient (summed over the batch) placed at rows ``pos…``.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> wte, wpe = t.leaf(fm.zeros((5, 1))), t.leaf(fm.zeros((4, 1)))
        >>> y = t.embedding(fm.tensor([[3, 3]]), wte, wpe, pos=1)
        >>> g = t.backward(y)
        >>> g[wte.id].numpy().ravel().tolist(), g[wpe.id].numpy().ravel().tolist()
        ([0.0, 0.0, 0.0, 2.0, 0.0], [0.0, 1.0, 1.0, 0.0])
        """
        self._check(wte, wpe)
        pos = ops._as_int(pos)      # a NumPy integer as the int it is (the ops' own rule)
        if self.records and not isinstance(pos, int):
            raise TapeError(f"embedding: the tape takes an int position, got {type(pos).__name__} "
                            "(a device position is for inference: ops.embedding, or a "
                            "Tape(grad=False))")
        out = ops.embedding(ids, wte.t, wpe.t, pos)
        iw, ip = wte.id, wpe.id
        sids = _Saved(ids, "embedding")
        wte_shape, (n_ctx, c) = wte.t.shape, wpe.t.shape
        t = ids.shape[-1]
        dev, dt = wte.t.device, wte.t.dtype

        def backward(dy):
            dwte = zeros(wte_shape, dt, dev)
            if dy.numel == 0:          # no ids (B or T of 0): no gradient to place
                return [(iw, dwte), (ip, zeros((n_ctx, c), dt, dev))]
            ops.scatter_add_rows(dwte, sids.get(), dy)
            rows = dy.reshape(-1, t * c)                               # (B, T*C)
            rows = ops.sum_rows(rows) if rows.shape[0] > 1 else rows    # (T*C,) summed over B
            dwpe3 = zeros((1, n_ctx, c), dt, dev)
            ops.kv_append(dwpe3, rows.reshape(1, t, c), pos)
            return [(iw, dwte), (ip, dwpe3.reshape(n_ctx, c))]

        return self._record(out, backward)

    def dropout(self, x: TVar, p: float, seed: int) -> TVar:
        """Inverted dropout; backward regenerates the mask from ``seed``, nothing is saved.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> x = t.leaf(fm.tensor(np.ones(4, np.float32)))
        >>> y = t.dropout(x, 0.5, seed=7)
        >>> y.t.numpy().tolist(), t.backward(y)[x.id].numpy().tolist()
        ([2.0, 2.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0])
        """
        self._check(x)
        if p == 0.0:
            return x
        out = ops.dropout(x.t, p, seed)
        ix, sseed = x.id, _saved_seed(seed, "dropout")

        def backward(dy):
            if sseed is not None:
                sseed.get()
            return [(ix, ops.dropout(dy, p, seed))]

        return self._record(out, backward)

    def cross_entropy(self, logits: TVar, targets: Tensor, vocab_size: Optional[int] = None) -> TVar:
        """Mean token cross-entropy (a 0-d node: float32, float64 for float64 logits); fused
        softmax + NLL backward.

        >>> import numpy as np, forge_ml as fm
        >>> tape = fm.Tape()
        >>> logits = tape.leaf(fm.zeros((2, 4)))
        >>> loss = tape.cross_entropy(logits, fm.tensor([1, 3]))
        >>> round(loss.t.item(), 4), tape.backward(loss)[logits.id].numpy()[0].tolist()
        (1.3863, [0.125, -0.375, 0.125, 0.125])
        """
        self._check(logits)
        out = ops.cross_entropy(logits.t, targets, vocab_size)
        il, sl = logits.id, _Saved(logits.t, "cross_entropy")
        st = _Saved(targets, "cross_entropy")
        return self._record(
            out, lambda dy: [(il, ops.cross_entropy_bwd(sl.get(), st.get(), dy, vocab_size))])


    def linear_cross_entropy(self, x: TVar, w: TVar, targets: Tensor,
                             vocab_size: Optional[int] = None, *, grad: bool = True) -> TVar:
        """The mean cross-entropy of the logits ``x @ w^T`` (the LM head) against ``targets``,
        one 0-d node, the ``(N, Vp)`` logits never kept (``ops.linear_cross_entropy``).

        With ``grad`` (training) the gradients for dloss = 1 are computed in the forward, over
        the logits' own memory, and the backward scales them by dL/dloss; ``grad=False``
        (evaluation) computes the loss alone, and a backward, if one comes, computes them then.

        >>> import numpy as np, forge_ml as fm
        >>> tape = fm.Tape()
        >>> x = tape.leaf(fm.tensor(np.ones((2, 3), np.float32)))
        >>> w = tape.leaf(fm.tensor(np.zeros((4, 3), np.float32)))
        >>> loss = tape.linear_cross_entropy(x, w, fm.tensor([1, 2]))
        >>> tape.backward(loss)[w.id].shape
        (4, 3)
        """
        self._check(x, w)
        # checked here: ``"no" and True`` is True, which the op's own check would pass
        grad = ops._flag("linear_cross_entropy", "grad", grad) and self.records
        loss, dx, dw = ops.linear_cross_entropy(x.t, w.t, targets, vocab_size, grad=grad)
        ix, iw = x.id, w.id
        sx, sw = _Saved(x.t, "linear_cross_entropy"), _Saved(w.t, "linear_cross_entropy")
        st = _Saved(targets, "linear_cross_entropy")
        unit = self._unit_seed   # the list, not the tape: a closure must not keep the tape alive

        def backward(dy):
            gx, gw = dx, dw
            if gx is None:   # evaluation's forward: the gradients now
                _, gx, gw = ops.linear_cross_entropy(sx.get(), sw.get(), st.get(), vocab_size)
            else:            # computed in the forward: x, w, targets must be the forward's still
                sx.get(), sw.get(), st.get()
            if unit and dy is unit[0]:   # the loss is the root, seeded with 1: nothing to scale
                return [(ix, gx), (iw, gw)]
            return [(ix, ops.scale(gx, dy)), (iw, ops.scale(gw, dy))]

        return self._record(loss, backward)
    # -- the reverse sweep -----------------------------------------------------------------
    def backward(self, root: TVar, seed_grad: Optional[Tensor] = None) -> list:
        """Sweep from ``root`` down, seeded with ``seed_grad`` (``dL/droot``; ones by default).

        Fan-in is accumulated with ``ops.add``, or by the rule itself where a node asked for its
        input's gradient so far (``_record``'s ``into``: layernorm adds it in its backward's
        last pass); each interior gradient is freed as soon as its node has consumed it.
        Returns the per-node gradient list (also ``self.grads``): leaves reached keep theirs,
        every other entry is None. A tape is swept once. Unlike torch, a root of any shape
        takes the default seed (ones: the gradient of the sum of the root's elements).

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> x = t.leaf(fm.tensor([1.0, 2.0]))
        >>> y = t.add(x, x)
        >>> grads = t.backward(y, fm.tensor([1.0, 10.0]))
        >>> grads[x.id].numpy().tolist(), grads[y.id]                # interior entries: None
        ([2.0, 20.0], None)
        """
        if not isinstance(root, TVar):
            raise TapeError(f"backward: root must be a TVar of this tape, got {type(root).__name__}")
        self._check(root)
        if not self.records:
            raise TapeError("backward: this tape was made with grad=False and recorded nothing to "
                            "sweep; record the forward on a Tape() to get gradients")
        if self._swept:
            raise TapeError("backward: this tape was already swept; record a new forward")
        if not root.t.dtype.is_float:   # (its default seed was integer ones, its "gradient")
            raise DTypeError(f"backward: root is {root.t.dtype.name} {root.t.shape}: expected a "
                             "float value; an integer one has no gradient")
        if seed_grad is None:
            seed_grad = ones_like(root.t)
            self._unit_seed.append(seed_grad)
        # Checked before the sweep starts: a wrong seed found by the first rule would leave
        # the tape swept, its closures gone, and name an op the caller never called.
        if not isinstance(seed_grad, Tensor):
            raise TapeError(f"backward: seed_grad must be a forge_ml Tensor like the root "
                            f"({root.t.dtype.name} {root.t.shape} on {root.t.device}), got "
                            f"{type(seed_grad).__name__}")
        if seed_grad.shape != root.t.shape:
            raise ShapeError(f"backward: seed_grad is {seed_grad.shape} but root is {root.t.shape}")
        if seed_grad.dtype != root.t.dtype or seed_grad.device != root.t.device:
            raise TapeError(f"backward: seed_grad is {seed_grad.dtype.name} on {seed_grad.device} "
                            f"but root is {root.t.dtype.name} on {root.t.device}; they must agree")
        self._swept = True
        try:
            grads = self._sweep(root, seed_grad)
        finally:
            # the tape is swept once: every rule left (nodes above root, a branch the root does
            # not use, the rest after an error) can never run; drop them and what they saved
            self._nodes = [None] * len(self._nodes)
            self._into.clear()
            self._sums.clear()
        self.grads = grads
        return grads

    def _sweep(self, root: TVar, seed_grad: Tensor) -> list:
        """``backward``'s reverse sweep from ``root`` (checked) seeded with ``seed_grad``."""
        grads: list[Optional[Tensor]] = [None] * len(self._nodes)
        grads[root.id] = seed_grad
        for i in range(root.id, -1, -1):
            if grads[i] is None:
                continue
            f = self._nodes[i]
            if f is None:
                continue  # a leaf: keep its gradient
            self._nodes[i] = None
            dy, grads[i] = grads[i], None
            into = self._into.pop(i, None)
            kw = {}
            if i in self._sums_to:   # dy's row sums, if a layernorm wrote dy as it is now
                made = self._sums.pop(i, None)
                kw["sums"] = made[1] if made is not None and made[0] is dy else None
            if into is None:
                out = f(dy, **kw)
            else:   # the rule adds the parent's gradient so far in its own kernel
                out = f(dy, grads[into], **kw)
                grads[into] = None
            for pid, g in out:
                acc = grads[pid]
                if acc is None:
                    grads[pid] = g
                else:
                    grads[pid] = ops.add(acc, g)
                    self._sums.pop(pid, None)   # sums of the old gradient: no longer its own (frees it)
        return grads

    def grad(self, v: TVar) -> Optional[Tensor]:
        """The gradient ``backward`` left for ``v`` (a leaf), or None if it was not reached.

        >>> import numpy as np, forge_ml as fm
        >>> t = fm.Tape()
        >>> x, unused = t.leaf(fm.tensor([0.0])), t.leaf(fm.tensor([0.0]))
        >>> _ = t.backward(t.gelu(x))
        >>> t.grad(x).numpy().tolist(), t.grad(unused)
        ([0.5], None)
        """
        self._check(v)
        return self.grads[v.id] if v.id < len(self.grads) else None
