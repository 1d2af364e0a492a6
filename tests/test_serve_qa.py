"""A QA pass over ``forge-ml serve`` as a user of OpenAI's client and vLLM would use it: the
mends of what it found. ``--slots`` past the host's memory is refused at start-up (the server
took all the machine's free memory for 40 s and was killed, exit 137, without a word); an API
key given with spaces or a newline around it is the key clients send (none could match it);
a request body that is JSON but not an object, and a field's value, are named in JSON's words
("got NoneType" for a ``null``, "got True" for ``true``)."""
import json

import pytest
from starlette.testclient import TestClient

import forge_ml.errors
import forge_ml.inference.batch as batch
from forge_ml import flags
from forge_ml.errors import ConfigError
from forge_ml.inference.batch import BatchEngine, host_engine_bytes
from forge_ml.models.gpt2 import GPT2, GPT2Config
from forge_ml.serve.app import create_app
from forge_ml.tokenizer import CharTokenizer

from test_generate import make_model

CHARS = "abcdefghijklmnopqrstuvwxyz .,!?\n"
CFG = GPT2Config(vocab_size=len(CHARS), block_size=32, n_layer=1, n_head=1, n_embd=16)


class _Allocated(Exception):
    """Raised where the engine would allocate its slots' cache."""


@pytest.fixture
def no_allocation(monkeypatch):
    """The engine's step (its KV cache for every slot) is never built: reaching it raises
    ``_Allocated``, so a check that is missing fails the test instead of filling the host."""
    def step(*a, **k):
        raise _Allocated("the engine went on to allocate its slots")
    monkeypatch.setattr(batch, "DecodeStep", step)
    monkeypatch.setattr(forge_ml.errors, "host_available_bytes", lambda: 1 << 30)   # 1 GiB free


# -- 1. --slots past the host's memory -------------------------------------------------------


def test_slots_past_the_hosts_free_memory_are_refused_before_any_is_allocated(no_allocation):
    model = make_model(CFG, seed=1)
    need = host_engine_bytes(CFG, 1_000_000, 32)
    assert need > 1 << 30
    with pytest.raises(ConfigError) as e:
        BatchEngine(model, CharTokenizer(CHARS), slots=1_000_000)
    msg = str(e.value)
    assert msg.startswith("BatchEngine: 1,000,000 slots x a context of 32 tokens would hold "
                          f"about {need / 2 ** 30:,.1f} GiB on the CPU"), msg
    assert "than the 1.0 GiB this machine has free" in msg
    fit = (1 << 30) // (need // 1_000_000)
    assert f"use at most about {fit:,} slots (forge-ml serve --slots)" in msg
    assert "--max-len" in msg and "FORGE_HOST_MEMORY_CHECK=off" in msg
    # slots that fit go on to their step; so does any number with the check off
    with pytest.raises(_Allocated):
        BatchEngine(model, CharTokenizer(CHARS), slots=fit)
    with flags.override(FORGE_HOST_MEMORY_CHECK="off"), pytest.raises(_Allocated):
        BatchEngine(model, CharTokenizer(CHARS), slots=1_000_000)


def test_the_estimate_covers_the_cache_and_the_logits_of_every_slot():
    """The KV cache (two float32 n_embd vectors a layer and a position) and the rows of the
    padded vocabulary grow with the slots; a shorter context holds less."""
    cfg = GPT2Config(vocab_size=50257, block_size=128, n_layer=2, n_head=2, n_embd=64)
    kv = 2 * 2 * 128 * 64 * 4
    assert host_engine_bytes(cfg, 1, 128) >= kv + 4 * cfg.padded_vocab_size
    assert host_engine_bytes(cfg, 1000, 128) == 1000 * host_engine_bytes(cfg, 1, 128)
    assert host_engine_bytes(cfg, 8, 64) < host_engine_bytes(cfg, 8, 128)


def test_serve_with_too_many_slots_says_so_in_one_line(tmp_path, no_allocation, monkeypatch,
                                                      capsys):
    from forge_ml.checkpoint import save_checkpoint
    import forge_ml.serve.cli as serve_cli

    save_checkpoint(tmp_path / "ckpt", GPT2.init(CFG).state_dict(),
                    {"config": CFG.to_dict(), "tokenizer": {"kind": "char", "chars": CHARS},
                     "step": 1})

    def no_serving(*a, **k):
        raise AssertionError("the server started")
    monkeypatch.setattr(serve_cli, "_Server", no_serving)
    rc = serve_cli.main(["--ckpt", str(tmp_path / "ckpt"), "--slots", "1000000", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("forge-ml serve: error: BatchEngine: 1,000,000 slots x a context of "
                          "32 tokens") and "(forge-ml serve --slots)" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# -- 2. an API key with spaces around it -----------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    with BatchEngine(make_model(CFG, seed=3), CharTokenizer(CHARS), slots=2) as e:
        yield e


@pytest.mark.parametrize("key", [" k3y", "k3y ", "k3y\r\n", "\tk3y\n"])
def test_an_api_key_with_spaces_around_it_is_the_key_clients_send(engine, key):
    """``--api-key "$(cat key)"`` of a file with CRLF endings, a pasted key: the server compared
    the key as given with the header's value, which HTTP strips, so every client got 401
    (FORGE_API_KEY was stripped already)."""
    with TestClient(create_app(engine, "tiny", api_key=key)) as client:
        ok = client.get("/v1/models", headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200, ok.text
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k3"}).status_code == 401


@pytest.mark.parametrize("key", [" ", "\r\n"])
def test_a_blank_api_key_is_refused_not_taken_as_an_empty_one(engine, key):
    """Stripped, a blank key would be "" and let ``Authorization: Bearer`` in."""
    with pytest.raises(ConfigError, match="api_key is blank"):
        create_app(engine, "tiny", api_key=key)


# -- 3. a body that is JSON but not an object ------------------------------------------------


@pytest.mark.parametrize("body, said", [
    ("null", "got null"), ("[]", "got an array"), ('"prompt"', "got a string"),
    ("12", "got a number (12)"), ("true", "got true"),
])
def test_a_body_that_is_not_an_object_is_named_in_jsons_words(engine, body, said):
    with TestClient(create_app(engine, "tiny")) as client:
        r = client.post("/v1/completions", content=body.encode(),
                        headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == f"the request body must be a JSON object, {said}"
        ok = client.post("/v1/completions", content=json.dumps({"prompt": "ab", "max_tokens": 1}))
        assert ok.status_code == 200



# -- 4. a field's value named in JSON's words --------------------------------------------------


@pytest.mark.parametrize("body, said", [
    ('{"prompt": "a", "max_tokens": true}', "max_tokens must be an integer, got true"),
    ('{"prompt": "a", "stop": ["a", null]}',
     'stop must be a non-empty string or a list of them, got ["a", null]'),
    ('{"prompt": "a", "echo": "yes"}', 'echo must be true or false, got "yes"'),
    ('{"prompt": "a", "temperature": null, "top_p": [1]}', "top_p must be a number, got [1]"),
])
def test_a_fields_value_is_named_in_jsons_words(engine, body, said):
    """The client wrote JSON: ``true``, ``null`` and ``"yes"`` as it sent them (the messages
    said Python's ``True``, ``None`` and ``'yes'``)."""
    with TestClient(create_app(engine, "tiny")) as client:
        r = client.post("/v1/completions", content=body.encode(),
                        headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == said
