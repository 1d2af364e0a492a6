"""Continuous batching: ``BatchEngine`` runs many requests through one decode step.

A background thread owns the model and a step over ``slots`` rows, each row with its own
KV-cache rows and its own position (``decode.row_step``). Every step feeds each busy slot one
token at that slot's position: the next prompt token while the request is still inside its
prompt (the prompt is prefilled one token per step, as ``generate`` does for ragged batches),
else its last chosen token. Each slot past its prompt then chooses its next token from its
row of logits with its own ``SamplingParams`` (``choose_tokens``, on the host), and the
request's ``Stream`` gets a ``TokenOut``. A request finishes on a stop token, ``max_tokens``
or a full context, and frees its slot at once; a cancelled one frees it at the next step. A
new request takes a free slot at the next step, starting at position 0 (the slot's old cache
rows are overwritten before they are read). Idle slots are fed a dummy token at position 0
and their logits are ignored: that writes only their own row 0, which the next request of
the slot writes again at its first step, before any step reads it.

Per request reproducible: a request draws its uniforms from its own generator, seeded with
``(seed, 0)``, and a row's logits depend on the other rows only through rounding (a product
over more rows may sum in another order: its log-probabilities move by about 1e-6), so a
request gives the same tokens whatever else shares the batch, except where two tokens' scores
tie within that rounding. Alone, or with the same company, it is exact.

>>> from forge_ml.models.gpt2 import GPT2, GPT2Config
>>> model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
>>> with BatchEngine(model, slots=2) as engine:
...     a = engine.submit([1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
...     b = engine.submit([4], SamplingParams(max_tokens=2, seed=1))
...     out_a, out_b = list(a), list(b)
>>> len(out_a), out_a[-1].finish, len(out_b)
(4, 'length', 2)
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Optional, Sequence

import numpy as np

from ..errors import ConfigError
from ..tensor import device_has
from .decode import check_finite_logits, nonfinite_error
from .engine import (EngineClosedError, RequestError, SamplingParams, Stream, TokenOut,
                     _is_int, check_prompt)

try:
    from .decode import row_step
except ImportError:   # an older tree without the per-row step: see _row_step_fallback
    row_step = None

__all__ = ["BatchEngine", "choose_tokens", "SamplingParams", "TokenOut", "Stream",
           "RequestError", "EngineClosedError"]

log = logging.getLogger("forge_ml.inference")

# -- choosing the next token -----------------------------------------------------------------

# Cuts look for their tokens among those within these distances of the top logit first (one
# comparison pass over the vocabulary), wider only when those are not enough: the tokens
# at or above any threshold are the head of the sorted order, ties included, so the result
# is the one a full sort gives.
_WIDTHS = (8.0, 16.0, 32.0)
_W_THRESHOLDS = tuple(float(np.float32(np.exp(-d))) for d in _WIDTHS)   # on exp(z - max z)
_DRAW_BLOCK = 1024
_F32_MAX = float(np.finfo(np.float32).max)
_PEN_RANGE = (1e-30, 1e30)


def choose_tokens(logits, params: Sequence[SamplingParams], seen: Sequence, u) -> list:
    """One token per row: ``[(token, logprob or None, top), ...]``, ``top`` the
    ``((id, logprob), ...)`` of the ``params[r].logprobs`` most likely tokens.

    ``logits``: ``(B, V)``; ``seen[r]``: the ids row ``r`` has seen (prompt and generated,
    for the repetition penalty); ``u[r]``: a uniform in [0, 1) (unused on greedy rows). Per
    row, in this order: the repetition penalty (a seen token's positive logit divided by it,
    a negative one multiplied), the temperature (0: the argmax, lowest id on ties), the
    log-softmax (the log-probabilities returned), then top-k (the k most likely, and every
    token tied with the k-th), top-p (the smallest most likely set whose probability,
    renormalised after top-k, reaches p, at least one token, and every token tied with its
    least likely), min-p (drop tokens less likely than min_p times the most likely), and the
    draw (the cuts keep ties as ``sampling.sample_row`` and transformers' warpers do): the first token whose cumulative kept
    probability exceeds ``u`` times their sum. A temperature or penalty so far from 1 that
    the float32 logits would overflow gives the limit (at a vanishing temperature, the argmax:
    other tokens' log-probabilities are -inf). In float32 (running sums in float64); the passes
    over the whole vocabulary run for all rows at once, and each row's result depends on its
    own inputs only. A row whose logits hold NaN or inf gets ``(None, None, ())``: no token
    can be chosen (seen free: the greedy choice's logit, or the softmax's sum, is not finite).

    >>> logits = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    >>> ps = [SamplingParams(top_p=0.6), SamplingParams(temperature=0, logprobs=1)]
    >>> [(t, None if lp is None else round(lp, 3), len(top))
    ...  for t, lp, top in choose_tokens(logits, ps, [[], []], [0.99, 0.0])]
    [(1, None, 0), (2, -0.223, 1)]
    """
    z = np.asarray(logits, dtype=np.float32)                  # (B, V)
    if z.ndim != 2 or len(params) != z.shape[0]:
        raise ConfigError(f"choose_tokens: expected logits (B, V) with one SamplingParams per "
                          f"row, got {z.shape} and {len(params)}")
    penalised = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0 and len(seen[r])]
    with np.errstate(over="ignore"):        # a temperature past float32's range: inf, uniform
        temp = np.array([p.temperature if p.temperature > 0 else 1.0 for p in params], np.float32)
    if penalised or (temp != 1.0).any():
        z = z.copy()
    for r in penalised:
        # a penalty past 1e30 (or under 1e-30) changes no draw in float32, but would overflow
        pen = np.float32(min(max(params[r].repetition_penalty, _PEN_RANGE[0]), _PEN_RANGE[1]))
        idx = np.unique(np.asarray(seen[r], dtype=np.int64))
        v = z[r, idx]
        with np.errstate(over="ignore"):
            z[r, idx] = np.clip(np.where(v > 0, v / pen, v * pen), -_F32_MAX, _F32_MAX)
    if (temp != 1.0).any():
        # a temperature so low that z / T overflows float32: (z - max z) / T in float64 for
        # that row, the same distribution with its top at 0 and no inf - inf
        low = {r: (z[r].astype(np.float64), params[r].temperature) for r in np.flatnonzero(temp < 1)
               if float(np.abs(z[r]).max()) >= float(temp[r]) * (_F32_MAX / 2)}
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            z /= temp[:, None]
            for r, (zr, t) in low.items():
                z[r] = (zr - zr.max()) / t
    # the softmax, only for the rows that sample or report log-probabilities
    soft = [r for r, p in enumerate(params) if not p.greedy or p.logprobs is not None]
    row_of = {r: i for i, r in enumerate(soft)}
    if soft:
        zs = z[soft]                                            # (S, V), a copy
        with np.errstate(invalid="ignore"):                     # (a NaN row: given None below)
            zs -= zs.max(axis=1, keepdims=True)                 # the top logit is 0
        e = np.exp(zs)                                          # unnormalised, the top is 1
        total = e.sum(axis=1).astype(np.float64)                # (S,), pairwise sums
    out = []
    for r, p in enumerate(params):
        tok = int(np.argmax(z[r])) if p.greedy else None
        if not np.isfinite(z[r, tok] if p.greedy else total[row_of[r]]):
            out.append((None, None, ()))      # NaN or inf in the row's logits
            continue
        if not p.greedy:
            i = row_of[r]
            kept = _cut(e[i], total[i], p.top_k, p.top_p, p.min_p)
            if kept is None:
                tok = _draw(e[i], float(u[r]))
            else:
                tok = int(kept[_draw(e[i][kept], float(u[r]))])
        lp, top = None, ()
        if p.logprobs is not None:
            i = row_of[r]
            lse = np.log(total[i])
            lp = float(zs[i, tok] - lse)
            top = tuple((int(t), float(zs[i, t] - lse)) for t in _top_ids(zs[i], p.logprobs))
        out.append((tok, lp, top))
    return out


def _head(v: np.ndarray, thresholds, enough) -> np.ndarray:
    """Ascending ids of the ``v >= t`` for the first threshold ``t`` where ``enough(ids)``,
    else every id."""
    for t in thresholds:
        ids = np.flatnonzero(v >= t)
        if enough(ids):
            return ids
    return np.arange(v.shape[0])


def _cut(w: np.ndarray, total: float, top_k: int, top_p: float, min_p: float):
    """The ids (ascending) that top-k, top-p and min-p keep of the unnormalised
    probabilities ``w`` (largest 1.0, sum ``total``), or None when they keep every id."""
    V = w.shape[0]
    kept = None
    if 0 < top_k < V:
        kept = _at_least_kth(w, top_k, _W_THRESHOLDS)
        total = float(w[kept].sum(dtype=np.float64))
    if top_p < 1.0:
        # the nucleus: the shortest head of the ids sorted by probability whose probability
        # reaches top_p, and every id tied with its last
        cand = kept if kept is not None else _head(
            w, _W_THRESHOLDS, lambda ids: w[ids].sum(dtype=np.float64) >= top_p * total)
        order = cand[np.argsort(-w[cand], kind="stable")]
        cum = np.cumsum(w[order], dtype=np.float64) / total
        n_keep = min(int(np.searchsorted(cum, top_p, side="left")) + 1, len(order))
        kept = cand[w[cand] >= w[order[n_keep - 1]]]            # ascending, as cand
    if min_p > 0.0:
        # the most likely token (w = 1) survives every cut, so min_p times it is min_p
        kept = np.flatnonzero(w >= min_p) if kept is None else kept[w[kept] >= min_p]
    return kept


def _draw(w: np.ndarray, u: float) -> int:
    """The first index whose cumulative weight exceeds ``u`` times the sum of ``w``: over
    block sums first, then inside the block (a cumulative sum over a whole large vocabulary
    is the slowest pass of all)."""
    n = w.shape[0]
    if n <= 4 * _DRAW_BLOCK:
        cdf = np.cumsum(w, dtype=np.float64)
        return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), n - 1)
    sums = np.add.reduceat(w, np.arange(0, n, _DRAW_BLOCK))     # (blocks,), pairwise sums
    csum = np.cumsum(sums, dtype=np.float64)
    x = u * csum[-1]
    b = min(int(np.searchsorted(csum, x, side="right")), len(sums) - 1)
    lo = b * _DRAW_BLOCK
    block = w[lo:lo + _DRAW_BLOCK]
    cdf = np.cumsum(block, dtype=np.float64) + (csum[b - 1] if b else 0.0)
    j = int(np.searchsorted(cdf, x, side="right"))
    if j >= block.shape[0]:        # rounding put x past the block's end: its last token
        j = int(np.flatnonzero(block)[-1])
    return lo + j


def _top_ids(lps: np.ndarray, n: int) -> np.ndarray:
    """Ids of the ``n`` largest of ``lps`` (log-probabilities), largest first, ties by
    lower id."""
    n = min(n, lps.shape[0])
    if n == 0:
        return np.zeros(0, np.int64)
    top = float(lps.max())
    ids = _largest(lps, n, [top - d for d in _WIDTHS])
    return ids[np.argsort(-lps[ids], kind="stable")]


def _at_least_kth(v: np.ndarray, k: int, thresholds) -> np.ndarray:
    """Ascending ids of the ``v`` at least the ``k``-th largest: the k largest and every id
    tied with the k-th (``_head`` first)."""
    ids = _head(v, thresholds, lambda ids: len(ids) >= k)
    vals = v[ids]
    return ids[vals >= np.partition(vals, len(ids) - k)[len(ids) - k]]


def _largest(v: np.ndarray, k: int, thresholds) -> np.ndarray:
    """Ascending ids of the ``k`` largest of ``v``, ties by lower id (``_head`` first)."""
    ids = _head(v, thresholds, lambda ids: len(ids) >= k)
    vals = v[ids]
    kth = np.partition(vals, len(ids) - k)[len(ids) - k]        # the k-th largest
    above = ids[vals > kth]
    ties = ids[vals == kth][: k - len(above)]                   # lowest ids first
    return np.union1d(above, ties)


# -- the step ------------------------------------------------------------------------------


def _row_step_fallback(model, batch: int, max_len: int):
    """``decode.row_step``'s contract on ``model.forward_cached``, one row at a time, each
    slot with a one-row cache whose ``pos`` is set to the row's position before its token."""
    from ..tensor import tensor

    caches = [model.new_cache(1, max_len) for _ in range(batch)]
    V, dev = model.config.vocab_size, model.device

    def step(tokens, positions) -> np.ndarray:
        out = np.full((batch, V), np.nan, np.float32)
        for b in range(batch):
            pos = int(positions[b])
            if 0 <= pos < max_len:
                caches[b].pos = pos
                logits = model.forward_cached(tensor([[int(tokens[b])]], device=dev), caches[b])
                out[b] = logits.numpy()[0, -1, :V]
        return out

    return step, caches


class _Request:
    """An admitted request's state in the loop."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.prompt = stream.prompt
        self.params = p = stream.params
        self.gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([p.seed, 0])))
        self.fed = 0                    # tokens fed so far: the next one goes at this position
        self.generated: list = []
        self.seen = set(self.prompt) if p.repetition_penalty != 1.0 else None
        self.stop = frozenset(p.stop_tokens)

    def next_token(self) -> int:
        if self.fed < len(self.prompt):
            return self.prompt[self.fed]
        return self.generated[-1]


class BatchEngine:
    """Serves requests by continuous batching over ``slots`` rows (see the module docstring).

    ``model``: a ``GPT2`` (on cpu or cuda); ``tokenizer``: kept for the server (the engine
    works in token ids, but neither takes nor chooses an id past the tokenizer's vocabulary,
    as a model whose vocabulary was padded past it has); ``slots``: rows per step (default 64
    on a device with its own memory (a GPU), 8 on host memory); ``max_len``: the context a request may fill, prompt and new tokens
    together (default and at most the model's ``block_size``). ``submit`` checks a request and queues it; ``close()`` stops
    the thread and ends every open stream with ``EngineClosedError``.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
    >>> engine = BatchEngine(model, slots=2)
    >>> [t.finish for t in engine.submit([1, 2], SamplingParams(max_tokens=2))]
    [None, 'length']
    >>> engine.stats()["slots"], engine.running
    (2, True)
    >>> engine.close()
    >>> engine.submit([1], SamplingParams(max_tokens=1))
    Traceback (most recent call last):
    ...
    forge_ml.inference.engine.EngineClosedError: the engine is closed
    """

    def __init__(self, model, tokenizer=None, slots: Optional[int] = None,
                 max_len: Optional[int] = None):
        cfg = model.config
        if slots is None:
            slots = 8 if device_has(model.device, "host_memory") else 64
        if not (_is_int(slots) and slots >= 1):
            raise ConfigError(f"BatchEngine: slots must be an int >= 1, got {slots!r}")
        if max_len is None:
            max_len = cfg.block_size
        if not (_is_int(max_len) and 1 <= max_len <= cfg.block_size):
            raise ConfigError(f"BatchEngine: max_len must be an int in 1..{cfg.block_size} "
                              f"(the model's block_size), got {max_len!r}")
        slots, max_len = int(slots), int(max_len)
        self.model, self.tokenizer = model, tokenizer
        self.slots, self.max_len, self.vocab_size = slots, max_len, cfg.vocab_size
        n_tok = getattr(tokenizer, "vocab_size", None)
        if isinstance(n_tok, int) and 0 < n_tok < cfg.vocab_size:
            self.vocab_size = n_tok     # the model's ids past the tokenizer's are no tokens
        make = row_step if row_step is not None else _row_step_fallback
        self._step, self._cache = make(model, batch=slots, max_len=max_len)
        # one step on token 0 (every slot idle: each is rewritten when a request takes it):
        # a model whose logits are NaN or inf is refused here, not served as id 0 at every step
        check_finite_logits(model, self._step(np.zeros(slots, np.int64), np.zeros(slots, np.int32))[:1],
                            "BatchEngine", "a first step on token 0 (its check of the model)")
        self._cond = threading.Condition()
        self._pending: collections.deque = collections.deque()
        self._active: list = [None] * slots
        self._closed = False
        self._error: Optional[str] = None
        self.steps = 0                  # decode steps run so far
        self._thread = threading.Thread(target=self._run, name="forge-ml-batch", daemon=True)
        self._thread.start()

    # -- the public side ----------------------------------------------------------------
    def submit(self, prompt_ids, params: SamplingParams = SamplingParams()) -> Stream:
        """Queue a request; returns its ``Stream``. Raises ``RequestError`` (naming the
        field) for a prompt that does not fit the vocabulary or, with ``max_tokens``, the
        context, and ``EngineClosedError`` once the engine is closed."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"submit: params must be SamplingParams, got "
                               f"{type(params).__name__}", "params")
        ids = check_prompt(prompt_ids, params, self.vocab_size, self.max_len)
        stream = Stream(ids, params, on_cancel=self._wake)
        with self._cond:
            if self._closed:
                raise EngineClosedError(self._error or "the engine is closed", None)
            if params.max_tokens == 0 and (params.prompt_logprobs is None or len(ids) == 1):
                stream._end("length")       # nothing to compute
                return stream
            self._pending.append(stream)
            self._cond.notify_all()
        return stream

    def stats(self) -> dict:
        """``{"slots", "running", "waiting", "steps"}`` right now (a request whose stream was
        cancelled, a client that left, is in neither: the loop drops it at its next turn)."""
        with self._cond:
            return {"slots": self.slots,
                    "running": sum(r is not None and not r.stream.cancelled for r in self._active),
                    "waiting": sum(not s.cancelled for s in self._pending), "steps": self.steps}

    @property
    def running(self) -> bool:
        """Whether the loop is alive (not closed, not failed)."""
        return not self._closed and self._thread.is_alive()

    def close(self, timeout: float = 10.0, reason: Optional[str] = None) -> None:
        """Stop the loop (after the step in flight) and end every open stream (with an
        EngineClosedError that says ``reason``, when given)."""
        with self._cond:
            if reason is not None and self._error is None:
                self._error = reason
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _wake(self):
        with self._cond:
            self._cond.notify_all()

    # -- the loop ------------------------------------------------------------------------
    def _admit(self) -> None:
        """Under the lock: free the slots of cancelled requests, fill free slots in order."""
        for s, rq in enumerate(self._active):
            if rq is not None and rq.stream.cancelled:
                self._active[s] = None
        for s in range(self.slots):
            if self._active[s] is not None:
                continue
            while self._pending and self._pending[0].cancelled:
                self._pending.popleft()
            if not self._pending:
                break
            self._active[s] = _Request(self._pending.popleft())

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._admit()
                    while not self._closed and not any(self._active):
                        self._cond.wait()
                        self._admit()
                    if self._closed:
                        break
                    batch = list(self._active)
                self._step_once(batch)
        except Exception as e:   # a failing step must not leave clients waiting forever
            log.exception("BatchEngine: the decode loop failed")
            self._error = f"the engine stopped after an error: {type(e).__name__}: {e}"
        finally:
            with self._cond:
                self._closed = True
                streams = [rq.stream for rq in self._active if rq is not None]
                streams += list(self._pending)
                self._active = [None] * self.slots
                self._pending.clear()
            for st in streams:
                st._push(EngineClosedError(self._error or "the engine was closed"))

    def _step_once(self, batch: list) -> None:
        S = self.slots
        tokens = np.zeros(S, np.int64)
        positions = np.zeros(S, np.int32)   # idle: token 0 at position 0 (see the docstring)
        for s, rq in enumerate(batch):
            if rq is not None:
                tokens[s] = rq.next_token()
                positions[s] = rq.fed
        logits = self._step(tokens, positions)[:, :self.vocab_size]   # (S, V) float32
        self.steps += 1
        rows = []
        for s, rq in enumerate(batch):
            if rq is None or rq.stream.cancelled:
                continue
            rq.fed += 1
            n = len(rq.prompt)
            if rq.fed < n:                                       # still inside the prompt
                if rq.params.prompt_logprobs is not None:
                    scored = _logprob_of(logits[s], rq.prompt[rq.fed], rq.params.prompt_logprobs)
                    if not np.isfinite(scored[0]):   # NaN or inf logits: no score to give
                        self._fail(s, rq)
                        continue
                    rq.stream.prompt_logprobs.append(scored)
                    if rq.params.max_tokens == 0 and rq.fed == n - 1:
                        self._finish(s, rq, None)               # the prompt is scored
                continue
            rows.append(s)
        if not rows:
            return
        reqs = [batch[s] for s in rows]
        params = [rq.params for rq in reqs]
        seen = [list(rq.seen) if rq.seen is not None else () for rq in reqs]
        u = [rq.gen.random() if not rq.params.greedy else 0.0 for rq in reqs]
        for s, rq, (tok, lp, top) in zip(rows, reqs, choose_tokens(logits[rows], params, seen, u)):
            if tok is None:     # NaN or inf logits past the prompt: the request ends in an error
                self._fail(s, rq)
                continue
            rq.generated.append(tok)
            if rq.seen is not None:
                rq.seen.add(tok)
            finish = None
            if tok in rq.stop:
                finish = "stop"
            elif (len(rq.generated) >= rq.params.max_tokens
                  or len(rq.prompt) + len(rq.generated) >= self.max_len):
                finish = "length"
            rq.stream._push(TokenOut(tok, lp, top, finish))
            if finish is not None:
                self._finish(s, rq, finish)

    def _fail(self, s: int, rq: _Request) -> None:
        """End slot ``s``'s request with a ModelError: its logits (for the token it was fed at
        position ``rq.fed - 1``) hold NaN or inf, so no token or score can be given; the message
        names the weight to blame (``nonfinite_error``)."""
        rq.stream._push(nonfinite_error(self.model, "BatchEngine",
                                        f"this request's token at position {rq.fed - 1}"))
        self._finish(s, rq, None)

    def _finish(self, s: int, rq: _Request, finish: Optional[str]) -> None:
        if finish is None:
            rq.stream._end("length")
        with self._cond:
            if self._active[s] is rq:
                self._active[s] = None


def _logprob_of(row: np.ndarray, token: int, n: int) -> tuple:
    """``(logprob of token, top-n ((id, logprob), ...))`` under ``softmax(row)``."""
    z = row.astype(np.float64)
    z -= z.max()
    lps = z - np.log(np.exp(z).sum())
    return float(lps[token]), tuple((int(t), float(lps[t])) for t in _top_ids(lps, n))
