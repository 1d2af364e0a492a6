"""forge-ml serve: the real server (uvicorn on 127.0.0.1, an ephemeral port, in a thread)
tested with the official ``openai`` client and with plain httpx: whole and streamed responses,
stop strings, n, seed reproducibility, logprobs, echo and prompt scoring, every prompt form,
the API key, OpenAI error bodies for bad input (and the server serving on afterwards), the
models and health endpoints, client disconnects freeing their slots, GPT-2's byte tokens
streamed without broken characters, a concurrent load whose every request returns what it
returns alone, and the ``forge-ml serve`` command in a subprocess."""
import asyncio
import gc
import json
import os
import argparse
import logging
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import uvicorn

import forge_ml as fm
from forge_ml.inference.batch import BatchEngine
from forge_ml.inference.engine import SamplingParams, Stream, TokenOut
from forge_ml.models.gpt2 import GPT2, GPT2Config, param_shapes
from forge_ml.serve.app import create_app
from forge_ml.serve.protocol import parse_completion
from forge_ml.tokenizer import CharTokenizer, GPT2Tokenizer

from test_generate import make_model  # varied weights with clear margins

CHARS = "abcdefghijklmnopqrstuvwxyz .,!?\n"
KEY = "sk-test-key"


class Server:
    """uvicorn serving ``app`` on 127.0.0.1 and a free port, in a background thread."""

    def __init__(self, app):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer(CHARS)


@pytest.fixture(scope="module")
def engine(tok):
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32)
    eng = BatchEngine(make_model(cfg, seed=3), tok, slots=4)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    s = Server(create_app(engine, "tiny", max_body_bytes=20_000))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def locked(engine):
    """The same engine behind an API key."""
    s = Server(create_app(engine, "tiny", api_key=KEY))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def complete(http, **body):
    body.setdefault("model", "tiny")
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(http, **body):
    """The parsed chunks of a streamed completion (asserting the ``[DONE]`` ending)."""
    body.setdefault("model", "tiny")
    with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def engine_tokens(engine, tok, prompt, **kw):
    return [t.token for t in engine.submit(tok.encode(prompt), SamplingParams(**kw))]


# -- the endpoints -------------------------------------------------------------------------


def test_models_and_health(http, client):
    r = http.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["tiny"]
    assert r.json()["data"][0]["max_model_len"] == 64
    assert [m.id for m in client.models.list()] == ["tiny"]
    m = client.models.retrieve("tiny")                      # GET /v1/models/tiny
    assert (m.id, m.object, m.owned_by) == ("tiny", "model", "forge-ml")
    r = http.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["slots"] == 4 and h["model"] == "tiny"


def test_whole_response_with_the_openai_client(client, engine, tok):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length" and c.logprobs is None
    assert c.text == tok.decode(engine_tokens(engine, tok, "hello", max_tokens=10, temperature=0))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 10, 15)


def test_openai_penalties_and_logit_bias_through_the_openai_client(client, engine, tok):
    """presence_penalty, frequency_penalty and logit_bias as the openai client sends them
    (logit_bias's keys are strings in JSON): the engine's tokens for those settings and seed;
    a bias of 100 on one id makes every token that id, -100 on the greedy text's first
    token keeps it out."""
    kw = dict(model="tiny", prompt="hello", max_tokens=12, temperature=0.9, seed=5)
    adj = dict(presence_penalty=1.1, frequency_penalty=0.7, logit_bias={"3": 2.0, "5": -1.0})
    r = client.completions.create(**kw, **adj)
    want = engine_tokens(engine, tok, "hello", max_tokens=12, temperature=0.9, seed=5,
                         presence_penalty=1.1, frequency_penalty=0.7,
                         logit_bias={3: 2.0, 5: -1.0})
    assert r.choices[0].text == tok.decode(want)
    assert r.choices[0].text != client.completions.create(**kw).choices[0].text
    only = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0,
                                     logit_bias={str(tok.encode("z")[0]): 100})
    assert only.choices[0].text == "zzzzzz"
    greedy = client.completions.create(model="tiny", prompt="hello", max_tokens=6,
                                       temperature=0).choices[0].text
    banned = tok.encode(greedy[0])[0]
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0,
                                    logit_bias={str(banned): -100}).choices[0].text
    assert greedy[0] not in out


def test_max_tokens_defaults_to_16_or_what_the_context_leaves(http):
    assert complete(http, prompt="ab")["usage"]["completion_tokens"] == 16
    r = complete(http, prompt="a" * 60)
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "length"
    # a prompt that fills the context leaves no room: refused as max_tokens 1 would be (it
    # was a 200 with no text)
    for extra in ({}, {"max_tokens": 1}):
        r = http.post("/v1/completions", json={"prompt": "a" * 64, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_streamed_response_matches_the_whole_one(client, http):
    kw = dict(model="tiny", prompt="the sea", max_tokens=12, temperature=0.9, seed=5)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert len(chunks) == 12                        # one chunk per token
    assert all(len(ch.choices) == 1 and ch.choices[0].index == 0 for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in chunks] == [None] * 11 + ["length"]
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert len({ch.id for ch in chunks}) == 1
    raw = sse(http, **kw)                           # plain HTTP: the same events
    assert "".join(c["choices"][0]["text"] for c in raw) == whole.choices[0].text


def test_usage_in_the_stream(http):
    chunks = sse(http, prompt="abc", max_tokens=3, stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in chunks[:-1])
    # a null option is its default, as a null top-level field is (it was a 400)
    plain = sse(http, prompt="abc", max_tokens=3, stream_options={"include_usage": None})
    assert len(plain) == 3 and all(c.get("usage") is None for c in plain)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_usage_in_every_chunk_with_continuous_usage_stats(http):
    # vLLM's stream_options.continuous_usage_stats, accepted and ignored before (a QA report):
    # the request's counts so far in every chunk, then the final usage chunk as without it
    chunks = sse(http, prompt="abc", max_tokens=3, n=2, seed=1,
                 stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3, 4, 5, 6]
    assert all(c["usage"]["prompt_tokens"] == 3 and c["usage"]["total_tokens"] ==
               3 + c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_stop_strings_cut_the_text(client, http):
    kw = dict(model="tiny", prompt="once upon", max_tokens=40, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[7:9]                                 # two characters: spans two tokens
    cut = full[:full.index(stop)]
    r = client.completions.create(stop=[stop, "&never"], **kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == full.index(stop) + len(stop)
    chunks = sse(http, stop=stop, **kw)
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(stop not in c["choices"][0]["text"] for c in chunks)


def test_n_choices_and_seeds(client):
    kw = dict(model="tiny", prompt="a cat", max_tokens=10, temperature=1.0)
    r = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=11 + j, **kw).choices[0].text for j in range(3)]
    assert [c.text for c in r.choices] == alone
    assert len(set(alone)) > 1
    assert client.completions.create(n=3, seed=11, **kw).choices[2].text == alone[2]
    assert r.usage.completion_tokens == 30 and r.usage.prompt_tokens == 5
    # a negative seed (OpenAI's seeds are int64) is a seed like any other: reproducible
    neg = [client.completions.create(seed=-7, **kw).choices[0].text for _ in range(2)]
    assert neg[0] == neg[1]
    # without a seed, the same prompt twice in a list is two draws (one random base a request
    # gave every prompt the same numbers: a user's batch of 3 came back as 3 copies); with a
    # seed, each prompt gives what it gives alone with that seed
    many = dict(kw, prompt=["a cat"] * 4, max_tokens=12)
    texts = [c.text for c in client.completions.create(**many).choices]
    assert len(set(texts)) > 1, texts
    seeded = client.completions.create(**dict(kw, prompt=["a cat"] * 2), seed=11).choices
    assert [c.text for c in seeded] == [alone[0]] * 2


def test_a_seeded_completion_is_the_text_generate_gives(client, engine, tok):
    """The server draws what the library draws: a seeded completion (temperature, top-p,
    top-k, a penalty) is the text of ``generate`` on the served model with that seed."""
    from forge_ml.inference.generate import generate
    for seed, kw in ((5, dict(temperature=0.9, top_p=0.8)), (6, dict(temperature=1.3)),
                     (7, dict(temperature=0.7, top_k=3, repetition_penalty=1.3))):
        extra = {k: kw[k] for k in ("top_k", "repetition_penalty") if k in kw}
        r = client.completions.create(model="tiny", prompt="a cat", max_tokens=12, seed=seed,
                                      extra_body=extra, **{k: v for k, v in kw.items() if k not in extra})
        want = generate(engine.model, tok.encode("a cat"), max_new_tokens=12, seed=seed, **kw)
        assert r.choices[0].text == tok.decode(list(want)), (seed, kw)


@pytest.mark.parametrize("prompt, says", [
    ([[]], "its list 0 is empty"),
    ([[1, 2], [3, 1.5]], "its list 1 holds 1.5, not a token id"),
    ([1.5], "must hold integers; got 1.5"),
    ([True], "must hold integers; got true"),
    ([1, "a"], "a list mixing these"),
])
def test_a_bad_prompt_list_is_named_as_it_is(http, prompt, says):
    """[[]], [1.5] and [true] were all refused as "a list mixing other items", though nothing
    was mixed: the message now says which item fits no form and why."""
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and says in err["message"], err


def test_prompt_forms(client, tok):
    kw = dict(model="tiny", max_tokens=4, temperature=0)
    one = {p: client.completions.create(prompt=p, **kw).choices[0].text for p in ("ab", "cd")}
    r = client.completions.create(prompt=["ab", "cd"], n=2, **kw)
    assert [c.text for c in r.choices] == [one["ab"]] * 2 + [one["cd"]] * 2
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 4
    ids = tok.encode("ab")
    assert client.completions.create(prompt=ids, **kw).choices[0].text == one["ab"]
    r = client.completions.create(prompt=[ids, tok.encode("cd")], **kw)
    assert [c.text for c in r.choices] == [one["ab"], one["cd"]]


def test_logprobs(client, engine, tok):
    r = client.completions.create(model="tiny", prompt="hi there", max_tokens=6,
                                  temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.tokens) == 6
    assert lp.text_offset == list(range(8, 14))   # from the prompt's start, as OpenAI counts
    want = list(engine.submit(tok.encode("hi there"),
                              SamplingParams(max_tokens=6, temperature=0, logprobs=3)))
    for i, t in enumerate(want):
        assert lp.token_logprobs[i] == pytest.approx(t.logprob, abs=1e-6)
        top = lp.top_logprobs[i]
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp.token_logprobs[i])
        assert top == pytest.approx({tok.decode([k]): v for k, v in t.top_logprobs})
        assert all(v <= 0 for v in top.values())


def test_a_vanishing_temperature_gives_the_greedy_text_and_json_logprobs(http):
    """A temperature so low that the float32 logits overflow gives the greedy text; the
    tokens it makes impossible get OpenAI's -9999.0, not a 500 for -inf (or -Infinity in a
    stream, which is not JSON)."""
    kw = dict(prompt="hi there", max_tokens=6, logprobs=5)
    greedy = complete(http, temperature=0, **kw)["choices"][0]["text"]
    for t in (1e-40, 1e-300):
        c = complete(http, temperature=t, seed=1, **kw)["choices"][0]
        chunks = sse(http, temperature=t, seed=1, **kw)
        assert c["text"] == greedy
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == greedy
        lps = [c["logprobs"]] + [ch["choices"][0]["logprobs"] for ch in chunks]
        assert all(v == 0.0 for lp in lps for v in lp["token_logprobs"])
        tops = [top for lp in lps for top in lp["top_logprobs"]]
        assert all(len(top) == 5 and all(-9999.0 <= v <= 0.0 for v in top.values())
                   for top in tops)


def test_echo_and_prompt_scoring(client, http, engine):
    kw = dict(model="tiny", prompt="abc de", temperature=0)
    plain = client.completions.create(max_tokens=5, **kw).choices[0].text
    r = client.completions.create(max_tokens=5, echo=True, logprobs=1, **kw)
    c = r.choices[0]
    assert c.text == "abc de" + plain
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert len(c.logprobs.tokens) == 11 and c.logprobs.text_offset == list(range(11))
    # scoring only (as lm-eval-harness asks): max_tokens 0, echo, logprobs
    s = client.completions.create(max_tokens=0, echo=True, logprobs=0, **kw).choices[0]
    assert s.text == "abc de" and s.finish_reason == "length"
    assert s.logprobs.token_logprobs[1:] == pytest.approx(c.logprobs.token_logprobs[1:6], abs=1e-6)
    model = engine.model
    ids = engine.tokenizer.encode("abc de")
    logits = model.logits(fm.tensor([ids])).numpy()[0].astype(np.float64)
    lps = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert s.logprobs.token_logprobs[1:] == pytest.approx(
        [lps[i, ids[i + 1]] for i in range(5)], abs=1e-5)
    chunks = sse(http, max_tokens=3, echo=True, **kw)
    assert chunks[0]["choices"][0]["text"] == "abc de"
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == "abc de" + plain[:3]


# -- bad input -----------------------------------------------------------------------------


BAD = [
    (b"[" * 5000 + b"]" * 5000, 400, None),                    # nested past Python's recursion
    ({"prompt": "ab", "suffix": 0}, 400, "suffix"),            # wrong types were taken as unset
    ({"prompt": "ab", "logit_bias": False}, 400, "logit_bias"),
    ({"prompt": "ab", "presence_penalty": False}, 400, "presence_penalty"),
    ({"prompt": "ab", "best_of": "x"}, 400, "best_of"),
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "ab", "max_tokenz": 3}, 400, "max_tokenz"),
    ({"prompt": "ab", "max_tokens": "3"}, 400, "max_tokens"),
    ({"prompt": "ab", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "ab", "temperature": -0.1}, 400, "temperature"),
    ({"prompt": "ab", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "ab", "temperature": 2.5}, 400, "temperature"),      # past OpenAI's 0..2
    ({"prompt": "ab", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a" * 65}, 400, "prompt"),
    ({"prompt": "ab", "max_tokens": 63}, 400, "max_tokens"),
    ({"prompt": "AB"}, 400, "prompt"),                       # not in the char vocabulary
    ({"prompt": [1, 99]}, 400, "prompt"),                    # id out of the vocabulary
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": "ab", "n": 0}, 400, "n"),
    ({"prompt": "ab", "top_p": 0}, 400, "top_p"),
    ({"prompt": "ab", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "ab", "stop": ""}, 400, "stop"),
    ({"prompt": "ab", "seed": 1 << 63}, 400, "seed"),            # past OpenAI's int64
    ({"prompt": "ab", "seed": 1 << 64}, 400, "seed"),
    ({"prompt": "ab", "presence_penalty": 2.5}, 400, "presence_penalty"),   # past OpenAI's
    ({"prompt": "ab", "frequency_penalty": -2.01}, 400, "frequency_penalty"),
    ({"prompt": "ab", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ({"prompt": "ab", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "ab", "logit_bias": {"99": 1}}, 400, "logit_bias"),        # no such token
    ({"prompt": "ab", "best_of": 3}, 400, "best_of"),
    ({"prompt": "ab", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "ab", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options"),                          # usage in every chunk of no usage asked for
    ({"prompt": "ab", "stream": True,              # accepted and ignored: any value passed
      "stream_options": {"include_usage": True, "continuous_usage_stats": "garbage"}}, 400,
     "stream_options.continuous_usage_stats"),
    (b'{"prompt": "A", "max_tokens": 1, "\\ud800": 1}', 400, None),   # a 500 and a traceback
    (b'{"prompt": "A\\udc00b", "max_tokens": 1}', 400, None),        # (the key: param unencodable)
    (b'{"prompt": "A", "max_tokens": 1, "\xed\xa0\x80": 1}', 400, None),  # one as UTF-8 bytes
    ('{"prompt": "A", "max_tokens": 1}'.encode("utf-16"), 400, None),      # not UTF-8 (RFC 8259)
    ({"prompt": "ab", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "ab " * 10_000}, 413, None),
    (b'{"prompt": "ab", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),   # said Python's hint
    ({"prompt": ["ab"] * 257}, 400, "prompt"),                 # too many prompts: named n
    # 500s of a QA pass: keys that passed a digit test but not int() ...
    ({"prompt": "ab", "max_tokens": 1, "logit_bias": {"--5": 1}}, 400, "logit_bias"),
    ({"prompt": "ab", "max_tokens": 1, "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    ({"prompt": "ab", "max_tokens": 1, "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),
    # ... and integers past float's range in the number fields (OverflowError)
    ({"prompt": "ab", "max_tokens": 1, "temperature": 10 ** 400}, 400, "temperature"),
    ({"prompt": "ab", "max_tokens": 1, "top_p": -10 ** 400}, 400, "top_p"),
    ({"prompt": "ab", "max_tokens": 1, "presence_penalty": 10 ** 400}, 400, "presence_penalty"),
    ({"prompt": "ab", "max_tokens": 1, "logit_bias": {"3": 10 ** 400}}, 400, "logit_bias"),
]


def test_a_megabyte_of_whitespace_is_a_prompt_too_long_not_a_500():
    """~1 MB of whitespace made tiktoken's pattern overflow its stack (a Rust panic, which no
    `except Exception` catches): a plain-text 500 and a traceback for one request. The server
    now knows such a prompt is too long from its length (a GPT-2 token covers at most 128
    characters), and the tokenizer says its failure as a TokenizerError."""
    from forge_ml.errors import TokenizerError
    from forge_ml.tokenizer import GPT2Tokenizer
    gpt2 = GPT2Tokenizer()

    class PanicException(BaseException):   # pyo3's, as tiktoken raises it (not an Exception)
        pass

    class Overflowing:                     # tiktoken's two failures, whatever its build does
        def encode_ordinary(self, text):
            raise PanicException("called `Result::unwrap()` on an `Err` value: StackOverflow")

        def encode_to_numpy(self, text, **kw):
            raise ValueError("Regex error while tokenizing: Max stack size exceeded")
    broken = GPT2Tokenizer()
    broken._enc = Overflowing()
    with pytest.raises(TokenizerError, match="tiktoken cannot split this text of 1,000,000 characters"):
        broken.encode(" " * 1_000_000)
    with pytest.raises(TokenizerError, match="tiktoken cannot split"):
        broken.encode_array("\n" * 2_000_000)
    cfg = GPT2Config(vocab_size=gpt2.vocab_size, block_size=32, n_layer=1, n_head=1, n_embd=8)
    with BatchEngine(make_model(cfg, seed=1), gpt2, slots=1) as eng:
        s = Server(create_app(eng, "g"))
        try:
            with httpx.Client(base_url=s.url, timeout=30) as c:
                for prompt, says in ((" " * 1_000_000, "1,000,000 characters are more than 32 tokens"),
                                     (" " * 1_000, "the prompt has 1000 tokens")):
                    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                    assert r.status_code == 400, r.text
                    err = r.json()["error"]
                    assert err["code"] == "context_length_exceeded" and says in err["message"], err
                assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        finally:
            s.stop()


@pytest.mark.parametrize("body, status, param", BAD, ids=range(len(BAD)))
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(http, body, status, param):
    if isinstance(body, bytes):
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert len(err["message"]) > 10 and "sys.set_int_max_str_digits" not in err["message"]
    assert http.get("/health").json()["status"] == "ok"
    assert complete(http, prompt="ab", max_tokens=2)["usage"]["completion_tokens"] == 2
    if body in ({"prompt": "a" * 65}, {"prompt": "ab", "max_tokens": 63}):
        # OpenAI's code for both: a prompt past the context, or one whose max_tokens runs past
        # it (the second had code null)
        assert err["code"] == "context_length_exceeded", err


@pytest.mark.parametrize("field, value, message", [
    ("seed", 1 << 64, f"seed must be an integer in [-2**63, 2**63) (OpenAI's int64), got {1 << 64}"),
    ("seed", -(1 << 63) - 1, "seed must be an integer in [-2**63, 2**63) (OpenAI's int64), got "
                             f"{-(1 << 63) - 1}"),
    ("temperature", 2.5, "temperature must be >= 0 and <= 2, got 2.5"),
    ("temperature", 1e6, "temperature must be >= 0 and <= 2, got 1000000.0"),
    ("temperature", -0.5, "temperature must be >= 0 and <= 2, got -0.5"),
    ("top_p", 1.5, "top_p must be > 0 and <= 1, got 1.5"),
])
def test_sampling_fields_outside_openais_ranges_get_a_400_naming_the_range(http, field, value,
                                                                          message):
    """OpenAI documents temperature in 0..2, top_p in 0..1 and an int64 seed, and answers 400
    outside them; a temperature above 2 was taken, and the seed's error named one bound. The
    error names the range and the value given; temperature 2 itself is taken."""
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "ab", field: value})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error",
                                  "param": field, "code": None}}
    assert complete(http, prompt="ab", max_tokens=2, temperature=2)["usage"]["completion_tokens"] == 2


def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="ab", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="ab")


def test_unknown_routes_and_methods(http):
    r = http.get("/v1/chat/completions")
    assert r.status_code == 404 and "/v1/completions" in r.json()["error"]["message"]
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    # RFC 9110: a 405 names the methods the resource takes (it came without the header)
    assert r.headers["allow"] == "POST" and "it takes POST" in r.json()["error"]["message"]
    r = http.post("/v1/models")
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_api_key(locked):
    with httpx.Client(base_url=locked.url, timeout=30) as h:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for path in ("/v1/models", "/v1/models/tiny"):
                r = h.get(path, headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "invalid_api_key"
            # (README QA) a load balancer's probe has no key, as vLLM's /health takes none:
            # it learns whether the engine runs, and nothing else
            r = h.get("/health", headers=headers)
            assert r.status_code == 200 and r.json() == {"status": "ok"}
            assert h.head("/health", headers=headers).status_code == 200   # probes that send HEAD
        r = h.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1})
        assert r.status_code == 401
        assert h.post("/health").status_code == 401      # only GET is open
        ok = {"Authorization": f"Bearer {KEY}"}
        r = h.get("/health", headers=ok)
        assert r.status_code == 200 and r.json()["model"] == "tiny" and "running" in r.json()
    bad = openai.OpenAI(base_url=locked.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="ab", max_tokens=1)
    good = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny", prompt="ab", max_tokens=2).usage.completion_tokens == 2


# -- load and disconnects --------------------------------------------------------------------


def test_concurrent_requests_each_return_what_they_return_alone(server):
    """12 overlapping requests on 4 slots (so they queue, join and leave at different steps),
    half of them streamed: each returns exactly what it returns when sent alone."""
    rng = np.random.default_rng(0)
    reqs = []
    for i in range(12):
        prompt = "".join(rng.choice(list(CHARS[:27]), size=int(rng.integers(1, 12))))
        reqs.append(dict(model="tiny", prompt=prompt, max_tokens=int(rng.integers(3, 30)),
                         temperature=0.0 if i % 3 == 0 else float(rng.choice([0.7, 1.0, 1.4])),
                         top_k=int(rng.choice([0, 5])), seed=int(rng.integers(0, 1000)),
                         stream=bool(i % 2)))

    def send(body):
        with httpx.Client(base_url=server.url, timeout=60) as h:
            if body["stream"]:
                chunks = sse(h, **body)
                return "".join(c["choices"][0]["text"] for c in chunks), len(chunks)
            r = complete(h, **body)
            return r["choices"][0]["text"], r["usage"]["completion_tokens"]

    alone = [send(b) for b in reqs]
    with ThreadPoolExecutor(12) as pool:
        together = list(pool.map(send, reqs))
    assert together == alone
    assert [n for _, n in together] == [b["max_tokens"] for b in reqs]


@pytest.fixture()
def slow_server(tok):
    """A server whose engine takes 30 ms a step, so a request is still running when its
    client leaves."""
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=1, n_embd=16)
    eng = BatchEngine(make_model(cfg, seed=3), tok, slots=2)
    launch = eng._launch

    def slow(*args):
        time.sleep(0.03)
        return launch(*args)

    eng._launch = slow
    s = Server(create_app(eng, "slow"))
    yield s, eng
    s.stop()
    eng.close()


def test_nan_logits_past_the_prompt_are_a_500_naming_the_weight(tok, caplog):
    """A model whose wpe row 8 is NaN passes the engine's first step; a completion reaching
    position 8 was served garbage ids. Now: a 500 JSON error naming the weight (whole or
    streamed: an error event, then [DONE]), no traceback logged, and the server goes on."""
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=1, n_embd=16)
    m = make_model(cfg, seed=3)
    m.params["wpe.weight"].data[8, :] = np.nan
    eng = BatchEngine(m, tok, slots=2)
    s = Server(create_app(eng, "nan"))
    try:
        with httpx.Client(base_url=s.url, timeout=30) as h:
            body = {"model": "nan", "prompt": "abc", "max_tokens": 10, "temperature": 0}
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and "wpe.weight holds 16 NaN" in err["message"]
            assert "position 8" in err["message"]
            with h.stream("POST", "/v1/completions", json=dict(body, stream=True)) as st:
                lines = [ln for ln in st.iter_lines() if ln]
            assert lines[-1] == "data: [DONE]"
            events = [json.loads(ln[6:]) for ln in lines[:-1]]
            assert "wpe.weight" in events[-1]["error"]["message"]
            assert all("choices" in e for e in events[:-1]) and len(events) == 1 + 6   # 3-8
            ok = h.post("/v1/completions", json=dict(body, max_tokens=4))   # positions 3-6
            assert ok.status_code == 200 and len(tok.encode(ok.json()["choices"][0]["text"])) == 4
        assert not [r for r in caplog.records if r.exc_info]
    finally:
        s.stop()
        eng.close()


def wait_idle(eng, timeout=5.0):
    """Whether the engine's loop has freed every slot and queue place within ``timeout``
    (its own lists: ``stats()`` leaves out cancelled requests at once, before the loop
    frees their slots, so it cannot tell a slot that leaks)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with eng._cond:
            if all(r is None for r in eng._active) and not eng._pending:
                return True
        time.sleep(0.01)
    return False


def test_a_client_that_leaves_a_stream_frees_its_slot(slow_server):
    srv, eng = slow_server
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        with h.stream("POST", "/v1/completions",
                      json={"prompt": "ab", "max_tokens": 60, "stream": True}) as r:
            lines = r.iter_lines()
            got = [ln for ln in (next(lines) for _ in range(6)) if ln]
            assert len(got) >= 2
            assert eng.stats()["running"] == 1
    steps = eng.steps
    assert wait_idle(eng)
    assert eng.steps - steps < 30                   # well short of the 60 tokens asked


def test_a_client_that_leaves_a_whole_request_frees_its_slot(slow_server, caplog):
    srv, eng = slow_server
    with httpx.Client(base_url=srv.url, timeout=0.3) as h:
        with pytest.raises(httpx.TimeoutException):
            h.post("/v1/completions", json={"prompt": "ab", "max_tokens": 60})
    steps = eng.steps                               # about 10 steps ran in the 0.3 s
    assert wait_idle(eng)
    assert eng.steps - steps < 30
    # and quietly: each client that left logged asyncio's "_GatheringFuture exception was never
    # retrieved" traceback (the cancelled gather was not awaited), noise that looks like a crash
    time.sleep(0.2)
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_client_that_leaves_while_sending_its_body_is_not_an_internal_error(server, http,
                                                                             caplog):
    """A client that sends half a body and hangs up: no traceback in the log ("internal
    error", "Exception in ASGI application"), and the server goes on serving."""
    host, port = server.url.rsplit("/", 1)[1].split(":")
    with caplog.at_level(logging.INFO):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        time.sleep(0.2)
        s.close()
        deadline = time.time() + 5
        while time.time() < deadline and not [r for r in caplog.records if "left" in r.getMessage()]:
            time.sleep(0.02)
    said = [r for r in caplog.records if r.name.startswith(("forge_ml", "uvicorn"))]
    assert [r for r in said if "left before its request arrived" in r.getMessage()]
    assert not [r for r in said if r.exc_info or r.levelno >= logging.ERROR], \
        [r.getMessage() for r in said]
    assert complete(http, prompt="ab", max_tokens=3)["choices"][0]["finish_reason"] == "length"


# -- GPT-2's byte tokens ---------------------------------------------------------------------


def test_byte_tokens_never_stream_a_broken_character():
    """The text logic alone: the parrot emoji is three GPT-2 tokens, streamed as one piece."""
    from forge_ml.serve.app import _Choice, _events

    tok = GPT2Tokenizer()
    ids = tok.encode("x 🦜!")
    assert len(ids) > 3
    req = parse_completion({"prompt": "a", "stop": "!"})
    stream = Stream([64], SamplingParams())
    for t in ids:
        stream._push(TokenOut(t))
    stream._push(TokenOut(50256, finish="stop"))

    async def run():
        return [x async for x in _events(_Choice(0, stream, tok, req, 50256), req)]

    events = asyncio.run(run())
    texts = [t for t, _, _ in events]
    assert "".join(texts) == "x 🦜" and all("\ufffd" not in t for t in texts)
    assert len(events) == len(ids) and events[-1][2] == "stop"


def test_ignore_eos_leaves_the_end_of_text_token_out_of_the_text():
    """With ignore_eos the choice goes on past <|endoftext|>, which is then no text where it
    comes (vLLM's skip_special_tokens; it was the literal "<|endoftext|>" in the text), its
    log-probability listed at the text's offset; streamed or not, the same text."""
    from forge_ml.serve.app import _Choice, _events

    tok = GPT2Tokenizer()
    before, after = tok.encode("Hi"), tok.encode(" there")
    for stream_it in (False, True):
        req = parse_completion({"prompt": "a", "logprobs": 1, "ignore_eos": True,
                                "stream": stream_it})
        stream = Stream([64], SamplingParams())
        for i, t in enumerate(before + [tok.eot_token] + after):
            stream._push(TokenOut(t, logprob=-0.5 - i, top_logprobs=((t, -0.5 - i),),
                                  finish="length" if i == len(before + after) else None))

        async def run():
            return [x async for x in _events(_Choice(0, stream, tok, req, tok.eot_token), req)]

        events = asyncio.run(run())
        assert "".join(t for t, _, _ in events) == "Hi there"
        assert events[-1][2] == "length"
        lp = [p for _, p, _ in events if p is not None]
        tokens = [x for p in lp for x in p["tokens"]]
        offsets = [x for p in lp for x in p["text_offset"]]
        assert tokens == ["Hi", "<|endoftext|>", " there"]
        assert offsets == [1, 3, 3]          # from the prompt's start ("a"), as OpenAI's API
        assert [x for p in lp for x in p["token_logprobs"]] == [-0.5, -1.5, -2.5]


def test_an_empty_prompt_on_a_char_model_starts_from_its_newline_as_the_cli_does(http, tok):
    """A char model's server refused an empty prompt (no <|endoftext|>), where OpenAI's API
    takes it and ``forge-ml sample --prompt ''`` starts from a newline (``prompt_ids``): the
    server now starts it there too, neither echoed nor counted in text_offset."""
    kw = dict(max_tokens=5, temperature=0)
    want = complete(http, prompt="\n", **kw)["choices"][0]["text"]
    assert complete(http, prompt="", **kw)["choices"][0]["text"] == want
    assert complete(http, **kw)["choices"][0]["text"] == want
    got = complete(http, prompt="", echo=True, logprobs=1, **kw)
    assert got["choices"][0]["text"] == want
    assert got["choices"][0]["logprobs"]["text_offset"][0] == 0
    assert got["usage"]["prompt_tokens"] == 1


def test_a_gpt2_tokenizer_server_streams_whole_characters():
    tok = GPT2Tokenizer()
    cfg = GPT2Config(vocab_size=50257, block_size=32, n_layer=1, n_head=1, n_embd=16)
    eng = BatchEngine(GPT2.init(cfg, seed=0), tok, slots=2)
    srv = Server(create_app(eng, "gpt2-tiny"))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            # no prompt, or an empty one: a new document, from <|endoftext|>, as OpenAI's API
            # documents (a char tokenizer starts from its newline: the test after this one)
            kw = dict(model="gpt2-tiny", max_tokens=6, temperature=0, ignore_eos=True)
            want = complete(h, prompt=[tok.eot_token], **kw)["choices"][0]["text"]
            assert want and complete(h, **kw)["choices"][0]["text"] == want
            assert complete(h, prompt="", **kw)["choices"][0]["text"] == want
            # the <|endoftext|> an empty prompt starts from is not the client's: not echoed,
            # not counted in text_offset (the echo began "<|endoftext|>", the offsets at 13);
            # one the client sends is echoed
            for echo in (False, True):
                got = complete(h, prompt="", echo=echo, logprobs=1, **kw)["choices"][0]
                assert got["text"] == want
                assert got["logprobs"]["text_offset"][0] == 0
                assert "".join(got["logprobs"]["tokens"]) == want
            sent = complete(h, prompt=[tok.eot_token], echo=True, **kw)["choices"][0]["text"]
            assert sent == "<|endoftext|>" + want
            # max_tokens the whole context: said of the token the client did not send (it read
            # "the prompt's 1 tokens plus max_tokens 32 exceed ...": a QA report)
            r = h.post("/v1/completions", json=dict(kw, prompt="", max_tokens=32))
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            assert r.json()["error"]["message"] == (
                "an empty prompt starts a new document from 1 token of the tokenizer's "
                "('<|endoftext|>'), so max_tokens 32 is past the context of 32 tokens; ask for "
                "at most 31")
            prompt = tok.encode("Hello 🦜")
            kw = dict(model="gpt2-tiny", prompt=prompt, max_tokens=20, temperature=1.0, seed=3,
                      echo=True, ignore_eos=True)
            whole = complete(h, **kw)["choices"][0]["text"]
            chunks = sse(h, **kw)
            # half a character is "bytes:\\xNN" in tokens and top_logprobs, as OpenAI writes it
            # (as U+FFFD every such token had one key: top_logprobs lost entries); text_offset
            # counts from the prompt's start, echo or not
            scored = complete(h, model="gpt2-tiny", prompt="a🦜🦜", max_tokens=0, echo=True,
                              logprobs=3)["choices"][0]["logprobs"]
            byte_tokens = [t for t in scored["tokens"] if t.startswith("bytes:\\x")]
            assert len(byte_tokens) >= 2 and all("\ufffd" not in t for t in scored["tokens"])
            for top in scored["top_logprobs"][1:]:
                assert len(top) >= 3                 # no entry lost to another
            gen = complete(h, model="gpt2-tiny", prompt="Hello 🦜", max_tokens=3, logprobs=1,
                           temperature=0, ignore_eos=True)["choices"][0]["logprobs"]
            assert gen["text_offset"][0] == len("Hello 🦜")
        texts = [c["choices"][0]["text"] for c in chunks]
        assert texts[0] == "Hello 🦜"
        assert "".join(texts) == whole
        assert sum("\ufffd" in t for t in texts) == whole.count("\ufffd")
    finally:
        srv.stop()
        eng.close()


def greedy_gpt2(token: int) -> GPT2:
    """A model of GPT-2's vocabulary whose greedy choice is ``token`` at every step."""
    cfg = GPT2Config(vocab_size=50257, block_size=16, n_layer=1, n_head=1, n_embd=4,
                     tied_head=False)
    params = {k: np.zeros(s, np.float32) for k, s in param_shapes(cfg).items()}
    params["ln_f.bias"][:] = 1.0
    params["lm_head.weight"][token] = 1.0
    return GPT2(cfg, {k: fm.tensor(v) for k, v in params.items()})


def test_text_offset_gives_a_broken_character_to_the_tokens_that_began_it():
    """A prompt (as ids) that ends in half of "é" (GPT-2's byte token 0xc3), echoed with
    logprobs: the U+FFFD that half character becomes once the next token does not complete it
    was counted in the first generated token's span (text_offset [0, 5, 5, 7, 8] for
    "Hello\\ufffd!!!": text[5:5] for the half, "\\ufffd!" for the "!"), where without echo the
    completion's offsets start past it. The offsets now index the returned text so that each
    token's span is the text it made, echoed or generated, whole or streamed; a token that
    completes a character still owns the whole character."""
    tok = GPT2Tokenizer()
    half = next(i for i in range(256) if tok.decode_bytes([i]) == b"\xc3")
    rest = next(i for i in range(256) if tok.decode_bytes([i]) == b"\xa9")   # "é" = c3 a9
    (bang,) = tok.encode("!")
    prompt = tok.encode("Hello") + [half]

    def spans(text, offsets):
        return [text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])]

    for token, text, offsets, own in (
            (bang, "Hello\ufffd!!!", [0, 5, 6, 7, 8], ["Hello", "\ufffd", "!", "!", "!"]),
            # the first 0xa9 completes "é" (the half is then no text of its own); the others
            # are a lone byte each
            (rest, "Helloé\ufffd\ufffd", [0, 5, 5, 6, 7], ["Hello", "", "é", "\ufffd", "\ufffd"])):
        eng = BatchEngine(greedy_gpt2(token), tok, slots=2)
        srv = Server(create_app(eng, "g"))
        try:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=60)
            kw = dict(model="g", prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
            c = client.completions.create(echo=True, **kw).choices[0]
            assert c.text == text
            assert c.logprobs.tokens[:2] == ["Hello", "bytes:\\xc3"]
            assert c.logprobs.text_offset == offsets
            assert spans(c.text, c.logprobs.text_offset) == own
            with httpx.Client(base_url=srv.url, timeout=60) as h:
                chunks = [ch["choices"][0] for ch in sse(h, echo=True, **kw)]
                # the prompt's scores alone (max_tokens 0): its broken end is its own
                scored = complete(h, **dict(kw, max_tokens=0, echo=True))["choices"][0]
            assert "".join(ch["text"] for ch in chunks) == text
            assert [o for ch in chunks for o in ch["logprobs"]["text_offset"]] == offsets
            assert scored["text"] == "Hello\ufffd" and scored["logprobs"]["text_offset"] == [0, 5]
            if token == bang:
                # without echo the offsets count from the prompt's start, "Hello\ufffd", the same
                plain = client.completions.create(**kw).choices[0]
                assert plain.text == "!!!" and plain.logprobs.text_offset == offsets[2:]
        finally:
            srv.stop()
            eng.close()
    # a broken character inside the prompt is its tokens' too, as at its end
    eng = BatchEngine(greedy_gpt2(bang), tok, slots=2)
    srv = Server(create_app(eng, "g"))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            c = complete(h, model="g", prompt=prompt + [bang], max_tokens=1, temperature=0,
                         logprobs=0, echo=True)["choices"][0]
    finally:
        srv.stop()
        eng.close()
    assert c["text"] == "Hello\ufffd!!" and c["logprobs"]["text_offset"] == [0, 5, 6, 7]


# -- the command ---------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_model_with_ids_past_the_tokenizer_never_chooses_them(tok):
    """A model whose vocabulary is larger than its tokenizer's (a Hugging Face export padded
    to 50304 for GPT-2's 50257 tokens, say) never chooses an id the tokenizer cannot decode,
    even where the model makes those ids the most likely: no 500, no stream cut short; a
    prompt with such an id is refused like any id out of range."""
    cfg = GPT2Config(vocab_size=tok.vocab_size + 8, block_size=32, n_layer=1, n_head=1,
                     n_embd=16)
    rng = np.random.default_rng(0)
    host = {k: (rng.standard_normal(s) * 0.5).astype(np.float32)
            for k, s in param_shapes(cfg).items()}
    host["wte.weight"][tok.vocab_size:] *= 20         # the extra ids dominate every step
    eng = BatchEngine(GPT2(cfg, {k: fm.tensor(v) for k, v in host.items()}), tok, slots=2)
    srv = Server(create_app(eng, "padded"))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            kw = dict(model="padded", prompt="abc", max_tokens=20, seed=1, logprobs=3)
            c = complete(h, **kw)["choices"][0]
            assert c["finish_reason"] == "length" and len(c["logprobs"]["tokens"]) == 20
            assert len(c["text"]) == 20 and all(ch in CHARS for ch in c["text"])
            chunks = sse(h, **kw)
            assert "".join(ch["choices"][0]["text"] for ch in chunks) == c["text"]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            r = h.post("/v1/completions", json={"prompt": [1, tok.vocab_size + 2]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    finally:
        srv.stop()
        eng.close()


class FailingTokenizer:
    """``tok`` whose ``decode`` fails from its ``n``-th call on: a stand-in for any bug."""

    def __init__(self, tok, n):
        self.tok, self.n, self.vocab_size = tok, n, tok.vocab_size

    def encode(self, text):
        return self.tok.encode(text)

    def decode(self, ids):
        self.n -= 1
        if self.n <= 0:
            raise RuntimeError("decode failed")
        return self.tok.decode(ids)


def test_a_stream_that_fails_midway_ends_with_an_error_not_a_done(tok):
    """A choice that fails after some tokens sends an OpenAI error event (the client raises),
    not a [DONE] that passes the cut text off as a whole completion."""
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=1, n_embd=16)
    eng = BatchEngine(make_model(cfg, seed=1), FailingTokenizer(tok, 4), slots=2)
    srv = Server(create_app(eng, "failing"))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            with h.stream("POST", "/v1/completions",
                          json={"prompt": "ab", "max_tokens": 10, "stream": True}) as r:
                events = [json.loads(ln[6:]) for ln in r.iter_lines()
                          if ln.startswith("data: {")]
        assert len(events) == 4 and all("choices" in e for e in events[:3])
        err = events[3]["error"]
        assert err["type"] == "server_error" and "RuntimeError" in err["message"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0)
        eng.tokenizer.n = 2
        with pytest.raises(openai.APIError):
            list(client.completions.create(model="failing", prompt="ab", max_tokens=10,
                                           stream=True))
        assert eng.running
    finally:
        srv.stop()
        eng.close()


def test_a_runs_checkpoint_is_served_under_the_runs_name(tmp_path):
    """serve --ckpt runs/my-run/ckpt answered to model "ckpt" (a fine-tuning user's report);
    a folder named ckpt that is not in a run keeps its name."""
    from forge_ml.serve.cli import model_id
    run = tmp_path / "my-run"
    (run / "ckpt").mkdir(parents=True)
    (run / "log.jsonl").write_text("")
    assert model_id(run / "ckpt") == model_id(run / "best") == model_id(run) == "my-run"
    (tmp_path / "loose" / "ckpt").mkdir(parents=True)
    assert model_id(tmp_path / "loose" / "ckpt") == "ckpt"


def test_forge_ml_serve_command(tmp_path):
    from forge_ml.checkpoint import save_checkpoint

    cfg = GPT2Config(vocab_size=len(CHARS), block_size=32, n_layer=1, n_head=1, n_embd=8)
    save_checkpoint(tmp_path / "ckpt", GPT2.init(cfg).state_dict(),
                    {"config": cfg.to_dict(), "tokenizer": {"kind": "char", "chars": CHARS},
                     "step": 1})
    port = free_port()
    env = dict(os.environ, FORGE_API_KEY="k1")
    proc = subprocess.Popen([sys.executable, "-m", "forge_ml.serve.cli", "--ckpt",
                             str(tmp_path / "ckpt"), "--port", str(port), "--slots", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.time() < deadline, "the server did not come up"
                time.sleep(0.1)
        assert r.status_code == 200 and r.json() == {"status": "ok"}    # a probe: no key, no figures
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401   # the key is asked
        c = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        out = c.completions.create(model="ckpt", prompt="abc", max_tokens=4, temperature=0)
        assert len(out.choices[0].text) == 4
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode in (0, -15)


def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path, capsys):
    """uvicorn announced http://host:port/v1 as if the server were up, then printed its bind
    error among six lines of log, exit 3; now one line before the model loads, exit 2."""
    import socket

    from forge_ml.serve.cli import main

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        assert main(["--ckpt", str(tmp_path / "no_such_ckpt"), "--port", str(port)]) == 2
    finally:
        busy.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"forge-ml serve: error: cannot listen on 127.0.0.1:{port}: port {port} is in "
                   "use (another server? choose another with --port)"], err


def test_serve_listens_before_its_model_loads(tmp_path, capsys):
    """A review found that two servers on one port both bound it (SO_REUSEADDR, neither
    listening yet) and the first died with a traceback once its model had loaded: the sockets
    listen at once, so the second is refused in one line. A host name binds every address it
    resolves to on one port; a mistyped host is one line, not a traceback."""
    from forge_ml.errors import ConfigError
    from forge_ml.serve.cli import _listen_sockets, main

    first = _listen_sockets("127.0.0.1", 0)
    port = first[0].getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: port {port} is in use"):
            _listen_sockets("127.0.0.1", port)
    finally:
        for sock in first:
            sock.close()
    import socket
    from unittest import mock
    real = socket.getaddrinfo

    def with_a_missing_address(host, port, *a, **k):   # ::1 where IPv6 is off, say
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2001:db8::1", port, 0, 0))] + \
            real("127.0.0.1", port, *a, **k)

    with mock.patch("socket.getaddrinfo", with_a_missing_address):   # skipped, as asyncio does
        kept = _listen_sockets("localhost", 0)
    assert [sock.getsockname()[0] for sock in kept] == ["127.0.0.1"]
    for sock in kept:
        sock.close()
    every = _listen_sockets("", 0)    # "": all interfaces, every family on the same port
    try:
        assert len({sock.getsockname()[1] for sock in every}) == 1
    finally:
        for sock in every:
            sock.close()
    assert main(["--ckpt", str(tmp_path / "none"), "--host", "127..0.1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("forge-ml serve: error: --host 127..0.1: not an "
                                               "address of this machine"), err


def test_serve_parser_defaults():
    import argparse

    from forge_ml.serve.cli import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    a = add_parser(sub).parse_args(["--ckpt", "x", "--dtype", "bf16", "--api-key", "k"])
    assert (a.host, a.port, a.dtype, a.api_key, a.slots) == ("127.0.0.1", 8000, "bf16", "k", None)
    assert a.shutdown_timeout == 5.0   # the grace on SIGTERM, fixed at 5 s before, now a flag
    from forge_ml.errors import ConfigError
    from forge_ml.serve.cli import run
    bad = add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        ["--ckpt", "x", "--shutdown-timeout", "-1"])
    with pytest.raises(ConfigError, match="--shutdown-timeout must be a number of seconds >= 0"):
        run(bad)


def test_serve_refuses_a_forge_api_key_set_but_empty(tmp_path, capsys, monkeypatch):
    """`--api-key ''` is refused, but FORGE_API_KEY="" (an `export FORGE_API_KEY=$KEY` with KEY
    unset) served every client with no key, in silence. Set but empty or blank, it is refused
    the same way, in one line, before the model loads (exit 2, no traceback); unset, it still
    means no key, and an --api-key given is the key whatever the variable holds."""
    from forge_ml.serve.cli import main

    missing = str(tmp_path / "no_such_ckpt")
    for empty in ("", "  ", "\t"):
        monkeypatch.setenv("FORGE_API_KEY", empty)
        assert main(["--ckpt", missing, "--port", "0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["forge-ml serve: error: FORGE_API_KEY is set but empty; expected the key "
                       "clients must send (unset the variable to serve without one)"], err
        # --api-key is the key: the variable is not read
        assert main(["--ckpt", missing, "--port", "0", "--api-key", "k"]) == 2
        assert "checkpoint not found" in capsys.readouterr().err
    monkeypatch.delenv("FORGE_API_KEY")
    assert main(["--ckpt", missing, "--port", "0"]) == 2          # past the key: the model
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint not found" in err[0], err
    # the command itself, as a shell runs it
    out = subprocess.run([sys.executable, "-m", "forge_ml.serve.cli", "--ckpt", missing,
                          "--port", "0"], env=dict(os.environ, FORGE_API_KEY=""),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        "forge-ml serve: error: FORGE_API_KEY is set but empty; expected the key clients must "
        "send (unset the variable to serve without one)"], out.stderr


def test_serve_refuses_a_model_whose_vocabulary_is_not_its_tokenizers(tmp_path):
    """A Hugging Face folder with its own 97-token vocabulary is read with GPT-2's tokenizer:
    serve refuses it at start, as sample does, instead of failing request by request."""
    from forge_ml.errors import ConfigError
    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2
    from forge_ml.serve.cli import _load

    cfg = {"vocab_size": 97, "block_size": 16, "n_layer": 1, "n_head": 1, "n_embd": 8}
    save_hf_gpt2(tmp_path / "small", cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    with pytest.raises(ConfigError, match="the model has 97 tokens but its tokenizer"):
        _load(str(tmp_path / "small"), "cpu", "float32")


def test_serve_names_its_flags_for_bad_slots_and_max_len(tmp_path):
    """--slots 0 and --max-len past the context said "BatchEngine: slots/max_len ..."; the
    command's own flags are named, with the model's context."""
    from forge_ml.checkpoint import save_checkpoint
    from forge_ml.errors import ConfigError
    from forge_ml.serve.cli import add_arguments, run

    cfg = GPT2Config(vocab_size=len(CHARS), block_size=32, n_layer=1, n_head=1, n_embd=8)
    save_checkpoint(tmp_path / "ckpt", GPT2.init(cfg).state_dict(),
                    {"config": cfg.to_dict(), "tokenizer": {"kind": "char", "chars": CHARS},
                     "step": 1})
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ConfigError, match=r"^--slots must be >= 1 .*got 0"):
        run(p.parse_args(["--ckpt", str(tmp_path / "ckpt"), "--slots", "0"]))
    with pytest.raises(ConfigError, match=r"^--max-len must be in 1\.\.32 \(the model's context\), got 100"):
        run(p.parse_args(["--ckpt", str(tmp_path / "ckpt"), "--max-len", "100"]))
    # `--api-key "$KEY"` with KEY unset served every client, in silence (a QA report)
    for empty in ("", "  "):
        with pytest.raises(ConfigError, match=r"^--api-key is empty; give the key clients must send"):
            run(p.parse_args(["--ckpt", str(tmp_path / "ckpt"), "--api-key", empty]))
        # `--model-name ""` served the folder's name, in silence (a QA report); were the check
        # gone, run() would go on to serve: the sockets fail the test instead of blocking it
        import forge_ml.serve.cli as serve_cli

        def no_serving(*a, **k):
            raise AssertionError("--model-name \"\" reached the server's sockets")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(serve_cli, "_listen_sockets", no_serving)
            with pytest.raises(ConfigError, match=r"^--model-name is empty; give the id"):
                run(p.parse_args(["--ckpt", str(tmp_path / "ckpt"), "--model-name", empty]))


# -- a Hugging Face tokenizer (kind "hf") ----------------------------------------------------


def metaspace_tokenizer():
    """An "hf" tokenizer that is not byte-level (a Metaspace BPE, as Llama-style tokenizers
    are): bos <s> (0), two eos ids (</s> 1 and <pad> 2, as a generation_config lists them)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from forge_ml.tokenizer import HFTokenizer, hf_tokenizer_spec

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(["Hello world, this is the test of a metaspace tokenizer; héllo again."] * 20,
                          trainers.BpeTrainer(vocab_size=90, special_tokens=["<s>", "</s>", "<pad>"],
                                              show_progress=False))
    spec = hf_tokenizer_spec(json.loads(t.to_str()), {"tokenizer_class": "PreTrainedTokenizerFast",
                                                      "bos_token": "<s>", "eos_token": "</s>"},
                             {"bos_token_id": 0, "eos_token_id": [1, 2]})
    return HFTokenizer(spec)


def test_an_hf_tokenizer_server_starts_from_bos_and_stops_on_its_eos_ids():
    """An empty prompt starts from the tokenizer's empty_prompt() (its bos token, as
    transformers' generate), not from the end-of-text id; every eos id stops, and none is text."""
    from forge_ml.serve.app import _Choice, _events

    tok = metaspace_tokenizer()
    assert tok.stop_tokens == (1, 2) and tok.empty_prompt() == [0]
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=1, n_embd=16)
    eng = BatchEngine(make_model(cfg, seed=0), tok, slots=2)
    seen = []
    submit = eng.submit

    def spy(ids, params):
        seen.append((list(ids), params.stop_tokens))
        return submit(ids, params)

    eng.submit = spy
    srv = Server(create_app(eng, "hf-tiny"))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as h:
            kw = dict(model="hf-tiny", max_tokens=6, temperature=0)
            got = complete(h, prompt="", **kw)["choices"][0]["text"]
            assert seen[-1] == ([0], (1, 2))
            assert got == complete(h, prompt=[0], **kw)["choices"][0]["text"]
            complete(h, prompt="", ignore_eos=True, **kw)
            assert seen[-1] == ([0], ())
    finally:
        srv.stop()
        eng.close()
    # the second eos id ends the choice with no text of its own
    req = parse_completion({"prompt": "a"})
    stream = Stream([5], SamplingParams())
    ids = tok.encode("this is")
    for t in ids:
        stream._push(TokenOut(t))
    stream._push(TokenOut(2, finish="stop"))

    async def run():
        return [x async for x in _events(_Choice(0, stream, tok, req, tok.stop_tokens), req)]

    events = asyncio.run(run())
    assert "".join(t for t, _, _ in events) == tok.decode([5] + ids)[len(tok.decode([5])):]
    assert "<pad>" not in "".join(t for t, _, _ in events) and events[-1][2] == "stop"


def test_a_tokenizer_that_is_not_byte_level_streams_its_spaces():
    """A Metaspace tokenizer's tokens decoded one by one lose their spaces ("▁is" alone is
    "is"); the stream gives the text decode gives, after the prompt's."""
    from forge_ml.serve.app import Detokenizer

    tok = metaspace_tokenizer()
    prompt, ids = tok.encode("Hello"), tok.encode("Hello world, this is a test")[1:]
    d = Detokenizer(tok, prompt)
    text = "".join(d.feed(t) for t in ids) + d.flush()
    assert text == tok.decode(prompt + ids)[len(tok.decode(prompt)):] and text.count(" ") >= 4


def test_a_second_ctrl_c_ends_requests_with_openai_errors_not_a_cut(tmp_path):
    """A second Ctrl-C during the grace period is uvicorn's "quit now": requests in flight got
    a plain-text 500, a stream cut without an error event or [DONE], and tracebacks in the log
    (a QA report). Now they end at once as the grace period's end ends them: a 503 with
    OpenAI's error body, an error event and [DONE]; exit 130, no traceback."""
    import signal
    from forge_ml.checkpoint import save_checkpoint

    cfg = GPT2Config(vocab_size=len(CHARS), block_size=1024, n_layer=4, n_head=4, n_embd=256)
    save_checkpoint(tmp_path / "ckpt", GPT2.init(cfg).state_dict(),
                    {"config": cfg.to_dict(), "tokenizer": {"kind": "char", "chars": CHARS},
                     "step": 1})
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "forge_ml.serve.cli", "--ckpt",
                             str(tmp_path / "ckpt"), "--port", str(port), "--slots", "2",
                             "--shutdown-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    got = {}
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.time() < deadline, "the server did not come up"
                time.sleep(0.1)
        body = dict(model="ckpt", prompt="a", max_tokens=1000, temperature=0)
        first = threading.Event()

        def streamed():
            with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True),
                              timeout=60) as r:
                got["stream"] = []
                for ln in r.iter_lines():
                    if ln:
                        got["stream"].append(ln)
                        first.set()

        def whole():
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            got["whole"] = (r.status_code, r.headers.get("content-type"), r.text)

        threads = [threading.Thread(target=streamed), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        assert first.wait(30)
        while httpx.get(url + "/health", timeout=5).json()["running"] < 2:   # both admitted
            assert time.time() < deadline + 60, "the requests did not start"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(30)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    status, ctype, text = got["whole"]
    assert status == 503 and ctype.startswith("application/json"), (status, text)
    assert "stopped at once" in json.loads(text)["error"]["message"]
    lines = got["stream"]
    assert lines[-1] == "data: [DONE]" and "stopped at once" in lines[-2], lines[-3:]
    assert len(lines) < 900                      # cut, not run to the end
    assert proc.returncode in (130, -2) and "Traceback" not in out, out


def test_a_stop_token_that_is_not_special_is_in_the_completion(tmp_path):
    """vLLM's rule: the text holds a stop token unless it is special. With "." (13) among the
    model's eos ids the completion ended before it ("Hi" where vLLM gives "Hi."); an
    <|endoftext|> stays out."""
    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2
    from forge_ml.inference import load_model

    cfg = dict(vocab_size=50257, block_size=16, n_layer=1, n_head=1, n_embd=4, tied_head=False)
    got = {}
    for stop_id in (13, 50256):
        params = {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()}
        params["ln_f.bias"][:] = 1.0
        params["lm_head.weight"][stop_id] = 1.0        # greedy: stop_id at once
        save_hf_gpt2(tmp_path / str(stop_id), cfg, params,
                     tokenizer={"kind": "gpt2", "eos_token_id": [50256, 13]})
        model, tok, _ = load_model(tmp_path / str(stop_id))
        eng = BatchEngine(model, tok, slots=2)
        srv = Server(create_app(eng, "m"))
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as h:
                whole = complete(h, model="m", prompt="Hi", max_tokens=4, temperature=0, logprobs=1)
                chunks = sse(h, model="m", prompt="Hi", max_tokens=4, temperature=0)
        finally:
            srv.stop()
            eng.close()
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == 1
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        got[stop_id] = (choice["text"], choice["logprobs"]["tokens"])
    assert got == {13: (".", ["."]), 50256: ("", [])}


def test_seed_plus_choice_index_wraps_at_two_to_the_64(client):
    """Choice j draws with seed + j: for seed -1 (2**64 - 1 unsigned) choice 1 is seed 0's,
    kept in the engine's [0, 2**64) (the engine now refuses 2**64, which drew as 0)."""
    kw = dict(model="tiny", prompt="a cat", max_tokens=8, temperature=1.0)
    r = client.completions.create(n=2, seed=-1, **kw)
    assert r.choices[1].text == client.completions.create(seed=0, **kw).choices[0].text


def test_clients_that_leave_mid_stream_leave_no_socket_warnings(server, caplog):
    """Streams of n=3 choices that clients leave after a few lines: the server wrote bursts of
    queued chunks, one write each, without letting its loop see the disconnect, and asyncio
    logged "socket.send() raised exception." for every write past the fifth to the closed
    connection (a QA run: 114 lines). The waiting chunks now go out in one write, and the loop
    runs between writes."""
    def leave(k):
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 55, "n": 3, "stream": True,
                "repetition_penalty": 0.3, "seed": k}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3 + k % 4:
                    break

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        for _ in range(4):
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(leave, range(8)))
        time.sleep(0.3)
    assert not [r for r in caplog.records if "socket.send" in r.getMessage()]
    with httpx.Client(base_url=server.url, timeout=30) as c:    # and it serves on
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "ab", "max_tokens": 2}).status_code == 200
