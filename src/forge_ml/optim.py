"""AdamW with float32 master weights, the warmup + cosine learning-rate schedule, and
global-norm gradient clipping.

The optimizer never loops over elements in Python: each parameter takes one fused
``ops.adamw_update`` per step, and clipping costs one ``ops.sumsq`` per gradient plus a
single host sync; its factor rides along as ``adamw_update``'s ``grad_scale`` instead of a
separate pass that rescales every gradient.

>>> import numpy as np, forge_ml as fm
>>> params = {"w": fm.tensor(np.ones((2, 2), np.float32)), "b": fm.tensor(np.zeros(2, np.float32))}
>>> opt = AdamW(params, lr=0.1, weight_decay=0.0)
>>> opt.step({"w": fm.tensor(np.ones((2, 2), np.float32)), "b": fm.tensor(np.ones(2, np.float32))})
>>> round(params["w"].numpy()[0, 0].item(), 4), opt.steps
(0.9, 1)
"""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional

import numpy as np

from . import dtype as _dt
from . import ops
from .errors import ConfigError, DTypeError, ShapeError
from .tensor import Tensor, backend_of, tensor, zeros


def _hyper(who: str, lr, betas, eps, weight_decay) -> tuple:
    """``(lr, (beta1, beta2), eps, weight_decay)`` as floats, or a ConfigError naming ``who``
    and what came: betas two numbers in [0, 1), lr >= 0, eps > 0, weight_decay >= 0, all finite."""
    try:
        b1, b2 = (float(b) for b in betas)
        lr, eps, weight_decay = float(lr), float(eps), float(weight_decay)
    except (TypeError, ValueError):
        raise ConfigError(f"{who}: betas must be two numbers (beta1, beta2) and lr, eps, weight_decay "
                          f"numbers; got betas={betas!r}, lr={lr!r}, eps={eps!r}, "
                          f"weight_decay={weight_decay!r}") from None
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ConfigError(f"{who}: betas must be in [0, 1), got {(b1, b2)}")
    bad = [f"{k}={v}" for k, v, ok in (("lr", lr, 0 <= lr < math.inf), ("eps", eps, 0 < eps < math.inf),
                                         ("weight_decay", weight_decay, 0 <= weight_decay < math.inf)) if not ok]
    if bad:     # a NaN or inf would turn every weight into NaN at the first step
        raise ConfigError(f"{who}: expected finite lr >= 0, eps > 0, weight_decay >= 0; got {', '.join(bad)}")
    return lr, (b1, b2), eps, weight_decay


class AdamW:
    """AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019) over a dict
    of parameters, with torch.optim.AdamW's update rule.

    Weight decay applies to tensors of rank >= 2 only (matmul weights and embeddings);
    biases and layer-norm gains are exempt, as in GPT-2 / nanoGPT / llm.c training. Bias
    correction counts each parameter's own updates, as torch does: a parameter that had no
    gradient for a while starts its correction where it started updating.

    Mixed precision is the optimizer's (llm.c's ``master_weights``): with
    ``compute_dtype="bfloat16"`` it keeps the float32 tensors it was given as the masters
    (``params``), its moments beside them, and puts bf16 compute copies in their place in the
    dict it was given (``compute``: the model's ``params``), which every fused update rewrites
    from the new masters. The model then computes in bf16 and knows nothing of the masters.

    >>> import numpy as np, forge_ml as fm
    >>> opt = AdamW({"w": fm.zeros((3, 4)), "b": fm.zeros(4)}, lr=1e-3)
    >>> opt.decays("w"), opt.decays("b")
    (True, False)
    """

    def __init__(self, params: dict, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, compute_dtype=None, lowp: Optional[dict] = None):
        if not isinstance(params, dict):
            raise ConfigError(f"AdamW: params must be a dict of name -> Tensor (model.params), got "
                              f"{type(params).__name__}")
        if not params:
            raise ConfigError("AdamW: expected at least one parameter, got an empty dict")
        lr, (b1, b2), eps, weight_decay = _hyper("AdamW", lr, betas, eps, weight_decay)
        seen = {}
        for name, p in params.items():
            if not isinstance(p, Tensor) or p.dtype.name not in ("float32", "float64"):
                what = p.dtype.name if isinstance(p, Tensor) else type(p).__name__
                raise ConfigError(f"AdamW: parameter {name} must be a float32 master Tensor, got {what}")
            if id(p) in seen:   # one tensor, two moments, two updates a step
                raise ConfigError(f"AdamW: parameters {seen[id(p)]} and {name} are the same tensor; "
                                  "give a tied weight once")
            seen[id(p)] = name
        self.params = dict(params)          # the float32 masters
        self.compute = params               # what the model computes with
        if lowp is not None:
            warnings.warn("AdamW(lowp=...) is deprecated: use compute_dtype='bfloat16'",
                          DeprecationWarning, stacklevel=2)
            self._lowp = lowp
        elif compute_dtype is not None and _dt.get(compute_dtype) != _dt.float32:
            if _dt.get(compute_dtype) != _dt.bfloat16:
                raise ConfigError(f"AdamW: compute_dtype must be float32 or bfloat16, got {compute_dtype!r}")
            for name, p in self.params.items():
                if not backend_of(p.device).bf16:
                    raise ConfigError(f"AdamW: bfloat16 compute copies need a device with bf16 "
                                      f"storage; {name} is on {p.device}")
                params[name] = p.to("bfloat16")
            self._lowp = params
        else:
            self._lowp = None
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), (b1, b2), float(eps), float(weight_decay)
        # Moments live beside their parameter: same device, same (float32) dtype.
        self.m = {k: zeros(p.shape, p.dtype, p.device) for k, p in self.params.items()}
        self.v = {k: zeros(p.shape, p.dtype, p.device) for k, p in self.params.items()}
        self._scalars = None  # prepare()'s device tensor (ops.STEP_SCALARS)
        self.steps = 0  # step() calls so far (the schedule's clock)
        self.param_steps = {k: 0 for k in self.params}  # updates each parameter has taken

    @property
    def lowp(self) -> Optional[dict]:
        """The bf16 compute copies (None in float32)."""
        return self._lowp

    def decays(self, name: str) -> bool:
        """Whether parameter ``name`` takes weight decay (rank >= 2)."""
        return self.params[name].ndim >= 2

    def _weight_decay(self, name: str) -> float:
        return self.weight_decay if self.decays(name) else 0.0

    def _known(self, grads: dict, what: str) -> None:
        """Every gradient names a parameter: one under another name (a typo, another model's
        dict) would leave its parameter without an update and no word of it."""
        if not isinstance(grads, dict):
            raise ConfigError(f"AdamW.{what}: expected a dict of gradients by parameter name, "
                              f"got {type(grads).__name__}")
        unknown = [k for k in grads if k not in self.params]
        if unknown:
            raise ConfigError(f"AdamW.{what}: gradients for {len(unknown)} name(s) that are not "
                              f"parameters of this optimizer: {sorted(map(str, unknown))[:5]}; "
                              f"parameters are e.g. {list(self.params)[:5]}")

    def _fit(self, grads: dict, names: list, what: str) -> None:
        """Every gradient of ``names`` fits its parameter (a float tensor of its shape, on its
        device), checked before anything is counted or written: a refused step counted a step
        (every later bias correction shifted), and the one-parameter-at-a-time path updated
        the parameters before the bad one. The error names the parameter."""
        for n in names:
            ops._adamw_check(f"AdamW.{what}, the gradient of {n!r}", self.params[n], grads[n],
                             self.m[n], self.v[n], None if self._lowp is None else self._lowp[n])

    def step(self, grads: dict, lr: Optional[float] = None, grad_scale: float = 1.0) -> None:
        """One update of every parameter that has a gradient (a None gradient skips its
        parameter, moments and step count untouched, as torch does). Gradients are
        multiplied by ``grad_scale`` inside the fused op (gradient accumulation's 1/n and the
        clip factor).

        >>> import numpy as np, forge_ml as fm
        >>> p = {"w": fm.tensor(np.zeros((1, 1), np.float32))}
        >>> opt = AdamW(p, lr=0.5); opt.step({"w": fm.tensor(np.full((1, 1), 3.0, np.float32))})
        >>> round(p["w"].item(), 4)
        -0.5
        """
        self._known(grads, "step")
        lr = self.lr if lr is None else _step_value("step", "lr", lr)
        grad_scale = _step_value("step", "grad_scale", grad_scale, signed=True)
        names = [n for n in self.params if grads.get(n) is not None]
        self._fit(grads, names, "step")
        self.steps += 1
        b1, b2 = self.betas
        for name in names:
            self.param_steps[name] += 1
        ops.adamw_update_many(
            [self.params[n] for n in names], [grads[n] for n in names], [self.m[n] for n in names],
            [self.v[n] for n in names], lr=lr, beta1=b1, beta2=b2, eps=self.eps,
            weight_decays=[self._weight_decay(n) for n in names],
            steps=[self.param_steps[n] for n in names], grad_scale=float(grad_scale),
            p_lowps=None if self._lowp is None else [self._lowp[n] for n in names])

    # -- a step whose values live in device memory (a captured graph replays it) ------------
    def prepare(self, lr: Optional[float] = None, grad_scale: float = 1.0) -> Tensor:
        """Write the next step's values into ``scalars`` (``ops.STEP_SCALARS``: lr, the bias
        corrections of step ``steps + 1``, ``grad_scale``; the norm slot NaN) and return it,
        for ``update``. Every parameter must have taken the same number of steps (the
        corrections are shared); a ConfigError says which did not.

        >>> import numpy as np, forge_ml as fm
        >>> opt = AdamW({"w": fm.zeros((2, 2))}, lr=0.1, betas=(0.9, 0.99))
        >>> [round(x, 4) for x in opt.prepare().numpy().tolist()[:3]]
        [0.1, 0.1, 0.01]
        """
        values = self._step_values(lr, grad_scale)
        first = next(iter(self.params.values()))
        if self._scalars is None:
            self._scalars = tensor(values, device=first.device)
        else:
            ops.assign(self._scalars, values)
        return self._scalars

    def _step_values(self, lr: Optional[float], grad_scale: float, ahead: int = 0) -> np.ndarray:
        """``prepare``'s values (float64, ``ops.STEP_SCALARS``) for the step ``ahead`` steps
        after the next (a step queued and not yet counted by ``advance``)."""
        counts = set(self.param_steps.values())
        if len(counts) != 1:
            late = sorted(k for k, n in self.param_steps.items() if n != max(counts))[:3]
            raise ConfigError(f"AdamW.prepare: parameters have taken different numbers of steps "
                              f"({min(counts)}..{max(counts)}; e.g. {late}): a step with shared "
                              "bias corrections needs them equal; use step()")
        step = counts.pop() + 1 + int(ahead)
        b1, b2 = self.betas
        lr = self.lr if lr is None else _step_value("prepare", "lr", lr)
        grad_scale = _step_value("prepare", "grad_scale", grad_scale, signed=True)
        return np.array([lr, 1.0 - b1 ** step, 1.0 - b2 ** step,
                         grad_scale, float("nan"), float(step)], np.float64)

    @property
    def scalars(self) -> Optional[Tensor]:
        """The device tensor ``prepare`` writes (``ops.STEP_SCALARS``); None before it ran."""
        return self._scalars

    def update(self, grads: dict, scalars: Tensor) -> None:
        """The update of every parameter with the values in ``scalars`` (``prepare``'s, the
        factor perhaps rewritten by ``ops.clip_scale``): launches only, nothing read back, so
        it can be captured. Call ``advance()`` once the step is known to have been taken.
        Every parameter needs a gradient.

        >>> import numpy as np, forge_ml as fm
        >>> p = {"w": fm.tensor(np.zeros((1, 1), np.float32))}
        >>> opt = AdamW(p, lr=0.5)
        >>> opt.update({"w": fm.tensor(np.full((1, 1), 3.0, np.float32))}, opt.prepare())
        >>> round(p["w"].item(), 4), opt.steps       # updated; not counted until advance()
        (-0.5, 0)
        """
        self._known(grads, "update")
        b1, b2 = self.betas
        names = list(self.params)
        for name in names:
            if grads.get(name) is None:
                raise ConfigError(f"AdamW.update: no gradient for {name}; a captured step updates "
                                  "every parameter (use step())")
        self._fit(grads, names, "update")
        ops.adamw_update_many(
            [self.params[n] for n in names], [grads[n] for n in names], [self.m[n] for n in names],
            [self.v[n] for n in names], beta1=b1, beta2=b2, eps=self.eps,
            weight_decays=[self._weight_decay(n) for n in names], scalars=scalars,
            p_lowps=None if self._lowp is None else [self._lowp[n] for n in names])

    def advance(self) -> None:
        """Count a step taken through ``update`` (the host's step counters).

        >>> import forge_ml as fm
        >>> opt = AdamW({"w": fm.zeros((2, 2))}); opt.update({"w": fm.zeros((2, 2))}, opt.prepare())
        >>> opt.advance(); opt.steps, opt.param_steps
        (1, {'w': 1})
        """
        self.steps += 1
        for k in self.param_steps:
            self.param_steps[k] += 1

    def state_dict(self) -> dict:
        """Moments as NumPy (``m``, ``v``: name -> array), the step counts and hyper-parameters.

        >>> import forge_ml as fm
        >>> sorted(AdamW({"w": fm.zeros((2, 2))}).state_dict())
        ['betas', 'eps', 'lr', 'm', 'param_steps', 'step', 'v', 'weight_decay']
        """
        return dict(counters(self), m={k: t.numpy() for k, t in self.m.items()},
                    v={k: t.numpy() for k, t in self.v.items()})

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s moments and step counts (hyper-parameters too where
        present). A state without ``param_steps`` (an older checkpoint) gives every parameter
        the global step count.

        >>> import forge_ml as fm
        >>> a = AdamW({"w": fm.zeros((2, 2))}); s = a.state_dict(); s["step"] = 5; del s["param_steps"]
        >>> a.load_state_dict(s); a.steps, a.param_steps["w"]
        (5, 5)
        """
        where = "AdamW.load_state_dict"
        if not isinstance(state, dict):   # (None: an AttributeError from deep inside)
            raise ConfigError(f"{where}: expected a dict from state_dict(), got "
                              f"{type(state).__name__}")
        hyper = _hyper(where, state.get("lr", self.lr), state.get("betas", self.betas),
                       state.get("eps", self.eps), state.get("weight_decay", self.weight_decay))
        # every check before anything is assigned: a bad step count came after the moments
        # were replaced, leaving the optimizer half loaded
        steps = _count_value(where, "step", state.get("step", 0))
        saved_steps = state.get("param_steps") or {}
        if not isinstance(saved_steps, dict):
            raise ConfigError(f"{where}: param_steps must be a dict of parameter names to step "
                              f"counts, got {type(saved_steps).__name__}")
        param_steps = {k: _count_value(where, f"param_steps[{k!r}]", saved_steps.get(k, steps))
                       for k in self.params}
        moments = {}
        for key in ("m", "v"):
            saved = state.get(key)
            if not isinstance(saved, dict):
                raise ConfigError(f"AdamW.load_state_dict: missing moments {key!r}")
            missing = sorted(set(self.params) - set(saved))
            extra = sorted(set(saved) - set(self.params))
            if missing or extra:
                raise ConfigError(f"AdamW.load_state_dict: moments {key!r} do not match the parameters "
                                  f"(missing {missing[:5]}, unexpected {extra[:5]})")
            for name, p in self.params.items():
                moments[key, name] = _moment(where, key, name, saved[name], p.shape)
        # every moment read and checked before one is assigned: a bad v (strings, None) came
        # after the m were replaced, and None, NaN or a negative v made every weight NaN at
        # the next step
        self.m = {k: tensor(moments["m", k], dtype=p.dtype, device=p.device)
                  for k, p in self.params.items()}
        self.v = {k: tensor(moments["v", k], dtype=p.dtype, device=p.device)
                  for k, p in self.params.items()}
        self.steps, self.param_steps = steps, param_steps
        self.lr, self.betas, self.eps, self.weight_decay = hyper


def _moment(where: str, key: str, name, value, shape: tuple) -> np.ndarray:
    """A saved moment ``key[name]`` as a host array (its own dtype) of the parameter's
    ``shape``, of finite numbers, none negative in ``v`` (squared gradients); else a
    ShapeError or ConfigError naming it (a NaN or negative moment, or None, turned its
    weights into NaN at the next step).

    >>> _moment("load", "v", "w", [[1.0, -2.0]], (1, 2))
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: load: v[w] must hold finite numbers >= 0, got -2.0 in it
    """
    if isinstance(value, Tensor):
        value = value.numpy()
    try:
        a = np.asarray(value)
    except (TypeError, ValueError, RuntimeError):
        a = None
    if a is None or a.dtype.kind not in "fiub":
        what = type(value).__name__ + ("" if a is None else f" (dtype {a.dtype})")
        raise ConfigError(f"{where}: {key}[{name}] must be an array of numbers, got {what}")
    if tuple(a.shape) != shape:
        raise ShapeError(f"{where}: {key}[{name}] is {tuple(a.shape)} but the parameter is "
                         f"{shape}")
    bad = ~np.isfinite(a) | ((a < 0) if key == "v" else False)
    if bad.any():
        want = "finite numbers >= 0" if key == "v" else "finite numbers"
        raise ConfigError(f"{where}: {key}[{name}] must hold {want}, got {a[bad].flat[0]} in it")
    return a


def _count_value(where: str, name: str, v) -> int:
    """A saved step count: an int >= 0 (NumPy's too; not a bool), else a ConfigError.

    >>> _count_value("load", "step", np.int64(3))
    3
    """
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0:
        return int(v)
    raise ConfigError(f"{where}: {name} must be a step count (an int >= 0), got {v!r:.40}")


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _step_value(where: str, name: str, value, signed: bool = False) -> float:
    """``value`` as a float: finite, and >= 0 unless ``signed``; else a ConfigError (a NaN
    or infinite learning rate or factor would write NaN into every weight).

    >>> _step_value("step", "lr", float("nan"))
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: AdamW.step: lr must be a finite number >= 0, got nan
    """
    if not _finite(value) or (not signed and float(value) < 0):
        raise ConfigError(f"AdamW.{where}: {name} must be a finite number{'' if signed else ' >= 0'}, "
                          f"got {value!r}")
    return float(value)


def cosine_lr(step: int, max_lr: float, warmup: int, max_steps: int, min_lr: float) -> float:
    """Learning rate at 0-based ``step``: linear warmup to ``max_lr`` over ``warmup`` steps
    (``max_lr * (step + 1) / warmup``, llm.c's form, so step 0 already moves), then a cosine
    from ``max_lr`` down to ``min_lr`` at ``max_steps``, and ``min_lr`` after that
    (SGDR, Loshchilov & Hutter 2017, without restarts). A warmup longer than ``max_steps``
    runs to its end (no cosine), then ``min_lr``: the warmup comes first.

    >>> cosine_lr(0, 1.0, 10, 110, 0.1), cosine_lr(9, 1.0, 10, 110, 0.1)
    (0.1, 1.0)
    >>> round(cosine_lr(60, 1.0, 10, 110, 0.1), 4), cosine_lr(500, 1.0, 10, 110, 0.1)
    (0.55, 0.1)

    A negative or fractional step count, or a negative or non-finite rate, is a ConfigError
    (a negative warmup moved the cosine; a step before 0 gave a negative rate).
    """
    for name, v in (("step", step), ("warmup", warmup), ("max_steps", max_steps)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ConfigError(f"cosine_lr: {name} must be an int >= 0, got {v!r:.40}")
    for name, v in (("max_lr", max_lr), ("min_lr", min_lr)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf:
            raise ConfigError(f"cosine_lr: {name} must be a finite number >= 0, got {v!r:.40}")
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= max_steps or max_steps <= warmup:
        return min_lr
    ratio = (step - warmup) / (max_steps - warmup)      # 0 -> 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))     # 1 -> 0
    return min_lr + coeff * (max_lr - min_lr)


def counters(opt) -> dict:
    """An AdamW's state but its moments (``state_dict()`` without ``m`` and ``v``): the step
    counts and hyper-parameters, of an ``AdamW`` or anything holding the same attributes (a
    sharded one).

    >>> import forge_ml as fm
    >>> sorted(counters(AdamW({"w": fm.zeros((2, 2))})))
    ['betas', 'eps', 'lr', 'param_steps', 'step', 'weight_decay']
    """
    return {"step": opt.steps, "lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
            "weight_decay": opt.weight_decay, "param_steps": dict(opt.param_steps)}


def accumulate(acc: Optional[dict], grads: dict, in_float32: bool = False) -> dict:
    """``grads`` added into ``acc`` (None for the first micro-batch), name by name, after a cast
    to float32 where ``in_float32`` (bf16 gradients of several micro-batches add up in
    float32).

    >>> import forge_ml as fm
    >>> acc = accumulate(None, {"w": fm.tensor([1.0])})
    >>> accumulate(acc, {"w": fm.tensor([2.0])})["w"].numpy().tolist()
    [3.0]

    A name missing from (or None in) a micro-batch's ``grads`` keeps its sum so far; a name
    new in it is added (the union of the names, as torch's ``.grad`` accumulates).
    """
    if not isinstance(grads, dict) or not (acc is None or isinstance(acc, dict)):
        raise ConfigError(f"accumulate: expected dicts of name -> gradient, got {type(acc).__name__} and "
                          f"{type(grads).__name__}")
    if in_float32:
        grads = {k: None if g is None else g.to("float32") for k, g in grads.items()}
    if acc is None:
        return dict(grads)
    # a name without a gradient in this micro-batch keeps its sum; a name new in it starts one
    # (the first form kept only this micro-batch's names: an earlier sum was dropped)
    out = dict(acc)
    for k, g in grads.items():
        if g is not None:
            out[k] = g if out.get(k) is None else ops.add(out[k], g)
    return out


def grad_sumsq(grads: dict):
    """The sum of every (non-None) gradient's squares: ``(host float, device 0-d Tensor or
    None)``: on one device one ``ops.sumsq_total`` (no wait); in host memory one ``ops.sumsq``
    per tensor (or the backend's ``sumsq_many``), the sums added in float64.

    >>> import numpy as np, forge_ml as fm
    >>> grad_sumsq({"a": fm.tensor(np.array([3.0], np.float32))})
    (9.0, None)
    """
    host = 0.0
    dev = None
    gs = [g for g in grads.values() if g is not None]
    bk = backend_of(gs[0].device) if gs else None
    many = getattr(bk, "sumsq_many", None) if bk is not None and bk.host_memory else None
    if many is not None and all(g.device == gs[0].device for g in gs):
        for s in many([g.data for g in gs]):   # one call; added in float64 in the same order
            host += float(s)
        return host, None
    if bk is not None and not bk.host_memory and all(g.device == gs[0].device for g in gs):
        return host, ops.sumsq_total(gs)   # one call: the GPU's table of the tensors
    for g in gs:
        s = ops.sumsq(g)
        if backend_of(s.device).host_memory:
            host += s.item()
        else:
            dev = s if dev is None else ops.add(dev, s)
    return host, dev


def grad_norm(grads: dict, grad_scale: float = 1.0) -> float:
    """Global L2 norm of ``grad_scale * g`` over every (non-None) gradient: one ``ops.sumsq``
    per tensor, summed on the device, one host sync.

    >>> import numpy as np, forge_ml as fm
    >>> grad_norm({"a": fm.tensor(np.array([3.0], np.float32)), "b": fm.tensor(np.array([4.0], np.float32))})
    5.0
    """
    _check_grads("grad_norm", grads, grad_scale)   # (a list, NumPy arrays: AttributeErrors)
    return ops.clip_from_sumsq(_total_sumsq(grads), 0.0, grad_scale)[0]


def _total_sumsq(grads: dict) -> float:
    """``grad_sumsq``'s two parts added on the host (one device sync)."""
    host, dev = grad_sumsq(grads)
    return host + (0.0 if dev is None else dev.item())


def clip_on_device(grads: dict, max_norm: float, scalars: Tensor, grad_scale: float = 1.0,
                   check: Optional[Tensor] = None) -> None:
    """``clip_grad_norm`` without a host wait: the norm and the factor go into ``scalars``
    (``ops.clip_scale``), which ``AdamW.update`` reads; a non-finite norm or ``check`` (the
    loss) makes the update skip. Gradients on one device.

    >>> import numpy as np, forge_ml as fm
    >>> opt = AdamW({"g": fm.zeros(2)}); s = opt.prepare()
    >>> clip_on_device({"g": fm.tensor(np.array([3.0, 4.0], np.float32))}, 1.0, s)
    >>> [round(x, 6) for x in s.numpy()[3:5].tolist()]
    [0.2, 5.0]
    """
    host, dev = grad_sumsq(grads)
    if dev is None:     # host memory: the float64 sum, as clip_grad_norm has it
        dev = tensor(np.array(host, np.float64), device=scalars.device)
    ops.clip_scale(dev, scalars, max_norm, grad_scale, check)


def _check_grads(who: str, grads, grad_scale) -> None:
    """``grads`` a dict of name -> float Tensor (or None) and ``grad_scale`` a finite number,
    else a ConfigError or DTypeError naming ``who`` and what came."""
    if not isinstance(grads, dict):
        raise ConfigError(f"{who}: expected a dict of name -> gradient Tensor, got "
                          f"{type(grads).__name__}")
    bad = next((k for k, g in grads.items() if g is not None and not isinstance(g, Tensor)), None)
    if bad is not None:
        raise ConfigError(f"{who}: gradient {bad!r} is a {type(grads[bad]).__name__}; expected a "
                          f"forge_ml Tensor (fm.tensor(array))")
    ints = next((k for k, g in grads.items() if g is not None and not g.dtype.is_float), None)
    if ints is not None:   # as ops.sumsq refuses them (the C kernel's sum took them silently)
        raise DTypeError(f"{who}: gradient {ints!r} must be a float tensor, got "
                         f"{grads[ints].dtype.name}")
    if (isinstance(grad_scale, bool) or not isinstance(grad_scale, numbers.Real)
            or not math.isfinite(grad_scale)):   # ("x" met float() as a bare ValueError)
        raise ConfigError(f"{who}: grad_scale must be a finite number, got {grad_scale!r:.40}")


def clip_grad_norm(grads: dict, max_norm: float, grad_scale: float = 1.0) -> tuple:
    """Global-norm clipping without touching the gradients: returns ``(total_norm, scale)``
    where ``total_norm`` is the norm of ``grad_scale * g`` and ``scale`` is the factor to hand
    to ``AdamW.step(grad_scale=...)``: ``grad_scale * min(1, max_norm / (total_norm + 1e-6))``,
    torch.nn.utils.clip_grad_norm_'s coefficient. ``max_norm <= 0`` disables clipping.
    A non-finite norm comes back as NaN with ``scale`` unclipped; the caller decides.

    >>> import numpy as np, forge_ml as fm
    >>> norm, scale = clip_grad_norm({"g": fm.tensor(np.array([3.0, 4.0], np.float32))}, 1.0)
    >>> norm, round(scale, 6)
    (5.0, 0.2)
    """
    _check_grads("clip_grad_norm", grads, grad_scale)
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or math.isnan(max_norm):
        raise ConfigError(f"clip_grad_norm: max_norm must be a number (<= 0: no clipping), got {max_norm!r}")
    return ops.clip_from_sumsq(_total_sumsq(grads), max_norm, grad_scale)
