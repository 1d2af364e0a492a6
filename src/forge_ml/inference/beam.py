"""Beam search with the KV cache, giving the sequences transformers' beam search gives.

``beam_search(model, prompt_ids, max_new_tokens, num_beams)`` returns the best finished
sequences (new tokens only, best first) and their scores. It reproduces
``transformers.GenerationMixin._beam_search`` (transformers 5.x, ``do_sample=False``, no
logits processors), step by step, for one prompt:

- Every step scores each running beam's next tokens by the beam's summed log-probability
  plus ``log_softmax(logits)``, and takes the best ``K = max(2, 1 + n_eos) * num_beams``
  candidates over all beams (``_get_top_k_continuations``). At the first step only beam 0
  exists (transformers starts the other beams at -1e9: the same, since ``K <= vocab_size``).
- A candidate *hits a stop* when its token is an end-of-sequence id or it reaches
  ``max_new_tokens``. The best ``num_beams`` candidates that do not hit one are the next
  running beams (``_get_running_beams_for_next_iteration``).
- A candidate that hits one becomes a finished hypothesis only if it is among the first
  ``num_beams`` of the ``K`` (``_update_finished_beams``' ``top_num_beam_mask``); its score
  is its summed log-probability divided by ``generated_length ** length_penalty``, where the
  generated length counts the new tokens, the end-of-sequence token included. The finished
  set keeps the best ``num_beams`` hypotheses; the result is its best
  ``num_return_sequences``, best first.
- The search ends (``_beam_search_has_unfinished_sequences``) when every candidate hits a
  stop (``max_new_tokens`` reached); or, with ``early_stopping=True``, once ``num_beams``
  hypotheses are finished; or, when ``num_beams`` are finished and the best running beam's
  score divided by ``L ** length_penalty`` is no better than the worst finished score
  (``_check_early_stop_heuristic``), with ``L`` the running beams' generated length, or
  ``max_new_tokens`` for ``early_stopping="never"`` with a positive length penalty.

Scores are computed in float64 from forge-ml's float32 logits (transformers: float32), so the
sequences differ only where two candidates' scores are within rounding of each other.

The cache holds one row per beam. When the running beams are re-chosen, row ``b`` of every
layer's keys and values is replaced by the row of the beam it continues (through the host:
correct on every backend, and a host round trip of the cache per step; a device gather op is
the fix where speed matters).

``num_beams=1`` is greedy search, as transformers' ``generate(num_beams=1)`` runs it (to the
first end-of-sequence id; ``early_stopping`` has nothing to stop), scored as a hypothesis.

``generate`` does not route to this: it streams tokens as they are chosen, and beam search
knows its sequences only at the end.

>>> from forge_ml.models.gpt2 import GPT2, GPT2Config
>>> model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
>>> seqs, scores = beam_search(model, [1, 2, 3], max_new_tokens=4, num_beams=2,
...                            num_return_sequences=2)
>>> [len(s) for s in seqs], scores[0] >= scores[1]
([4, 4], True)
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from .. import errors, ops
from ..errors import ConfigError, ShapeError
from ..sampling import is_finite
from ..tensor import Tensor, device_has, tensor
from .decode import DecodeStep, KVCache, check_finite_logits, host_decode_bytes, model_check
from .engine import _is_int


def _normalised(score: float, length: int, length_penalty: float) -> float:
    """``score / length ** length_penalty``, transformers' formula, where Python's float power
    would raise: a power past float's range is inf (the quotient -0.0 for a negative score),
    one under it 0 (the quotient -inf, or 0 for the empty score log 1 = 0).

    >>> _normalised(-2.0, 4, 1.0), _normalised(-2.0, 4, 600.0), _normalised(-2.0, 4, -600.0)
    (-0.5, -0.0, -inf)
    """
    try:
        d = float(length) ** length_penalty
    except OverflowError:
        d = float("inf")
    if d == 0.0:
        return float("-inf") if score < 0 else 0.0
    return score / d


def _greedy(model, prompt, max_new_tokens, length_penalty, eos) -> tuple[list, list]:
    """``beam_search``'s answer for one beam: greedy search, as transformers' ``generate``
    runs ``num_beams=1`` (to the first end-of-sequence id, included, or ``max_new_tokens``;
    ``early_stopping`` has nothing to stop), scored as a hypothesis: its summed
    log-probability over its length ** ``length_penalty``."""
    from .generate import _Choice, _steps
    greedy = _Choice(0.0, None, None, None, 1.0, 0)   # the argmax, with its log-probability
    events = [e for step in _steps(model, [list(prompt)], max_new_tokens, greedy, 0, frozenset(eos),
                                   (), None, who="beam_search")
              for e in step]
    tokens = [e.token for e in events]
    return [tokens], [_normalised(sum(e.logprob for e in events), len(tokens), length_penalty)]


def candidates_per_beam(n_eos: int) -> int:
    """Candidates a step keeps for each beam with ``n_eos`` end-of-sequence ids:
    max(2, 1 + n_eos), transformers' ``beams_to_keep``; the step keeps this times num_beams,
    which the vocabulary must hold.

    >>> candidates_per_beam(0), candidates_per_beam(2)
    (2, 3)
    """
    return max(2, 1 + n_eos)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of ``z (B, V)`` in float64."""
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _check(model, prompt, max_new_tokens, num_beams, length_penalty, early_stopping, eos,
           num_return_sequences) -> tuple:
    """Refuse what beam_search cannot take; returns ``(length_penalty, early_stopping)`` as
    Python's float and bool (or "never"): a NumPy float32 penalty made the scores float32, a
    NumPy bool ``early_stopping`` ran as False (the search asks ``is True``)."""
    cfg = model.config
    if len(prompt) == 0:
        raise ShapeError("beam_search: the prompt is empty; give at least one token")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ShapeError(f"beam_search: token id {bad[0]} in the prompt is out of range; ids "
                         f"must be in 0..{cfg.vocab_size - 1}")
    if not _is_int(max_new_tokens) or max_new_tokens < 0:   # 0: nothing to search, as generate
        raise ConfigError(f"beam_search: max_new_tokens must be an int >= 0, got "
                          f"{max_new_tokens!r}")
    if len(prompt) + max_new_tokens > cfg.block_size:
        raise ShapeError(f"beam_search: a prompt of {len(prompt)} tokens plus {max_new_tokens} "
                         f"new ones exceeds the model's context of {cfg.block_size} tokens "
                         f"(block_size)")
    if not _is_int(num_beams) or num_beams < 1:
        raise ConfigError(f"beam_search: num_beams must be an int >= 1, got {num_beams!r}")
    k = candidates_per_beam(len(eos)) * num_beams
    if k > cfg.vocab_size and num_beams > 1:   # (one beam is greedy search: no candidates)
        raise ConfigError(f"beam_search: each step keeps {k} candidates (max(2, 1 + end ids) x "
                          f"num_beams), more than the vocabulary's {cfg.vocab_size} tokens; "
                          f"use fewer beams")
    if not is_finite(length_penalty):
        raise ConfigError(f"beam_search: length_penalty must be a finite number, got "
                          f"{length_penalty!r}")
    if not (isinstance(early_stopping, (bool, np.bool_)) or (isinstance(early_stopping, str)
                                                             and early_stopping == "never")):
        raise ConfigError(f"beam_search: early_stopping must be True, False or 'never', got "
                          f"{early_stopping!r}")
    bad = [t for t in eos if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ConfigError(f"beam_search: eos_token_id {bad[0]} is out of range; ids must be in "
                          f"0..{cfg.vocab_size - 1}")
    if not _is_int(num_return_sequences) or not 1 <= num_return_sequences <= num_beams:
        raise ConfigError(f"beam_search: num_return_sequences must be an int in "
                          f"1..num_beams ({num_beams}), got {num_return_sequences!r}")
    return float(length_penalty), early_stopping if isinstance(early_stopping, str) else bool(
        early_stopping)


def _check_host_memory(model, n_prompt: int, max_new: int, beams: int) -> None:
    """On the CPU, refuse beams whose cache, prefill and scores cannot fit the host's free
    memory, before any of it is allocated: Linux hands the arrays out and then kills the
    process as they fill (exit 137, without a word). Each beam holds a cache row, a prefill
    of the prompt, and eleven float32 rows' worth of the vocabulary (its logits, their float64
    log-softmax, the scores over every beam's candidates and their order: 7 to 9 measured, 20
    to 1,000 beams of 50,304 ids); a reorder copies one layer."""
    if not device_has(model.device, "host_memory"):
        return
    cfg, itemsize = model.config, max(4, model.params["wte.weight"].dtype.itemsize)
    capacity = n_prompt + max_new - 1
    need = (host_decode_bytes(cfg, beams, n_prompt, capacity, 11, itemsize)
            + 2 * beams * capacity * cfg.n_embd * itemsize)

    def advice(free: int) -> str:
        fit = free // max(1, need // beams)
        head = f"use at most about {fit:,} beams (--num-beams), " if beams > 1 and fit else "use "
        return head + "a shorter prompt or a smaller max_new_tokens (--max-new-tokens)"
    errors.check_host_memory("beam_search", f"{beams:,} beams of a prompt of {n_prompt:,} tokens "
                             f"and {max_new:,} new ones", need, advice)


def _reorder(cache: KVCache, src: np.ndarray) -> None:
    """Row ``b`` of every layer's keys and values becomes row ``src[b]``, in place (the
    tensors keep their memory unless shared; the caller checks)."""
    for t in cache.k + cache.v:
        ops.assign(t, t.numpy()[src])  # (B, H, Tmax, hs); bf16 comes back as float32: exact


def beam_search(model, prompt_ids, max_new_tokens: int, num_beams: int,
                length_penalty: float = 1.0, early_stopping: Union[bool, str] = False,
                eos_token_id: Optional[Union[int, Sequence[int]]] = None,
                num_return_sequences: int = 1) -> tuple[list, list]:
    """``(sequences, scores)``: the best ``num_return_sequences`` finished hypotheses for
    ``prompt_ids`` (a list of ints), best first; each sequence is its new tokens as a list of
    ints (an end-of-sequence token, when it ended one, included); each score its summed
    log-probability over ``generated_length ** length_penalty``, as transformers'
    ``sequences_scores``. The rules are in the module docstring.

    ``eos_token_id``: None, an id or a list of ids that end a hypothesis. ``early_stopping``:
    False (stop when the heuristic says no running beam can win), True (stop once
    ``num_beams`` hypotheses are finished) or "never", as in transformers.
    ``length_penalty > 0`` favours longer sequences, ``< 0`` shorter ones.

    ``max_new_tokens=0`` generates nothing, as ``generate`` then yields nothing: the result is
    ``num_return_sequences`` empty continuations, each scored 0.0 (an empty continuation's
    log-probability is log 1 = 0; the formula's 0 / 0 ** length_penalty is taken as that 0,
    for every length penalty), and the model does not run.

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
    >>> seqs, scores = beam_search(model, [4, 2], max_new_tokens=3, num_beams=1)
    >>> len(seqs), len(seqs[0]), scores[0] <= 0
    (1, 3, True)
    >>> beam_search(model, [4, 2], max_new_tokens=0, num_beams=2, num_return_sequences=2)
    ([[], []], [0.0, 0.0])
    """
    model_check("beam_search", model)
    if isinstance(prompt_ids, Tensor):   # as generate takes one
        prompt_ids = prompt_ids.numpy()
    if isinstance(prompt_ids, np.ndarray) and prompt_ids.ndim == 1:
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, Sequence) or not all(_is_int(t) for t in prompt_ids):
        raise ShapeError(f"beam_search: prompt_ids must be a list of int token ids, got "
                         f"{prompt_ids!r:.80}")
    prompt = [int(t) for t in prompt_ids]
    if isinstance(eos_token_id, np.ndarray) and eos_token_id.ndim == 0:
        eos_token_id = eos_token_id.item()   # np.array(5): one id, as generate's stop_tokens
    if eos_token_id is None:
        eos = ()
    elif _is_int(eos_token_id):
        eos = (int(eos_token_id),)
    elif (isinstance(eos_token_id, Sequence) or (isinstance(eos_token_id, np.ndarray)
                                                  and eos_token_id.ndim == 1)) \
            and all(_is_int(t) for t in eos_token_id):
        eos = tuple(int(t) for t in eos_token_id)      # a list, a tuple or a 1-d array of ids
    else:
        raise ConfigError(f"beam_search: eos_token_id must be None, an int or a list of ints, "
                          f"got {eos_token_id!r}")
    length_penalty, early_stopping = _check(model, prompt, max_new_tokens, num_beams,
                                            length_penalty, early_stopping, eos,
                                            num_return_sequences)
    if max_new_tokens == 0:   # finished before the first step: the prompt is the whole text
        return [[] for _ in range(num_return_sequences)], [0.0] * num_return_sequences
    _check_host_memory(model, len(prompt), max_new_tokens, num_beams)
    if num_beams == 1:   # transformers' generate(num_beams=1) is greedy search, not one beam
        return _greedy(model, prompt, max_new_tokens, length_penalty, eos)

    cfg = model.config
    V, B, L = cfg.vocab_size, num_beams, len(prompt)
    K = candidates_per_beam(len(eos)) * B          # candidates kept per step
    eos_ids = np.array(eos, np.int64)

    # Every beam row starts as the prompt; the last new token is never fed back.
    cache = model.new_cache(B, L + max_new_tokens - 1)
    logits = model.forward_cached(tensor([prompt] * B, device=model.device), cache,
                                  last_only=True).numpy()[:, -1, :V]        # (B, V)
    check_finite_logits(model, logits, "beam_search")
    step = DecodeStep(model, cache)
    memory = [t.memory() for t in cache.k + cache.v]

    running = [[] for _ in range(B)]       # each running beam's new tokens
    run_scores = np.full(B, -np.inf)       # their summed log-probabilities
    run_scores[0] = 0.0                    # only beam 0 is live at the first step
    finished: list[tuple[float, list]] = []   # (normalised score, tokens), best first

    for t in range(max_new_tokens):
        gen_len = t + 1                                            # new tokens after this step
        acc = (_log_softmax(logits) + run_scores[:, None]).reshape(-1)  # (B * V,)
        top = np.argpartition(-acc, K - 1)[:K]
        top = top[np.lexsort((top, -acc[top]))]       # best first (ties: lower beam, then id)
        beam, tok, score = top // V, top % V, acc[top]
        hits = np.isin(tok, eos_ids) | (gen_len == max_new_tokens)

        # Only the first num_beams candidates may finish; the rest only back up the running set.
        for i in np.flatnonzero(hits[:B]):
            finished.append((_normalised(float(score[i]), gen_len, length_penalty),
                             running[beam[i]] + [int(tok[i])]))
        finished.sort(key=lambda h: -h[0])         # stable: earlier hypotheses first on ties
        del finished[B:]
        if hits.all():                             # max_new_tokens: nothing can go on
            break

        keep = np.flatnonzero(~hits)[:B]       # B of them: at most n_eos * B of the K hit an eos
        src = beam[keep]
        running = [running[b] + [int(x)] for b, x in zip(src, tok[keep])]
        run_scores = score[keep]

        if len(finished) == B:
            if early_stopping is True:
                break
            # the best length a running beam may reach: its own, or the longest for "never"
            never = early_stopping == "never" and length_penalty > 0
            best_len = max_new_tokens if never else gen_len
            if _normalised(float(run_scores[0]), best_len, length_penalty) <= finished[-1][0]:
                break                              # no running beam can beat the finished ones

        # (at the first step every row still holds the prompt alone)
        if t > 0 and not np.array_equal(src, np.arange(B)):
            _reorder(cache, src)
            now = [x.memory() for x in cache.k + cache.v]
            if any(a is not b for a, b in zip(now, memory)):
                step, memory = DecodeStep(model, cache), now   # a graph would hold the old memory
        logits = step(tok[keep], L + t)                            # (B, V)
        check_finite_logits(model, logits, "beam_search", f"the tokens at position {L + t}")

    best = finished[:num_return_sequences]
    return [toks for _, toks in best], [s for s, _ in best]
