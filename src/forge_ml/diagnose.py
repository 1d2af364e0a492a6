"""Where a NaN comes from: ``CheckingTape``, a tape that checks every op's output in the
forward and every gradient in the backward, and names the first op, layer and tensor that
produced a NaN or an infinity. The trainer re-runs a step that went non-finite on it; no
peer does this without a slow global mode.

>>> import numpy as np, forge_ml as fm
>>> tape = CheckingTape({})
>>> x = tape.leaf(fm.tensor(np.array([1.0, -1.0], np.float32)))
>>> _ = tape.gelu(x); tape.found is None
True
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .autograd import Tape, TVar
from .errors import plural

_CHECKED_OPS = ("add", "matmul", "matmul_gelu", "matmul_add", "mlp", "gelu", "layernorm",
                "softmax", "split_heads", "merge_heads", "reshape", "attention", "attention_qkv",
                "embedding", "dropout", "cross_entropy", "linear_cross_entropy")


def _bad_values(t) -> Optional[str]:
    """None when every value of Tensor (or NumPy array) ``t`` is finite, else what is wrong,
    e.g. "3 NaN and 1 inf of 64 values".

    >>> _bad_values(np.array([1.0, np.nan, np.inf, -np.inf])), _bad_values(np.ones(3))
    ('1 NaN and 2 inf of 4 values', None)
    """
    a = t if isinstance(t, np.ndarray) else np.asarray(t.numpy())   # (no float64 copy of a big weight)
    if np.isfinite(a).all():
        return None
    n_nan, n_inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    parts = [f"{n_nan} NaN" if n_nan else "", f"{n_inf} inf" if n_inf else ""]
    return " and ".join(p for p in parts if p) + f" of {a.size} values"


def nonfinite_params(params: dict) -> tuple:
    """``(n, listed)``: how many of the tensors in ``params`` (name -> Tensor or array) hold
    NaN or inf, and the first three said with ``_bad_values`` (and how many more), for the
    errors and warnings about weights that cannot be trained or run from.

    >>> nonfinite_params({"a": np.ones(2), "b": np.array([np.nan, 1.0])})
    (1, 'b: 1 NaN of 2 values')
    """
    bad = [(n, b) for n, b in ((n, _bad_values(t)) for n, t in params.items()) if b]
    listed = "; ".join(f"{n}: {b}" for n, b in bad[:3])
    if len(bad) > 3:
        listed += f"; and {len(bad) - 3} {plural(len(bad) - 3, 'tensor')} more"
    return len(bad), listed


def _where(op: str, params: list) -> str:
    """The part of GPT-2 an op belongs to, from the parameters it used (an op without any
    belongs where the last op with some did: the loss after the LM head's product, the
    attention after its layer's qkv product).

    >>> _where("embedding", ["wte.weight", "wpe.weight"]), _where("matmul", ["wte.weight"])
    ('the embeddings', 'the LM head')
    """
    if not params:
        return "the model"
    p = params[0]
    if p.startswith("h."):
        return f"layer {p.split('.')[1]}"
    if p == "wte.weight" and op in ("matmul", "linear_cross_entropy") or p.startswith("lm_head"):
        return "the LM head"
    if p.startswith("ln_f"):
        return "the final layer norm"
    return "the embeddings"


class CheckingTape(Tape):
    """A Tape that checks the output of every op it records (forward) and every gradient each
    backward rule returns (backward), and keeps in ``found`` a line about the first value
    that is not finite. ``names``: id(Tensor) -> parameter name, to name leaves and layers.

    >>> import forge_ml as fm
    >>> x, w = fm.tensor([[1e30]]), fm.tensor([[1e30]])
    >>> tape = CheckingTape({id(w): "h.0.mlp.c_fc.weight"})
    >>> _ = tape.matmul(tape.leaf(x), tape.leaf(w)); print(tape.found)  # doctest: +NORMALIZE_WHITESPACE
    forward: matmul in layer 0 (h.0.mlp.c_fc.weight) produced 1 inf of 1 values in its output
    (1, 1), from finite inputs
    """

    def __init__(self, names: dict):
        super().__init__()
        self._param_of = {}         # leaf node id -> parameter name
        self._info = {}             # node id -> (op, where, parameter names)
        self._names = names
        self._last = "the model"    # where the last op that used parameters belongs
        self.found: Optional[str] = None

    def leaf(self, t) -> TVar:
        v = super().leaf(t)
        name = self._names.get(id(t))
        if name is not None:
            self._param_of[v.id] = name
            bad = _bad_values(t) if self.found is None else None
            if bad:
                self.found = (f"the parameter {name} already held {bad} before the step "
                              f"(a previous update or the loaded weights put them there)")
        return v

    def _record(self, t, f, into=None, sums=False):
        node = len(self._nodes)

        def checked(dy, *acc, **kw):
            if self.found is None:
                bad = _bad_values(dy)
                if bad:
                    op, where, _ = self._info.get(node, ("an op", "the model", []))
                    self.found = (f"backward: the gradient reaching {op}'s output in {where} held {bad} "
                                  f"(gradients of two uses of one tensor overflowed when added)")
            grads = f(dy, *acc, **kw)
            if self.found is None:
                op, where, params = self._info.get(node, ("an op", "the model", []))
                for pid, g in grads:
                    bad = _bad_values(g)
                    if bad:
                        into = self._param_of.get(pid)
                        what = (f"the gradient of {into}" if into else
                                f"the gradient of its input (the output of {self._info.get(pid, ('an op',))[0]})")
                        self.found = (f"backward of {op} in {where}" + (f" ({', '.join(params)})" if params else "")
                                      + f" produced {bad} in {what} {tuple(g.shape)}, from finite inputs")
                        break
            return grads

        return super()._record(t, checked, into, sums)


def _checked_op(op: str):
    base = getattr(Tape, op)

    def method(self, *args, **kw):
        params = [self._param_of[a.id] for a in list(args) + list(kw.values())
                  if isinstance(a, TVar) and a.id in self._param_of]
        if params:
            self._last = _where(op, params)
        where = self._last          # an op without parameters belongs where the last one with some did
        first = len(self._nodes)
        out = base(self, *args, **kw)
        for v in (out if isinstance(out, tuple) else (out,)):
            if v.id < first:
                continue  # not a new node (dropout with p = 0 returns its input)
            self._info[v.id] = (op, where, params)
            if self.found is None:
                bad = _bad_values(v.t)
                if bad:
                    self.found = (f"forward: {op} in {where}" + (f" ({', '.join(params)})" if params else "")
                                  + f" produced {bad} in its output {tuple(v.t.shape)}, from finite inputs")
        return out

    method.__name__, method.__qualname__ = op, f"CheckingTape.{op}"
    method.__doc__ = (f"``Tape.{op}`` (its example there), its outputs and its backward's "
                      f"gradients checked for NaN and inf: the first bad one is named in ``found`` "
                      f"(CheckingTape's example).")
    return method


for _op in _CHECKED_OPS:
    setattr(CheckingTape, _op, _checked_op(_op))


def gpt2_loss_numpy(cfg, params: dict, ids, targets) -> float:
    """GPT-2's mean next-token cross-entropy for ``ids`` and ``targets`` ``(B, T)``, written
    out in float64 NumPy without any forge-ml op: the independent reference that
    ``forge-ml check`` holds forge-ml's own float64 model to (its float64 run shares the
    NumPy kernels with a CPU that has no C kernels, so it cannot be its own reference).
    ``params``: name -> array, as ``GPT2.state_dict()``; ``cfg``: its ``GPT2Config``.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> from forge_ml import tensor
    >>> cfg = GPT2Config(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> m = GPT2.init(cfg, seed=0, dtype="float64")
    >>> x, y = np.array([[1, 2, 3]]), np.array([[2, 3, 4]])
    >>> got = gpt2_loss_numpy(cfg, m.state_dict(), x, y)
    >>> bool(abs(got - m.loss_and_grads(tensor(x), tensor(y))[0]) < 1e-12)
    True
    """
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x, y = np.asarray(ids), np.asarray(targets)
    B, T = x.shape
    C, H = cfg.n_embd, cfg.n_head

    def ln(a, p):
        d = a - a.mean(-1, keepdims=True)
        rstd = 1.0 / np.sqrt((d * d).mean(-1, keepdims=True) + cfg.layernorm_eps)
        return d * rstd * w[p + ".weight"] + w[p + ".bias"]

    def lin(a, p):
        return a @ w[p + ".weight"] + w[p + ".bias"]

    def heads(a):
        return a.reshape(B, T, H, C // H).transpose(0, 2, 1, 3)

    h = w["wte.weight"][x] + w["wpe.weight"][:T]
    masked = np.triu(np.ones((T, T), bool), 1)
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        q, k, v = (heads(a) for a in np.split(lin(ln(h, p + "ln_1"), p + "attn.c_attn"), 3, -1))
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(C // H)
        s[..., masked] = -np.inf
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        h = h + lin((s @ v).transpose(0, 2, 1, 3).reshape(B, T, C), p + "attn.c_proj")
        u = lin(ln(h, p + "ln_2"), p + "mlp.c_fc")
        u = 0.5 * u * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (u + 0.044715 * u ** 3)))
        h = h + lin(u, p + "mlp.c_proj")
    head = w["wte.weight"] if cfg.tied_head else w["lm_head.weight"]
    z = (ln(h, "ln_f") @ head.T)[..., :cfg.vocab_size]
    m = z.max(-1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(-1)) + m[..., 0]
    return float((lse - np.take_along_axis(z, y[..., None], -1)[..., 0]).mean())


def check_reference(cfg, params: dict, ids, targets, loss: float, grads: dict,
                    seed: int = 0) -> Optional[str]:
    """None when forge-ml's float64 ``loss`` and ``grads`` (name -> array) for ``params``
    agree with ``gpt2_loss_numpy`` (the loss within 1e-9, relative) and each gradient with
    central differences of it along a random direction (within 1e-5 of the gradient's norm);
    else a line naming what disagrees, and by how much.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> from forge_ml import tensor
    >>> cfg = GPT2Config(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> m = GPT2.init(cfg, seed=0, dtype="float64")
    >>> x, y = np.array([[1, 2, 3]]), np.array([[2, 3, 4]])
    >>> loss, g = m.loss_and_grads(tensor(x), tensor(y))
    >>> g = {k: t.numpy() for k, t in g.items()}
    >>> check_reference(cfg, m.state_dict(), x, y, loss, g) is None
    True
    >>> g["h.0.mlp.c_fc.bias"] *= 1.01
    >>> print(check_reference(cfg, m.state_dict(), x, y, loss, g))  # doctest: +ELLIPSIS
    the gradient of h.0.mlp.c_fc.bias is off from central differences of ... by ...e-03 ...
    """
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    want = gpt2_loss_numpy(cfg, w, ids, targets)
    if not abs(loss - want) <= 1e-9 * abs(want):     # (False for a NaN)
        return (f"the float64 loss {loss:.9f} is not plain NumPy's GPT-2 loss {want:.9f} "
                f"(a forward op computes something else)")
    rs = np.random.default_rng(seed)
    for k in sorted(grads):
        g = np.asarray(grads[k], np.float64)
        d = rs.standard_normal(g.shape)
        t = 1e-4 * max(float(np.abs(w[k]).max()), 1.0) / max(float(np.abs(d).max()), 1.0)
        plus = gpt2_loss_numpy(cfg, {**w, k: w[k] + t * d}, ids, targets)
        minus = gpt2_loss_numpy(cfg, {**w, k: w[k] - t * d}, ids, targets)
        fd, an = (plus - minus) / (2 * t), float((g * d).sum())
        err = abs(fd - an) / max(float(np.sqrt((g * g).sum())), 1e-12)
        if not err <= 1e-5:
            return (f"the gradient of {k} is off from central differences of plain NumPy's "
                    f"GPT-2 loss by {err:.1e} of its norm (along a random direction: "
                    f"{an:.6e} against {fd:.6e}; a backward op computes something else)")
    return None
