"""The interface between the HTTP server (``forge_ml.serve``) and a decoding engine.

A request is a prompt (token ids) and ``SamplingParams``; the engine streams ``TokenOut``
events for it: one per generated token, the last one carrying ``finish`` ("stop" when a stop
token was drawn, "length" when ``max_tokens`` or the context ran out). ``submit`` is safe to
call from any thread; events arrive on the request's ``Stream`` (an iterator for threads and
an async iterator for the server's event loop). ``Stream.cancel()`` ends a request early (a
client that disconnected) and frees its place in the batch.

Bad requests are refused at ``submit`` with a ``RequestError`` that names the offending
field (``param``), so the server can answer HTTP 400 with it.

>>> p = SamplingParams(max_tokens=4, temperature=0.0)
>>> p.greedy
True
>>> SamplingParams(temperature=-1)
Traceback (most recent call last):
...
forge_ml.inference.engine.RequestError: temperature must be a finite number >= 0 (0 is greedy) within float32's range (3.4e38), got -1
"""
from __future__ import annotations

import asyncio
import collections
import collections.abc
import numbers
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..errors import ConfigError, plural
from ..sampling import F32_MAX, is_finite, logit_bias_row, openai_penalty

MAX_LOGPROBS = 20


def shown_logprob(lp: Optional[float]) -> Optional[float]:
    """A log-probability as the server's JSON and ``forge-ml sample --logprobs`` show it: one
    under -9999 (-inf, a token the sampling made impossible, or -1e30 at a vanishing
    temperature) becomes -9999.0, the value OpenAI's API gives such tokens.

    >>> shown_logprob(float("-inf")), shown_logprob(-1e30), shown_logprob(-1.5), shown_logprob(None)
    (-9999.0, -9999.0, -1.5, None)
    """
    return lp if lp is None or lp > -9999.0 else -9999.0


class RequestError(ConfigError):
    """A request the engine refuses: a field out of range, a prompt that does not fit the
    context or the vocabulary. ``param`` names the field (OpenAI's error ``param``).

    >>> try:
    ...     SamplingParams(max_tokens=-1)
    ... except RequestError as e:
    ...     print(e.param, "|", e)
    max_tokens | max_tokens must be an int >= 0, got -1
    """

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.param, self.code = param, code


class EngineClosedError(RequestError):
    """The engine was closed (or its loop failed) before or while serving the request.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> from forge_ml.inference.batch import BatchEngine
    >>> engine = BatchEngine(GPT2.init(GPT2Config(vocab_size=5, block_size=32, n_layer=1, n_head=1, n_embd=4)))
    >>> engine.close(reason="the server is shutting down")
    >>> try:
    ...     engine.submit([1])
    ... except EngineClosedError as e:
    ...     print(e, "|", isinstance(e, RequestError))
    the server is shutting down | True
    """


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens (OpenAI's completion fields, plus the usual extras).

    temperature 0 is greedy; top_k 0 (or None) and top_p 1.0 and min_p 0.0 switch those cuts
    off;
    repetition_penalty 1.0 is none (HF/CTRL's rule: a seen token's positive logit is divided
    by it, a negative one multiplied); logprobs None returns no log-probabilities, n >= 0
    returns the chosen token's and the n most likely tokens' log-probabilities (after the
    temperature, before the cuts; at temperature 0, of the logits as they are);
    stop_tokens (an id, or a tuple, list or array of ids) end the request when drawn (the token is returned with
    finish "stop").
    ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], 0 is off) and ``logit_bias``
    ({token id: bias in [-100, 100]}, kept as sorted ``(id, bias)`` pairs) are OpenAI's, as
    ``generate`` takes them (``forge_ml.sampling.adjusted``: counted over the request's
    generated tokens, before the repetition penalty; the log-probabilities are those of the
    adjusted distribution).
    ``prompt_logprobs`` (None or n >= 0) also scores the prompt: ``Stream.prompt_logprobs``
    gets, for each prompt token after the first, its log-probability and the n most likely
    tokens' under the model's plain distribution (temperature 1, no penalty); with it,
    ``max_tokens`` 0 scores a prompt without generating. Every value is checked here.

    >>> SamplingParams(top_p=0)
    Traceback (most recent call last):
    ...
    forge_ml.inference.engine.RequestError: top_p must be a number in (0, 1], got 0
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    logprobs: Optional[int] = None
    stop_tokens: tuple = ()
    prompt_logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[tuple] = None

    def __post_init__(self):
        def bad(name, want):
            raise RequestError(f"{name} must be {want}, got {getattr(self, name)!r}", name)

        if self.top_k is None:          # generate's "off": 0 here
            object.__setattr__(self, "top_k", 0)
        # generate's forms: one id (an int, a 0-d array), a list or an array of ids: a tuple here
        st = self.stop_tokens
        if _is_int(st) or (isinstance(st, np.ndarray) and st.ndim == 0):
            object.__setattr__(self, "stop_tokens", (st.item() if isinstance(st, np.ndarray) else st,))
        elif isinstance(st, list) or (isinstance(st, np.ndarray) and st.ndim == 1):
            object.__setattr__(self, "stop_tokens", tuple(st.tolist() if isinstance(st, np.ndarray) else st))
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            bad("max_tokens", "an int >= 0")
        if not is_finite(self.temperature) or not 0 <= float(self.temperature) <= F32_MAX:
            bad("temperature", "a finite number >= 0 (0 is greedy) within float32's range (3.4e38)")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an int >= 0 (0 is off)")
        if not is_finite(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        if not is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "a finite number > 0 (1 is none)")
        if not _is_int(self.seed) or not 0 <= self.seed < 1 << 64:   # (2**64 drew as seed 0)
            bad("seed", "an int in [0, 2**64)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"None or an int in 0..{MAX_LOGPROBS}")
        if not isinstance(self.stop_tokens, tuple) or not all(_is_int(t) for t in self.stop_tokens):
            bad("stop_tokens", "a token id or a tuple, list or array of token ids")
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, openai_penalty(
                name, getattr(self, name), None, lambda m, n=name: RequestError(m, n)))
        lb = self.logit_bias
        if isinstance(lb, tuple):   # its own form, (id, bias) pairs
            lb = dict(lb) if all(isinstance(x, tuple) and len(x) == 2 for x in lb) else lb
        object.__setattr__(self, "logit_bias", logit_bias_row(
            lb, None, None, lambda m: RequestError(m, "logit_bias")) or None)
        # NumPy scalars as Python numbers (an np.uint8 logprobs overflowed in the top-n cut,
        # inside the engine's loop, and stopped it)
        for name in ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, int(v))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class TokenOut:
    """One generated token of one request: its id, its log-probability (when asked), the
    top log-probabilities as ``((id, logprob), ...)`` most likely first (when asked), and
    ``finish`` (None, "stop" or "length") on the request's last token.

    >>> TokenOut(7, logprob=-0.25, top_logprobs=((7, -0.25), (3, -1.5)), finish="stop")
    TokenOut(token=7, logprob=-0.25, top_logprobs=((7, -0.25), (3, -1.5)), finish='stop')
    """

    token: int
    logprob: Optional[float] = None
    top_logprobs: tuple = field(default_factory=tuple)
    finish: Optional[str] = None


def check_prompt(prompt_ids, params: SamplingParams, vocab_size: int, max_len: int) -> list:
    """The prompt as a list of ints, after checking it fits the vocabulary and, with
    ``params.max_tokens`` new tokens, the context of ``max_len`` tokens.

    >>> check_prompt([1, 2], SamplingParams(max_tokens=2), vocab_size=5, max_len=4)
    [1, 2]
    >>> check_prompt([1, 2], SamplingParams(max_tokens=3), vocab_size=5, max_len=4)
    Traceback (most recent call last):
    ...
    forge_ml.inference.engine.RequestError: the prompt's 2 tokens plus max_tokens 3 exceed the context of 4 tokens; ask for at most 2 new tokens
    >>> check_prompt(5, SamplingParams(), vocab_size=5, max_len=4)
    Traceback (most recent call last):
    ...
    forge_ml.inference.engine.RequestError: the prompt must be a list of int token ids, got 5
    """
    if hasattr(prompt_ids, "numpy") and not isinstance(prompt_ids, collections.abc.Sequence):
        prompt_ids = prompt_ids.numpy()             # a Tensor of ids
    if hasattr(prompt_ids, "tolist") and getattr(prompt_ids, "ndim", 1) == 1:
        prompt_ids = prompt_ids.tolist()            # a NumPy array of ids
    if isinstance(prompt_ids, collections.abc.Iterator):
        prompt_ids = list(prompt_ids)               # once: iterating it spends it
    # a 0-d array (iterating it raised a TypeError), and a set or a dict, whose order is not
    # the prompt's (a set's ids were fed sorted, a dict's keys in silence)
    if (isinstance(prompt_ids, (str, bytes, collections.abc.Set, collections.abc.Mapping))
            or getattr(prompt_ids, "ndim", 1) == 0
            or not isinstance(prompt_ids, collections.abc.Iterable)
            or not all(_is_int(t) for t in prompt_ids)):
        raise RequestError(f"the prompt must be a list of int token ids, got {prompt_ids!r:.80}",
                           "prompt")
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise RequestError("the prompt is empty; give at least one token", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} in the prompt is out of range; ids must be in "
                           f"0..{vocab_size - 1}", "prompt")
    if len(ids) > max_len:
        raise RequestError(f"the prompt has {len(ids)} tokens, longer than the context of "
                           f"{max_len} tokens", "prompt", "context_length_exceeded")
    if len(ids) + params.max_tokens > max_len:
        raise RequestError(f"the prompt's {len(ids)} {plural(len(ids), 'token')} plus max_tokens "
                           f"{params.max_tokens} exceed the context of {max_len} tokens; ask for "
                           f"at most {max_len - len(ids)} {plural(max_len - len(ids), 'new token')}",
                           "max_tokens",
                           "context_length_exceeded")
    bad = [t for t in params.stop_tokens if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"stop token {bad[0]} is out of range; ids must be in "
                           f"0..{vocab_size - 1}", "stop_tokens")
    bad = [t for t, _ in params.logit_bias or () if not t < vocab_size]
    if bad:
        raise RequestError(f"logit_bias has token id {bad[0]}; the ids are 0..{vocab_size - 1}",
                           "logit_bias")
    return ids


_END = object()


class Stream:
    """The events of one request: iterate it (blocking, from a thread) or ``async for`` it
    (from an event loop) to get its ``TokenOut``\\ s; iteration ends after the one carrying
    ``finish`` (or at once after ``cancel()``). ``finish`` is then the reason; a request with
    ``max_tokens`` 0 ends with no token and finish "length". If the engine fails or closes
    meanwhile, iteration raises ``EngineClosedError``. ``prompt_logprobs``: see
    ``SamplingParams``; complete before the first token arrives.

    The engine's thread calls ``_push``; consumers never block it.

    >>> s = Stream([1, 2], SamplingParams())
    >>> s._push(TokenOut(7)); s._push(TokenOut(8, finish="length"))
    >>> [t.token for t in s], s.finish
    ([7, 8], 'length')
    """

    def __init__(self, prompt: list, params: SamplingParams, on_cancel=None):
        self.prompt = prompt
        self.params = params
        self.prompt_logprobs: list = []   # (logprob, ((id, logprob), ...)) per prompt token 1..
        self.finish: Optional[str] = None
        self.cancelled = False
        self._items = collections.deque()
        self._cond = threading.Condition()
        self._waker = None                # (loop, asyncio.Event) of an async consumer
        self._ended = False
        self._failed = None               # the error an iteration raised (a later one, again)
        self._on_cancel = on_cancel

    # -- the producer side (the engine's thread) ------------------------------------------
    def _push(self, item) -> None:
        """Queue a TokenOut (one with ``finish`` ends the stream) or an exception to raise
        in the consumer (it ends the stream too)."""
        finish = item.finish if isinstance(item, TokenOut) else None
        ends = finish is not None or isinstance(item, BaseException)
        self._append(item, ends, finish)

    def _end(self, finish: str) -> None:
        """End the stream with no further token (``max_tokens`` 0, a scored prompt)."""
        self._append(_END, True, finish)

    def _append(self, item, ends: bool, finish: Optional[str]) -> None:
        with self._cond:
            if self._ended:
                return
            if finish is not None:
                self.finish = finish
            self._ended = ends
            self._items.append(item)
            self._cond.notify_all()
            waker = self._waker
        self._wake_async(waker)

    @staticmethod
    def _wake_async(waker) -> None:
        if waker is not None:
            loop, event = waker
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:   # the consumer's loop is closed: nobody is listening
                pass

    @property
    def done(self) -> bool:
        """Whether the stream has ended (finished, cancelled or failed)."""
        return self._ended

    # -- the consumer side ----------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the request: iteration ends at once (tokens not yet read are dropped) and its
        slot is freed at the engine's next step. Safe from any thread; ``finish`` stays
        None unless the request had finished before.

        >>> s = Stream([1], SamplingParams())
        >>> s._push(TokenOut(7)); s.cancel()
        >>> list(s), s.done, s.finish
        ([], True, None)
        """
        with self._cond:
            was_open = not self._ended
            self.cancelled = self.cancelled or was_open
            self._ended = True
            self._items.clear()
            self._items.append(_END)
            self._cond.notify_all()
            waker = self._waker
        self._wake_async(waker)
        if was_open and self._on_cancel is not None:
            self._on_cancel()

    def _take(self, item):
        """``item`` to yield, or None at the end."""
        if item is _END:
            return None
        if isinstance(item, BaseException):
            self._failed = item   # raised again by a later iteration
            raise item
        return item

    def _over(self) -> bool:
        """Under the lock, with nothing left to read: whether the stream has ended (its end
        was read by an earlier iteration: a second one ends at once, or raises its error
        again, rather than waiting for events that will never come)."""
        if not self._ended:
            return False
        if self._failed is not None:
            raise self._failed
        return True

    def __iter__(self):
        while True:
            with self._cond:
                while not self._items:
                    if self._over():
                        return
                    self._cond.wait()
                item = self._items.popleft()
            out = self._take(item)
            if out is None:
                return
            yield out
            if out.finish is not None:
                return

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            self._waker = (loop, event)
        while True:
            with self._cond:
                item = self._items.popleft() if self._items else None
                if item is None:
                    if self._over():
                        return
                    event.clear()
            if item is None:
                await event.wait()
                continue
            out = self._take(item)
            if out is None:
                return
            yield out
            if out.finish is not None:
                return
