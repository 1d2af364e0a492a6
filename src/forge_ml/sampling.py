"""The sampling rule of a decoding step, written once: ``sample_row`` (temperature, top-k,
top-p, min-p, repetition penalty, and a Philox draw at the row's position), after
``adjusted`` where a row has OpenAI's presence or frequency penalty or a logit bias. The CPU
runs it
as it is (``backends.compose.sample_next`` through the host), the GPU's kernel
(``backends/cuda/sample.cu``) bit for bit, and ``inference.generate`` for the tokens it
chooses on the host, and the server's engine (``inference.batch``) through ``sample_next``
on the model's device, with generate's key for a request's seed.

>>> SAMPLE_KNOBS
('temperature', 'top_k', 'top_p', 'min_p', 'repetition_penalty')
"""
from __future__ import annotations

import math
import numbers
import re
from typing import Optional

import numpy as np

from . import rng

SAMPLE_KNOBS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
"""The columns of ``sample_next``'s ``knobs`` (B, 5) float32: 0 / 0 / 1 / 0 / 1 turn each off."""

_W_ONE = 1 << 24   # the integer weight of the most likely token
_DRAW_BLOCK = 1024  # the draw's running sum goes over blocks of this many ids first
_PENALTY_RANGE = (1e-30, 1e30)
_F32_TINY = float(np.finfo(np.float32).smallest_subnormal)   # the least top_p float32 keeps
F32_MAX = float(np.finfo(np.float32).max)   # the largest temperature a float32 knob holds


def knobs_row(temperature, top_k=None, top_p=None, min_p=None, repetition_penalty=1.0) -> list:
    """The row of ``sample_next``'s float32 knobs for these settings (None or 0 turn a cut
    off). A top_k of 2^24 or more is off too (it keeps every id of any vocabulary float32
    can count, and 10**40 would be float32's infinity); a top_p below float32's least
    positive value is that value (1e-46 rounded to 0, which is off). A repetition penalty is
    held to [1e-30, 1e30] (``penalty_knob``).

    >>> knobs_row(0.7, top_k=40)
    [0.7, 40, 1.0, 0.0, 1.0]
    >>> knobs_row(1.0, top_k=10**40, repetition_penalty=1e-300)
    [1.0, 0, 1.0, 0.0, 1e-30]
    """
    top_k = top_k or 0
    if top_p is not None and 0 < top_p < _F32_TINY:   # float32 would round it to 0, "off"
        top_p = _F32_TINY
    return [temperature, top_k if top_k < _W_ONE else 0, 1.0 if top_p is None else top_p,
            min_p or 0.0, penalty_knob(repetition_penalty)]


def penalty_knob(repetition_penalty: float) -> float:
    """The repetition penalty every sampling path applies: held to [1e-30, 1e30], where
    float32 still holds it (past that it rounds to 0 or infinity) and the penalised logits of
    any model are already far from every other.

    >>> penalty_knob(1e300), penalty_knob(1.2)
    (1e+30, 1.2)
    """
    lo, hi = _PENALTY_RANGE
    return min(max(repetition_penalty, lo), hi)


def penalised(z, knobs, seen=None) -> np.ndarray:
    """Step 1 of ``sample_row``: the float32 logits ``z (V,)`` (a copy) with the repetition
    penalty of ``knobs`` applied to the tokens ``seen`` marks. A row whose logit at the argmax
    of these is not finite (a NaN, +inf, or every logit -inf) has no token to choose: the
    device's choice marks it -1 (``ops.sample_next``'s ``out``); a penalty that overflows
    finite logits is step 2's argmax.

    >>> import numpy as np
    >>> penalised(np.array([2.0, -2.0, 1.0], np.float32), [1.0, 0, 1, 0, 2.0], [1, 1, 0]).tolist()
    [1.0, -4.0, 1.0]
    """
    z = np.array(z, dtype=np.float32).reshape(-1)
    pen = np.float32(np.asarray(knobs, np.float32).reshape(5)[4])
    if seen is not None and pen != np.float32(1):
        s = np.asarray(seen).reshape(-1)[:z.shape[0]].astype(bool)
        with np.errstate(over="ignore", under="ignore", divide="ignore"):
            z[s] = np.where(z[s] > 0, z[s] / pen, z[s] * pen).astype(np.float32)
    return z


def seen_row(context, generated, size: int) -> np.ndarray:
    """A row's marks (int32 ``(size,)``) as every sampling path keeps them: bit 0 set for an
    id of ``context`` (the prompt), plus 2 for each time the row generated the id. The
    repetition penalty applies where a mark is not 0 (the prompt and the tokens generated);
    presence and frequency penalties read the count, ``mark >> 1`` (generated tokens only, as
    OpenAI's and vLLM's). The sampling kernels add 2 at the token they choose.

    >>> seen_row([0, 2], [2, 3, 3], 5).tolist()
    [1, 0, 3, 4, 0]
    """
    marks = np.zeros(int(size), np.int32)
    marks[np.asarray(list(context), np.int64)] = 1
    np.add.at(marks, np.asarray(list(generated), np.int64), 2)
    return marks


def adjusted(z, seen, presence: float = 0.0, frequency: float = 0.0, bias=None) -> np.ndarray:
    """OpenAI's logit adjustments of one row, before ``sample_row``: the float32 logits ``z
    (V,)`` (a copy) plus ``bias`` (float32 ``(V,)`` or None: OpenAI's ``logit_bias`` as a
    dense row), then ``frequency * c`` and, where ``c > 0``, ``presence`` taken away, ``c`` the
    times the row generated the id (``seen >> 1``, ``seen_row``'s marks). Each operation is
    rounded to float32 on its own (no fused multiply-add), as the device's
    ``penalize_logits`` does it; the repetition penalty comes after, in ``sample_row``.

    >>> z = np.array([1.0, 1.0, 1.0], np.float32)
    >>> adjusted(z, seen_row([0], [1, 1], 3), presence=0.5, frequency=0.25).tolist()
    [1.0, 0.0, 1.0]
    >>> adjusted(z, None, bias=np.array([0, -100, 5], np.float32)).tolist()
    [1.0, -99.0, 6.0]
    """
    z = np.array(z, dtype=np.float32).reshape(-1)
    V = z.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        if bias is not None:
            z = (z + np.asarray(bias, np.float32).reshape(-1)[:V]).astype(np.float32)
        if seen is not None and (presence or frequency):
            c = (np.asarray(seen, np.int32).reshape(-1)[:V] >> 1)
            z = (z - np.float32(frequency) * c.astype(np.float32)).astype(np.float32)
            z = np.where(c > 0, z - np.float32(presence), z).astype(np.float32)
    return z


PENALTY_LIMIT = 2.0     # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
BIAS_LIMIT = 100.0     # and for a logit_bias value: [-100, 100]
_DECIMAL = re.compile(r"-?[0-9]+")   # a logit_bias key's string form (ASCII digits only)


def is_int(value) -> bool:
    """An integer (NumPy's too), not a bool: a count, a token id, a seed as the API takes it.

    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number (NumPy's too) that a float holds, not a bool and not a NaN; infinities
    pass (each knob's range says). An int past float's range is not one: ``float()`` and
    ``math.isfinite`` raise OverflowError on it, so each check of a knob's range starts here.

    >>> is_real(0.5), is_real(np.int64(3)), is_real(True), is_real(float("nan")), is_real(10 ** 400)
    (True, True, False, False, False)
    """
    if not isinstance(value, (numbers.Real, np.integer)) or isinstance(value, (bool, np.bool_)):
        return False
    try:
        v = float(value)
    except OverflowError:
        return False
    return v == v


def is_finite(value) -> bool:
    """``is_real`` and finite.

    >>> is_finite(1e308), is_finite(float("inf")), is_finite("1")
    (True, False, False)
    """
    return is_real(value) and math.isfinite(float(value))


def openai_penalty(name: str, value, who: str, error=None) -> float:
    """A presence or frequency penalty checked as OpenAI's API takes it: a number in [-2, 2]
    (0 is off); else ``error`` (default ConfigError; called with the message) naming ``who``
    (None: no name) and the field.

    >>> openai_penalty("presence_penalty", 0.5, "generate")
    0.5
    >>> openai_penalty("frequency_penalty", 3, "generate")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: generate: frequency_penalty must be a number in [-2, 2] ..., got 3
    """
    from .errors import ConfigError
    if not (is_real(value) and -PENALTY_LIMIT <= float(value) <= PENALTY_LIMIT):
        raise (error or ConfigError)(f"{who + ': ' if who else ''}{name} must be a number in "
                                     f"[-2, 2] (0 is off), got {value!r}")
    return float(value)


def token_id_key(key) -> Optional[int]:
    """A logit-bias key as a token id: an int (NumPy's too, not a bool) or its decimal string
    in ASCII digits, as OpenAI's JSON keys are ("50256", "-3": negative ids are the range
    check's to refuse); None for anything else (" 5", "1_0", "²", 40 digits).

    >>> token_id_key("50256"), token_id_key(7), token_id_key("--5"), token_id_key(True)
    (50256, 7, None, None)
    """
    if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
        return int(key)
    if isinstance(key, str) and len(key) <= 20 and _DECIMAL.fullmatch(key):
        return int(key)
    return None


def logit_bias_row(logit_bias, vocab_size: int, who: str, error=None):
    """OpenAI's ``logit_bias`` (a mapping of token id to a bias in [-100, 100], added to the
    id's logit before sampling; ids as ints or as the strings of ints a JSON object has) as a
    dense float32 row ``(vocab_size,)``, or None for None or an empty mapping; anything else
    is ``error`` (default ConfigError; called with the message) naming ``who`` (None: no name)
    and what was expected. ``vocab_size`` None checks the keys and values alone and returns
    the mapping as sorted ``(id, bias)`` pairs.

    >>> logit_bias_row({"2": -100, 0: 5}, 4, "generate").tolist()
    [5.0, 0.0, -100.0, 0.0]
    >>> logit_bias_row({7: 1}, 4, "generate")
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: generate: logit_bias has token id 7; the ids are 0..3
    """
    from .errors import ConfigError
    err = error or ConfigError
    at = f"{who}: " if who else ""
    if logit_bias is None:
        return None
    if not hasattr(logit_bias, "items"):
        raise err(f"{at}logit_bias must be a mapping of token id to bias, got "
                  f"{type(logit_bias).__name__}")
    pairs = {}
    for key, value in logit_bias.items():
        tid = token_id_key(key)
        if tid is None:
            raise err(f"{at}logit_bias keys must be token ids (ints, or their strings of ASCII "
                      f"digits), got {key!r:.60}")
        if tid < 0:
            raise err(f"{at}logit_bias has token id {tid}; token ids are 0 or more")
        if vocab_size is not None and tid >= vocab_size:
            raise err(f"{at}logit_bias has token id {tid}; the ids are 0..{vocab_size - 1}")
        if not (is_real(value) and -BIAS_LIMIT <= float(value) <= BIAS_LIMIT):
            raise err(f"{at}logit_bias[{int(tid)}] must be a number in [-100, 100], got "
                      f"{value!r}")
        pairs[int(tid)] = float(value)
    if vocab_size is None:
        return tuple(sorted(pairs.items()))
    if not pairs:
        return None
    row = np.zeros(int(vocab_size), np.float32)
    row[list(pairs)] = list(pairs.values())
    return row


def sample_row(z, knobs, key, position, seen=None) -> int:
    """One token from the float32 logits ``z (V,)`` of one row: the sampling rule every
    backend implements bit for bit (sums in integers, so no order of addition matters).

    1. A seen token (``seen[j]``) gets ``z/penalty`` when ``z > 0``, ``z*penalty`` otherwise.
    2. Temperature 0, a NaN logit, or a row past float32's range (``1 / T`` or the largest
       penalised logit infinite: the limit of the draw): the argmax, the lowest id among
       equal maxima.
    3. ``w_j = uint32(exp((z_j - max z) / T) * 2^24)``: the most likely token weighs 2^24.
    4. top-k (``0 < k < V``): keep ``w >= `` the k-th largest w (ties at the cut all kept);
       top-p (``0 < p < 1``): keep ``w >= t`` for the largest t whose kept mass reaches
       ``ceil(p K)``, K the mass top-k kept; min-p: keep ``w >= ceil(min(min_p, 1) 2^24)``.
    5. ``word`` = the first word of Philox4x32-10 at counter ``(position, 0, 0, 0)`` with
       ``key``; the token is the first id whose running kept mass exceeds
       ``floor(total * word / 2^32)``.

    >>> import numpy as np
    >>> sample_row(np.array([0.0, 5.0, 1.0], np.float32), [0.0, 0, 1, 0, 1], (1, 2), 0)
    1
    >>> sample_row(np.array([0.0, 5.0, 1.0], np.float32), [1.0, 1, 1, 0, 1], (1, 2), 7)
    1
    """
    z = penalised(z, knobs, seen)
    temp = np.float32(np.asarray(knobs, np.float32).reshape(5)[0])
    with np.errstate(over="ignore", divide="ignore"):
        inv_t = np.float32(1) / temp if temp > 0 else np.float32(0)
    m = z.max()                     # NaN when any logit is NaN
    if not (temp > 0 and np.isfinite(inv_t) and np.isfinite(m)):
        return int(np.argmax(z))
    with np.errstate(under="ignore", over="ignore"):   # -inf: weight 0, as on the GPU
        w = (np.exp((z - m) * inv_t) * np.float32(_W_ONE)).astype(np.uint32)
    return choose_from_weights(w, knobs, key, position)


def choose_from_weights(w, knobs, key, position) -> int:
    """Steps 4 and 5 of ``sample_row`` on the integer weights ``w (V,)`` (uint32): the top-k,
    top-p and min-p cuts, then the Philox draw. The GPU's sampling kernel, on its own weights,
    chooses this token.

    >>> import numpy as np
    >>> choose_from_weights(np.array([5, 1 << 24, 9], np.uint32), [1.0, 1, 1, 0, 1], (1, 2), 7)
    1
    """
    _, k, ptop, pmin, _ = (np.float32(v) for v in np.asarray(knobs, np.float32).reshape(5))
    k = int(k)
    w = np.asarray(w, np.uint32).reshape(-1)
    V = w.shape[0]
    floor = 0
    if 0 < k < V:
        floor = int(np.partition(w, V - k)[V - k])           # the k-th largest weight
    if 0 < ptop < 1:
        kept = w[w >= floor].astype(np.uint64)
        need = math.ceil(float(ptop) * int(kept.sum()))
        for lo in (1 << 16, 1 << 8, 0):   # sort only the heaviest weights that reach `need`
            top = kept[kept >= lo]
            if int(top.sum()) >= need:
                break
        top = np.sort(top)[::-1]
        floor = max(floor, int(top[int(np.searchsorted(np.cumsum(top), need, side="left"))]))
    if pmin > 0:   # at most 1: the most likely token (weight 2^24) is always kept
        floor = max(floor, math.ceil(min(float(pmin), 1.0) * _W_ONE))
    mass = np.where(w >= floor, w, 0) if floor else w
    word = rng.philox_first_word(int(position), key)
    # the first id whose running mass exceeds the target: over blocks' sums first, then
    # inside the block (integers: the same id as one running sum over the whole row)
    starts = np.arange(0, V, _DRAW_BLOCK)
    sums = np.cumsum(np.add.reduceat(mass, starts, dtype=np.uint64))
    target = (int(sums[-1]) * word) >> 32
    b = int(np.searchsorted(sums, np.uint64(target), side="right"))
    lo = b * _DRAW_BLOCK
    cum = np.cumsum(mass[lo:lo + _DRAW_BLOCK], dtype=np.uint64)
    before = int(sums[b - 1]) if b else 0
    return lo + int(np.searchsorted(cum, np.uint64(target - before), side="right"))
