"""The ASGI app of ``forge-ml serve``: OpenAI's completions API over a ``BatchEngine``.

Endpoints: ``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health``,
``POST /v1/completions`` (whole responses, or server-sent events with ``"stream": true``:
one ``data: {json}`` chunk per token, the last one of each choice with its
``finish_reason``, or an OpenAI error body for a choice that fails, then
``data: [DONE]``). Every choice of a request is one engine request; with a ``seed``,
choice ``j`` of each prompt draws with ``seed + j`` (a prompt gives the text it gives alone
with that seed, unless scores tie within rounding: see ``inference.batch``), and without one
every choice draws its own. An empty prompt starts a new document from the tokenizer's
``empty_prompt()`` (``<|endoftext|>``, an hf tokenizer's bos, a char model's newline, as
``forge-ml sample --prompt ''`` starts; counted in ``usage.prompt_tokens``, but neither echoed
nor counted in ``text_offset``). A client that
disconnects cancels its requests, which frees their slots.

Text: tokens are decoded incrementally (a GPT-2 byte token that splits a UTF-8 character
adds no text until the character is whole), and text that could begin a ``stop`` string is
held back until it is known not to, so neither a broken character nor part of a stop string
ever reaches the client. A choice ends with finish "stop" on a stop string (its text cut
before it) or the tokenizer's end-of-text token (not in the text; ``ignore_eos`` turns that
off, and the token is then no text where it comes, as vLLM's ``skip_special_tokens``; its
log-probability is listed), else "length". ``logprobs.text_offset`` is each token's character offset in the prompt's
text followed by the completion's (the returned text, with echo), as OpenAI's API has it:
from one offset to the next is the text that token made. A character cut across byte tokens
is the text of the token that completes it; one left broken (U+FFFD, a prompt that ends in
half a character, say) is that of the tokens that began it, not of the token after them.

Safe by default: with ``api_key`` every request needs ``Authorization: Bearer KEY`` (else
401), but ``GET /health``, which without the key says only whether the engine runs; request bodies over ``max_body_bytes`` get 413 and prompts over ``max_prompt_tokens``
tokens get 400; a body sent as another type than JSON (``application/json`` or a ``+json``
type, parameters such as ``; charset=utf-8`` allowed) gets 415: a web page can POST text/plain
or a form to a server on localhost without the browser asking first (curl's ``-d`` sends a
form's type: add ``-H 'Content-Type: application/json'``). A body without the header is read
as JSON, as FastAPI (vLLM's server) reads it: ``requests.post(url, data=json.dumps(...))``
sends none. Every refusal has OpenAI's error body and the server keeps serving.

>>> from forge_ml.models.gpt2 import GPT2, GPT2Config
>>> from forge_ml.tokenizer import CharTokenizer
>>> from starlette.testclient import TestClient
>>> tok = CharTokenizer("abcdefgh ")
>>> engine = BatchEngine(GPT2.init(GPT2Config(vocab_size=9, block_size=32, n_layer=1, n_head=1,
...                                           n_embd=8)), tok, slots=2)
>>> with TestClient(create_app(engine, "tiny")) as client:
...     r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5,
...                                               "temperature": 0})
>>> r.status_code, r.json()["usage"], r.json()["choices"][0]["finish_reason"]
(200, {'prompt_tokens': 3, 'completion_tokens': 5, 'total_tokens': 8}, 'length')
>>> engine.close()
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import ConfigError, ModelError, TokenizerError, plural
from ..inference.batch import BatchEngine
from ..tokenizer import TextStream, hides_stop
from ..inference.engine import EngineClosedError, RequestError, SamplingParams, TokenOut, shown_logprob
from .protocol import (APIError, CompletionRequest, chunk_body, choice_body, completion_body,
                       error_body, logprobs_body, models_body, parse_completion, usage_body)

__all__ = ["create_app", "BatchEngine"]

log = logging.getLogger("forge_ml.serve")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_TOKENS = 16


def _json(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _server_error(e: Exception) -> APIError:
    """The OpenAI error of a request the server could not finish: its engine closed (503), or
    its logits turned NaN or inf (a ModelError naming the weight, 500)."""
    return APIError(str(e), status=503 if isinstance(e, EngineClosedError) else 500,
                    type="server_error")


def _error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


# -- text ------------------------------------------------------------------------------------


# token ids to text, one token at a time (shared with forge-ml sample; feed_split for text_offset)
Detokenizer = TextStream


class StopText:
    """Cuts generated text at the first stop string; holds back a tail that could begin one.

    >>> s = StopText(["\\n\\n", "END"])
    >>> s.feed("ab\\n"), s.feed("c E"), s.feed("N"), s.feed("D more")
    (('ab', False), ('\\nc ', False), ('', False), ('', True))
    >>> StopText(["x"]).feed("abc") + (StopText(["xy"]).flush(),)
    ('abc', False, '')
    """

    def __init__(self, stops):
        self.stops = tuple(stops)
        self.pending = ""

    def feed(self, text: str) -> tuple:
        """``(text to emit, stopped)``."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[:min(hits)], True
        hold = 0
        for s in self.stops:                      # the longest tail that begins a stop string
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _Choice:
    """One choice of a request: its engine stream and the text and log-probabilities built
    from its tokens."""

    def __init__(self, index: int, stream, tokenizer, req: CompletionRequest, stop_ids=(),
                 hidden: int = 0):
        self.index, self.stream, self.tokenizer = index, stream, tokenizer
        # hidden: the prompt's first tokens that the client did not send (the <|endoftext|> or
        # bos an empty prompt starts from): not echoed, and not counted in text_offset
        self.hidden = hidden
        # the text follows the prompt's (a Metaspace token's space depends on what precedes
        # it): the prompt decoded before, or its hidden start where echo feeds the rest
        self.detok = Detokenizer(tokenizer, stream.prompt[:hidden] if req.echo else stream.prompt)
        self.stop = StopText(req.stop)
        # the ids that end the choice with no text (an int: the one end-of-text id)
        self.stop_ids = (stop_ids,) if isinstance(stop_ids, int) else tuple(stop_ids or ())
        self.tokenizer = tokenizer
        self.want_logprobs = req.logprobs is not None
        # text_offset counts characters from the start of the prompt, as OpenAI's API does,
        # echo or not (it counted from the completion's start without echo)
        self.offset = (0 if req.echo or not self.want_logprobs
                       else len(tokenizer.decode(stream.prompt[hidden:])))
        self.n_tokens = 0          # generated tokens, the end-of-text token included
        self.finish: Optional[str] = None

    def _token_str(self, t: int) -> str:
        """A token's text for ``tokens`` and ``top_logprobs``; a byte token that is not whole
        UTF-8 (half a character) is ``"bytes:\\xNN..."``, as OpenAI's API writes it (as U+FFFD,
        every such token had one key: ``top_logprobs`` lost entries to each other)."""
        if hasattr(self.tokenizer, "decode_bytes") and t < getattr(self.tokenizer, "vocab_size", t + 1):
            b = self.tokenizer.decode_bytes([t])
            try:
                return b.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{c:02x}" for c in b)
        return self.tokenizer.decode([t])

    def _logprob_part(self, lp: dict, tok: int, logprob, top, offset: int) -> None:
        logprob = shown_logprob(logprob)
        lp["tokens"].append(self._token_str(tok))
        lp["token_logprobs"].append(logprob)
        if top is None:
            lp["top_logprobs"].append(None)
        else:
            d = {self._token_str(t): shown_logprob(v) for t, v in top}
            if logprob is not None:
                d.setdefault(self._token_str(tok), logprob)
            lp["top_logprobs"].append(d)
        lp["text_offset"].append(offset)

    def echo(self) -> tuple:
        """``(text, logprobs part or None)`` of the prompt, for ``echo``."""
        lp = logprobs_body() if self.want_logprobs else None
        parts = []
        prompt = self.stream.prompt
        scores = self.stream.prompt_logprobs
        for i, t in enumerate(prompt):
            if i < self.hidden:
                continue
            text, lead = self.detok.feed_split(t)
            if lp is not None:
                logprob, top = (None, None) if i == 0 else scores[i - 1]
                self._logprob_part(lp, t, logprob, top, self.offset + lead)
            parts.append(text)
            self.offset += len(text)
        return "".join(parts), lp

    def token(self, out: TokenOut) -> tuple:
        """``(text, logprobs part or None, finished)`` for one generated token."""
        self.n_tokens += 1
        lp = logprobs_body() if self.want_logprobs else None
        text, stopped = "", False
        # an end-of-text token is no text; a stop id that is not special (a "."), as vLLM has it
        if out.finish == "stop" and hides_stop(self.tokenizer, out.token, self.stop_ids):
            pass
        elif getattr(self.tokenizer, "is_special", lambda t: False)(out.token):
            # a special token inside the completion (ignore_eos's <|endoftext|>): no text, as
            # vLLM's skip_special_tokens has it; its log-probability at the text's offset
            if lp is not None:
                self._logprob_part(lp, out.token, out.logprob, out.top_logprobs, self.offset)
        else:
            # lead: a character the tokens before began (the echoed prompt's broken end, say)
            # that this token ends as U+FFFD is theirs; the token's own text begins after it
            piece, lead = self.detok.feed_split(out.token)
            if lp is not None:
                self._logprob_part(lp, out.token, out.logprob, out.top_logprobs, self.offset + lead)
            self.offset += len(piece)
            text, stopped = self.stop.feed(piece)
        if stopped:
            self.finish = "stop"
            self.stream.cancel()
        elif out.finish is not None:
            self.finish = out.finish
        if self.finish is not None and not stopped:
            text += self.end_text()
        return text, lp, self.finish is not None

    def end_text(self) -> str:
        """What is held back at the end: an unfinished character, a partial stop string."""
        tail, _ = self.stop.feed(self.detok.flush())
        return tail + self.stop.flush()


def _merge_logprobs(parts: list) -> Optional[dict]:
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    out = logprobs_body()
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out


# -- the app ---------------------------------------------------------------------------------


class _APIKey:
    """ASGI middleware: every HTTP request must carry ``Authorization: Bearer <key>``, except
    ``GET /health`` (and HEAD: a load balancer's probe has no key, as vLLM's /health takes none): it is
    answered without the engine's figures there (``scope["state"]["keyed"]`` says which)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            keyed = scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)
            scope.setdefault("state", {})["keyed"] = keyed
            if not keyed and not (scope.get("path") == "/health"
                                  and scope.get("method") in ("GET", "HEAD")):
                e = APIError("a valid API key is required: send the header 'Authorization: "
                             "Bearer <key>'", status=401, code="invalid_api_key")
                await _error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: BatchEngine, model_id: str, api_key: Optional[str] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_prompt_tokens: Optional[int] = None) -> Starlette:
    """The app serving ``engine`` as the model ``model_id`` (see the module docstring).
    ``max_prompt_tokens`` defaults to the engine's context (``engine.max_len``).

    >>> from forge_ml.models.gpt2 import GPT2, GPT2Config
    >>> from forge_ml.tokenizer import CharTokenizer
    >>> from starlette.testclient import TestClient
    >>> engine = BatchEngine(GPT2.init(GPT2Config(vocab_size=3, block_size=8, n_layer=1, n_head=1, n_embd=4)),
    ...                      CharTokenizer("ab "), slots=1)
    >>> with TestClient(create_app(engine, "tiny", api_key="k")) as client:
    ...     no_key = client.get("/v1/models").status_code
    ...     models = client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()
    >>> no_key, [(m["id"], m["max_model_len"]) for m in models["data"]]
    (401, [('tiny', 8)])
    >>> engine.close()
    """
    if api_key is not None and api_key != api_key.strip():
        # a key with spaces or a newline around it (a pasted key, "$(cat key)" of a CRLF file)
        # matched no client: a header's value arrives without them (HTTP strips them)
        if not api_key.strip():
            raise ConfigError("create_app: api_key is blank; give the key clients must send "
                              "(None serves without one)")
        api_key = api_key.strip()
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ConfigError("create_app: the engine needs a tokenizer (BatchEngine(model, "
                          "tokenizer)) to serve text")
    max_prompt = engine.max_len if max_prompt_tokens is None else max_prompt_tokens
    token_chars = getattr(tokenizer, "max_token_chars", None)   # None: no length check first
    # the ids generation stops on (an hf tokenizer may have several), and those an empty
    # prompt starts from: a new document, from <|endoftext|> (gpt2), the bos token (hf) or a
    # newline (char: the CLI's empty prompt too, tokenizer.prompt_ids)
    stop_ids = tuple(getattr(tokenizer, "stop_tokens", ()))
    new_document = hasattr(tokenizer, "empty_prompt")
    started = int(time.time())

    async def read_json(request: Request):
        _check_json_type(request.headers.get("content-type"))
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_body_bytes:
            raise APIError(f"the request body is {size} bytes; at most {max_body_bytes}",
                           status=413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(f"the request body is over {max_body_bytes} bytes", status=413)
        try:
            # UTF-8 strictly (RFC 8259; a surrogate's bytes are refused here), then JSON
            text = bytes(body).decode("utf-8-sig")
            data = json.loads(text, parse_constant=_no_constant)
            if "\\u" in text:     # a lone surrogate escape (\ud800) decodes to no character
                json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(f"the request body is not valid Unicode text: it holds a lone UTF-16 "
                           f"surrogate ({e.object[e.start]!r}), which is half of a character "
                           f"escape") from None
        except UnicodeDecodeError as e:
            raise APIError(f"the request body is not UTF-8 text (JSON over HTTP is UTF-8): {e}") from None
        except ValueError as e:
            if "integer string conversion" in str(e):   # (Python's hint is no help to a client)
                raise APIError("the request body holds an integer of more than 4,300 digits, "
                               "past any field's range") from None
            raise APIError(f"the request body is not valid JSON: {e}") from None
        except RecursionError:     # a body nested thousands deep: a 400, not a 500 and a traceback
            raise APIError("the request body is nested too deeply to be a completions request") from None
        return data

    def prompt_ids(prompt) -> list:
        """The prompt's token ids; an empty prompt is the tokenizer's start of a new document
        (``empty_prompt()``: ``[eot]``, an hf tokenizer's bos, a char model's newline; see
        ``hidden``)."""
        if isinstance(prompt, str):
            if token_chars and len(prompt) > max_prompt * token_chars:
                # more tokens than the server takes, known without encoding it (a tokenizer
                # may fail on, or take long over, a text of megabytes)
                raise APIError(f"the prompt's {len(prompt):,} characters are more than {max_prompt} "
                               f"tokens of this model's tokenizer hold (each covers at most "
                               f"{token_chars}); this server takes at most {max_prompt} tokens",
                               param="prompt", code="context_length_exceeded")
            try:
                ids = tokenizer.encode(prompt)
            except TokenizerError as e:
                raise APIError(f"cannot tokenize the prompt: {e}", param="prompt") from None
        else:
            ids = prompt
        if len(ids) > max_prompt:
            raise APIError(f"the prompt has {len(ids)} tokens; this server takes at most "
                           f"{max_prompt}", param="prompt", code="context_length_exceeded")
        if not ids:
            # OpenAI's empty prompt: the model writes as from the start of a new document
            if not new_document:
                raise APIError("the prompt is empty, and this model's tokenizer has no "
                               "start of a new document (empty_prompt); give at least "
                               "one token", param="prompt")
            try:
                return tokenizer.empty_prompt()
            except TokenizerError as e:
                raise APIError(f"the prompt is empty: {e}", param="prompt") from None
        return ids

    def submit(req: CompletionRequest) -> tuple:
        """Every choice's engine request; ``(choices, prompt token count)``."""
        prompts = [prompt_ids(p) for p in req.prompt]
        base = None if req.seed is None else req.seed % (1 << 64)  # int64 as unsigned
        stop_tokens = () if req.ignore_eos else stop_ids
        choices = []
        try:
            for i, ids in enumerate(prompts):
                # no max_tokens: OpenAI's 16, or what the context leaves if that is less
                max_tokens = req.max_tokens
                if max_tokens is None:
                    if len(ids) >= engine.max_len:      # as max_tokens 1 would be refused
                        raise APIError(f"the prompt's {len(ids)} tokens fill the context of "
                                       f"{engine.max_len} tokens: no room for a completion",
                                       param="prompt", code="context_length_exceeded")
                    max_tokens = min(DEFAULT_MAX_TOKENS, engine.max_len - len(ids))
                elif len(req.prompt[i]) == 0 and len(ids) + max_tokens > engine.max_len:
                    # said of the tokens the client sent none of (the engine counts them)
                    raise APIError(f"an empty prompt starts a new document from "
                                   f"{len(ids)} {plural(len(ids), 'token')} of the tokenizer's "
                                   f"({tokenizer.decode(ids)!r}), so max_tokens {max_tokens} is "
                                   f"past the context of {engine.max_len} tokens; ask for at most "
                                   f"{engine.max_len - len(ids)}", param="max_tokens",
                                   code="context_length_exceeded")
                for j in range(req.n):
                    params = SamplingParams(
                        max_tokens=max_tokens, temperature=req.temperature, top_k=req.top_k,
                        top_p=req.top_p, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
                        presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty, logit_bias=req.logit_bias,
                        # no seed: every choice its own draw (one base a request gave the same
                        # prompt twice in a list the same text); a seed: seed + j, as documented
                        seed=secrets.randbits(62) if base is None else (base + j) % (1 << 64),
                        logprobs=req.logprobs, stop_tokens=stop_tokens,
                        prompt_logprobs=req.logprobs if req.echo else None)
                    stream = engine.submit(ids, params)
                    choices.append(_Choice(i * req.n + j, stream, tokenizer, req, stop_ids,
                                           hidden=len(ids) if len(req.prompt[i]) == 0 else 0))
        except BaseException:
            for c in choices:
                c.stream.cancel()
            raise
        return choices, sum(len(p) for p in prompts)

    async def completions(request: Request) -> Response:
        req = parse_completion(await read_json(request))
        if req.model is not None and req.model != model_id:
            raise APIError(f"the model {req.model!r} does not exist; this server serves "
                           f"{model_id!r}", status=404, param="model", code="model_not_found")
        choices, n_prompt = submit(req)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(_sse(choices, req, cid, created, n_prompt),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        collect = asyncio.gather(*(_collect(c, req) for c in choices))
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
            if collect not in done:            # the client left: free the slots
                collect.cancel()
                # its cancellation read here: left unread, asyncio logged a "_GatheringFuture
                # exception was never retrieved" traceback for every client that left
                await asyncio.gather(collect, return_exceptions=True)
                return Response(status_code=499)
            bodies = collect.result()
        finally:
            watch.cancel()
            for c in choices:
                c.stream.cancel()
        usage = usage_body(n_prompt, sum(c.n_tokens for c in choices))
        return JSONResponse(completion_body(cid, created, model_id, bodies, usage))

    async def _collect(c: _Choice, req: CompletionRequest) -> dict:
        texts, parts = [], []
        async for text, lp, _ in _events(c, req):
            texts.append(text)
            parts.append(lp)
        return choice_body(c.index, "".join(texts), _merge_logprobs(parts), c.finish)

    async def _sse(choices: list, req: CompletionRequest, cid: str, created: int, n_prompt: int):
        queue: asyncio.Queue = asyncio.Queue()

        def chunk(c, text, lp, finish):
            usage = (usage_body(n_prompt, sum(ch.n_tokens for ch in choices))
                     if req.continuous_usage else req.include_usage)
            body = chunk_body(cid, created, model_id, choice_body(c.index, text, lp, finish),
                              usage=usage)
            return f"data: {_json(body)}\n\n"

        async def run(c: _Choice):
            try:
                async for text, lp, finish in _events(c, req):
                    await queue.put(chunk(c, text, lp, finish))
            except (EngineClosedError, ModelError) as e:   # closed; or NaN logits, said as it is
                await queue.put(f"data: {_json(error_body(_server_error(e)))}\n\n")
            except Exception as e:             # said, not passed off as a finished choice
                log.exception("forge-ml serve: a streamed choice failed")
                err = APIError(f"internal server error: {type(e).__name__}", status=500,
                               type="server_error")
                await queue.put(f"data: {_json(error_body(err))}\n\n")
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(run(c)) for c in choices]
        try:
            left = len(tasks)
            while left:
                # the chunks waiting go out in one write; then the loop runs once before the
                # next (asyncio.sleep(0)), so a client that left is seen after one write, not
                # after a burst of them (asyncio logged "socket.send() raised exception." for
                # each write past the fifth to a closed connection)
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                left -= items.count(None)
                out = "".join(x for x in items if x is not None)
                if out:
                    yield out
                    await asyncio.sleep(0)
            if req.include_usage:
                usage = usage_body(n_prompt, sum(c.n_tokens for c in choices))
                body = completion_body(cid, created, model_id, [], usage)
                yield f"data: {_json(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:                               # done, or the client left: free the slots
            for c in choices:
                c.stream.cancel()
            for t in tasks:
                t.cancel()

    async def models(request: Request) -> Response:
        return JSONResponse(models_body(model_id, started, engine.max_len))

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name != model_id:
            raise APIError(f"the model {name!r} does not exist; this server serves {model_id!r}",
                           status=404, param="model", code="model_not_found")
        return JSONResponse(models_body(model_id, started, engine.max_len)["data"][0])

    async def health(request: Request) -> Response:
        ok = engine.running
        body = {"status": "ok" if ok else "stopped"}
        if getattr(request.state, "keyed", True):   # (no key asked, or the key given)
            body.update(model=model_id, **engine.stats())
        return JSONResponse(body, status_code=200 if ok else 503)

    async def on_api_error(request: Request, e: APIError) -> Response:
        return _error_response(e)

    async def on_request_error(request: Request, e: RequestError) -> Response:
        if isinstance(e, EngineClosedError):
            return _error_response(_server_error(e))
        return _error_response(APIError(str(e), param=e.param, code=e.code))

    async def on_http_error(request: Request, e: HTTPException) -> Response:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        allow = (e.headers or {}).get("Allow")     # Starlette names the route's methods on a 405
        msg = {404: f"no route {request.method} {request.url.path}; this server has GET "
                    "/v1/models, GET /v1/models/{model}, GET /health and POST /v1/completions",
               405: f"method {request.method} is not allowed on {request.url.path}"
                    + (f"; it takes {allow}" if allow else "")}
        response = _error_response(APIError(msg.get(e.status_code, str(e.detail)),
                                            status=e.status_code, type=kind))
        if e.headers:   # HTTP's Allow header (RFC 9110: a 405 must send it)
            response.headers.update(e.headers)
        return response

    async def on_client_gone(request: Request, e: ClientDisconnect) -> Response:
        # the client left while sending its request: nothing to answer, nothing went wrong
        log.info("forge-ml serve: the client of %s left before its request arrived",
                 request.url.path)
        return Response(status_code=400)

    async def on_model_error(request: Request, e: ModelError) -> Response:
        # a request whose logits turned NaN or inf past its prompt (the model's fault, said
        # with the weight to blame, not an internal error with a traceback)
        return _error_response(_server_error(e))

    async def on_server_error(request: Request, e: Exception) -> Response:
        log.exception("forge-ml serve: internal error on %s", request.url.path)
        return _error_response(APIError(f"internal server error: {type(e).__name__}",
                                        status=500, type="server_error"))

    routes = [Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"])]
    middleware = [Middleware(_APIKey, key=api_key)] if api_key else []
    return Starlette(routes=routes, middleware=middleware, exception_handlers={
        APIError: on_api_error, RequestError: on_request_error, HTTPException: on_http_error,
        ClientDisconnect: on_client_gone, ModelError: on_model_error, Exception: on_server_error})


def _check_json_type(value: Optional[str]) -> None:
    """An APIError (415) unless ``value``, a request's Content-Type, is JSON's:
    ``application/json`` or ``application/...+json`` in any case, its parameters allowed but a
    charset other than UTF-8 (JSON over HTTP is UTF-8, RFC 8259); no header (None) is taken as
    JSON, as FastAPI takes it.

    >>> _check_json_type("Application/JSON; charset=UTF-8"), _check_json_type(None)
    (None, None)
    >>> _check_json_type("text/plain")
    Traceback (most recent call last):
    ...
    forge_ml.serve.protocol.APIError: the request body must be JSON sent with the header 'Content-Type: application/json'; got Content-Type 'text/plain'
    """
    if value is None:
        return
    media, _, params = value.partition(";")
    media = media.strip().lower()
    if not (media == "application/json" or media.startswith("application/") and media.endswith("+json")):
        got = f"Content-Type {value.strip()[:80]!r}" if value.strip() else "an empty Content-Type"
        raise APIError(f"the request body must be JSON sent with the header 'Content-Type: "
                       f"application/json'; got {got}", status=415)
    for param in params.split(";"):
        name, _, v = param.partition("=")
        charset = v.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            raise APIError(f"the request body must be UTF-8 JSON (RFC 8259); got Content-Type "
                           f"{value.strip()[:80]!r}", status=415)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def _events(c: _Choice, req: CompletionRequest):
    """``(text, logprobs part, finish)`` per chunk of a choice: the echoed prompt first (once
    the engine has scored it: its scores are complete when the first token comes or the
    stream ends), then one per token, the last with its finish reason."""
    echoed = not req.echo
    async for out in c.stream:
        if not echoed:
            echoed = True
            yield (*c.echo(), None)
        text, lp, finished = c.token(out)
        yield text, lp, c.finish
        if finished:
            return
    if not echoed:
        yield (*c.echo(), None)
    if c.finish is None:                       # max_tokens 0: no token came
        c.finish = c.stream.finish or "length"
        yield c.end_text(), None, c.finish


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read before)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
