"""Session 30's mends of the server and the tokenizers: a request body that is not sent as
JSON gets 415 (it was read as JSON whatever its Content-Type), a Hugging Face folder's own
tokenizer is built once when it loads (it was built twice: for its spec, then as the
HFTokenizer), and a run of a million whitespace characters is a TokenizerError before
tiktoken sees it (tiktoken panicked, and printed Rust's panic text and backtrace on stderr
even where the panic was caught)."""
import json
import pickle
import types

import numpy as np
import pytest
from starlette.testclient import TestClient

from forge_ml.errors import TokenizerError
from forge_ml.inference.batch import BatchEngine
from forge_ml.models.gpt2 import GPT2Config
from forge_ml.serve.app import create_app
from forge_ml.tokenizer import CharTokenizer, GPT2Tokenizer

from test_generate import make_model

CHARS = "abcdefghijklmnopqrstuvwxyz .,!?\n"
BODY = json.dumps({"prompt": "ab", "max_tokens": 2, "temperature": 0})


# -- 1. Content-Type -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    tok = CharTokenizer(CHARS)
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=1, n_embd=16)
    with BatchEngine(make_model(cfg, seed=3), tok, slots=2) as engine:
        with TestClient(create_app(engine, "tiny")) as c:
            yield c


@pytest.mark.parametrize("ctype", [
    "text/plain",                                   # a browser's form-free cross-site POST
    "application/x-www-form-urlencoded",            # what curl -d sends
    "multipart/form-data; boundary=x",
    "text/json",
    "application/jsonp",
    "application/json; charset=utf-16",             # JSON over HTTP is UTF-8 (RFC 8259)
    "application/json; charset=latin-1",
    "",                                             # a header with nothing in it
])
def test_a_body_not_sent_as_json_gets_415_with_an_openai_error(client, ctype):
    r = client.post("/v1/completions", content=BODY.encode(), headers={"content-type": ctype})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] is None and err["code"] is None
    assert "Content-Type" in err["message"]
    if not ctype:
        assert "an empty Content-Type" in err["message"]
    elif "charset" in ctype:
        assert "UTF-8" in err["message"] and ctype in err["message"]
    else:
        assert "application/json" in err["message"] and repr(ctype) in err["message"]
    # and the server goes on serving
    assert client.post("/v1/completions", content=BODY.encode(),
                       headers={"content-type": "application/json"}).status_code == 200


@pytest.mark.parametrize("ctype", [
    "application/json", "Application/JSON", "application/json; charset=utf-8",
    "application/json;charset=UTF-8", 'application/json; charset="utf-8"', " application/json ",
    "application/json; charset=utf8; foo=bar", "application/vnd.api+json", None,   # None: no header
])
def test_json_with_its_parameters_in_any_case_is_served(client, ctype):
    """As FastAPI (vLLM's server): a +json type, and a body without the header
    (``requests.post(url, data=json.dumps(...))`` sends none), are read as JSON."""
    r = client.post("/v1/completions", content=BODY.encode(),
                    headers={} if ctype is None else {"content-type": ctype})
    if ctype is None:
        assert "content-type" not in r.request.headers
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert client.post("/v1/completions", json=json.loads(BODY)).status_code == 200   # json=: its type


def test_the_type_is_checked_before_the_body_is_read(client):
    """A body too big and of the wrong type: the type is said (the body is never read)."""
    r = client.post("/v1/completions", content=b"x" * (5 << 20), headers={"content-type": "text/plain"})
    assert r.status_code == 415, r.text


# -- 2. a Hugging Face folder's tokenizer, built once ----------------------------------------


def _counting_tokenizers(monkeypatch):
    """Count the tokenizers library's Tokenizer builds of forge_ml.tokenizer (``from_str``)."""
    import forge_ml.tokenizer as T
    tk = pytest.importorskip("tokenizers")
    built = []

    class Tokenizer:
        @staticmethod
        def from_str(text):
            built.append(len(text))
            return tk.Tokenizer.from_str(text)

    monkeypatch.setattr(T, "_tokenizers", lambda: types.SimpleNamespace(Tokenizer=Tokenizer,
                                                                        AddedToken=tk.AddedToken))
    return built


def _hf_folder(d):
    """A Hugging Face GPT-2 folder whose own byte-level BPE (not GPT-2's vocabulary) is in
    its tokenizer.json (kind "hf"), written without transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["First Citizen:\nBefore we proceed any further, hear me speak. héllo 🦜\n"] * 20,
                          trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = {"vocab_size": t.get_vocab_size(), "block_size": 32, "n_layer": 1, "n_head": 1, "n_embd": 8}
    rng = np.random.default_rng(0)
    save_hf_gpt2(d, cfg, {k: rng.normal(0, 0.2, s).astype(np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    (d / "tokenizer.json").write_text(t.to_str())
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "eos_token": "<|endoftext|>"}))
    return d


def test_a_hugging_face_folder_builds_its_tokenizer_once_at_serve_startup(tmp_path, monkeypatch):
    """forge-ml serve's load (load_model and the fit check) of a folder with its own
    tokenizer.json: one Tokenizer build (hf_tokenizer_spec's, which the HFTokenizer takes), where
    the HFTokenizer built a second one from the spec's JSON."""
    pytest.importorskip("tokenizers")
    from forge_ml.serve.cli import _load
    from forge_ml.tokenizer import HFTokenizer

    d = _hf_folder(tmp_path / "hf")
    built = _counting_tokenizers(monkeypatch)
    model, tok, meta = _load(str(d), "cpu", "float32")
    assert isinstance(tok, HFTokenizer) and meta["tokenizer"]["kind"] == "hf"
    assert len(built) == 1, built
    # the same tokenizer as one built afresh from the spec (a plain dict: nothing carried)
    fresh = HFTokenizer(dict(meta["tokenizer"]))
    assert len(built) == 2
    for text in ("First Citizen: héllo 🦜 speak<|endoftext|>further", "", "  two\n\n"):
        assert tok.encode(text) == fresh.encode(text)
        assert tok.decode(tok.encode(text)) == fresh.decode(fresh.encode(text))
    assert tok.stop_tokens == fresh.stop_tokens and tok.vocab_size == fresh.vocab_size == model.config.vocab_size


def test_the_spec_gives_its_built_tokenizer_once_and_only_unchanged(monkeypatch):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from forge_ml.tokenizer import HFTokenizer, hf_tokenizer_spec
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    built = _counting_tokenizers(monkeypatch)
    spec = hf_tokenizer_spec(json.loads(t.to_str()), {"tokenizer_class": "PreTrainedTokenizerFast"})
    assert len(built) == 1
    a = HFTokenizer(spec)
    assert len(built) == 1
    b = HFTokenizer(spec)                     # taken once: a second HFTokenizer has its own
    assert len(built) == 2 and a._tok is not b._tok
    spec = hf_tokenizer_spec(json.loads(t.to_str()), {"tokenizer_class": "PreTrainedTokenizerFast"})
    spec["tokenizer"]["added_tokens"] = [dict(id=0, content="<x>", single_word=False, lstrip=False, rstrip=False,
                                              normalized=False, special=True)]
    changed = HFTokenizer(spec)               # its JSON changed since: built from the JSON
    assert len(built) == 4 and changed.vocab_size == 1 and changed.is_special(0)
    # a copy or pickle of a spec is a plain dict, without the library's object
    spec = hf_tokenizer_spec(json.loads(t.to_str()), {"tokenizer_class": "PreTrainedTokenizerFast"})
    assert type(pickle.loads(pickle.dumps(spec))) is dict and pickle.loads(pickle.dumps(spec)) == spec
    assert json.loads(json.dumps(spec)) == spec


# -- 3. a million whitespace characters: no Rust panic ---------------------------------------


@pytest.mark.parametrize("text, run, at", [
    (" " * 1_000_000, 1_000_000, 0),
    ("a" + "\n" * 1_000_000 + "b", 1_000_000, 1),
    ("x" * 10 + " \t\n\u3000\xa0" * 200_001, 1_000_005, 10),    # any of Unicode's White_Space
])
def test_a_run_of_a_million_whitespace_characters_is_a_tokenizer_error_without_panic_text(capfd, text, run, at):
    """tiktoken's pattern overflows its regex stack on a run of more than 999,998 whitespace
    characters: a Rust panic, whose message and backtrace went to stderr even though
    GPT2Tokenizer caught it (as a TokenizerError); the run is now found first."""
    tok = GPT2Tokenizer()
    for encode in (tok.encode, tok.encode_array, lambda t: tok.encode(t, allowed_special=True)):
        with pytest.raises(TokenizerError, match=f"run of {run:,} whitespace characters "
                                                 f"\\(from character {at:,}\\)") as e:
            encode(text)
        assert "split such a text first" in str(e.value)
    err = capfd.readouterr().err
    assert "panicked" not in err and "backtrace" not in err, err[:300]


def test_the_longest_run_tiktoken_splits_is_still_encoded(capfd):
    tok = GPT2Tokenizer()
    text = "a" + " " * 999_998 + "b"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.encode_array(text).tolist() == ids
    # not whitespace to tiktoken (Python's isspace says it is): no overflow, no refusal
    assert len(tok.encode("\x1c" * 1_000_000)) > 0
    # a prefix space (add_prefix_space) makes a leading run of 999,998 newlines 999,999 long
    with pytest.raises(TokenizerError, match="more than 999,997"):
        GPT2Tokenizer(add_prefix_space=True).encode("\n" * 999_998 + "x")
    err = capfd.readouterr().err
    assert "panicked" not in err, err[:300]
