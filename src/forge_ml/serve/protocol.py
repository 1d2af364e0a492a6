"""OpenAI's completions protocol: checking a request body, and the response, chunk, model
list and error bodies.

``parse_completion`` turns a decoded JSON body into a ``CompletionRequest`` or raises
``APIError`` (HTTP status, message, ``param``): an unknown field, a field of the wrong type
or out of range, a malformed prompt. ``presence_penalty`` and ``frequency_penalty`` (in
[-2, 2]) and ``logit_bias`` (an object of token ids, as strings, to biases in [-100, 100])
are OpenAI's (``forge_ml.sampling.adjusted``). OpenAI fields this server cannot honour
(``best_of`` other than ``n``, a ``suffix``) are refused the same way rather than ignored.
Extra fields, as vLLM takes them: ``top_k`` (0 or -1 off), ``min_p``, ``repetition_penalty``,
``ignore_eos``.

>>> r = parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 5, "stop": "\\n"})
>>> r.prompt, r.max_tokens, r.stop, r.temperature
(['Hi'], 5, ('\\n',), 1.0)
>>> parse_completion({"prompt": "Hi", "max_token": 5})
Traceback (most recent call last):
...
forge_ml.serve.protocol.APIError: unknown field 'max_token'; known fields: best_of, echo, frequency_penalty, ignore_eos, logit_bias, logprobs, max_tokens, min_p, model, n, presence_penalty, prompt, repetition_penalty, seed, stop, stream, stream_options, suffix, temperature, top_k, top_p, user
>>> error_body(APIError("temperature must be >= 0 and <= 2, got -1", param="temperature"))
{'error': {'message': 'temperature must be >= 0 and <= 2, got -1', 'type': 'invalid_request_error', 'param': 'temperature', 'code': None}}
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from ..inference.engine import MAX_LOGPROBS
from ..sampling import is_finite, is_int as _is_int

MAX_N = 128          # choices per prompt
MAX_CHOICES = 256    # choices per request (prompts x n)
MAX_STOPS = 16       # stop strings per request


class APIError(Exception):
    """An error answered with OpenAI's error body: ``status`` (400 unless said), ``message``,
    ``param`` (the field at fault), ``type`` and ``code`` as OpenAI names them."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code


def error_body(e: APIError) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


@dataclass
class CompletionRequest:
    """A checked ``POST /v1/completions`` body. ``prompt``: a list of prompts, each a str or
    a list of token ids (no prompt is ``[""]``: as OpenAI's API, the model writes a new
    document, from ``<|endoftext|>`` where the tokenizer has it); ``stop``: a list of strings;
    ``seed`` None means a fresh random one; ``max_tokens`` None means OpenAI's default, 16, or
    less where the context ends sooner."""

    prompt: list
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple = ()
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[tuple] = None    # sorted (token id, bias) pairs


def _out_of_range(name, got: str, lo=None, hi=None, lo_open=False) -> APIError:
    """The error of a value (``got``, as written) outside its bounds: it names all of them."""
    want = [f"{'>' if lo_open else '>='} {lo}"] if lo is not None else []
    want += [f"<= {hi}"] if hi is not None else []
    return APIError(f"{name} must be {' and '.join(want)}, got {got}", param=name)


def _num(name, v, lo=None, lo_open=False, hi=None):
    """A finite number within the bounds given; the error names all of them."""
    if not is_finite(v):
        raise APIError(f"{name} must be a number, got {_shown(v)}", param=name)
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        raise _out_of_range(name, repr(v), lo, hi, lo_open)
    return float(v)


def _int(name, v, lo=None, hi=None):
    """An integer within the bounds given; the error names all of them."""
    if not _is_int(v):
        raise APIError(f"{name} must be an integer, got {_shown(v)}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _out_of_range(name, str(v), lo, hi)
    return int(v)


def _seed(v):
    """OpenAI's int64: a negative seed is its unsigned twin (``% 2**64``), so none aliases."""
    if not _is_int(v) or not -(1 << 63) <= v < 1 << 63:
        raise APIError(f"seed must be an integer in [-2**63, 2**63) (OpenAI's int64), got "
                       f"{_shown(v)}", param="seed")
    return int(v)


def _or(v, default):
    return default if v is None else v


def _bool(name, v):
    if not isinstance(v, bool):
        raise APIError(f"{name} must be true or false, got {_shown(v)}", param=name)
    return v


def _prompt(v) -> list:
    """A list of prompts from OpenAI's four forms: a string, a list of strings, a list of
    token ids, a list of lists of token ids."""
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not v:
        raise APIError("prompt must be a string, a list of strings, a list of token ids or a "
                       f"list of lists of token ids (not empty), got {_shown(v)}", param="prompt")
    if all(isinstance(p, str) for p in v):
        return list(v)
    if all(_is_int(t) for t in v):
        return [[int(t) for t in v]]
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in v):
        return [[int(t) for t in p] for p in v]
    # say what is wrong with the first item that fits no form
    if all(isinstance(p, list) for p in v):
        i = next(i for i, p in enumerate(v) if not (p and all(_is_int(t) for t in p)))
        bad = next((t for t in v[i] if not _is_int(t)), None)
        what = ("is empty" if not v[i] else
                f"holds {_shown(bad, 30)}, not a token id (an integer)")
        raise APIError(f"prompt must be a list of non-empty lists of token ids; its list {i} {what}",
                       param="prompt")
    if not any(isinstance(p, (str, list)) for p in v):
        bad = next(t for t in v if not _is_int(t))
        raise APIError(f"prompt as a list of token ids must hold integers; got "
                       f"{_shown(bad, 30)} in {_shown(v)}", param="prompt")
    raise APIError("prompt must be a string, a list of strings, a list of token ids or a list "
                   f"of non-empty lists of token ids; got a list mixing these: {_shown(v)}",
                   param="prompt")


def _stop(v) -> tuple:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(f"stop must be a non-empty string or a list of them, got {_shown(v)}",
                       param="stop")
    if len(stops) > MAX_STOPS:
        raise APIError(f"stop has {len(stops)} strings; at most {MAX_STOPS}", param="stop")
    return tuple(stops)


def _zero_or_none(name, v, what, kind):
    """A field this server takes only at its neutral value: the right type first (``kind``: a
    number, an object or a string; false or 0 were taken as unset for any of them), then the
    value."""
    want = {"number": (int, float), "object": dict, "string": str}[kind]
    if v is not None and (isinstance(v, bool) or not isinstance(v, want)):
        _raise_type(name, f"a{'n' if kind[0] == 'o' else ''} {kind}", v)
    if v is None or v == 0 or v == {} or v == "":
        return
    raise APIError(f"{name} is not supported by this server ({what}); got {_shown(v)}", param=name)


# field -> check(value) -> value for CompletionRequest (None for fields only checked)
_FIELDS = {
    "model": lambda v: v if isinstance(v, str) else _raise_type("model", "a string", v),
    "prompt": _prompt,
    "max_tokens": lambda v: _int("max_tokens", v, lo=0),
    "temperature": lambda v: _num("temperature", v, lo=0, hi=2),        # OpenAI's range
    "top_p": lambda v: _num("top_p", v, lo=0, lo_open=True, hi=1),
    "n": lambda v: _int("n", v, lo=1, hi=MAX_N),
    "stop": _stop,
    "seed": _seed,
    "logprobs": lambda v: _int("logprobs", v, lo=0, hi=MAX_LOGPROBS),
    "echo": lambda v: _bool("echo", v),
    "stream": lambda v: _bool("stream", v),
    "stream_options": None,
    "top_k": lambda v: max(_int("top_k", v, lo=-1), 0),
    "min_p": lambda v: _num("min_p", v, lo=0, hi=1),
    "repetition_penalty": lambda v: _num("repetition_penalty", v, lo=0, lo_open=True),
    "ignore_eos": lambda v: _bool("ignore_eos", v),
    "user": lambda v: v if isinstance(v, str) else _raise_type("user", "a string", v),
    "best_of": None,
    "presence_penalty": lambda v: _num("presence_penalty", v, lo=-2, hi=2),   # OpenAI's range
    "frequency_penalty": lambda v: _num("frequency_penalty", v, lo=-2, hi=2),
    "logit_bias": lambda v: _logit_bias(v),
    "suffix": lambda v: _zero_or_none("suffix", v, "no insertion", "string"),
}
_ONLY_CHECKED = {"user", "suffix", "stream_options", "best_of"}


def _logit_bias(v):
    """OpenAI's ``logit_bias``: a JSON object of token ids (strings of ints) to numbers in
    [-100, 100], as sorted ``(id, bias)`` pairs (None when empty); whether each id is one of
    the model's is the engine's check (``check_prompt``)."""
    from ..sampling import logit_bias_row
    if not isinstance(v, dict):
        _raise_type("logit_bias", "an object of token ids to biases", v)
    return logit_bias_row(v, None, None, lambda m: APIError(m, param="logit_bias")) or None


def _shown(v, width: int = 60) -> str:
    """A value of the request as JSON writes it (``true``, ``null``, ``["a", null]``), cut to
    ``width`` characters: the client sent JSON, so an error names its values so (Python's
    ``True`` and ``['a', None]`` before). A lone surrogate (from a library caller: the server
    refuses such bodies) is shown escaped, as the response's UTF-8 can carry no other form.

    >>> _shown(True), _shown(["a", None]), _shown({"k": 1.5}), _shown("x" * 70, 8)
    ('true', '["a", null]', '{"k": 1.5}', '"xxxxxxx')
    >>> _shown("\\udc80é")
    '"\\\\udc80é"'
    """
    try:
        text = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):   # not from JSON (a library caller's object)
        text = repr(v)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")[:width]


def _json_kind(v) -> str:
    """What a decoded JSON value is, in JSON's words (Python's said "NoneType" of a ``null``
    body and "list" of an array).

    >>> _json_kind(None), _json_kind([1]), _json_kind(True), _json_kind(2.5), _json_kind("x")
    ('null', 'an array', 'true', 'a number (2.5)', 'a string')
    """
    if v is None or isinstance(v, bool):
        return {None: "null", True: "true", False: "false"}[v]
    if isinstance(v, (int, float)):
        return f"a number ({v!r:.30})"
    return {list: "an array", str: "a string", dict: "an object"}.get(type(v), type(v).__name__)


def _raise_type(name, want, v):
    raise APIError(f"{name} must be {want}, got {_shown(v)}", param=name)


def parse_completion(body) -> CompletionRequest:
    """Check a decoded ``/v1/completions`` body; see the module docstring. A field given as
    JSON ``null`` takes its default, as OpenAI's API does."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {_json_kind(body)}")
    unknown = sorted(k for k in body if k not in _FIELDS)
    if unknown:
        raise APIError(f"unknown field {unknown[0]!r}; known fields: {', '.join(sorted(_FIELDS))}",
                       param=unknown[0])
    # no prompt: OpenAI's default, a new document (the server starts it from the tokenizer's
    # empty_prompt(): <|endoftext|>, a bos token, a char model's newline)
    kw = {"prompt": [""]}
    for name, value in body.items():
        if value is None:
            continue
        check = _FIELDS[name]
        out = check(value) if check is not None else value
        if name not in _ONLY_CHECKED:
            kw[name] = out
    req = CompletionRequest(**kw)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise APIError(f"stream_options must be an object with include_usage (and "
                           f"continuous_usage_stats), got {_shown(opts)}", param="stream_options")
        # (null: the default, as a null top-level field is)
        req.include_usage = _bool("stream_options.include_usage",
                                  _or(opts.get("include_usage"), False))
        req.continuous_usage = _bool("stream_options.continuous_usage_stats",
                                     _or(opts.get("continuous_usage_stats"), False))
        if req.continuous_usage and not req.include_usage:
            raise APIError("stream_options.continuous_usage_stats puts the usage in every chunk of "
                           "the usage asked for: add \"include_usage\": true",
                           param="stream_options")
        if not req.stream:
            raise APIError("stream_options is only allowed with \"stream\": true",
                           param="stream_options")
    best_of = body.get("best_of")
    if best_of is not None:
        _int("best_of", best_of, lo=1, hi=MAX_N)
    if best_of is not None and best_of != req.n:
        raise APIError(f"best_of must equal n ({req.n}) here; this server returns every choice "
                       f"it draws, got {_shown(best_of)}", param="best_of")
    if len(req.prompt) * req.n > MAX_CHOICES:
        raise APIError(f"{len(req.prompt)} prompts x n={req.n} is {len(req.prompt) * req.n} "
                       f"choices; at most {MAX_CHOICES} per request",
                       param="n" if req.n > 1 else "prompt")
    return req


# -- bodies ----------------------------------------------------------------------------------


def completion_body(id: str, created: int, model: str, choices: list, usage: dict) -> dict:
    """A whole ``text_completion``: ``choices`` as from ``choice_body``."""
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def choice_body(index: int, text: str, logprobs: Optional[dict], finish: Optional[str]) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chunk_body(id: str, created: int, model: str, choice: dict, usage=False) -> dict:
    """One server-sent chunk with one choice. ``usage``: True adds ``"usage": null``, as OpenAI
    does when the client asked for usage in the stream; a ``usage_body`` dict adds it (vLLM's
    ``continuous_usage_stats``: the request's counts so far in every chunk); False, nothing."""
    out = {"id": id, "object": "text_completion", "created": created, "model": model,
           "choices": [choice]}
    if usage is not False:
        out["usage"] = None if usage is True else usage
    return out


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def logprobs_body() -> dict:
    """An empty legacy-completions ``logprobs`` object, to extend token by token."""
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def models_body(model_id: str, created: int, max_len: int) -> dict:
    return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                        "owned_by": "forge-ml", "max_model_len": max_len}]}
