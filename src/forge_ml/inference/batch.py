"""Continuous batching: ``BatchEngine`` runs many requests through one decode step.

A background thread owns the model and a step over ``slots`` rows, each row with its own
KV-cache rows and its own position (``DecodeStep.rows_choose``). Every step feeds each busy
slot one token at that slot's position: the next prompt token while the request is still
inside its prompt, else its last chosen token. A prompt of at least ``prefill_min`` tokens is
first prefilled in one forward pass into its slot's cache rows (all but its last token, which
the step feeds and chooses after), so its first token comes after one pass, not one step a
token; a shorter prompt rides the steps a token at a time (which costs the other slots
nothing). On a device with graphs (a GPU) that pass is replayed from a graph captured once per
padded length (the next power of two, 64 to ``max_len``: the prompt's last real token repeated
after it, whose keys and values no step reads before it writes its own there) into a one-row
cache, and copied into the slot's rows: a launch and a copy a layer, where op by op the host's
launches held the engine ~8 ms a prompt (GPT-2 124M, an H100). The path depends on the prompt
alone, never on the load, so a request gives the same tokens alone or among others. Each slot
past its prompt then gets its next token, chosen on the device with its own
``SamplingParams`` by the one sampling rule of every decoding path
(``forge_ml.sampling.sample_row``: ``ops.sample_next``), so only the tokens come back to the
host, and a row's logits only for a request that asks for log-probabilities or scores its
prompt. The request's ``Stream`` gets a ``TokenOut``, after the next step is on its way to
the device (the streams' locks and wake-ups run while the device computes). A request
finishes on a stop token, ``max_tokens`` or a full context, and frees its slot at once; a cancelled one frees it at the next step. A
new request takes a free slot at the next step, starting at position 0 (the slot's old cache
rows are overwritten before they are read). Idle slots are fed a dummy token at position 0
and their choices are ignored: that writes only their own row 0, which the next request of
the slot writes again at its first step, before any step reads it.

Per request reproducible, and the same draws as ``generate``: a request draws with the Philox
key ``generate.row_key(seed, 0)`` at the position of each token it chooses, as
``generate(model, prompt, seed=seed)`` draws for one prompt, so alone (or with any company) it
gives the tokens generate gives for its prompt and settings (where the tokenizer's vocabulary
is the model's: the engine never chooses an id past the tokenizer's), except where two tokens' scores
tie within rounding: the per-row step's logits equal generate's up to rounding, and a row's
logits depend on the other rows only through rounding (a product over more rows may sum in
another order).

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
from typing import Optional

import numpy as np

from .. import errors, flags, graph, ops
from ..errors import CaptureError, ConfigError
from ..sampling import knobs_row, logit_bias_row
from ..tensor import device_has, tensor
from .decode import DecodeStep, KVCache, model_check, nonfinite_error
from .engine import (EngineClosedError, RequestError, SamplingParams, Stream, TokenOut,
                     _is_int, check_prompt)
from .generate import _top_logprobs, penalised_logprobs, row_key

__all__ = ["BatchEngine", "SamplingParams", "TokenOut", "Stream", "RequestError",
           "EngineClosedError"]

log = logging.getLogger("forge_ml.inference")

_GREEDY = knobs_row(0.0)   # an idle slot's knobs: the argmax, the cheapest choice


def prefill_length(n: int, cap: int) -> int:
    """The padded length a prefill of ``n`` tokens runs at on a device with graphs: the next
    power of two, at least 64 and at most ``cap`` (the slots' capacity), so that a few graphs
    serve every prompt length.

    >>> prefill_length(63, 1024), prefill_length(64, 1024), prefill_length(65, 1024), prefill_length(700, 1000)
    (64, 64, 128, 1000)
    """
    return min(int(cap), max(64, 1 << (int(n) - 1).bit_length()))


def host_engine_bytes(config, slots: int, max_len: int) -> int:
    """About the bytes a ``BatchEngine`` on the CPU holds at its peak, its model aside: per
    slot, its KV-cache rows (two float32 vectors of ``n_embd`` a layer and a position) and
    about nine float32 rows of the padded vocabulary (the step's logits, the penalty marks and
    logit bias kept per row, the host's copy and the log-softmax of a request that asks for
    log-probabilities), and some ``n_embd`` rows of a step's activations. Fitted to the peak
    RSS of an engine whose every slot asked for log-probabilities, a penalty and a logit bias
    on the CPU backend (2026-12-07): 2 layers x 64 channels, 50,304 ids x 512 and 2,048 slots
    and 65 ids x 32,768 slots, within 15% of it.

    >>> from forge_ml.models.gpt2 import GPT2Config
    >>> cfg = GPT2Config(vocab_size=50257, block_size=128, n_layer=2, n_head=2, n_embd=64)
    >>> round(host_engine_bytes(cfg, 2048, 128) / 2 ** 30, 2)
    3.74
    """
    c, v = config.n_embd, config.padded_vocab_size
    return 4 * int(slots) * (2 * config.n_layer * int(max_len) * c + 9 * v + 64 * c)


class _Prefill:
    """The prefill of one padded length ``L``: its ids buffer (1, L), its one-row cache of L
    positions, and the graph that replays ``forward_cached`` from one into the other (None:
    op by op, where the device has no graphs or the capture failed)."""

    def __init__(self, model, L: int, padded: np.ndarray, captured: bool):
        self.model = model
        self.ids = tensor(padded, device=model.device)
        self.cache = KVCache.empty(model, 1, L)
        self.graph = None
        if captured:   # the real run (compiling every kernel) then the capture, in its memory
            try:   # (the real run's own failure, out of memory say, is the request's error)
                self.graph = graph.capture(model.device, self._work, run_first=True)
            except CaptureError as e:   # after the real run: this prefill is done
                log.warning("BatchEngine: a prefill's graph capture failed (%s); prefills run "
                            "op by op", e)
        else:
            self._work()

    def _work(self):
        self.cache.pos = 0
        return self.model.forward_cached(self.ids, self.cache, last_only=True)

    def run(self, padded: np.ndarray) -> None:
        ops.assign(self.ids, padded)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._work()


def knobs_of(p: SamplingParams) -> list:
    """A request's row of ``ops.sample_next``'s knobs (``forge_ml.sampling.knobs_row``).

    >>> knobs_of(SamplingParams(temperature=0.7, top_k=40))
    [0.7, 40, 1.0, 0.0, 1.0]
    """
    return knobs_row(p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty)


def token_logprobs_of(row: np.ndarray, p: SamplingParams, seen, token: int) -> tuple:
    """``(logprob, top)`` of ``token`` under the request's log-softmax of its logits ``row``
    (V,): after its repetition penalty over ``seen`` (the ids it has seen) and its
    temperature, before the cuts (``generate.token_logprobs``); ``top``: its ``p.logprobs``
    most likely ``((id, logprob), ...)``, most likely first, ties by lower id.

    >>> lp, top = token_logprobs_of(np.log(np.array([0.5, 0.3, 0.2], np.float32)),
    ...                             SamplingParams(logprobs=1), (), 1)
    >>> round(lp, 3), [(t, round(x, 3)) for t, x in top]
    (-1.204, [(0, -0.693)])
    """
    logp = penalised_logprobs(row, p.temperature, p.repetition_penalty, list(seen), "BatchEngine")
    return float(logp[token]), _top_logprobs(logp, p.logprobs or 0)


class _Request:
    """An admitted request's state in the loop."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.prompt = stream.prompt
        self.params = p = stream.params
        self.knobs = knobs_of(p)
        self.key = row_key(p.seed, 0)   # generate's key for one prompt with this seed
        self.fed = 0                    # tokens fed so far: the next one goes at this position
        self.generated: list = []
        marks = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        self.seen = set(self.prompt) if marks else None
        self.penalties = (p.presence_penalty, p.frequency_penalty)
        self.marked = False             # its penalty's marks are on the device
        self.choosing = False           # its slot's knobs are its own (else greedy's)
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
    on a device with its own memory (a GPU), 8 on host memory); ``max_len``: the context a
    request may fill, prompt and new tokens together (default and at most the model's
    ``block_size``); ``prefill_min``: the prompt length (tokens) from which a request's prompt
    is prefilled in one forward pass (default 64; requests that score their prompt,
    ``prompt_logprobs``, step through it). ``submit`` checks a request and queues it; ``close()`` stops the thread and
    ends every open stream with ``EngineClosedError``.

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
                 max_len: Optional[int] = None, prefill_min: int = 64):
        model_check("BatchEngine", model)
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
        if not (_is_int(prefill_min) and prefill_min >= 1):
            raise ConfigError(f"BatchEngine: prefill_min must be an int >= 1, got {prefill_min!r}")
        slots, max_len, self.prefill_min = int(slots), int(max_len), int(prefill_min)
        _check_host_memory(model, slots, max_len)
        self.model, self.tokenizer = model, tokenizer
        self.slots, self.max_len, self.vocab_size = slots, max_len, cfg.vocab_size
        n_tok = getattr(tokenizer, "vocab_size", None)
        if _is_int(n_tok) and 0 < n_tok < cfg.vocab_size:
            self.vocab_size = int(n_tok)   # the model's ids past the tokenizer's are no tokens
        self._decode = DecodeStep(model, KVCache.empty(model, slots, max_len))
        self._launch, self._collect = self._decode.rows_launch, self._decode.rows_collect
        self._knobs = np.tile(np.array(_GREEDY, np.float32), (slots, 1))   # per slot
        self._keys = np.zeros((slots, 2), np.int64)
        # OpenAI's adjustments per slot (0 and no bias while a slot is idle or in its prompt):
        # presence and frequency penalties, and the logit-bias rows to write at the next
        # launch ({slot: row, or None to clear it}; the step keeps which rows it holds)
        self._pen = np.zeros((slots, 2), np.float32)
        self._bias_next: dict = {}
        # one step on token 0 (every slot idle: each is rewritten when a request takes it):
        # a model whose logits are NaN or inf is refused here, not served as id 0 at every step
        self._launch(np.zeros(slots, np.int64), np.zeros(slots, np.int32), self._knobs,
                     self._keys, None, self.vocab_size)
        _, finite, _ = self._collect()
        if not finite[0]:
            raise nonfinite_error(model, "BatchEngine", "a first step on token 0 (its check of the model)")
        self._cond = threading.Condition()
        self._pending: collections.deque = collections.deque()
        self._active: list = [None] * slots
        self._closed = False
        self._error: Optional[str] = None
        self.steps = 0                  # decode steps run so far
        self.prefills = 0               # prompts prefilled in one forward pass
        # prefills by padded length, replayed from graphs where the device has them (the
        # tests force the padded path on the CPU through _padded)
        self._graphed = graph.available(model.device) and flags.on("FORGE_CUDA_GRAPH")
        self._padded = self._graphed
        self._prefill_at: dict = {}     # padded length -> _Prefill
        self._thread = threading.Thread(target=self._run, name="forge-ml-batch", daemon=True)
        self._thread.start()

    # -- the public side ----------------------------------------------------------------
    def submit(self, prompt_ids, params: SamplingParams = SamplingParams()) -> Stream:
        """Queue a request; returns its ``Stream``. Raises ``RequestError`` (naming the
        field) for a prompt that does not fit the vocabulary or, with ``max_tokens``, the
        context, and ``EngineClosedError`` once the engine is closed.

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
        >>> with BatchEngine(model, slots=2) as engine:
        ...     out = list(engine.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0)))
        ...     try:
        ...         engine.submit([11])           # ids are 0..10
        ...     except RequestError as e:
        ...         print(e.param)
        prompt
        >>> len(out), out[-1].finish
        (3, 'length')
        """
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
        cancelled, a client that left, is in neither: the loop drops it at its next turn).

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
        >>> with BatchEngine(model, slots=2) as engine:
        ...     _ = list(engine.submit([1], SamplingParams(max_tokens=2)))   # 2 steps
        ...     engine.stats()
        {'slots': 2, 'running': 0, 'waiting': 0, 'steps': 2}
        """
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
        EngineClosedError that says ``reason``, when given).

        >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
        >>> model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
        >>> engine = BatchEngine(model, slots=1)
        >>> engine.close(reason="shutting down")
        >>> engine.running, engine.stats()["running"]
        (False, 0)
        """
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
                self._free(s)
        for s in range(self.slots):
            if self._active[s] is not None:
                continue
            while self._pending and self._pending[0].cancelled:
                self._pending.popleft()
            if not self._pending:
                break
            self._active[s] = rq = _Request(self._pending.popleft())
            self._keys[s] = rq.key

    def _run(self) -> None:
        try:
            flight = None    # the slots' requests of the step on the device, or None
            while True:
                with self._cond:
                    self._admit()
                    while flight is None and not self._closed and not any(self._active):
                        self._cond.wait()
                        self._admit()
                    if self._closed:
                        break
                if flight is None:
                    flight = self._launch_step()
                outs = self._collect_step(flight)
                # the next step goes to the device before this one's tokens go to their
                # streams: the streams' locks and wake-ups run while the device computes
                with self._cond:
                    self._admit()
                    go = not self._closed and any(self._active)
                flight = self._launch_step() if go else None
                for stream, item in outs:
                    stream._push(item)
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

    def _prefill(self, batch: list) -> None:
        """Prefill the prompts of at least ``prefill_min`` tokens of the requests new in this
        step's ``batch``, each in one forward pass into its slot's cache rows."""
        for s, rq in enumerate(batch):
            if (rq is None or rq.fed or rq.params.prompt_logprobs is not None
                    or rq.stream.cancelled):
                continue
            n = len(rq.prompt) - 1          # the last prompt token is the step's to feed
            if n >= max(1, self.prefill_min - 1):   # a prompt of prefill_min tokens or more
                try:
                    self._prefill_one(s, rq.prompt[:n])
                except Exception as e:   # (out of memory for a long prompt): this request's
                    log.warning("BatchEngine: a prompt's prefill failed: %s: %s",  # error,
                                type(e).__name__, e)                              # not the engine's
                    rq.stream._push(e)
                    self._finish(s, rq, None)
                    batch[s] = None
                    continue
                rq.fed = n
                self.prefills += 1

    def _prefill_one(self, s: int, ids: list) -> None:
        """``ids`` (a prompt but its last token) into slot ``s``'s cache rows: by one forward
        pass op by op, or (``_padded``) padded to ``prefill_length`` into that length's
        one-row cache, replayed from its graph where there is one, then copied into the slot's
        rows (every padded position: those past the prompt are written by the slot's steps
        before any step reads them)."""
        row = self._decode.cache.row(s)
        if not self._padded:
            self.model.forward_cached(tensor(np.array([ids], np.int64), device=self.model.device),
                                      row, last_only=True)
            return
        n = len(ids)
        L = prefill_length(n, self.max_len)
        padded = np.full((1, L), ids[-1], np.int64)
        padded[0, :n] = ids
        pre = self._prefill_at.get(L)
        if pre is None:   # its first run is this prefill
            pre = _Prefill(self.model, L, padded, self._graphed)
            if pre.graph is None and self._graphed:
                # a failed capture (warned once): this prefill ran; the next ones run op by op
                # into the slot's rows, unpadded (padding without a graph is only more work)
                self._graphed = self._padded = False
                self._prefill_at.clear()
            else:
                self._prefill_at[L] = pre
        else:
            pre.run(padded)
        for dst, src in zip(row.k + row.v, pre.cache.k + pre.cache.v):
            ops.kv_append(dst, src, 0)

    def _launch_step(self) -> list:
        """Queue a step for the busy slots (each fed its next token at its position, the new
        ones' prompts prefilled first where due); returns the slots' requests (None: idle) as
        they were at the launch."""
        batch = list(self._active)
        self._prefill(batch)
        S = self.slots
        tokens = np.zeros(S, np.int64)
        positions = np.zeros(S, np.int32)   # idle: token 0 at position 0 (see the docstring)
        marks = {}    # the rows whose penalty's marks are set at this step
        for s, rq in enumerate(batch):
            if rq is None:
                continue
            tokens[s] = rq.next_token()
            positions[s] = rq.fed
            choosing = rq.fed + 1 >= len(rq.prompt)
            if choosing != rq.choosing:   # a row inside its prompt takes the cheapest choice
                self._knobs[s] = rq.knobs if choosing else _GREEDY
                rq.choosing = choosing
                self._pen[s] = rq.penalties if choosing else (0.0, 0.0)
                if choosing and rq.params.logit_bias:   # (its ids checked at submit)
                    self._bias_next[s] = logit_bias_row(dict(rq.params.logit_bias),
                                                        self.vocab_size, "BatchEngine")
            if rq.seen is not None and not rq.marked and choosing:
                # it chooses its first token at this step: its marks are its prompt's (the
                # device marked its prefill steps' ignored choices; those go here)
                marks[s] = rq.prompt
                rq.marked = True
        bias, self._bias_next = self._bias_next, {}
        self._launch(tokens, positions, self._knobs, self._keys, marks, self.vocab_size,
                     self._pen if self._pen.any() else None, bias)
        return batch

    def _free(self, s: int) -> None:
        """Slot ``s`` idle again: greedy knobs, no penalties, its logit bias cleared at the next
        launch."""
        self._active[s] = None
        self._knobs[s] = _GREEDY
        self._pen[s] = 0.0
        self._bias_next[s] = None   # (a row the step holds no bias for: nothing to do)

    def _collect_step(self, batch: list) -> list:
        """The launched step's results for its slots' requests: their state moves on, the
        finished ones free their slots; returns the ``(stream, TokenOut)`` pairs to push.
        Everything that reads the step's logits (log-probabilities, prompt scores) is done
        here, before the next launch overwrites them."""
        toks, finite, logits = self._collect()
        self.steps += 1
        rows = _HostRows(logits, self.vocab_size)
        outs = []
        for s, rq in enumerate(batch):
            if rq is None or rq.stream.cancelled:
                continue
            rq.fed += 1
            n = len(rq.prompt)
            if rq.fed < n:                                       # still inside the prompt
                if rq.params.prompt_logprobs is not None:
                    if not finite[s]:        # NaN or inf logits: no score to give
                        self._fail(s, rq)
                        continue
                    scored = _logprob_of(rows[s], rq.prompt[rq.fed], rq.params.prompt_logprobs)
                    rq.stream.prompt_logprobs.append(scored)
                    if rq.params.max_tokens == 0 and rq.fed == n - 1:
                        self._finish(s, rq, None)               # the prompt is scored
                continue
            if not finite[s]:   # NaN or inf logits past the prompt: the request ends in an error
                self._fail(s, rq)
                continue
            tok = int(toks[s])
            lp, top = None, ()
            if rq.params.logprobs is not None:
                lp, top = token_logprobs_of(rows[s], rq.params, rq.seen or (), tok)
            rq.generated.append(tok)
            if rq.seen is not None:
                rq.seen.add(tok)
            finish = None
            if tok in rq.stop:
                finish = "stop"
            elif (len(rq.generated) >= rq.params.max_tokens
                  or len(rq.prompt) + len(rq.generated) >= self.max_len):
                finish = "length"
            outs.append((rq.stream, TokenOut(tok, lp, top, finish)))
            if finish is not None:
                self._finish(s, rq, finish)
        return outs

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
                self._free(s)


def _check_host_memory(model, slots: int, max_len: int) -> None:
    """On the CPU, refuse slots whose cache and logits cannot fit the host's free memory,
    before any of it is allocated: Linux hands the arrays out and then kills the process as
    they fill (``forge-ml serve --slots 100000`` of a small GPT-2 ran 40 s and died, exit 137,
    without a word, taking the machine's free memory with it)."""
    if not device_has(model.device, "host_memory"):
        return
    need = host_engine_bytes(model.config, slots, max_len)
    errors.check_host_memory(
        "BatchEngine", f"{slots:,} slots x a context of {max_len:,} tokens", need,
        lambda free: f"use at most about {max(0, free // max(1, need // slots)):,} slots "
                     f"(forge-ml serve --slots) or a shorter context (--max-len)")


class _HostRows:
    """Rows of a step's device logits, each read back when first asked for (the whole
    logits at once past a quarter of the rows): ``rows[s]`` is row ``s``'s first
    ``vocab_size`` logits, float32 (V,)."""

    def __init__(self, logits, vocab_size: int):
        self.logits, self.vocab_size, self.got, self.all = logits, vocab_size, {}, None

    def __getitem__(self, s: int) -> np.ndarray:
        if self.all is not None:
            return self.all[s]
        if s not in self.got:
            B, Vp = self.logits.shape
            if len(self.got) + 1 > max(1, B // 4):
                self.all = self.logits.numpy()[:, :self.vocab_size]
                return self.all[s]
            row = ops.take_rows(self.logits.reshape(1, B, Vp), s)       # (1, Vp), a copy
            self.got[s] = row.numpy()[0, :self.vocab_size]
        return self.got[s]


def _logprob_of(row: np.ndarray, token: int, n: int) -> tuple:
    """``(logprob of token, top-n ((id, logprob), ...))`` under ``softmax(row)``."""
    lps = penalised_logprobs(row, 1.0, 1.0, (), "BatchEngine")
    return float(lps[token]), _top_logprobs(lps, n)
