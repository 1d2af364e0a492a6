"""The decoding runtime: the KV cache, and the one-token step on fixed buffers that a CUDA
graph captures once and replays at every position.

Everything here works through ``ops``, Tensors and ``forge_ml.graph``; no backend module
and no raw array. ``DecodeStep`` feeds one token per row; ``decoder`` keeps a (cache, step)
pair with its graphs between generation calls; ``row_step`` is the step with one position
per row, which the continuous-batching engine (``inference.batch``) drives.

>>> from forge_ml.models.gpt2 import GPT2, GPT2Config
>>> from forge_ml import tensor
>>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
>>> cache = model.new_cache(2, 8)
>>> _ = model.forward_cached(tensor([[1, 2], [3, 4]]), cache)
>>> DecodeStep(model, cache)([5, 6], 2).shape, cache.pos
((2, 10), 3)
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import errors, flags, graph, ops
from ..sampling import SAMPLE_KNOBS
from ..errors import ConfigError, DTypeError, ModelError, ModelTypeError, ShapeError
from ..tensor import Tensor, device_has, host_buffer, tensor, zeros


@dataclass
class KVCache:
    """Per-layer key and value caches ``(B, H, Tmax, hs)``, allocated once; ``pos`` rows filled.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> from forge_ml.tensor import tensor
    >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
    >>> cache = model.new_cache(1)
    >>> _ = model.forward_cached(tensor([[1, 2, 3]]), cache)
    >>> cache.pos, cache.k[0].shape
    (3, (1, 1, 8, 4))
    """

    k: list
    v: list
    pos: int = 0

    @classmethod
    def empty(cls, model, batch: int, max_len: Optional[int] = None) -> "KVCache":
        """A cache for ``batch`` rows and up to ``max_len`` (<= block_size) tokens of ``model``,
        in its parameters' dtype and on its device.

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=2, n_head=1, n_embd=4))
        >>> c = KVCache.empty(model, 3, np.int64(5))
        >>> len(c.k), c.batch, c.capacity, c.pos
        (2, 3, 5, 0)
        >>> KVCache.empty(model, 1, 9)
        Traceback (most recent call last):
        ...
        forge_ml.errors.ShapeError: new_cache: max_len must be an int in 1..8 (the model's block_size), got 9
        """
        cfg = model.config
        max_len = cfg.block_size if max_len is None else max_len
        if not (_is_int(max_len) and 0 < max_len <= cfg.block_size):
            raise ShapeError(f"new_cache: max_len must be an int in 1..{cfg.block_size} (the "
                             f"model's block_size), got {max_len!r}")
        if not (_is_int(batch) and batch > 0):
            raise ShapeError(f"new_cache: batch must be a positive int, got {batch!r}")
        batch, max_len = int(batch), int(max_len)
        ref = model.params["wte.weight"]
        if device_has(ref.device, "host_memory"):   # (generate and beam_search said it first)
            need = 2 * cfg.n_layer * batch * max_len * cfg.n_embd * ref.dtype.itemsize
            errors.check_host_memory(
                "new_cache", f"a KV cache of {batch:,} rows x {max_len:,} positions", need,
                lambda free: f"use at most about {free // max(1, need // batch):,} rows or a "
                             f"shorter max_len")
        shape = (batch, cfg.n_head, max_len, cfg.head_size)
        mk = lambda: [zeros(shape, ref.dtype, ref.device) for _ in range(cfg.n_layer)]  # noqa: E731
        return cls(mk(), mk(), 0)

    def row(self, b: int) -> "KVCache":
        """Row ``b`` as a one-row cache over this cache's own memory, at position 0: a forward
        pass into it (``model.forward_cached``) writes row ``b``'s keys and values in place,
        so one request's prompt is prefilled into a batch's cache (``BatchEngine``).

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> cache = KVCache.empty(model, 3)
        >>> _ = model.forward_cached(tensor([[1, 2]]), cache.row(1))
        >>> [bool(np.any(cache.k[0].numpy()[b])) for b in range(3)]
        [False, True, False]
        """
        if not (_is_int(b) and 0 <= b < self.batch):
            raise ShapeError(f"KVCache.row: row must be in 0..{self.batch - 1}, got {b!r}")
        # a tensor of its own over the rows' memory (not a reshape view: one of those would be
        # copied on its first write, and the prefill would land in the copy)
        view = lambda t: Tensor(t._data[int(b):int(b) + 1], t.device)   # noqa: E731
        return KVCache([view(t) for t in self.k], [view(t) for t in self.v], 0)

    @property
    def capacity(self) -> int:
        """The most positions a row holds (``max_len``)."""
        return self.k[0].shape[-2]

    @property
    def batch(self) -> int:
        """The number of rows."""
        return self.k[0].shape[0]


def host_decode_bytes(config, batch: int, prefill: int, capacity: int, vocab_rows: int = 5,
                      itemsize: int = 4) -> int:
    """About the bytes a decoding run on the CPU holds at its peak, its model aside: the KV
    cache (``batch`` rows of ``capacity`` positions, two ``n_embd`` vectors a layer and a
    position), the prefill of ``prefill`` positions a row (per token about 16 ``n_embd``
    values of a layer's activations and 2.5 rows of its attention over the prefill, the
    scores and their softmax, of every head), and ``vocab_rows`` float32 rows of the padded
    vocabulary a row (a step's logits, their host copy, and what the choice keeps: marks,
    biases, log-probabilities). ``itemsize``: the model's dtype's. Fitted to the peak RSS of
    generate and beam_search on the CPU backend (2026-12-08): 512 rows of 50,304 ids,
    64 x 1,000 prompt tokens over 4 heads, 256 x 200 of 256 channels; within 25% above it.

    >>> from forge_ml.models.gpt2 import GPT2Config
    >>> cfg = GPT2Config(vocab_size=65, block_size=1024, n_layer=2, n_head=4, n_embd=64)
    >>> round(host_decode_bytes(cfg, 64, 1000, 1003) / 2 ** 30, 2)
    2.69
    """
    c, v = config.n_embd, config.padded_vocab_size
    batch, prefill, capacity = int(batch), int(prefill), int(capacity)
    cache = 2 * config.n_layer * batch * capacity * c * itemsize
    activations = batch * prefill * (16 * c + 5 * config.n_head * prefill // 2) * itemsize
    return cache + activations + 4 * vocab_rows * batch * v


def _check_knobs(knobs: np.ndarray) -> None:
    """The (B, 5) knob rows of DecodeStep.sample / choose, on the host before they go to the
    device (where nothing checks them): a NaN, a negative temperature (taken as greedy), a
    top_k that is no whole number >= 0, a top_p outside [0, 1] (0 and 1: no cut), a negative
    min_p or a repetition penalty <= 0 is a ConfigError naming the row.

    >>> _check_knobs(np.array([[0.8, 40, 0.9, 0.0, 1.2]], np.float32))
    >>> _check_knobs(np.array([[-1.0, 0, 1, 0, 1]], np.float32))
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: DecodeStep: knobs row 0 has temperature -1.0; expected >= 0 (0: greedy)
    """
    k = np.asarray(knobs, np.float64).reshape(-1, 5)
    t, top_k, top_p, min_p, pen = k.T          # NaN fails every comparison below
    with np.errstate(invalid="ignore"):        # (an infinite temperature: uniform, the limit)
        ok = np.stack([t >= 0, (top_k >= 0) & (top_k == np.floor(top_k)) & np.isfinite(top_k),
                       (top_p >= 0) & (top_p <= 1), (min_p >= 0) & np.isfinite(min_p),
                       (pen > 0) & np.isfinite(pen)], axis=1)
    if not ok.all():
        r, c = (int(i) for i in np.argwhere(~ok)[0])   # the first, row by row
        want = (">= 0 (0: greedy)", "a finite whole number >= 0 (0: off)", "in [0, 1] (0 or 1: off)",
                "finite and >= 0 (0: off)", "finite and > 0 (1: off)")[c]
        raise ConfigError(f"DecodeStep: knobs row {r} has {SAMPLE_KNOBS[c]} {float(k[r, c])!r}; expected {want}")


class DecodeStep:
    """``GPT2.decode_step`` on fixed buffers, for a generation loop.

    ``step(tokens, pos)`` feeds one token per row (``tokens``: B ints) at position ``pos``
    (the cache must hold rows ``0..pos-1``), writes the new keys and values into ``cache``,
    sets ``cache.pos = pos + 1`` and returns the logits ``(B, vocab_size)`` as a float32
    NumPy array. The inputs live in fixed device buffers (the position too), so where the
    backend captures graphs the step is captured once: the first call runs op by op
    (compiling and loading every kernel), the second captures, and from then on a call is two
    small host-to-device copies, one graph launch and one copy of the logits back.
    ``graph=False``, or the switch ``FORGE_CUDA_GRAPH=off``, keeps every call op by op.
    ``rows(tokens, positions)`` is the same step with one position per row.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
    >>> step = DecodeStep(model, model.new_cache(2, 8))
    >>> step.rows([1, 2], [0, 3]).shape
    (2, 10)
    """

    def __init__(self, model, cache: KVCache, graph_: Optional[bool] = None, **kw):
        if "params" in kw:
            raise TypeError("DecodeStep: params= was removed; give a model whose parameters "
                            "are the compute copies (model.to(dtype='bfloat16'))")
        if "graph" in kw:
            graph_ = kw.pop("graph")
        if kw:
            raise TypeError(f"DecodeStep: unexpected keyword arguments {sorted(kw)}")
        if hasattr(model, "check_cache"):
            model.check_cache("DecodeStep", cache)
        self.model, self.cache = model, cache
        self.held = False    # a running generate uses it (decoder() then hands out another)
        dev = model.device
        self.device = dev
        B = cache.batch
        self._ids = zeros((B, 1), "int32", dev)
        self._pos = zeros((1,), "int32", dev)
        self._row_pos = zeros((B,), "int32", dev)
        if graph_ is None:
            graph_ = flags.on("FORGE_CUDA_GRAPH")
        self.graph = bool(graph_) and graph.available(dev)
        self._knobs = self._keys = None   # sample(): (B, 5) knobs and (B, 2) keys
        self._sent = None      # the host values last written into them
        self._seen = self._seen_buf = None  # sample(): the penalty's seen tokens (B, Vp)
        self._pen = None       # (B, 2) presence and frequency penalties (ops.penalize_logits)
        self._pen_sent = None  # the host values last written into it
        self._bias = None      # (B, Vp) float32 logit bias rows
        self._adjust = None    # sample() / choose(): (penalties, bias or None) or None
        self._biased = set()   # rows_launch(): the rows whose logit bias is not all 0
        self._choice = None    # rows_choose(): the (B,) int32 tokens chosen on the device
        self._in_flight = None  # rows_launch(): the queued step's logits
        self._graphs = {}      # "logits", "rows": one step; ("greedy", k): k steps + choices
        self._hist = {}        # k -> the (k, B) int32 tensor of a k-step chain's tokens
        self._warm = False     # some step ran op by op: every kernel is compiled and loaded
        # a batch the device runs GPT-2's step for in a few kernels: those, at the step's
        # position buffer (``rows`` keeps the op-by-op step: its positions may be outside)
        self.fused = hasattr(model, "fused_decode_ok") and model.fused_decode_ok(cache)
        if self.fused:
            self._fused_logits = zeros((B, model.config.padded_vocab_size), "float32", dev)

    def _logits(self, pos):
        """The step's device work; returns the float32 logits (B, Vp) (the bf16 -> float32
        cast is part of the captured work, so the host copies one tensor back)."""
        if self.fused and pos is self._pos:
            self.model.decode_step_fused(self._ids, pos, self.cache, self._fused_logits)
            return self._fused_logits
        out = self.model.decode_step(self._ids, pos, self.cache)
        return out if out.dtype.name == "float32" else out.to("float32")

    def _check_filled(self, who: str, pos: int) -> None:
        """A step at ``pos`` attends over the cache's rows ``0..pos-1``: they must hold keys and
        values (``cache.pos`` rows are filled); past them it would attend over empty rows and
        give logits of no context, in silence."""
        if pos > self.cache.pos:
            raise ShapeError(f"{who}: position {pos} is past the cache's {self.cache.pos} filled rows, so "
                             f"it would attend over rows that hold nothing; feed the positions in order "
                             f"(the prompt first: model.forward_cached, or a step a token from "
                             f"position 0)")

    def __call__(self, tokens, pos: int) -> np.ndarray:
        B = self.cache.batch
        tokens = self._checked_tokens(tokens)
        if not (_is_int(pos) and 0 <= pos < self.cache.capacity):
            raise ShapeError(f"DecodeStep: position {pos!r} does not fit the cache's "
                             f"{self.cache.capacity} rows")
        self._check_filled("DecodeStep", pos)
        ops.assign(self._ids, tokens.astype(np.int32).reshape(B, 1))
        ops.assign(self._pos, np.array([pos], np.int32))
        out = self._run("logits", lambda: self._logits(self._pos))
        self.cache.pos = int(pos) + 1
        return out.numpy()[:, :self.model.config.vocab_size]

    def rows(self, tokens, positions) -> np.ndarray:
        """One step with one position per row: row ``b`` feeds ``tokens[b]`` at
        ``positions[b]`` (its cache rows ``0..positions[b]-1`` filled before) and attends over
        its own rows only. Returns float32 logits ``(B, vocab_size)``; a row whose position is
        outside the cache gets NaN logits and writes nothing. ``cache.pos`` is not used.

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> bool(np.isnan(DecodeStep(model, model.new_cache(2, 4)).rows([1, 2], [0, 9])[1]).all())
        True
        """
        self._row_inputs("DecodeStep.rows", tokens, positions)
        out = self._run("rows", lambda: self._logits(self._row_pos))
        return out.numpy()[:, :self.model.config.vocab_size]

    def rows_choose(self, tokens, positions, knobs, keys, marks=None, vocab_size=None,
                    penalties=None, bias=None) -> tuple:
        """``rows``' step with every row's next token chosen on the device
        (``ops.sample_next``, ``forge_ml.sampling.sample_row``'s rule): row ``b`` feeds
        ``tokens[b]`` at ``positions[b]`` and draws with ``knobs[b]`` and the Philox key
        ``keys[b]`` at counter ``positions[b] + 1``, the position of the token chosen, so a row
        draws what ``generate`` draws at that position with that key. The repetition penalty
        applies to a row's marks on the device, which a step adds the row's chosen token to
        when some row of it has a penalty or an adjustment (below; a step with none leaves
        every mark as it is): ``marks`` (``{row: ids}``) sets those rows' marks to exactly
        these ids first (a row's prompt when it starts choosing; rows never given marks have
        none). A row that keeps its penalty from its first choice on (as the engine's requests
        do) has exactly its prompt and its chosen tokens marked.
        ``vocab_size``: the ids that may be chosen (default the model's). ``penalties``
        ((B, 2): each row's OpenAI presence and frequency penalty, over the times the row chose
        each id since its marks were set) and ``bias`` (``{row: (vocab_size,) float32 logit
        bias, or None for none}``, kept for the row until changed) adjust the logits first
        (``ops.penalize_logits``); the logits returned carry them. Returns ``(tokens,
        finite, logits)``: the (B,) int64 choices, a (B,) bool array (False for a row whose
        logit at its argmax is not finite, a NaN or an infinity: its token, -1, means
        nothing) and the step's float32 logits (B, Vp)
        Tensor, valid until the next step (a row of it for log-probabilities:
        ``ops.take_rows(logits.reshape(1, B, Vp), b)``). A graph where the backend has them;
        what comes back is the B tokens (-1 for a row whose logit at its argmax is not
        finite: ``ops.sample_next``'s sign).

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> step = DecodeStep(model, model.new_cache(2, 8))
        >>> toks, ok, _ = step.rows_choose([1, 2], [0, 3], [[0, 0, 1, 0, 1]] * 2, [[1, 2]] * 2)
        >>> toks.shape, ok.tolist()
        ((2,), [True, True])
        """
        self.rows_launch(tokens, positions, knobs, keys, marks, vocab_size, penalties, bias)
        return self.rows_collect()

    def rows_launch(self, tokens, positions, knobs, keys, marks=None, vocab_size=None,
                    penalties=None, bias=None) -> None:
        """``rows_choose``'s step queued on the device without waiting for it (the arguments
        are ``rows_choose``'s): the host may work while the device computes; then
        ``rows_collect()`` gives its result, before the next launch.

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> step = DecodeStep(model, model.new_cache(2, 8))
        >>> step.rows_launch([1, 2], [0, 3], [[0, 0, 1, 0, 1]] * 2, [[1, 2]] * 2)   # greedy rows
        >>> toks, ok, logits = step.rows_collect()
        >>> toks.tolist() == logits.numpy().argmax(1).tolist(), ok.tolist()
        (True, [True, True])
        """
        B = self.cache.batch
        cfg = self.model.config
        V = cfg.vocab_size if vocab_size is None else int(vocab_size)
        self._row_inputs("DecodeStep.rows_choose", tokens, positions)
        if self._choice is None:
            self._choice = zeros((B,), "int32", self.device)
        self._sampling_inputs(knobs, keys, None)
        Vp = cfg.padded_vocab_size
        for b, ids in (marks or {}).items():
            ids = _int_array("DecodeStep.rows_choose", "marked ids", ids)
            if not (_is_int(b) and 0 <= b < B) or (ids.size and not 0 <= ids.min() <= ids.max() < Vp):
                raise ShapeError(f"DecodeStep.rows_choose: marks must map rows 0..{B - 1} to ids in "
                                 f"0..{Vp - 1}, got row {b!r} with ids {ids.min() if ids.size else ''}"
                                 f"..{ids.max() if ids.size else ''}")
            if self._seen_buf is None:
                self._seen_buf = zeros((B, Vp), "int32", self.device)
            row = np.zeros(Vp, np.int32)
            row[ids] = 1
            ops.assign(self._seen_buf, row, row=int(b))
        adjusting = self._row_adjust("DecodeStep.rows_choose", penalties, bias)
        penalty = adjusting or (self._seen_buf is not None and bool(
            (np.asarray(knobs, np.float32).reshape(B, 5)[:, 4] != 1).any()))
        biased = bool(self._biased)

        def work():
            logits = self._logits(self._row_pos)
            if adjusting:
                ops.penalize_logits(logits, V, self._seen_buf, self._pen,
                                    self._bias if biased else None)
            ops.sample_next(logits, V, self._ids, self._row_pos, self._knobs, self._keys,
                            self._seen_buf if penalty else None, out=self._choice)
            return logits

        self._in_flight = self._run(("rows_choose", V, penalty, adjusting, biased), work)

    def _row_adjust(self, who: str, penalties, bias) -> bool:
        """``rows_launch``'s penalties and logit-bias updates into the step's buffers; returns
        whether this step adjusts its logits (some row has a penalty or a bias)."""
        B = self.cache.batch
        Vp = self.model.config.padded_vocab_size
        for b, row in (bias or {}).items():
            if not (_is_int(b) and 0 <= b < B):
                raise ShapeError(f"{who}: bias must map rows 0..{B - 1} to logit-bias rows, "
                                 f"got row {b!r}")
            if row is None:
                if b in self._biased:
                    ops.assign(self._bias, np.zeros(Vp, np.float32), row=int(b))
                    self._biased.discard(b)
                continue
            row = np.asarray(row, np.float32).reshape(-1)
            if row.shape[0] > Vp or not np.isfinite(row).all():
                raise ShapeError(f"{who}: row {b}'s logit bias must be at most {Vp} finite "
                                 f"values, got {row.shape[0]}")
            full = np.zeros(Vp, np.float32)
            full[:row.shape[0]] = row
            self._bias_buffers()
            ops.assign(self._bias, full, row=int(b))
            self._biased.add(int(b))
        on = self._put_penalties(_checked_penalties(who, penalties, B))
        if (on or self._biased) and self._seen_buf is None:
            self._seen_buf = zeros((B, Vp), "int32", self.device)
        return on or bool(self._biased)

    def _put_penalties(self, pen: np.ndarray) -> bool:
        """Checked (B, 2) penalties into the device's buffer, copied only where they differ
        from the values last written (the engine's every step while its requests stay) and
        never while all of them are 0 and none were written; returns whether any is not 0."""
        on = bool(pen.any())
        if (on or self._pen is not None) and (self._pen_sent is None
                                              or not np.array_equal(pen, self._pen_sent)):
            self._bias_buffers()
            ops.assign(self._pen, pen)
            self._pen_sent = pen.copy()
        return on

    def _bias_buffers(self) -> None:
        """The penalties' and the logit bias's device buffers, made at their first use."""
        if self._pen is None:
            B, Vp = self.cache.batch, self.model.config.padded_vocab_size
            self._pen = zeros((B, 2), "float32", self.device)
            self._bias = zeros((B, Vp), "float32", self.device)

    def rows_collect(self) -> tuple:
        """The ``(tokens, finite, logits)`` of the step ``rows_launch`` queued (waiting for
        it), as ``rows_choose`` returns them.

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> step = DecodeStep(model, model.new_cache(2, 8))
        >>> step.rows_launch([1, 2], [0, 0], [[0.8, 0, 1, 0, 1]] * 2, [[1, 2], [3, 4]])
        >>> toks, ok, logits = step.rows_collect()
        >>> toks.shape, toks.dtype, ok.tolist(), logits.shape
        ((2,), dtype('int64'), [True, True], (2, 10))
        """
        toks = self._choice.numpy().astype(np.int64)
        return toks, toks >= 0, self._in_flight

    def _row_inputs(self, who: str, tokens, positions) -> None:
        """Check a per-row step's tokens and positions and write them into the step's
        buffers; a position outside the cache becomes the capacity (that row's logits: NaN)."""
        B = self.cache.batch
        tokens = self._checked_tokens(tokens)
        positions = _int_array(who, "positions", positions)
        if positions.shape != (B,):
            raise ShapeError(f"{who}: expected {B} positions, got {positions.shape[0]}")
        cap = self.cache.capacity
        positions = np.where((positions >= 0) & (positions < cap), positions, cap)  # out: NaN
        ops.assign(self._ids, tokens.astype(np.int32).reshape(B, 1))
        ops.assign(self._row_pos, positions.astype(np.int32))

    def _run(self, key, work):
        """``work()``'s device work: replayed from the graph kept under ``key``, or captured
        there first when graphs are on and some step ran op by op before (so every kernel
        ``work`` launches is compiled and loaded), else op by op. A capture that fails turns
        graphs off for this step, with one warning, and the work runs op by op."""
        g = self._graphs.get(key)
        if g is None and self.graph and self._warm:
            try:
                g = graph.capture(self.device, work)
            except Exception as e:
                warnings.warn(f"DecodeStep: the graph capture failed ({type(e).__name__}: "
                              f"{e}); decoding goes on op by op", RuntimeWarning, stacklevel=3)
                self.graph = False
            else:
                self._graphs[key] = g
        if g is None:
            out = work()
            self._warm = True
            return out
        g.replay()
        return g.outputs

    @property
    def captured(self) -> bool:
        """Whether the step now replays a graph (never on the CPU, which has none).

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> step = DecodeStep(model, model.new_cache(1, 8))
        >>> _ = step([1], 0), step([2], 1)
        >>> step.captured
        False
        """
        return "logits" in self._graphs

    def _greedy_work(self, k: int):
        """``k`` greedy steps on the device: each computes the logits, then ``ids = argmax``
        (also written to row i of the chain's token buffer) and ``pos += 1``."""
        hist = self._hist[k]
        V = self.model.config.vocab_size
        for i in range(k):
            if self.fused:   # the step and its argmax in one kernel
                self.model.decode_step_fused(self._ids, self._pos, self.cache,
                                             self._fused_logits, out=hist, row=i, greedy=True)
            else:
                ops.greedy_next(self._logits(self._pos), V, self._ids, self._pos, out=hist, row=i)
        return hist

    def _sample_work(self, k: int):
        """``k`` sampled steps on the device (``ops.sample_next`` with the step's knobs, keys
        and seen-token buffer), chained as ``_greedy_work``'s."""
        hist = self._hist[k]
        V = self.model.config.vocab_size
        for i in range(k):
            logits = self._logits(self._pos)
            if self._adjust is not None:
                ops.penalize_logits(logits, V, self._seen, *self._adjust)
            ops.sample_next(logits, V, self._ids, self._pos, self._knobs, self._keys,
                            self._seen, out=hist, row=i)
        return hist

    def greedy(self, tokens, pos: int, n: int, lookahead: int = 4, chunk: Optional[int] = None):
        """Yield ``n`` greedy steps with the host out of the loop: the first feeds ``tokens``
        at ``pos``, each next one feeds the previous step's choice at the next position; each
        yield is the (B,) int32 array of every row's argmax token (lowest id on ties, as
        ``np.argmax``; -1 for a row whose logit at its argmax is not finite, a NaN or an
        infinity: no token, and a sign for the caller to stop). The choice is made on the device, ``chunk`` steps at a time (with
        graphs one replay of ``chunk`` x (step + argmax) and one copy of their tokens back;
        default 8 with graphs, else 1), and at least ``lookahead`` steps are queued ahead, so
        the host reads tokens while the device computes the next ones. Closing the generator
        early waits for the queued steps; ``cache.pos`` then counts every row they wrote.

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> from forge_ml import tensor
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> cache = model.new_cache(1, 8)
        >>> _ = model.forward_cached(tensor([[1, 2]]), cache)
        >>> [t.shape for t in DecodeStep(model, cache).greedy([3], 2, 3)], cache.pos
        ([(1,), (1,), (1,)], 5)
        """
        return self._chain("greedy", self._greedy_work, tokens, pos, n, lookahead, chunk)

    def sample(self, tokens, pos: int, n: int, knobs, keys, seen=None, lookahead: int = 4,
               chunk: Optional[int] = None, penalties=None, bias=None):
        """``greedy``'s chain with a sampled choice on the device (``ops.sample_next``): row b
        samples with ``knobs[b]`` (temperature, top_k, top_p, min_p, repetition_penalty; see
        ``forge_ml.sampling.SAMPLE_KNOBS``) and Philox key ``keys[b]`` (two uint32 words), the
        counter being the position of the token chosen, so the tokens are those
        ``forge_ml.sampling.sample_row`` gives on the host. ``seen`` (B, vocab_size): the tokens
        the repetition penalty applies to (None: no penalty anywhere), as bool marks or as
        ``forge_ml.sampling.seen_row``'s int marks (bit 0 the prompt's ids, plus 2 a time a
        row generated the id: the chain adds each chosen one). ``penalties`` ((B, 2), each
        row's OpenAI presence and frequency penalty, over those counts) and ``bias`` ((B,
        vocab_size) float32 logit bias) adjust each step's logits before the choice
        (``ops.penalize_logits``, ``forge_ml.sampling.adjusted``). A row whose
        logit at its argmax is not finite yields -1, as in ``greedy``.

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> from forge_ml import tensor
        >>> model = GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> cache = model.new_cache(1, 8)
        >>> _ = model.forward_cached(tensor([[1, 2]]), cache)
        >>> toks = list(DecodeStep(model, cache).sample([3], 2, 3, [[0.8, 0, 1, 0, 1]], [[1, 2]]))
        >>> len(toks), cache.pos
        (3, 5)
        """
        self._sampling_inputs(knobs, keys, seen, penalties, bias)
        # graphs differ in their arguments
        kind = "sample" if self._seen is None else "sample_seen"
        if self._adjust is not None:
            kind += "_adjusted" if self._adjust[1] is None else "_biased"
        return self._chain(kind, self._sample_work, tokens, pos, n, lookahead, chunk)

    def _sampling_inputs(self, knobs, keys, seen, penalties=None, bias=None) -> None:
        """Write ``sample``'s knobs, keys, seen-token marks, penalties and logit bias into the
        step's device buffers (with penalties or a bias and no marks: none seen)."""
        B = self.cache.batch
        V = self.model.config.vocab_size
        knobs = np.asarray(knobs, np.float32)
        if knobs.shape not in ((B, 5), (B * 5,)):
            raise ShapeError(f"DecodeStep: knobs must be ({B}, 5), one row of "
                             f"{', '.join(SAMPLE_KNOBS)} per cache row, got {knobs.shape}")
        keys = _int_array("DecodeStep", "keys", keys)
        if keys.size != 2 * B:
            raise ShapeError(f"DecodeStep: keys must be ({B}, 2), two uint32 words per cache "
                             f"row, got {keys.shape}")
        if seen is not None and np.shape(seen) != (B, V):
            raise ShapeError(f"DecodeStep: seen must be ({B}, {V}) marks (None: no "
                             f"penalty), got {np.shape(seen)}")
        penalties = _checked_penalties("DecodeStep", penalties, B)
        if bias is not None:
            bias = np.asarray(bias, np.float32)
            if bias.shape != (B, V) or not np.isfinite(bias).all():
                raise ShapeError(f"DecodeStep: bias must be ({B}, {V}) finite logit biases, "
                                 f"got {bias.shape}")
        adjust = bool(penalties.any()) or bias is not None
        if adjust and seen is None:
            seen = np.zeros((B, V), np.int32)
        knobs = knobs.reshape(B, 5)
        keys = (keys.reshape(B, 2) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
        if self._knobs is None:
            self._knobs = zeros((B, 5), "float32", self.device)
            self._keys = zeros((B, 2), "int32", self.device)
        # the device's copies are written only here: the same values (the engine's every step
        # until a request comes or goes) need no check and no copy
        if self._sent is None or not (np.array_equal(knobs, self._sent[0])
                                      and np.array_equal(keys, self._sent[1])):
            _check_knobs(knobs)
            ops.assign(self._knobs, knobs)
            ops.assign(self._keys, keys)
            self._sent = (knobs.copy(), keys.copy())
        if seen is None:
            self._seen = None
        else:
            Vp = self.model.config.padded_vocab_size
            full = np.zeros((B, Vp), np.int32)
            seen = np.asarray(seen)
            full[:, :V] = seen if seen.dtype.kind in "iu" else seen.astype(bool)
            if self._seen_buf is None:
                self._seen_buf = zeros((B, Vp), "int32", self.device)
            ops.assign(self._seen_buf, full)
            self._seen = self._seen_buf
        self._adjust = None
        if adjust:
            Vp = self.model.config.padded_vocab_size
            self._bias_buffers()
            self._put_penalties(penalties)
            if bias is not None:
                full = np.zeros((B, Vp), np.float32)
                full[:, :V] = bias
                ops.assign(self._bias, full)
                self._biased = set(range(B))   # (rows_launch's rows: all rewritten)
            self._adjust = (self._pen, None if bias is None else self._bias)

    def choose(self, logits, pos: int, knobs=None, keys=None, seen=None, penalties=None,
               bias=None) -> np.ndarray:
        """Every row's token for position ``pos`` chosen on the device from ``logits (B, Vp)``
        (a prefill's last logits): the argmax when ``knobs`` is None, else ``sample``'s rule
        with these ``knobs``, ``keys``, ``seen``, ``penalties`` and ``bias`` (``logits``
        then carry the adjustments). Only the B tokens come back, not the
        logits, so a batch's first tokens cost one small copy.

        >>> import numpy as np, forge_ml as fm
        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=4))
        >>> step = DecodeStep(model, model.new_cache(1, 8))
        >>> step.choose(fm.tensor(np.array([[0.0, 2.0, 1.0, 9.0]], np.float32)), 2).tolist()
        [1]
        """
        B = self.cache.batch
        V = self.model.config.vocab_size
        if not (_is_int(pos) and pos >= 1):
            raise ShapeError(f"DecodeStep.choose: pos must be an int >= 1 (the position whose "
                             f"token is chosen), got {pos!r}")
        shape = tuple(getattr(logits, "shape", ()))
        if not (len(shape) in (2, 3) and shape[0] == B and shape[1:-1] in ((), (1,))
                and shape[-1] >= V):
            # (it reshaped whatever came to (B, -1): a prefill's whole (B, T, Vp) output chose
            # from position 0's logits, a row too few split one row in two)
            raise ShapeError(f"DecodeStep.choose: logits must be ({B}, Vp) or ({B}, 1, Vp) "
                             f"with Vp >= the vocabulary's {V} (a prefill's last position: "
                             f"forward_cached(..., last_only=True)), got {shape}")
        logits = logits.reshape(B, -1)
        if logits.dtype.name != "float32":
            logits = logits.to("float32")
        ids = zeros((B, 1), "int32", self.device)
        fed = tensor(np.array([pos - 1], np.int32), device=self.device)  # the position before
        if knobs is None:
            ops.greedy_next(logits, V, ids, fed)
        else:
            self._sampling_inputs(knobs, keys, seen, penalties, bias)
            if self._adjust is not None:
                ops.penalize_logits(logits, V, self._seen, *self._adjust)
            ops.sample_next(logits, V, ids, fed, self._knobs, self._keys, self._seen)
        return ids.numpy().reshape(B).astype(np.int64)

    def _chain(self, kind, work, tokens, pos, n, lookahead, chunk):
        """Yield ``n`` steps of ``work(k)`` (k steps and their on-device choices), chunks of
        ``chunk`` per graph replay, ``lookahead`` steps queued ahead of the host."""
        B = self.cache.batch
        if not (_is_int(n) and n >= 0):
            raise ShapeError(f"DecodeStep.{kind}: n must be an int >= 0, got {n!r}")
        if not _is_int(pos):
            raise ShapeError(f"DecodeStep.{kind}: pos must be an int, got {pos!r}")
        if not (_is_int(lookahead) and lookahead >= 0):
            raise ShapeError(f"DecodeStep.{kind}: lookahead must be an int >= 0, got {lookahead!r}")
        if n and not 0 <= pos <= pos + n - 1 < self.cache.capacity:
            raise ShapeError(f"DecodeStep.{kind}: positions {pos}..{pos + n - 1} do not fit the "
                             f"cache's {self.cache.capacity} rows")
        if n:
            self._check_filled(f"DecodeStep.{kind}", pos)
        if chunk is None:
            chunk = 8 if self.graph else 1
        if not (_is_int(chunk) and chunk >= 1):
            raise ShapeError(f"DecodeStep.{kind}: chunk must be an int >= 1, got {chunk!r}")
        if n == 0:
            return
        tokens = self._checked_tokens(tokens)
        ops.assign(self._ids, tokens.astype(np.int32).reshape(B, 1))
        pos = int(pos)
        ops.assign(self._pos, np.array([pos], np.int32))
        # whole chunks, then single steps: every launch writes only rows pos..pos+n-1
        sizes = [int(chunk)] * (n // chunk) + [1] * (n % chunk)
        for k in set(sizes):
            if k not in self._hist:
                self._hist[k] = zeros((k, B), "int32", self.device)
        ahead = max(2, -(-int(lookahead) // int(chunk)))
        rings = {k: host_buffer((ahead, k, B), "int32", self.device) for k in set(sizes)}
        pending = []    # (handle, host array) per launch in flight
        launched = 0    # launches queued
        done = 0        # steps of the queued launches

        def launch():
            nonlocal launched, done
            k = sizes[launched]
            out = self._run((kind, k), lambda: work(k))
            host = rings[k][launched % ahead]
            pending.append((out.copy_to_host(host), host))
            launched += 1
            done += k

        try:
            while launched < min(ahead, len(sizes)):
                launch()
            yielded = 0
            while pending:
                handle, host = pending.pop(0)
                if handle is not None:
                    handle.synchronize()
                toks = host.copy()
                if launched < len(sizes):
                    launch()
                for row in toks:
                    yielded += 1
                    self.cache.pos = pos + yielded
                    yield row
        finally:
            for handle, _ in pending:
                if handle is not None:
                    handle.synchronize()
            self.cache.pos = pos + done

    def _checked_tokens(self, tokens) -> np.ndarray:
        B = self.cache.batch
        tokens = _int_array("DecodeStep", "token ids", tokens)
        if tokens.shape != (B,):
            raise ShapeError(f"DecodeStep: expected {B} tokens (one per row), got {tokens.shape[0]}")
        V = self.model.config.vocab_size
        if tokens.min() < 0 or tokens.max() >= V:
            raise ShapeError(f"DecodeStep: token ids must be in 0..{V - 1}, got "
                             f"{int(tokens.min())}..{int(tokens.max())}")
        return tokens


def _checked_penalties(who: str, penalties, B: int) -> np.ndarray:
    """``penalties`` ((B, 2) finite presence and frequency rows, or None for all 0) as
    float32; anything else is a ShapeError naming ``who``."""
    if penalties is None:
        return np.zeros((B, 2), np.float32)
    pen = np.asarray(penalties, np.float32)
    if pen.shape != (B, 2) or not np.isfinite(pen).all():
        raise ShapeError(f"{who}: penalties must be ({B}, 2) finite (presence, frequency) "
                         f"rows, got {pen.shape}")
    return pen


def _is_int(x) -> bool:
    """An int or a NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_array(where: str, what: str, values) -> np.ndarray:
    """``values`` (ints, NumPy integers, an integer array or Tensor) flattened to int64; a
    float, a bool, a string or an int past int64 is a DTypeError, not a truncated id.

    >>> _int_array("step", "token ids", [1, 2.5])
    Traceback (most recent call last):
    ...
    forge_ml.errors.DTypeError: step: token ids must be integers, got [1, 2.5]
    """
    if isinstance(values, Tensor):
        values = values.numpy()
    a = np.asarray(values)
    if a.dtype.kind == "O" and all(_is_int(x) for x in a.reshape(-1)) or (
            a.dtype.kind == "u" and a.size and a.max() > 2**63 - 1):
        raise ShapeError(f"{where}: {what} must fit int64, got {values!r:.80}")
    if a.dtype.kind not in "iu":
        raise DTypeError(f"{where}: {what} must be integers, got {values!r:.80}")
    return a.astype(np.int64).reshape(-1)


def model_check(who: str, model) -> None:
    """Refuse what is not a forge-ml language model (``generate(None, ...)`` failed deep inside
    with "'NoneType' object has no attribute 'config'"): a ModelTypeError, which is a ForgeError
    as every user error of the package, and still the TypeError it was.

    >>> model_check("generate", None)
    Traceback (most recent call last):
    ...
    forge_ml.errors.ModelTypeError: generate: model must be a forge-ml language model (forge_ml.models.GPT2, e.g. from forge_ml.inference.load_model), got NoneType
    """
    if not (hasattr(model, "config") and hasattr(model, "forward_cached")
            and hasattr(model, "new_cache")):
        raise ModelTypeError(f"{who}: model must be a forge-ml language model (forge_ml.models.GPT2, "
                             f"e.g. from forge_ml.inference.load_model), got {type(model).__name__}")


def check_finite_logits(model, logits, who: str, what: str = "the prompt") -> None:
    """Raise a ModelError when the first ``vocab_size`` logits of a forward pass (the prompt's,
    or a step's where they come to the host anyway; ``logits``: a Tensor or array (B, ...,
    padded_vocab_size); ``what`` names the input in the message) hold a NaN or an infinity:
    no token can be chosen from them (an argmax would silently say id 0). The message names
    the first parameter that is not finite, or says that every one is. One small reduction on
    the logits' device and one number read back.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> model = GPT2.init(GPT2Config(vocab_size=20, block_size=8, n_layer=1, n_head=2,
    ...                              n_embd=8), seed=0)
    >>> model.params["h.0.mlp.c_fc.weight"].data[0, :3] = float("nan")
    >>> logits = model.forward_cached(tensor([[1, 2]]), model.new_cache(1, 8))
    >>> check_finite_logits(model, logits, "generate")
    Traceback (most recent call last):
    ...
    forge_ml.errors.ModelError: generate: the model's logits for the prompt hold NaN or inf, so no token can be chosen: its parameter h.0.mlp.c_fc.weight holds 3 NaN of 256 values (a damaged checkpoint, or weights from a training run that diverged)
    """
    if isinstance(logits, Tensor):
        if logits.dtype.name not in ("float32", "float64"):   # bf16: through forge-ml's cast,
            logits = logits.to("float32")                      # not CuPy's bf16 arithmetic
        logits = logits.data
    a = logits[..., :model.config.vocab_size]
    if isinstance(a, np.ndarray):   # on the host (every step of a host path): no copy
        if np.isfinite(a.max()) and np.isfinite(a.min()):   # (NaN propagates through both)
            return
    else:                           # on a device: one reduction, one number read back
        with np.errstate(invalid="ignore"):
            if np.isfinite(float((a * 0).sum())):   # inf * 0 and NaN * 0 are NaN
                return
    raise nonfinite_error(model, who, what)


def nonfinite_cause(model) -> str:
    """Why a model's output is not finite, said for an error: the first parameter that holds
    NaN or inf, or that every one is finite (an activation overflowed).

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> m = GPT2.init(GPT2Config(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4))
    >>> m.params["ln_f.bias"].data[1] = float("nan")
    >>> nonfinite_cause(m)
    'its parameter ln_f.bias holds 1 NaN of 4 values (a damaged checkpoint, or weights from a training run that diverged)'
    """
    from ..diagnose import _bad_values
    for name, p in model.params.items():
        bad = _bad_values(p)
        if bad:
            return (f"its parameter {name} holds {bad} (a damaged checkpoint, or weights from a "
                    f"training run that diverged)")
    return ("every parameter is finite, so an activation overflowed on the way (weights far "
            "larger than a trained model's?)")


def nonfinite_error(model, who: str, what: str) -> ModelError:
    """The ModelError for logits of ``what`` that hold NaN or inf: it names the first parameter
    that is not finite, or says that every one is (``check_finite_logits``'s message)."""
    return ModelError(f"{who}: the model's logits for {what} hold NaN or inf, so no token "
                      f"can be chosen: {nonfinite_cause(model)}")


def _same_memory(a: list, b: list) -> bool:
    # a graph holds the memory of every parameter: reuse it only while each tensor still has
    # the memory it had at the capture (an in-place update keeps it; copy-on-write does not)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def decoder(model, batch: int, max_len: Optional[int] = None) -> tuple:
    """``(cache, step)``: an empty KV cache for ``batch`` rows of up to ``max_len`` tokens and
    its ``DecodeStep``. Where the backend captures graphs, the pair and its graphs are kept
    and handed out again (emptied: ``pos`` 0) to the next call with the same batch, length
    and parameter tensors, so repeated generation pays the capture once; elsewhere every call
    makes a new pair. A kept pair that a running ``generate`` holds (``held``: set while its
    generator is alive) is not handed out: that call gets a new pair of its own, so two
    generators interleaved never share a cache. A pair taken here directly is the caller's
    until the next call of the same shape.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> cache, step = decoder(GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1,
    ...                                            n_head=1, n_embd=4)), 2, 8)
    >>> cache.capacity, cache.batch
    (8, 2)
    """
    if not graph.available(model.device):
        cache = KVCache.empty(model, batch, max_len)
        return cache, DecodeStep(model, cache)
    key = (batch, max_len, flags.get("FORGE_CUDA_GRAPH"), flags.get("FORGE_FUSED_DECODE"),
           tuple(model.params))
    memory = [v.memory() for v in model.params.values()]
    kept = getattr(model, "_decoder_kept", None)
    if kept is not None and kept[0] == key and _same_memory(kept[3], memory):
        if not kept[2].held:
            kept[1].pos = 0
            return kept[1], kept[2]
        cache = KVCache.empty(model, batch, max_len)   # a running generate holds the kept pair
        return cache, DecodeStep(model, cache)
    cache = KVCache.empty(model, batch, max_len)
    step = DecodeStep(model, cache)
    model._decoder_kept = (key, cache, step, memory)
    return cache, step


class Hold:
    """Marks ``step`` held (``DecodeStep.held``) for this object's life: a generator keeps one
    as a local, so the mark goes when the generator ends, is closed or is collected."""

    def __init__(self, step):
        self.step = step
        step.held = True

    def __del__(self):
        self.step.held = False


def held_decoder(model, batch: int, max_len: Optional[int] = None) -> tuple:
    """``decoder``'s pair and a ``Hold`` on its step: ``(cache, step, hold)``. Keep ``hold`` as
    long as the pair is in use (``generate``'s loop keeps it in its generator's frame)."""
    cache, step = decoder(model, batch, max_len)
    return cache, step, Hold(step)


def row_step(model, batch: int, max_len: Optional[int] = None) -> tuple:
    """``(step, cache)`` for continuous batching: ``step(tokens, positions)`` feeds each of
    ``batch`` rows its own token at its own position and returns float32 logits
    ``(batch, vocab_size)`` (``DecodeStep.rows``; a graph where the backend has them).

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> step, cache = row_step(GPT2.init(GPT2Config(vocab_size=10, block_size=8, n_layer=1,
    ...                                             n_head=1, n_embd=4)), 3)
    >>> step([1, 2, 3], [0, 0, 0]).shape
    (3, 10)
    """
    cache = KVCache.empty(model, batch, max_len)
    return DecodeStep(model, cache).rows, cache
