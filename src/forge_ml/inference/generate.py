"""Sampling from a GPT-2: a streaming generator over one prompt or a batch of prompts.

``generate`` yields tokens as they are produced. For one prompt (a list of ints, or a 1-d
integer Tensor) it yields ints. For a batch (a list of lists, lengths may differ, or a 2-d
integer Tensor) it yields, once per decoding step,
a list of ``TokenEvent``\\ s: one for every row that produced a token in that step. A row that
has finished yields nothing more; the generator ends when every row has finished.

The KV cache is allocated once per call (``inference.decode.decoder(model, B, max_len)``;
on cuda kept for the next call of the same shape, with its CUDA graphs), filled by
``model.forward_cached`` for the prompts, then one token per row at a time by its
``DecodeStep`` (on cuda a CUDA graph captured once and replayed at every position). A model
in bf16 (``model.to(dtype="bfloat16")``) generates in bf16. Once no row has prompt tokens
left and no log-probabilities are to be reported, the steps chain on the device: the choice
is made there (the argmax, ``DecodeStep.greedy``; or a sample, ``DecodeStep.sample``, by the
rule below) and the host reads the tokens as they come.

Rows share one position counter: the first ``min(len(p))`` tokens
of every prompt are prefilled together, then the batch steps one token at a time, and a row
still inside its prompt is fed its next prompt token instead of a sampled one. So every row
sees exactly the positions and keys it would see alone, and its tokens equal those of the
same prompt run alone when greedy. Sampling draws from the row's own random stream, keyed
by ``(seed, row index)``: the other rows' prompts do not change a row's random numbers, and
row 0 draws with the numbers the prompt alone (with the same seed) draws with; row ``r`` with
those of row ``r`` of any batch. The logits are another matter: a batch of another make-up
computes them with products of other shapes (and prefills another number of positions at
once), which sum in another order, so they can differ in the last bits, and a token that sits
on a cut (top-k's or top-p's edge, the draw's boundary between two tokens) can then go the
other way: rarely (one row in 40 over 38 tokens, top-p 0.9, in a test on the CPU), but from
there on that row differs. The same batch (the same prompts in the same rows) with the same
seed gives the same tokens.

Next-token choice, per row (``next_token_probs``), on the first ``vocab_size`` logits (the
padded columns are never sampled), in transformers' order (``GenerationMixin.
_get_logits_processor`` with ``do_sample``: the processors, then the warpers temperature,
top-k, top-p, min-p):

0. OpenAI's adjustments, where given (``forge_ml.sampling.adjusted``): ``logit_bias`` ({id:
   bias in [-100, 100]}) added to the logits, then ``frequency_penalty`` times the number of
   times the row generated each id so far and ``presence_penalty`` once for each id it
   generated taken away (each in [-2, 2]; the prompt's ids are not counted, as in OpenAI's
   API and vLLM).
1. ``repetition_penalty`` (CTRL, Keskar et al. 2019; transformers'
   ``RepetitionPenaltyLogitsProcessor``): the logit of every id present in the row's context
   so far (its prompt and its generated tokens) is divided by the penalty when positive and
   multiplied by it when negative. Greedy decoding applies it too, as transformers does.
2. temperature: 0 is greedy (the argmax of the penalised logits); otherwise the logits are
   divided by it.
3. ``top_k``: the ``k`` largest logits are kept (every token tied with the k-th too, as
   transformers keeps them).
4. ``top_p``: the smallest set of most likely tokens whose probability reaches ``top_p``.
5. ``min_p``: tokens whose probability is below ``min_p`` times the largest one's are dropped
   (transformers' ``MinPLogitsWarper``: after temperature, after top-k and top-p). It
   compares each token with the most likely one, which every cut keeps, so with top-k alone
   the order would not matter; placed last, top-p's nucleus is measured on the distribution
   before min-p's cut, as in transformers (placed first, the nucleus would grow).

The draw is ``forge_ml.sampling.sample_row``'s rule, the one the GPU's sampling kernel runs:
the kept probabilities as integer weights (the most likely token's 2^24), and one Philox
word at the counter of the position being chosen, with row ``r``'s key from ``(seed, r)``.
The same seed gives the same tokens for the same batch (see above for another batch).
``next_token_probs`` is the distribution written out (the reference the tests draw against).

Log-probabilities (``logprobs=n``, batch form only): each TokenEvent carries ``logprob``, the
chosen token's log-probability, and ``top_logprobs``, the ``n`` most likely ``(id,
logprob)`` pairs (most likely first, ties by lower id), both from
``log_softmax(penalised logits / temperature)`` (temperature 0: the penalised logits
untempered), that is before the top-k, top-p and min-p cuts, as ``token_logprobs`` computes
them. A single prompt yields plain ints, so ``generate(model, ids, logprobs=n)`` is a
ConfigError: pass ``[ids]``. The yield type then depends on the prompt's shape alone, with no
second switch meaning the same thing.

Beam search is ``forge_ml.inference.beam.beam_search``, not a mode of ``generate``: it picks
whole sequences at the end, so it has no tokens to stream.

A row finishes (``TokenEvent.finish`` says why) after
    - a token in ``stop_tokens`` ("stop_token"; the stop token is yielded),
    - a token that completes one of ``stop_strings`` in the row's generated text, the text
      ``decode(prompt + generated)`` adds to ``decode(prompt)`` (``text_after``: a Metaspace
      tokenizer's leading space included) ("stop_string"; needs ``tokenizer``; that token is
      yielded),
    - ``max_new_tokens`` tokens ("max_new_tokens"),
    - a full context: a row's prompt plus its generated tokens never exceed ``block_size``
      positions, so a prompt of ``n`` tokens gets at most ``block_size - n`` new ones
      ("context_full"; there is no sliding window). A row with nothing to generate (a prompt
      that fills the context, or ``max_new_tokens=0``) yields no event at all, so no finish
      reason either: its prompt is its whole text.

>>> from forge_ml.models.gpt2 import GPT2, GPT2Config
>>> model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
>>> out = list(generate(model, [1, 2, 3], max_new_tokens=4, temperature=0))
>>> len(out), all(0 <= t < 11 for t in out)
(4, True)
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from .. import errors
from ..errors import ConfigError, ShapeError
from ..sampling import (F32_MAX, adjusted, is_int as _is_int, is_real, knobs_row,
                        logit_bias_row, openai_penalty, penalty_knob, sample_row, seen_row)
from ..tensor import Tensor, device_has, tensor
from ..tokenizer import hides_stop
from .decode import (check_finite_logits, held_decoder, host_decode_bytes, model_check,
                     nonfinite_error)

FINISH_REASONS = ("stop_token", "stop_string", "max_new_tokens", "context_full")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one row of a batch.

    ``row``: the prompt's index; ``token``: the id; ``index``: its place among the row's
    generated tokens (0 for the first); ``finish``: None while the row goes on, else why the
    row ended with this token (one of ``FINISH_REASONS``).

    With ``generate(..., logprobs=n)``: ``logprob``, the token's log-probability, and
    ``top_logprobs``, a tuple of the ``n`` most likely ``(id, logprob)`` pairs, most likely
    first (see the module docstring); both None otherwise.

    >>> TokenEvent(row=1, token=42, index=0)
    TokenEvent(row=1, token=42, index=0, finish=None, logprob=None, top_logprobs=None)
    """

    row: int
    token: int
    index: int
    finish: Optional[str] = None
    logprob: Optional[float] = None
    top_logprobs: Optional[tuple] = None


# -- choosing the next token ---------------------------------------------------------------


def apply_repetition_penalty(logits, penalty: float, context,
                             who: str = "apply_repetition_penalty") -> np.ndarray:
    """``logits`` (float64 copy, one row: ``(V,)``, or ``(1, V)`` read as it) with the CTRL
    repetition penalty on every id in ``context``: a positive logit divided by ``penalty``, a
    negative one multiplied (transformers' ``RepetitionPenaltyLogitsProcessor``). An id counts
    once however often it occurs. ``penalty``: a finite number > 0 (1 is off), else a
    ConfigError naming ``who``.

    >>> apply_repetition_penalty(np.array([2.0, -1.0, 3.0]), 2.0, [0, 1, 1]).tolist()
    [1.0, -2.0, 3.0]
    """
    if not (is_real(penalty) and 0 < float(penalty) < float("inf")):
        # (0 gave inf logits, a negative penalty swapped the signs, NaN NaNs: all in silence)
        raise ConfigError(f"{who}: the repetition penalty must be a finite number > 0 (1 is "
                          f"off, > 1 discourages repeats), got {penalty!r}")
    if isinstance(logits, Tensor):          # the model's own output (float() of it failed)
        logits = logits.numpy()
    z = np.array(logits, dtype=np.float64)  # a copy
    if z.size and z.ndim > 1 and all(n == 1 for n in z.shape[:-1]):
        z = z.reshape(-1)                   # one row with leading axes of 1: (1, V)
    if z.ndim != 1 or z.shape[0] == 0:      # (B, V) flattened would be one distribution
        raise ShapeError(f"{who}: expected one row of logits (V,) or (1, V), got shape "
                         f"{z.shape}; give each row on its own")
    if _is_int(context) or (isinstance(context, np.ndarray) and context.ndim == 0):
        context = [int(context)]            # one id (np.int64(1) had no len())
    ctx = np.asarray(list(context) if not isinstance(context, np.ndarray) else context).reshape(-1)
    if ctx.size and (ctx.dtype.kind not in "iuf" or (ctx.dtype.kind == "f" and not
                                                     np.all(ctx == np.floor(ctx)))):
        # [1.5] penalised id 1 in silence (whole numbers as floats are ids, as before)
        raise ConfigError(f"{who}: context must hold token ids (integers), got {context!r:.60}")
    if penalty == 1.0 or ctx.size == 0:
        return z
    ctx = ctx[ctx < z.shape[0]]                       # ids past the logits cannot be chosen
    ids = np.unique(ctx.astype(np.int64))
    if ids.size and ids[0] < 0:   # NumPy would take -1 for the last id
        raise ConfigError(f"{who}: token id {int(ids[0])} in the context is negative; token "
                          f"ids are 0 or more")
    seen = z[ids]
    z[ids] = np.where(seen < 0, seen * penalty, seen / penalty)
    return z


def token_logprobs(logits, temperature: float = 1.0, *, repetition_penalty: float = 1.0,
                   context=()) -> np.ndarray:
    """Log-probabilities (float64, ``(V,)``) of the next token before any cut:
    ``log_softmax(penalised logits / temperature)``; temperature 0 takes the penalised logits
    as they are. What ``generate(..., logprobs=n)`` reports.

    >>> np.round(np.exp(token_logprobs(np.log([0.5, 0.25, 0.25]))), 3).tolist()
    [0.5, 0.25, 0.25]
    """
    _check_choice("token_logprobs", temperature, repetition_penalty=repetition_penalty)
    return penalised_logprobs(logits, temperature, repetition_penalty, context, "token_logprobs")


def penalised_logprobs(logits, temperature, repetition_penalty, context=(),
                       who: str = "token_logprobs") -> np.ndarray:
    """``token_logprobs`` of knobs checked already: every path's log-probabilities (generate's,
    the server's), the penalty held as the sampling knobs hold it (``penalty_knob``). Logits
    with NaN or +inf, or no finite value, are a ConfigError naming ``who``."""
    _distribution_or_raise(logits, who)
    return _log_softmax(apply_repetition_penalty(logits, penalty_knob(repetition_penalty),
                                                 context, who), temperature)


def _distribution_or_raise(logits, who: str) -> None:
    z = logits.numpy() if isinstance(logits, Tensor) else np.asarray(logits, np.float64)
    if z.size and (np.isnan(z).any() or not np.isfinite(z.max())):   # (-inf alone: masked)
        raise ConfigError(f"{who}: the logits hold NaN or +inf, or are all -inf, so they give no "
                          f"distribution (got max {float(z.max())!r})")


def _log_softmax(z, temperature: float) -> np.ndarray:
    """``token_logprobs`` of logits ``z`` that carry their penalty already, the temperature
    taken as checked (generate's per-token path)."""
    z = z - z.max()                 # before the temperature: a vanishing one gives -inf, not inf - inf
    if temperature > 0:
        with np.errstate(over="ignore"):
            z = z / temperature
    return z - np.log(np.exp(z).sum())


def _top_logprobs(logp: np.ndarray, n: int) -> tuple:
    """The ``n`` largest entries of ``logp`` as ``((id, logprob), ...)``, largest first,
    ties by lower id."""
    v = logp.shape[0]
    if n == 0:
        return ()
    if n < v:
        kth = np.partition(logp, v - n)[v - n]            # the n-th largest
        cand = np.flatnonzero(logp >= kth)                # ascending ids, ties included
    else:
        cand = np.arange(v)
    cand = cand[np.argsort(-logp[cand], kind="stable")][:n]
    return tuple((int(i), float(logp[i])) for i in cand)


def next_token_probs(logits, temperature: float = 1.0, top_k: Optional[int] = None,
                     top_p: Optional[float] = None, min_p: Optional[float] = None, *,
                     repetition_penalty: float = 1.0, context=()) -> np.ndarray:
    """The next-token distribution (float64, sums to 1) for one row of logits ``(V,)``.

    In transformers' order (see the module docstring): the repetition penalty on the ids in
    ``context`` (the row's prompt and generated tokens), then temperature (0 puts all mass on
    the argmax), then ``softmax(logits / temperature)`` cut to the ``top_k`` largest logits
    (and every token tied with the k-th, as transformers keeps them), then to the smallest
    set of most likely tokens whose probability reaches ``top_p`` (at least one token; tokens
    tied with its least likely one stay too), then to the tokens whose probability is at
    least ``min_p`` times the largest, renormalised. This is the distribution
    ``forge_ml.sampling.sample_row`` draws from (up to its integer weights).

    >>> next_token_probs(np.array([0.0, 0.0, 1.0, -1.0]), temperature=0).tolist()
    [0.0, 0.0, 1.0, 0.0]
    >>> p = next_token_probs(np.log([0.5, 0.3, 0.2]), top_p=0.7)
    >>> np.round(p, 3).tolist()
    [0.625, 0.375, 0.0]
    >>> np.round(next_token_probs(np.log([0.5, 0.3, 0.2]), min_p=0.5), 3).tolist()
    [0.625, 0.375, 0.0]
    >>> next_token_probs(np.array([2.0, 1.5]), temperature=0, repetition_penalty=2.0,
    ...                  context=[0]).tolist()
    [0.0, 1.0]
    """
    _check_choice("next_token_probs", temperature, top_k, top_p, min_p, repetition_penalty)
    top_k = _int_or_none(top_k)    # (an np.int8 top_k overflowed in v - top_k)
    _distribution_or_raise(logits, "next_token_probs")
    z = apply_repetition_penalty(logits, penalty_knob(repetition_penalty), context,
                                 "next_token_probs")  # (V,)
    v = z.shape[0]
    probs = np.zeros(v, np.float64)
    if temperature == 0:
        probs[int(np.argmax(z))] = 1.0
        return probs
    with np.errstate(over="ignore"):    # the max first: a vanishing temperature gives -inf,
        z = (z - z.max()) / temperature  # not inf - inf = NaN (token_logprobs' order)
    keep = np.ones(v, bool)
    if top_k and top_k < v:                              # None and 0: off
        kth = np.partition(z, v - top_k)[v - top_k]      # the k-th largest logit
        keep = z >= kth                                  # ties with it stay
    z = np.where(keep, z, -np.inf)
    e = np.exp(z - z.max())
    probs = e / e.sum()
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-probs, kind="stable")        # most likely first, ties by id
        cum = np.cumsum(probs[order])
        n_keep = min(int(np.searchsorted(cum, top_p, side="left")) + 1, v)
        cut = probs[order[n_keep - 1]]                   # the least likely kept; ties stay
        probs = np.where(probs >= cut, probs, 0.0)
        probs = probs / probs.sum()
    if min_p is not None and min_p > 0:
        # transformers' MinPLogitsWarper: p < min_p * max(p) goes; the top token always stays
        probs = np.where(probs < min_p * probs.max(), 0.0, probs)
        probs = probs / probs.sum()
    return probs


# -- argument checks -----------------------------------------------------------------------


def _as_prompts(prompts, who: str = "generate") -> tuple[list, bool]:
    """``(list of prompts as lists of ints, single)``; ``single`` when one prompt was given
    (a list, a NumPy array or an integer Tensor: 1-d for one prompt, 2-d for a batch).
    ``who`` names the caller in the errors."""
    if isinstance(prompts, Tensor):
        if prompts.dtype.is_float:
            raise ShapeError(f"{who}: prompts must be token ids (an int32 or int64 Tensor), got a "
                             f"{prompts.dtype.name} Tensor")
        prompts = prompts.numpy()
    if isinstance(prompts, np.ndarray):
        if prompts.dtype.kind not in "iuO":   # (a float array was read as a batch of rows)
            raise ShapeError(f"{who}: prompts must be token ids (an integer array), got a "
                             f"{prompts.dtype} array")
        prompts = prompts.tolist()
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise ShapeError(f"{who}: prompts must be a list of token ids or a list of such "
                         f"lists, got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise ShapeError(f"{who}: the prompt is empty; give at least one token "
                         "(e.g. the end-of-text token to start from nothing)")
    if all(_is_int(t) for t in prompts):
        return [[int(t) for t in prompts]], True
    rows = []
    for r, p in enumerate(prompts):
        if isinstance(p, np.ndarray):
            p = p.tolist()
        if not isinstance(p, Sequence) or not all(_is_int(t) for t in p):
            raise ShapeError(f"{who}: prompt {r} must be a list of int token ids, got {p!r:.80}")
        if len(p) == 0:
            raise ShapeError(f"{who}: prompt {r} is empty; give at least one token "
                             "(e.g. the end-of-text token to start from nothing)")
        rows.append([int(t) for t in p])
    return rows, False


def _stop_args(stop_tokens, stop_strings) -> tuple[tuple, tuple]:
    """``(stop token ids, stop strings)`` as tuples: an id or a list of ids, a string or a list
    of non-empty strings (None: none); anything else is a ConfigError.

    >>> _stop_args(5, "END")
    ((5,), ('END',))
    >>> _stop_args(["5"], ())
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: generate: stop_tokens must be a token id or a list of token ids, got ['5']
    """
    if stop_tokens is None:
        stop_tokens = ()
    elif _is_int(stop_tokens):
        stop_tokens = (stop_tokens,)
    elif isinstance(stop_tokens, np.ndarray) and stop_tokens.ndim == 0:   # np.array(5): one id
        stop_tokens = (stop_tokens.item(),)
    if not isinstance(stop_tokens, (str, bytes)) and isinstance(stop_tokens, Iterable):
        stop_tokens = list(stop_tokens)                  # once: it may be an iterator
    if not isinstance(stop_tokens, list) or not all(_is_int(t) for t in stop_tokens):
        raise ConfigError(f"generate: stop_tokens must be a token id or a list of token ids, "
                          f"got {stop_tokens!r:.80}")
    if stop_strings is None:
        stop_strings = ()
    elif isinstance(stop_strings, str):
        stop_strings = (stop_strings,)
    if not isinstance(stop_strings, bytes) and isinstance(stop_strings, Iterable):
        stop_strings = list(stop_strings)
    if not isinstance(stop_strings, list) or not all(isinstance(x, str) and x for x in stop_strings):
        raise ConfigError(f"generate: stop_strings must be a string or a list of non-empty "
                          f"strings, got {stop_strings!r:.80}")
    return tuple(int(t) for t in stop_tokens), tuple(stop_strings)


def _check_choice(who, temperature, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0) -> None:
    """The next-token knobs as generate, next_token_probs and token_logprobs take them: a
    ConfigError naming ``who`` and the knob otherwise (a negative temperature inverted the
    distribution, a min_p of 2 gave NaNs). A top_k of 0 is off, as None (transformers' and
    the engine's 0).

    >>> _check_choice("f", 0.8, 40, 0.9, 0.05, 1.2)
    >>> _check_choice("f", -1)
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: f: temperature must be >= 0 (0 = greedy) and finite in float32 (at most 3.403e+38), got -1
    """
    # (float(): np.float16's inf compared in float16, where the bound was inf too; the knobs
    # reach the device as float32)
    if not (is_real(temperature) and 0 <= float(temperature) <= F32_MAX):
        raise ConfigError(f"{who}: temperature must be >= 0 (0 = greedy) and finite in float32 "
                          f"(at most {F32_MAX:.4g}), got {temperature!r}")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise ConfigError(f"{who}: top_k must be None or an int >= 0 (None and 0 are off), got "
                          f"{top_k!r}")
    if top_p is not None and not (is_real(top_p) and 0 < top_p <= 1):
        raise ConfigError(f"{who}: top_p must be None or in (0, 1], got {top_p!r}")
    if min_p is not None and not (is_real(min_p) and 0 <= min_p <= 1):
        raise ConfigError(f"{who}: min_p must be None or in [0, 1] (a fraction of the most "
                          f"likely token's probability), got {min_p!r}")
    rp = repetition_penalty
    if not (is_real(rp) and 0 < rp < float("inf")):
        raise ConfigError(f"{who}: repetition_penalty must be a number > 0 (1 = off, > 1 "
                          f"discourages repeats), got {repetition_penalty!r}")


def _int_or_none(v):
    return None if v is None else int(v)


def _float_or_none(v):
    return None if v is None else float(v)


def _check_args(model, rows, max_new_tokens, temperature, top_k, top_p, seed, stop_strings,
                tokenizer, min_p=None, repetition_penalty=1.0, logprobs=None, single=False,
                who="generate", stop_tokens=()):
    cfg = model.config
    for r, p in enumerate(rows):
        where = "the prompt" if len(rows) == 1 else f"prompt {r}"
        if len(p) > cfg.block_size:
            raise ShapeError(f"{who}: {where} has {len(p)} tokens, longer than the model's "
                             f"context of {cfg.block_size} tokens (block_size)")
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ShapeError(f"{who}: token id {bad[0]} in {where} is out of range; ids must "
                             f"be in 0..{cfg.vocab_size - 1}")
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ConfigError(f"{who}: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    _check_choice(who, temperature, top_k, top_p, min_p, repetition_penalty)
    if not _is_int(seed) or not 0 <= seed < 1 << 64:     # row_key keeps 64 bits: 2**64 was 0
        raise ConfigError(f"{who}: seed must be an int in [0, 2**64), got {seed!r}")
    if stop_strings and tokenizer is None:
        raise ConfigError(f"{who}: stop_strings need a tokenizer to decode the generated text; "
                          "pass tokenizer=")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        # (an object without decode reached the first stop check: an AttributeError there)
        raise ConfigError(f"{who}: tokenizer must be a forge-ml tokenizer (with decode: "
                          f"load_model's second value), got {type(tokenizer).__name__}")
    if logprobs is not None:
        if not _is_int(logprobs) or not 0 <= logprobs <= cfg.vocab_size:
            raise ConfigError(f"{who}: logprobs must be None or an int in 0.."
                              f"{cfg.vocab_size} (how many top tokens to report), got {logprobs!r}")
        if single:
            raise ConfigError(f"{who}: logprobs need the batch form, which yields TokenEvents "
                              "(a single prompt yields plain ints): pass [prompt]")
    # stop ids must be the model's: one past its vocabulary can never be generated, so a run
    # would go on to max_new_tokens in silence (GPT-2's 50256 given to a small model), as
    # beam_search's eos_token_id refuses
    bad = [t for t in stop_tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ConfigError(f"{who}: stop token {bad[0]} is out of range: the model's ids are "
                          f"0..{cfg.vocab_size - 1}, so it could never be generated")


# -- the sampling loop ---------------------------------------------------------------------


def generate(model, prompts, max_new_tokens: int = 64, *, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
             stop_tokens=(), stop_strings=(), tokenizer=None, min_p: Optional[float] = None,
             repetition_penalty: float = 1.0, logprobs: Optional[int] = None,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias=None,
             **kw) -> Iterator:
    """Stream new tokens for one prompt (yields ints) or a batch (yields, per step, a list
    of ``TokenEvent``); see the module docstring for the rules.

    ``min_p``: None or in [0, 1]; ``repetition_penalty``: > 0, 1 is off; ``logprobs``: None
    (off) or how many top tokens each TokenEvent reports (0..vocab_size; batch form only).
    ``presence_penalty``, ``frequency_penalty`` (in [-2, 2], 0 is off) and ``logit_bias``
    ({token id: bias in [-100, 100]}) are OpenAI's: every row gets them, on the device as on
    the host (``forge_ml.sampling.adjusted``), before the repetition penalty.

    ``prompts``: a list of ids, or a list of lists of ids (lengths may differ). Arguments are
    checked at the call,
    before anything is computed: a prompt longer than ``block_size`` is a ShapeError, and so
    is an empty one.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
    >>> steps = list(generate(model, [[1, 2, 3], [4]], max_new_tokens=2, temperature=0))
    >>> [[(e.row, e.index) for e in s] for s in steps]
    [[(1, 0)], [(1, 1)], [(0, 0)], [(0, 1)]]
    >>> steps[-1][0].finish
    'max_new_tokens'
    """
    if "params" in kw:
        raise TypeError("generate: params= was removed; give a model in the dtype to compute "
                        "in (model.to(dtype='bfloat16'))")
    if "num_beams" in kw:
        raise TypeError("generate: num_beams is not a generate option; generate streams tokens "
                        "and beam search picks whole sequences at the end: use "
                        "forge_ml.inference.beam.beam_search")
    if kw:
        raise TypeError(f"generate: unexpected keyword arguments {sorted(kw)}")
    model_check("generate", model)
    rows, single = _as_prompts(prompts)
    stop_tokens, stop_strings = _stop_args(stop_tokens, stop_strings)
    _check_args(model, rows, max_new_tokens, temperature, top_k, top_p, seed, stop_strings,
                tokenizer, min_p, repetition_penalty, logprobs, single, stop_tokens=stop_tokens)
    # NumPy scalars as Python numbers from here on (np.uint8(250) + 10 prompt tokens wrapped
    # to 4 in the cache's size; an np.uint8 logprobs overflowed in the top-n cut)
    max_new_tokens, seed = int(max_new_tokens), int(seed)
    presence = openai_penalty("presence_penalty", presence_penalty, "generate")
    frequency = openai_penalty("frequency_penalty", frequency_penalty, "generate")
    bias = logit_bias_row(logit_bias, model.config.vocab_size, "generate")
    choice = _Choice(float(temperature), _int_or_none(top_k), _float_or_none(top_p),
                     _float_or_none(min_p), float(repetition_penalty), _int_or_none(logprobs),
                     presence, frequency, bias)
    _check_host_memory(model, rows, max_new_tokens, choice)
    steps = _steps(model, rows, max_new_tokens, choice, seed, frozenset(stop_tokens),
                   stop_strings, tokenizer)
    if single:
        return (ev.token for events in steps for ev in events)
    return steps


def _check_host_memory(model, rows, max_new: int, choice: "_Choice") -> None:
    """On the CPU, refuse a batch whose cache, prefill and logits cannot fit the host's free
    memory, at the call, before any of it is allocated: Linux hands the arrays out and then
    kills the process as they fill (exit 137, without a word). ``_steps``' sizes: the rows'
    shared prefill of the shortest prompt, a cache to the longest plus ``max_new - 1``."""
    cfg, lengths = model.config, [len(p) for p in rows]
    if max_new == 0 or min(lengths) >= cfg.block_size or \
            not device_has(model.device, "host_memory"):
        return                          # nothing to generate (_steps allocates nothing)
    B, longest = len(rows), max(lengths)
    capacity = min(cfg.block_size, longest + max_new - 1)
    # the marks and biases of penalties and logit_bias: six more rows of the vocabulary
    vocab_rows = 11 if choice.marks or choice.adjusts else 5
    need = host_decode_bytes(cfg, B, min(lengths), capacity, vocab_rows,
                             max(4, model.params["wte.weight"].dtype.itemsize))
    what = (f"{B:,} prompts of up to {longest:,} tokens" if B > 1 else
            f"a prompt of {longest:,} tokens") + f" and {max_new:,} new ones"

    def advice(free: int) -> str:
        fit = free // max(1, need // B)
        head = f"give at most about {fit:,} prompts at a time, " if B > 1 and fit else "use "
        return (head + ("shorter prompts" if B > 1 else "a shorter prompt")
                + " or a smaller max_new_tokens (--max-new-tokens)")
    errors.check_host_memory("generate", what, need, advice)


@dataclass(frozen=True)
class _Choice:
    """How ``generate`` picks each row's next token (checked arguments)."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    min_p: Optional[float]
    repetition_penalty: float
    logprobs: Optional[int]
    presence: float = 0.0
    frequency: float = 0.0
    # the dense logit-bias row (float32 (vocab_size,), read only), or None
    bias: Optional[np.ndarray] = field(default=None, compare=False)

    @property
    def adjusts(self) -> bool:
        """Whether OpenAI's adjustments change the logits (``forge_ml.sampling.adjusted``)."""
        return bool(self.presence or self.frequency) or self.bias is not None

    @property
    def marks(self) -> bool:
        """Whether the choice reads the row's marks (its context or its counts)."""
        return self.repetition_penalty != 1.0 or bool(self.presence or self.frequency)

    @property
    def greedy_on_device(self) -> bool:
        """Whether the device's argmax chain (``DecodeStep.greedy``) can pick the tokens:
        greedy on the raw logits, with nothing for the host to report."""
        return (self.temperature == 0 and self.repetition_penalty == 1.0 and not self.adjusts
                and self.logprobs is None)

    @property
    def on_device(self) -> bool:
        """Whether the steps can chain on the device (argmax or sampling kernel): nothing
        for the host to report."""
        return self.logprobs is None

    def knobs(self) -> list:
        """The row of ``ops.sample_next``'s knobs (temperature, top_k, top_p, min_p, penalty)."""
        return knobs_row(self.temperature, self.top_k, self.top_p, self.min_p,
                         self.repetition_penalty)

    def penalties(self, B: int):
        """The (B, 2) presence and frequency rows of ``DecodeStep``'s adjustments, or None."""
        return [[self.presence, self.frequency]] * B if self.presence or self.frequency else None

    def biases(self, B: int):
        """The (B, vocab_size) logit-bias rows of ``DecodeStep``'s adjustments, or None."""
        return None if self.bias is None else np.tile(self.bias, (B, 1))

    def __call__(self, logits, prompt, generated, key, position) -> tuple:
        """``(token, logprob, top_logprobs)`` for one row; the last two None without logprobs.
        ``prompt``, ``generated``: the row's ids so far; ``key``, ``position``: the row's
        Philox key and the position being chosen."""
        # the choice by the device chain's rule itself (adjusted, then sample_row: the
        # penalties applied in float32, as the kernels apply them), so logprobs change no token
        z32 = np.asarray(logits, np.float32).reshape(-1)                      # (V,)
        seen = seen_row(prompt, generated, z32.shape[0]) if self.marks else None
        if self.adjusts:
            z32 = adjusted(z32, seen, self.presence, self.frequency, self.bias)
        tok = sample_row(z32, self.knobs(), key, position,
                         seen if self.repetition_penalty != 1.0 else None)
        if self.logprobs is None:
            return tok, None, None
        context = list(prompt) + list(generated) if self.repetition_penalty != 1.0 else ()
        logp = penalised_logprobs(z32 if self.adjusts else logits, self.temperature,
                                  self.repetition_penalty, context, "generate")
        return tok, float(logp[tok]), _top_logprobs(logp, self.logprobs)


def row_key(seed: int, row: int) -> tuple:
    """Row ``row``'s Philox key under ``seed``: splitmix64 of the pair, as two uint32 words.

    >>> row_key(0, 0) != row_key(0, 1)
    True
    """
    mask = (1 << 64) - 1
    z = 0
    for word in (seed, row):
        z = ((z ^ (int(word) & mask)) + 0x9E3779B97F4A7C15) & mask   # splitmix64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
    return z & 0xFFFFFFFF, z >> 32


def _steps(model, rows, max_new, choice, seed, stop_tokens, stop_strings, tokenizer,
           who: str = "generate"):
    """The loop behind ``generate``: yields one non-empty list of TokenEvents per step."""
    cfg = model.config
    B, V = len(rows), cfg.vocab_size
    lengths = [len(p) for p in rows]
    # A row is done from the start when it may add nothing (no budget or a full context).
    done = [max_new == 0 or n >= cfg.block_size for n in lengths]
    if all(done):
        return
    keys = [row_key(seed, r) for r in range(B)]
    generated: list[list[int]] = [[] for _ in range(B)]

    # Every token but a row's last sampled one is fed back, so the cache needs at most
    # max(len) + max_new - 1 positions, and never more than the context.
    capacity = min(cfg.block_size, max(lengths) + max_new - 1)
    dev = model.device
    # kept for the next call where graphs pay; held while this generator lives, so that no
    # other call hands it out meanwhile
    cache, step, held = held_decoder(model, B, capacity)

    def seen_marks():
        """Each row's marks for the device (``forge_ml.sampling.seen_row``: its prompt's ids
        and how often it generated each id), (B, V) int32; None where no choice reads them."""
        if not choice.marks:
            return None
        return np.stack([seen_row(rows[r], generated[r], V) for r in range(B)])

    t0 = min(lengths)
    prefill = np.array([p[:t0] for p in rows], dtype=np.int64)                   # (B, t0)
    logits = model.forward_cached(tensor(prefill, device=dev), cache, last_only=True)
    pos = t0                                        # the position whose token is chosen next
    first = last = None
    if choice.on_device and t0 == max(lengths):
        check_finite_logits(model, logits, who)        # on the device: one number back
        # every row chooses its first token at t0 and nothing is reported: choose them on the
        # device from the prefill's logits (the rule and the Philox position are the chain's)
        if choice.greedy_on_device:
            first = step.choose(logits, pos)
        else:
            first = step.choose(logits, pos, [choice.knobs()] * B, keys, seen_marks(),
                                choice.penalties(B), choice.biases(B))
    else:
        last = logits.numpy()[:, -1, :V]                                          # (B, V)
        check_finite_logits(model, last, who)          # (read back already)

    heads: dict = {}        # each row's decoded prompt tail, for text_after

    def stopped(r) -> bool:
        """Whether row r's text holds a stop string: decoded once a token (not once a stop
        string), after the prompt's last _PROMPT_CONTEXT tokens, not the whole prompt (what a
        token's text depends on; a long prompt was decoded again at every token)."""
        text = text_after(tokenizer, rows[r][-_PROMPT_CONTEXT:], generated[r], heads, r)
        return any(s in text for s in stop_strings)

    def take(r, tok, logprob=None, top=None):
        """Row r's token at position pos: record it, decide whether the row finishes."""
        generated[r].append(tok)
        finish = None
        if tok in stop_tokens:
            finish = "stop_token"
        elif stop_strings and stopped(r):
            finish = "stop_string"
        elif len(generated[r]) == max_new:
            finish = "max_new_tokens"
        elif pos == cfg.block_size - 1:
            finish = "context_full"
        done[r] = finish is not None
        return TokenEvent(r, tok, len(generated[r]) - 1, finish, logprob, top)

    while True:
        feed = np.zeros((B, 1), np.int64)
        events = []
        for r in range(B):
            if done[r]:
                continue
            if pos < lengths[r]:                    # still inside its prompt: force it
                feed[r, 0] = rows[r][pos]
                continue
            if first is not None:                   # chosen on the device after the prefill
                tok, logprob, top = int(first[r]), None, None
            else:
                # the penalties' context: the whole prompt and the tokens generated so far
                tok, logprob, top = choice(last[r], rows[r], generated[r], keys[r], pos)
            events.append(take(r, tok, logprob, top))
            feed[r, 0] = tok
        first = None
        if events:
            yield events
        if all(done):
            return
        if choice.on_device and pos + 1 >= max(lengths):
            # No prompt token left to force and nothing to report: the choice is made on the
            # device and steps chain there (DecodeStep.greedy / .sample), the host reading
            # tokens as they come. Feeds at pos.. stay below the cache's capacity and the last
            # context position, and n covers every open row's budget, so every row finishes
            # inside the chain. The sample chooses the token of position pos + 1 first.
            budget = max(max_new - len(generated[r]) for r in range(B) if not done[r])
            n = min(cache.capacity - pos, cfg.block_size - 1 - pos, budget)
            if choice.greedy_on_device:
                chain = step.greedy(feed[:, 0], pos, n)
            else:
                chain = step.sample(feed[:, 0], pos, n, [choice.knobs()] * B, keys, seen_marks(),
                                    penalties=choice.penalties(B), bias=choice.biases(B))
            try:
                for toks in chain:
                    if any(toks[r] < 0 for r in range(B) if not done[r]):
                        # the device's sign that a row's logit at its argmax is not finite
                        # (a NaN from a weight row only this position reads, an overflow)
                        raise nonfinite_error(model, who, f"the tokens at position {pos}")
                    pos += 1
                    events = [take(r, int(toks[r])) for r in range(B) if not done[r]]
                    if events:
                        yield events
                    if all(done):
                        return
            finally:
                chain.close()
            raise AssertionError("generate: the device chain ended with open rows")  # unreachable
        last = step(feed[:, 0], pos)                                              # (B, V)
        # (the host path reads every step's logits back: a NaN arising past the prompt, from a
        # weight row only a later position reads, is said here rather than chosen as id 0)
        check_finite_logits(model, last, who, f"the tokens at position {pos}")
        pos += 1


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 64, **kwargs) -> str:
    """The text generated after ``prompt`` (the prompt itself is not included).

    ``kwargs`` are ``generate``'s (temperature, top_k, top_p, min_p, repetition_penalty,
    seed, stop_tokens, stop_strings; not logprobs, which need the batch form). An empty
    prompt starts from ``tokenizer.empty_prompt()``, as ``forge-ml sample`` does. The text is
    what ``decode(prompt + new tokens)`` adds to the prompt's text (``text_after``), cut
    before a stop string; a final stop token is left out where it is a special token (the
    tokenizer's ``is_special``: ``<|endoftext|>``); another (a ".") is part of the text,
    as in transformers' text-generation pipeline and vLLM.

    >>> from forge_ml.tokenizer import CharTokenizer
    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> tok = CharTokenizer("abc ")
    >>> model = GPT2.init(GPT2Config(vocab_size=4, block_size=16, n_layer=1, n_head=1, n_embd=8))
    >>> text = generate_text(model, tok, "ab", max_new_tokens=5, seed=1)
    >>> len(text), set(text) <= set("abc ")
    (5, True)
    """
    if kwargs.get("logprobs") is not None:
        raise ConfigError("generate_text returns text alone; for log-probabilities call "
                          "generate(model, [tokenizer.encode(prompt)], ..., logprobs=n), whose "
                          "TokenEvents carry them")
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise ConfigError(f"generate_text: tokenizer must be a forge-ml tokenizer (with encode and "
                          f"decode: load_model's second value), got {type(tokenizer).__name__}")
    if prompt == "" and callable(getattr(tokenizer, "empty_prompt", None)):
        # nothing to encode: start where forge-ml sample starts (a newline, end-of-text, or an
        # hf tokenizer's bos, as transformers' generate), not with generate's "empty" error
        ids = tokenizer.empty_prompt()
    else:
        ids = tokenizer.encode(prompt)
    stop_tokens, stop_strings = _stop_args(kwargs.get("stop_tokens"), kwargs.get("stop_strings"))
    kwargs["tokenizer"] = tokenizer
    out = list(generate(model, ids, max_new_tokens, **kwargs))
    if out and hides_stop(tokenizer, out[-1], stop_tokens):
        out = out[:-1]
    text = text_after(tokenizer, ids, out)
    cuts = [text.find(s) for s in stop_strings if s in text]
    return text[:min(cuts)] if cuts else text


# the prompt tokens before the new ones that their text can depend on: a UTF-8 character's
# bytes (4 at most, a byte a token at least), a Metaspace word's start (the token before)
_PROMPT_CONTEXT = 8


def text_after(tokenizer, prompt, ids, heads=None, key=None) -> str:
    """The text ``ids`` add after ``prompt``: ``decode(prompt + ids)`` past ``decode(prompt)``,
    as ``forge-ml sample`` and the server print it (``tokenizer.TextStream``). ``decode(ids)``
    alone is another text where a token's text depends on what precedes it: a Metaspace
    tokenizer's "▁is" is " is" after a word but "is" first (generate_text lost the space, and
    a stop string " is" was never found). Where ``decode(prompt)`` is no prefix of the whole
    (a prompt ending in half a character), ``decode(ids)``. An id past the tokenizer (an
    embedding row of a vocabulary padded past it, nanoGPT's 50304) has no text, as
    transformers decodes it and ``forge-ml sample`` prints it (decode raised on it, mid-run).
    ``heads``: a dict caching the decoded prompt under ``key``.

    >>> from forge_ml.tokenizer import CharTokenizer
    >>> text_after(CharTokenizer("abc"), [0, 1], [2, 0])
    'ca'
    """
    if heads is None or key not in heads:
        head = tokenizer.decode(list(prompt))
        if heads is not None:
            heads[key] = head
    else:
        head = heads[key]
    n = getattr(tokenizer, "vocab_size", None)
    if isinstance(n, int):
        ids = [t for t in ids if t < n]
    full = tokenizer.decode(list(prompt) + list(ids))
    return full[len(head):] if full.startswith(head) else tokenizer.decode(list(ids))


def stream_tokens(model, ids, max_new_tokens, *, temperature=0.8, top_k=None, top_p=None,
                  seed=0, stop_tokens=(), min_p=None, repetition_penalty=1.0,
                  presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None):
    """Yield up to ``max_new_tokens`` sampled ids after ``ids`` through ``generate``; once the
    context is full, generation goes on from the last ``block_size // 2`` tokens (a sliding
    window, recomputed), so a sample may be longer than the context. The repetition
    penalty's context is then the window, and the presence and frequency penalties count the
    tokens generated since the window began. A prompt longer than the context starts from its
    last ``block_size`` tokens (``generate`` refuses it).

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> m = GPT2.init(GPT2Config(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4))
    >>> len(list(stream_tokens(m, [1, 2], 10, temperature=0)))
    10
    """
    stop_tokens, _ = _stop_args(stop_tokens, ())     # one id too, as generate takes it
    model_check("stream_tokens", model)
    block = model.config.block_size
    prompts, single = _as_prompts(ids, "stream_tokens")
    if not single:
        raise ShapeError(f"stream_tokens: expected one prompt (a list of token ids), got {len(prompts)}")
    if block < 2:   # the window of the context kept would fill it: nothing could be generated
        raise ConfigError(f"stream_tokens: the model's context is {block} token; the sliding window "
                          f"needs at least 2 (block_size)")
    ctx = prompts[0][-block:]
    # every argument checked now, at the call (a generator would say it at the first next())
    _check_args(model, [ctx], max_new_tokens, temperature, top_k, top_p, seed, (), None, min_p,
                repetition_penalty, who="stream_tokens", stop_tokens=stop_tokens)
    adjust = dict(presence_penalty=openai_penalty("presence_penalty", presence_penalty,
                                                  "stream_tokens"),
                  frequency_penalty=openai_penalty("frequency_penalty", frequency_penalty,
                                                   "stream_tokens"),
                  logit_bias=logit_bias)
    logit_bias_row(logit_bias, model.config.vocab_size, "stream_tokens")
    return _stream(model, ctx, int(max_new_tokens), temperature, top_k, top_p, int(seed), stop_tokens, min_p,
                   repetition_penalty, adjust)


def _stream(model, ctx, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, min_p,
            repetition_penalty, adjust):
    """stream_tokens' generator, its arguments checked."""
    block = model.config.block_size
    made, chunk = 0, 0
    while made < max_new_tokens:
        if len(ctx) >= block:
            ctx = ctx[-(block // 2):]   # stream_tokens refused block_size < 2
        # each window its own stream, seed + chunk kept in generate's [0, 2**64)
        for t in generate(model, ctx, max_new_tokens - made, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=(seed + chunk) % (1 << 64), stop_tokens=stop_tokens,
                          min_p=min_p, repetition_penalty=repetition_penalty, **adjust):
            yield t
            made += 1
            ctx.append(t)
            if t in stop_tokens:
                return
        chunk += 1
