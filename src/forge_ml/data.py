"""Token data: llm.c token shards, corpus preparation and the batch loader.

Shard layout (llm.c's ``.bin``, version 1): a header of 256 little-endian int32, of which
``[0]`` is the magic 20240520, ``[1]`` the version 1 and ``[2]`` the token count N; then N
little-endian uint16 tokens. Nothing else follows.

Only version 1 is read: another version (or magic) in a header is a DataError naming the file,
never tokens read with the wrong width.

``prepare`` turns a text file into ``train.bin``, ``val.bin`` and ``tokenizer.json``.
``shard_folder`` finds the shards of a data folder: that layout, or llm.c's
(``dev/data/fineweb10B/fineweb_train_000001.bin ... fineweb_val_000000.bin``,
``tiny_shakespeare_train.bin``, ``tiny_shakespeare_val.bin``): the sorted ``*train*.bin`` are
the train shards and the sorted ``*val*.bin`` the val shards; without a ``tokenizer.json``
beside them they hold GPT-2 token ids, as llm.c's do.
``DataLoader`` memory-maps shards and draws random windows from a seeded PCG64 generator whose
state goes into checkpoints, so a resumed run sees exactly the batches it would have seen.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> write_shard(os.path.join(d, "a.bin"), [5, 6, 7])
>>> read_shard(os.path.join(d, "a.bin")).tolist()
[5, 6, 7]
"""
from __future__ import annotations

import glob
import itertools
import json
import math
import mmap
import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .checkpoint import safe_target, user_umask
from .runs import cannot_write
from .errors import CLI_WORDS, DataError, check_host_memory, plural

SHARD_MAGIC = 20240520
LLAMA3_MAGIC = 20240801   # llm.c's llama-3 shards (uint32 tokens), which forge-ml does not read
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
_TOKEN_DTYPE = np.dtype("<u2")


class DataWriteError(DataError, OSError):
    """A shard or tokenizer file could not be written (full disk, read-only or forbidden
    folder): a DataError whose message names the file and the cause, and an OSError whose
    ``errno`` is the cause's: ``except DataError`` and ``except OSError`` both catch it.

    >>> issubclass(DataWriteError, DataError), issubclass(DataWriteError, OSError)
    (True, True)
    """

    @classmethod
    def of(cls, path, e: OSError) -> "DataWriteError":
        """The error for ``e``, raised writing ``path``: its message names both, its errno is e's.

        >>> DataWriteError.of("out/train.bin", PermissionError(13, "Permission denied")).errno
        13
        """
        err = cls(cannot_write(path, e))
        err.errno = e.errno
        return err


def _atomic_write_bytes(path: Path, chunks) -> None:
    """Write ``chunks`` (bytes-like objects) to a temporary file next to ``path``, fsync it and
    rename it over ``path``: readers see the old file or the new one, never half of one.

    The file gets the user's umask (``mkstemp`` alone makes it 0600). A ``path`` that exists
    and is not a regular file (a device such as ``/dev/full``, a folder) is refused rather
    than replaced, and a failed write (full disk, read-only or forbidden folder) is a
    DataError naming the file and the cause; the old file, if any, is kept.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.bin"); _atomic_write_bytes(p, [b"xy"])
    >>> oct(os.stat(p).st_mode & 0o777) == oct(0o666 & ~user_umask())
    True
    """
    _atomic_write_files([(path, chunks)])


def _atomic_write_files(files) -> None:
    """``_atomic_write_bytes`` for several files that belong together (``files``: pairs of a
    path and its chunks): every file is written to its temporary name first, and only when
    all are written are they renamed into place, so a full disk leaves the old set whole
    rather than new files beside old ones. The last file of the set (``write_prepared``'s
    tokenizer.json, which makes a folder a prepared one) is removed before the first rename
    and renamed into place last: a kill or Ctrl-C between two renames leaves new shards
    without it (a folder that readers refuse), never beside the old tokenizer.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> _atomic_write_files([(os.path.join(d, "a"), [b"1"]), (os.path.join(d, "b"), [b"2"])])
    >>> sorted(os.listdir(d))
    ['a', 'b']
    """
    files = [(safe_target(path, DataError), chunks) for path, chunks in files]
    done = []  # (temporary name, path) of the files written
    made = []  # the paths renamed into place where no file was before
    path = None
    try:
        for path, chunks in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            done.append((tmp, path))
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o666 & ~user_umask())
            with os.fdopen(fd, "wb") as f:
                for c in chunks:
                    f.write(c)
                f.flush()
                os.fsync(f.fileno())
        if len(done) > 1 and done[-1][1].exists():
            done[-1][1].unlink()
        for tmp, path in done:
            fresh = not path.exists()
            os.replace(tmp, path)
            if fresh:
                made.append(path)
    except BaseException as e:
        for tmp, _ in done:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        # a rename that failed after others (a full disk, a kill's signal): the files this
        # call made where there were none go again, so no set is left half new
        for p in made:
            try:
                p.unlink()
            except OSError:
                pass
        if isinstance(e, OSError):
            raise DataWriteError.of(path, e) from e
        raise


# ---------------------------------------------------------------------------------------------
# Shards


def write_shard(path, tokens) -> None:
    """Write ``tokens`` (ints in [0, 65536)) as an llm.c shard, atomically.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.bin")
    >>> write_shard(p, [1, 2, 3]); os.path.getsize(p)
    1030
    """
    _atomic_write_bytes(Path(path), _shard_bytes(path, tokens))


def _shard_bytes(path, tokens) -> list:
    """The header and the tokens of a shard, as the chunks ``write_shard`` writes (``path``
    names the file in errors)."""
    if not hasattr(tokens, "__len__") and hasattr(tokens, "__iter__"):   # a generator of ids
        tokens = list(tokens)
    arr = np.asarray(tokens)
    if arr.ndim != 1:   # (None or 5 was a TypeError from list())
        raise DataError(f"write_shard: tokens must be a 1-D sequence of integer ids, got "
                        f"{type(tokens).__name__} of shape {arr.shape} for {path}")
    if arr.size >= 2**31:   # the header's count is an int32 (llm.c asserts the same)
        raise DataError(f"write_shard: {arr.size:,} tokens do not fit one shard (its header counts "
                        f"them in an int32: fewer than 2,147,483,648); split them over several "
                        f"shards for {path}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"write_shard: tokens must be integers, got dtype {arr.dtype} for {path}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= 65536:
            bad = lo if lo < 0 else hi
            where = int(np.argmax(arr == bad))
            raise DataError(
                f"write_shard: token {bad} at position {where} does not fit the shard's uint16; "
                f"expected 0 <= token < 65536 (a vocabulary this large needs another format) for {path}"
            )
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, arr.size
    return [header.tobytes(), np.ascontiguousarray(arr, dtype=_TOKEN_DTYPE).tobytes()]   # (one copy)


def read_shard(path) -> np.ndarray:
    """Memory-map the tokens of an llm.c shard (read-only uint16), after checking its header.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.bin"); write_shard(p, [9, 8])
    >>> read_shard(p).dtype, len(read_shard(p))
    (dtype('uint16'), 2)
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a token shard (a .bin file); give the shards in "
                        f"it, e.g. {path / '*train*.bin'}")
    if not path.exists():
        raise DataError(f"token shard not found: {path}")
    if not path.is_file():   # (a FIFO or a device was "not found")
        raise DataError(f"expected a token shard (a .bin file), but {path} is a special file "
                        f"(a pipe or a device): a shard is read by memory-mapping a file")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(
            f"token shard {path} is {size} {plural(size, 'byte')}, shorter than the {HEADER_BYTES}-byte header; "
            f"the file is truncated or not a shard"
        )
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    magic, version, n = int(header[0]), int(header[1]), int(header[2])
    if magic == LLAMA3_MAGIC:
        raise DataError(f"{path} is one of llm.c's llama-3 shards (magic {LLAMA3_MAGIC}, uint32 tokens), "
                        f"which forge-ml does not read; it reads GPT-2's (magic {SHARD_MAGIC}, uint16)")
    if magic != SHARD_MAGIC:
        raise DataError(f"{path} is not a token shard: expected magic {SHARD_MAGIC} in its first 4 bytes "
                        f"(llm.c's .bin format, which forge-ml prepare writes), got {magic}; nanoGPT's "
                        f"prepare.py writes raw uint16 ids without that header: the README's 'Coming from "
                        f"nanoGPT' shows how to write them as shards")
    if version != SHARD_VERSION:
        raise DataError(
            f"expected shard version {SHARD_VERSION} (uint16 tokens), got {version} in file {path}"
        )
    body = size - HEADER_BYTES
    if n < 0 or body != 2 * n:
        held = f"{body // 2} {plural(body // 2, 'token')}" + (" and a stray byte" if body % 2 else "")
        raise DataError(f"header says {n} {plural(n, 'token')} but file holds {held}: {path}")
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=_TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n,))


# ---------------------------------------------------------------------------------------------
# Text


def is_shard_file(path) -> bool:
    """Whether ``path`` is a regular file (never a FIFO, which would block) that starts with an
    llm.c shard's magic (one named otherwise than ``*.bin`` too).

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "s.dat"); write_shard(p, [1, 2])
    >>> is_shard_file(p), is_shard_file(os.path.dirname(p))
    (True, False)
    """
    path = Path(path)
    if not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            return int.from_bytes(f.read(4), "little", signed=True) == SHARD_MAGIC
    except OSError:
        return False


def _nul_padded(head: bytes, width: int) -> Optional[str]:
    """Which byte order (``"le"``, ``"be"``) ``head`` reads in as UTF-16 (``width`` 2) or UTF-32
    (``width`` 4) text of (mostly) ASCII characters, or None: NULs in all bytes of each
    ``width``-byte unit but one, printable characters or whitespace in that one, and half of
    those lowercase letters or spaces, as prose has (raw uint16 token ids have NULs beside bytes
    of any value; a character vocabulary's ids, below 128, fall mostly on punctuation and
    capitals).

    >>> _nul_padded("hello\\n".encode("utf-16-le"), 2), _nul_padded(bytes([7, 0, 200, 0, 3, 1]), 2)
    ('le', None)
    >>> _nul_padded("hello\\n".encode("utf-32-be"), 4), _nul_padded("hello\\n".encode("utf-32-le"), 2)
    ('be', None)
    """
    head = head[:len(head) // width * width]
    if len(head) < 2 * width:
        return None
    for order, at in (("le", 0), ("be", width - 1)):
        chars = head[at::width]
        zeros = [b for i in range(width) if i != at for b in head[i::width]]
        if zeros.count(0) >= 0.9 * len(zeros):
            printable = sum(32 <= c < 127 or c in (9, 10, 13) for c in chars)
            prose = sum(97 <= c <= 122 or c == 32 for c in chars)
            if printable >= 0.9 * len(chars) and prose >= 0.5 * len(chars):
                return order
    return None


def _wide_unicode(raw: bytes) -> Optional[tuple]:
    """``(name, iconv's name for it, what shows it)`` where ``raw`` is UTF-32 or UTF-16 text,
    else None: a byte-order mark, or ASCII characters padded with NULs (three a character in
    UTF-32, one in UTF-16). Without a mark, iconv's name says the byte order, which iconv
    would otherwise take as the machine's.

    >>> _wide_unicode("hi there\\n".encode("utf-32"))[:2], _wide_unicode("hi there\\n".encode("utf-16-be"))[:2]
    (('UTF-32', 'utf-32'), ('UTF-16', 'utf-16be'))
    """
    if raw[:4] in (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff"):
        return "UTF-32", "utf-32", "it starts with a UTF-32 byte-order mark"
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return "UTF-16", "utf-16", "it starts with a UTF-16 byte-order mark"
    for width, name, pattern in ((4, "UTF-32", "three NULs beside each ASCII character"),
                                 (2, "UTF-16", "a NUL every other byte")):
        order = _nul_padded(raw, width)
        if order:
            return name, f"{name.lower()}{order}", pattern
    return None


def _iconv_hint(path: Path, from_encoding: str) -> str:
    """An iconv command that converts ``path`` (as the user gave it, quoted for a shell) to
    UTF-8 in a file beside it.

    >>> _iconv_hint(Path("enc/my file.txt"), "latin1")
    "iconv -f latin1 -t utf-8 'enc/my file.txt' > 'enc/my file-utf8.txt'"
    """
    out = path.with_name(f"{path.stem}-utf8{path.suffix}")
    return f"iconv -f {from_encoding} -t utf-8 {shlex.quote(str(path))} > {shlex.quote(str(out))}"


def load_text(path) -> str:
    """The UTF-8 text of a file, with a DataError that says what went wrong. A UTF-8
    byte-order mark at its start is not text (as Python's utf-8-sig reads it): it is dropped.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.txt"); _ = open(p, "w").write("hi")
    >>> load_text(p)
    'hi'
    """
    path = Path(path)
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative to the current folder, {Path.cwd()})"
        raise DataError(f"text file not found: {path}{where}")
    if not path.is_file():
        raise DataError(f"expected a text file, but {path} is a directory or special file")
    raw = path.read_bytes()
    # a UTF-8 byte-order mark (Notepad's) is not a character of the text: skipped, without a
    # copy of the file's bytes
    start = 3 if raw[:3] == b"\xef\xbb\xbf" else 0
    if raw[start:start + 4] == SHARD_MAGIC.to_bytes(4, "little"):
        raise DataError(f"{path} is an llm.c token shard, not a text file; give the folder that holds the "
                        f"train and val shards")
    wide = _wide_unicode(raw[start:start + 4000]) if path.suffix != ".bin" else None
    if wide:
        # UTF-16 (a Windows editor's "Unicode") or UTF-32: NULs beside each ASCII character,
        # which the check for token ids below would take for ids
        name, iconv_name, why = wide
        raise DataError(f"{path} looks like {name} text ({why}), not UTF-8; convert it first, e.g. "
                        f"{_iconv_hint(path, iconv_name)}")
    nul = raw.count(0)
    if nul and (path.suffix == ".bin" or nul * 100 > len(raw)):
        # nanoGPT's prepare.py writes raw uint16 ids (no header): as UTF-8 they often decode,
        # and a run trained on their bytes as characters, in silence
        _refuse_binary(path, raw[start:start + 4096])   # a program, an archive: said as such
        raise DataError(f"{path} holds binary data, not text ({nul:,} NUL {plural(nul, 'byte')}): token "
                        f"ids? nanoGPT's train.bin and val.bin are raw uint16 ids without llm.c's header: "
                        f"write them as shards with forge_ml.data.write_shard (the README shows how), or "
                        f"give the text file")
    try:
        return str(memoryview(raw)[start:], "utf-8")
    except UnicodeDecodeError as e:
        _refuse_binary(path, raw[start:start + 4096])
        raise DataError(
            f"{path} is not UTF-8: byte 0x{raw[start + e.start]:02x} at offset {start + e.start} ({e.reason}); "
            f"convert it first, e.g. {_iconv_hint(path, 'latin1')}"
        ) from None


# the first bytes of files that are not text: what to call them, and what to do instead
_TEXT = "give a UTF-8 text file"
_MAGIC = ((b"\x7fELF", "a program (ELF)", _TEXT), (b"MZ", "a Windows program", _TEXT, True),
          (b"PK\x03\x04", "a zip archive (a .zip, an office document or a PyTorch checkpoint)", _TEXT),
          (b"\x1f\x8b", "gzip-compressed", "decompress it first: gzip -dc {path} > {out}"),
          (b"BZh", "bzip2-compressed", "decompress it first: bzip2 -dc {path} > {out}", True),
          (b"\xfd7zXZ\x00", "xz-compressed", "decompress it first: xz -dc {path} > {out}"),
          (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first: zstd -dc {path} > {out}"),
          (b"%PDF-", "a PDF", "extract its text first (e.g. pdftotext {path} {out})"),
          (b"\x89PNG", "a PNG image", _TEXT), (b"\xff\xd8\xff", "a JPEG image", _TEXT),
          (b"\x93NUMPY", "a NumPy array (.npy)",
           "give a UTF-8 text file (token ids are written as shards with forge_ml.data.write_shard)"))


def _refuse_binary(path, head: bytes) -> None:
    """A DataError naming what ``path`` is where its first bytes (``head``, up to 4 KB) are a
    known binary kind's; asked only of a file that is not text already (NUL bytes, or not
    UTF-8), so that a text that happens to begin "MZ" or "%PDF" is read. A ``.bin`` file is
    left to the token-id message (nanoGPT's ids can begin like a pickle), and a magic of two
    or three letters ("MZ", "BZh") counts only with a NUL byte in ``head`` (a Latin-1 text
    may begin so)."""
    p = Path(path)
    if p.suffix == ".bin":
        return
    binary = _binary_kind(head[:16])
    if binary is None or (binary[2] and 0 not in head):
        return
    # the text beside it: a compressed suffix dropped, a PDF's made .txt, else .txt added
    out = (p.with_suffix("") if p.suffix in (".gz", ".bz2", ".xz", ".zst", ".tgz")
           else p.with_suffix(".txt") if p.suffix == ".pdf" else p.with_name(p.name + ".txt"))
    advice = binary[1].format(path=shlex.quote(str(p)), out=shlex.quote(str(out)))
    raise DataError(f"{path} is {binary[0]}, not text; {advice}")


def _binary_kind(head: bytes):
    """``(what, advice, weak)`` for a file starting with ``head`` when it is a known kind of
    binary file (a program, an archive, compressed, a PDF, an image, a NumPy array, a pickle,
    safetensors), else None; ``advice`` may hold ``{path}``; ``weak``: a magic a text may begin
    with.

    >>> _binary_kind(b"\x7fELF\x02\x01"), _binary_kind(b"hello")
    (('a program (ELF)', 'give a UTF-8 text file', False), None)
    """
    for magic, kind, advice, *weak in _MAGIC:
        if head.startswith(magic):
            return kind, advice, bool(weak)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a Python pickle (a PyTorch or NumPy file?)", _TEXT, False
    if len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 1 << 27:
        return "a safetensors file (model weights)", ("give a UTF-8 text file (forge-ml convert "
                                                      "--from-hf takes a Hugging Face folder)"), False
    return None


def default_corpus(max_bytes: int = 3_000_000) -> str:
    """A corpus every machine has without a download: the standard library's own ``*.py``
    files, in sorted order, concatenated until ``max_bytes`` of source have been taken.

    The text depends only on the Python installation, so it is reproducible on one machine.

    >>> len(default_corpus(10_000)) > 1000
    True
    """
    stdlib = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    parts: list[str] = []
    total = 0
    for f in files:
        try:
            src = Path(f).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(f"# ---- {os.path.basename(f)} ----\n{src}\n")
        total += len(parts[-1])
        if total >= max_bytes:
            break
    if not parts:
        raise DataError(
            f"default_corpus: no readable *.py files in the standard library folder {stdlib}; "
            f"give a text file instead"
        )
    return "".join(parts)


def prepare(text_path, out_dir, tokenizer="char", val_fraction: float = 0.1) -> dict:
    """Tokenize a text file into ``train.bin``, ``val.bin`` (the last ``val_fraction`` of the
    tokens) and ``tokenizer.json`` in ``out_dir``; returns the counts.

    ``tokenizer`` is "char", "gpt2" or a tokenizer object.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "t.txt"); _ = open(p, "w").write("abcd" * 5)
    >>> prepare(p, d)["train_tokens"]
    18
    """
    from .tokenizer import load_tokenizer

    _check_val_fraction(val_fraction, "prepare")
    out = Path(out_dir)
    if not str(out_dir).strip() or (out.exists() and not out.is_dir()):
        what = "is empty" if not str(out_dir).strip() else "exists and is not a folder"
        raise DataError(f"prepare: out_dir {str(out_dir)!r} {what}; expected the folder to write the shards in")
    name = "--out" if CLI_WORDS.get() else "out_dir"
    # a link to nothing (a folder on a disk not mounted) in the way: said before tokenizing,
    # where mkdir's "cannot write data: File exists (EEXIST)" came after it
    dangling = next((p for p in (out, *out.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is not None:
        raise DataError(f"prepare: {name} {str(out_dir)!r} cannot be made: {dangling} is a link "
                        f"to {os.readlink(dangling)}, which does not exist; expected the folder to "
                        f"write the shards in (make the link's target, or give another folder)")
    above = next((p for p in out.parents if p.exists()), None)   # the folder that out would be made in
    if above is not None and not above.is_dir():
        raise DataError(f"prepare: {name} {str(out_dir)!r} cannot be made: {above} is a file, not a folder; "
                        f"expected the folder to write the shards in")
    _check_prepare_memory(text_path)
    text = load_text(text_path)
    if not text:
        raise DataError(f"prepare: {text_path} is empty")
    tok = load_tokenizer(tokenizer, text=text)
    _check_shard_vocab(tok, f"prepare: {text_path}")   # before tokenizing it all
    train, val = split_windows(encode_array(tok, text), val_fraction, f"prepare: {text_path}")
    return write_prepared(out_dir, train, val, tok)   # (the split checked before any write)


def _check_shard_vocab(tok, source: str) -> None:
    """A DataError naming ``source`` when ``tok`` has more ids than a shard's uint16 holds (a
    char alphabet of more than 65,536 characters), with the way out: GPT-2's BPE.

    >>> from forge_ml.tokenizer import CharTokenizer
    >>> _check_shard_vocab(CharTokenizer("ab"), "prepare: t.txt")
    """
    n = tok.vocab_size
    if n <= 65536:
        return
    each = " (one a character of the text)" if tok.kind == "char" else ""
    flag = "--tokenizer gpt2" if CLI_WORDS.get() else "tokenizer='gpt2'"
    way = f"; tokenize it with GPT-2's BPE ({flag}) instead" if tok.kind == "char" else ""
    raise DataError(f"{source}: the {tok.kind} tokenizer has {n:,} ids{each}, but a shard holds "
                    f"uint16 ids: at most 65,536{way}")


PREPARE_BYTES_PER_TEXT_BYTE = 10   # prepare's peak memory over its text's size (see below)


def _check_prepare_memory(text_path) -> None:
    """Refuse a text whose tokenizing cannot fit the host's free memory, before it is read:
    ``prepare`` holds the text, its ids and their shards at once, about 9x the text's size in
    peak RSS with the char tokenizer and 8x with GPT-2's (a 14.7 MB text, 2026-12-07), and a
    text of many gigabytes was read until Linux killed the process without a word. Nothing
    where the file's size is not known (not a regular file: load_text says why)."""
    try:
        size = os.stat(text_path).st_size if os.path.isfile(text_path) else 0
    except (OSError, TypeError, ValueError):
        return
    check_host_memory(
        "prepare", f"tokenizing {text_path} ({size / 2 ** 20:,.0f} MiB of text)",
        PREPARE_BYTES_PER_TEXT_BYTE * size,
        "split the text into smaller files and prepare them one at a time")


def _fraction_word() -> str:
    """``val_fraction`` as errors name it: ``--val-fraction`` where the command line runs."""
    return "--val-fraction" if CLI_WORDS.get() else "val_fraction"


MIN_SPLIT_TOKENS = 2   # a window of 1 token and its next-token target: what eval and training read


def split_windows(ids, val_fraction: float, source: str) -> tuple:
    """``split_tokens``' ``(train, val)`` for training and evaluation: each part first held to
    ``MIN_SPLIT_TOKENS`` (a DataError naming ``source`` says what each part got, what it needs
    and the ``val_fraction`` that gives it; ``split_tokens`` alone asks only 1 token each).

    >>> [len(a) for a in split_windows(range(20), 0.1, "t.txt")]
    [18, 2]
    """
    ids = np.asarray(ids)
    n_val = _val_count(ids.size, val_fraction)
    _check_windows(ids.size - n_val, n_val, val_fraction, source)
    return split_tokens(ids, val_fraction, source, fraction=_fraction_word())


def _check_windows(n_train: int, n_val: int, val_fraction: float, source: str) -> None:
    """A DataError when the train or val part of a split holds fewer than ``MIN_SPLIT_TOKENS``
    tokens (eval and a run's evaluation refused such a val.bin later), saying what the part
    got, what is needed and the ``val_fraction`` that gives it.

    >>> _check_windows(18, 1, 0.1, "prepare: t.txt")
    Traceback (most recent call last):
    ...
    forge_ml.errors.DataError: prepare: t.txt gives 19 tokens; with val_fraction 0.1 the val split gets 1 token, \
but evaluation needs at least 2 (a window of 1 token and its next-token target); give a larger val_fraction \
(at least 0.106) or more text
    """
    need, n, fr = MIN_SPLIT_TOKENS, n_train + n_val, _fraction_word()
    if n_train >= need and n_val >= need:
        return
    head = f"{source} gives {n:,} {plural(n, 'token')}; with {fr} {val_fraction:.15g} "
    why = f"at least {need} (a window of 1 token and its next-token target)"
    if n < 2 * need:
        raise DataError(head + f"the split gets {n_train} train and {n_val} val {plural(n_val, 'token')}, but each "
                        f"needs {why}; give more text (at least {2 * need} tokens)")
    if n_val < need:   # the smallest fraction (3 digits, rounded up) whose floor gives ``need``
        f = math.ceil(need / n * 1000) / 1000
        while math.floor(round(n * f, 6)) < need:
            f += 0.001
        raise DataError(head + f"the val split gets {n_val} {plural(n_val, 'token')}, but evaluation needs "
                        f"{why}; give a larger {fr} (at least {f:.3g}) or more text")
    f = math.floor((n - need) / n * 1000) / 1000   # the largest that leaves ``need`` for train
    raise DataError(head + f"the train split gets {n_train} {plural(n_train, 'token')}, but training needs "
                    f"{why}; give a smaller {fr} (at most {f:.3g}) or more text")


def file_fingerprint(path, chunk: int = 1 << 20) -> dict:
    """``{"size", "sha256"}`` of the file ``path`` (its bytes, read in chunks: a few hundred MB
    take a second or two), which a run records of the text it was prepared from, so that a
    resume can say when that text has changed since.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "t.txt"); _ = open(p, "w").write("ab")
    >>> file_fingerprint(p)["size"], file_fingerprint(p)["sha256"][:12]
    (2, 'fb8e20fc2e4c')
    """
    import hashlib
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def encode_array(tok, text: str) -> np.ndarray:
    """``tok``'s ids of ``text`` as an integer array: its ``encode_array`` (4 bytes a token)
    where it has one, else its ``encode`` list as int64.

    >>> from forge_ml.tokenizer import CharTokenizer
    >>> encode_array(CharTokenizer("ab"), "ba").tolist()
    [1, 0]
    """
    fn = getattr(tok, "encode_array", None)
    return fn(text) if fn is not None else np.asarray(tok.encode(text), np.int64)


def _check_val_fraction(v, who: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not 0.0 < v < 1.0:
        raise DataError(f"{who}: val_fraction must be a number in (0, 1), got {v!r}")


def _val_count(n: int, val_fraction: float) -> int:
    """How many of ``n`` tokens ``split_tokens`` gives to val: the floor of ``n * val_fraction``,
    where the float product may land just under a whole number (100 * 0.29 =
    28.999999999999996 gave 28 val tokens, not 29).

    >>> _val_count(100, 0.29), _val_count(19, 0.1)
    (29, 1)
    """
    return math.floor(round(n * val_fraction, 6))


def split_tokens(ids, val_fraction: float, source="the text", fraction="val_fraction") -> tuple:
    """``(train, val)``: ``ids`` (an integer array keeps its dtype, anything else becomes
    int64), the last ``val_fraction`` of them for validation;
    a DataError naming ``source`` when either part would be empty (``fraction``: how it names
    the fraction, e.g. forge-ml train's ``--val-fraction``).

    >>> [len(a) for a in split_tokens(range(20), 0.1)], [len(a) for a in split_tokens(range(100), 0.29)]
    ([18, 2], [71, 29])
    """
    _check_val_fraction(val_fraction, "split_tokens")
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" or ids.dtype == np.uint64:   # an integer array keeps its width
        ids = np.asarray(ids, dtype=np.int64)
    n = ids.size
    n_val = _val_count(n, val_fraction)
    n_train = n - n_val
    if n_val < 1 or n_train < 1:
        raise DataError(
            f"{source} gives {n:,} {plural(n, 'token')}; with {fraction} {val_fraction:.15g} that leaves "
            f"{n_train} for train and {n_val} for val; expected at least 1 each"
        )
    return ids[:n_train], ids[n_train:]


def write_prepared(out_dir, train, val, tok) -> dict:
    """Write the token ids ``train`` and ``val`` as ``train.bin`` and ``val.bin`` and ``tok`` as
    ``tokenizer.json`` in ``out_dir``; returns what ``prepare`` returns. The three are written
    together (``_atomic_write_files``): a failed write keeps the earlier set as it was, never
    a new ``train.bin`` beside an old ``tokenizer.json``.

    >>> import tempfile, os
    >>> from forge_ml.tokenizer import CharTokenizer
    >>> d = tempfile.mkdtemp(); r = write_prepared(d, [0, 1, 1], [1, 0], CharTokenizer("ab"))
    >>> r["train_tokens"], r["val_tokens"], r["tokenizer"], sorted(os.listdir(d))
    (3, 2, 'char', ['tokenizer.json', 'train.bin', 'val.bin'])
    """
    out = Path(out_dir)
    _check_shard_vocab(tok, f"the shards for {out}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataWriteError.of(out, e) from None
    _atomic_write_files([(out / "train.bin", _shard_bytes(out / "train.bin", train)),
                         (out / "val.bin", _shard_bytes(out / "val.bin", val)),
                         (out / "tokenizer.json", [json.dumps(tok.to_dict(), indent=1).encode("utf-8")])])
    return {
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "vocab_size": int(tok.vocab_size),
        "tokenizer": tok.to_dict()["kind"],
        "train_path": str(out / "train.bin"),
        "val_path": str(out / "val.bin"),
        "tokenizer_path": str(out / "tokenizer.json"),
    }


# ---------------------------------------------------------------------------------------------
# Data folders

PREPARED_FILES = ("train.bin", "val.bin", "tokenizer.json")   # what ``prepare`` writes
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class ShardFolder:
    """The shards of a data folder (``shard_folder``): ``train`` and ``val`` (sorted paths),
    ``tokenizer`` (``folder/tokenizer.json``, or None: the shards hold GPT-2 ids, as llm.c's
    do) and ``prepared`` (the folder is ``prepare``'s train.bin, val.bin and tokenizer.json).

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); write_shard(os.path.join(d, "a_train.bin"), [1, 2])
    >>> write_shard(os.path.join(d, "a_val.bin"), [3])
    >>> f = shard_folder(d); [p.name for p in f.train], f.tokenizer, f.prepared
    (['a_train.bin'], None, False)
    """
    folder: Path
    train: list
    val: list
    tokenizer: Optional[Path]
    prepared: bool

    def fingerprint(self) -> dict:
        """The shards' file names and sizes (what a checkpoint records, so that a resumed run can
        tell that it sees the same shards).

        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); write_shard(os.path.join(d, "a_train.bin"), [1, 2])
        >>> write_shard(os.path.join(d, "a_val.bin"), [3])
        >>> shard_folder(d).fingerprint()
        {'train': [['a_train.bin', 1028]], 'val': [['a_val.bin', 1026]]}
        """
        return {k: [[p.name, p.stat().st_size] for p in getattr(self, k)] for k in ("train", "val")}


def shard_folder(folder, need=("train", "val")) -> ShardFolder:
    """The shards of ``folder``: ``prepare``'s ``train.bin``, ``val.bin`` and
    ``tokenizer.json`` when it holds all three; else llm.c's layout, the sorted ``*train*.bin``
    files for training and the sorted ``*val*.bin`` files for validation, with
    ``tokenizer.json`` if the folder has one (None: GPT-2 token ids). A folder with no train
    or no val shard (of those ``need`` names: evaluation needs only "val") is a DataError
    saying what it holds and what was expected. The shards' headers are not read here
    (``read_shard`` checks them).

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> for n in ("x_train_000002.bin", "x_train_000001.bin", "x_val_000000.bin"):
    ...     write_shard(os.path.join(d, n), range(10))
    >>> f = shard_folder(d); [p.name for p in f.train], [p.name for p in f.val], f.tokenizer
    (['x_train_000001.bin', 'x_train_000002.bin'], ['x_val_000000.bin'], None)
    """
    d = Path(folder)
    if not d.is_dir():
        raise DataError(f"data folder not found: {d}")
    if all((d / f).is_file() for f in PREPARED_FILES):
        return ShardFolder(d, [d / "train.bin"], [d / "val.bin"], d / TOKENIZER_FILE, True)
    train = sorted(p for p in d.glob("*train*.bin") if p.is_file())
    val = sorted(p for p in d.glob("*val*.bin") if p.is_file())
    both = sorted(set(p.name for p in train) & set(p.name for p in val))
    if both:
        raise DataError(f"data folder {d}: {', '.join(both)} match both *train*.bin and *val*.bin; "
                        f"rename them so that each shard is a train or a val shard")
    lacking = [w for w, got in (("train", train), ("val", val)) if w in need and not got]
    if lacking:
        try:
            names = sorted(os.listdir(d))
        except OSError as e:
            raise DataError(f"data folder {d}: cannot list it: {e.strerror or e}") from None
        held = ", ".join(names[:12]) + (f", ... ({len(names)} entries)" if len(names) > 12 else "")
        lack = " or ".join(lacking)
        raise DataError(f"data folder {d} has no {lack} shard; it holds {held or 'nothing'}; expected "
                        f"`forge-ml prepare`'s train.bin, val.bin and tokenizer.json, or llm.c's token shards "
                        f"named *train*.bin and *val*.bin (e.g. fineweb_train_000001.bin, fineweb_val_000000.bin)")
    tok = d / TOKENIZER_FILE
    return ShardFolder(d, train, val, tok if tok.is_file() else None, False)


# ---------------------------------------------------------------------------------------------
# Loader


def _expand_paths(path_or_paths) -> list[Path]:
    if isinstance(path_or_paths, (str, os.PathLike)):
        s = os.fspath(path_or_paths)
        # a file whose name holds one of glob's characters (runs/lr[3e-4]/data/val.bin) is
        # that file, not a pattern that matches other names or none
        if any(ch in s for ch in "*?[") and not os.path.exists(s):
            found = sorted(glob.glob(s))
            if not found:
                raise DataError(f"no token shards match the pattern {s}")
            return [Path(p) for p in found]
        return [Path(s)]
    try:
        paths = [Path(p) for p in path_or_paths]
    except TypeError:   # (5, None, a list of ints: "'int' object is not iterable" from inside)
        raise DataError(f"DataLoader: expected a shard path, a glob pattern or a list of paths, "
                        f"got {path_or_paths!r:.60}") from None
    if not paths:
        raise DataError("DataLoader: expected at least one shard path, got an empty list")
    return paths


def _state_to_json(state):
    """PCG64's state holds 128-bit ints; JSON readers often keep only 53 bits, so store every
    int as a decimal string."""
    if isinstance(state, dict):
        return {k: _state_to_json(v) for k, v in state.items()}
    if isinstance(state, (int, np.integer)) and not isinstance(state, bool):
        return str(int(state))
    return state


def _state_from_json(state):
    if isinstance(state, dict):
        return {k: _state_from_json(v) for k, v in state.items()}
    if isinstance(state, str) and state.lstrip("-").isdigit():
        return int(state)
    return state


class DataLoader:
    """Random (B, T) windows over one or more memory-mapped shards.

    Each batch draws B start offsets uniformly from ``[0, N - T - 1]`` of the concatenated
    shards (N tokens in all; a window may run across a shard boundary) with a
    ``np.random.Generator(np.random.PCG64(seed))``, and returns ``(x, y)``: int64 NumPy arrays
    of shape (B, T) where ``y[b, t]`` is the token that follows ``x[b, t]``; the caller turns
    them into Tensors on its device.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "s.bin"); write_shard(p, range(100))
    >>> dl = DataLoader(p, batch_size=2, block_size=4, seed=0)
    >>> x, y = dl.next_batch(); x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    ((2, 4), True)
    >>> s = dl.state_dict(); a = dl.next_batch()[0]; dl.load_state_dict(s)
    >>> bool((dl.next_batch()[0] == a).all())
    True
    """

    def __init__(self, path_or_paths, batch_size: int, block_size: int, seed: int = 0):
        self._sizes(batch_size, block_size, seed)
        paths = _expand_paths(path_or_paths)
        self._use([read_shard(p) for p in paths], paths)

    @classmethod
    def from_tokens(cls, tokens, batch_size: int, block_size: int, seed: int = 0,
                    name: str = "the tokens") -> "DataLoader":
        """A loader over ``tokens``, a 1-D array of ids >= 0 held in memory, instead of shard
        files: ``forge-ml eval``'s text file, whose ids need no temporary shard (nor fit one's
        uint16: a tokenizer of more than 65,536 ids); ``name`` stands for the data in errors.

        >>> dl = DataLoader.from_tokens(np.arange(70_000, 70_050), 2, 4)
        >>> [x[0].tolist() for x, y in dl.eval_batches(1)], dl.windows
        ([[70000, 70001, 70002, 70003]], 12)
        """
        self = cls.__new__(cls)
        self._sizes(batch_size, block_size, seed)
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0)):
            raise DataError(f"DataLoader.from_tokens: expected a 1-D sequence of integer ids >= 0, "
                            f"got {arr.dtype} of shape {arr.shape} for {name}")
        if arr.size and arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
            # (the batches' int64 turned it into a negative id, in silence)
            raise DataError(f"DataLoader.from_tokens: expected ids below 2**63 (the batches are "
                            f"int64), got id {int(arr.max())} for {name}")
        self._use([arr], [Path(name)], what=f"{name} holds")
        return self

    def _sizes(self, batch_size, block_size, seed) -> None:
        """Check and keep ``B``, ``T`` and the seed."""
        for name, v in (("batch_size", batch_size), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise DataError(f"DataLoader: {name} must be a whole number, got {v!r}")
        if int(batch_size) < 1 or int(block_size) < 1:
            raise DataError(
                f"DataLoader: batch_size and block_size must be >= 1, got {batch_size} and {block_size}"
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"DataLoader: seed must be a whole number >= 0, got {seed!r}")  # (1.7 was 1)
        self.B = int(batch_size)
        self.T = int(block_size)
        self.seed = int(seed)

    def _use(self, shards: list, paths: list, what: Optional[str] = None) -> None:
        """Read windows from ``shards`` (token arrays; ``paths`` names them), joined end to end."""
        self.paths, self.shards = paths, shards
        lengths = np.array([len(s) for s in self.shards], dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(lengths)])  # shard i covers [starts[i], starts[i+1])
        self.n_tokens = n = int(self._starts[-1])
        if n < self.T + 1:   # (over all the shards: a window may run across a boundary)
            first, last, k = self.paths[0], self.paths[-1], len(self.paths)
            what = what or (f"token shard {first} holds" if k == 1 else
                            f"the {k} token shards {first} ... {last} hold")
            raise DataError(f"{what} {n} {plural(n, 'token')}; block_size={self.T} needs at least "
                            f"{self.T + 1} (one window plus its next-token target)")
        self.batches_drawn = 0
        self._rng = np.random.Generator(np.random.PCG64(self.seed))

    def _check_size(self, i: int) -> None:
        """Shard ``i``'s file still has the size it had when mapped (an fstat through the
        mapping): a read past the end of a file truncated meanwhile would kill the process
        with SIGBUS; a DataError says what was expected and what is there instead."""
        s = self.shards[i]
        if not isinstance(s.base, mmap.mmap):
            return
        want = HEADER_BYTES + 2 * len(s)
        try:
            got = s.base.size()
        except (OSError, ValueError):
            return
        if got != want:
            raise DataError(f"token shard {self.paths[i]} changed while it was read: expected {want:,} bytes "
                            f"(its {len(s):,} {plural(len(s), 'token')}), the file now holds {got:,}; it was "
                            f"truncated or rewritten in place (write a new shard beside it and rename it over "
                            f"the old one instead)")

    def _window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the concatenation, as int64."""
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            self._check_size(i)
            s = self.shards[i]
            lo = start + filled - int(self._starts[i])
            take = min(length - filled, len(s) - lo)
            out[filled:filled + take] = s[lo:lo + take]
            filled += take
            i += 1
        return out

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """The next random batch ``(x, y)``, each int64 of shape (B, T).

        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "s.bin"); write_shard(p, range(100))
        >>> dl = DataLoader(p, batch_size=2, block_size=3); x, y = dl.next_batch()
        >>> x.dtype, (y - x).tolist(), dl.batches_drawn     # token i + 1 follows token i
        (dtype('int64'), [[1, 1, 1], [1, 1, 1]], 1)
        """
        B, T = self.B, self.T
        offsets = self._rng.integers(0, self.n_tokens - T, size=B)  # start + T + 1 <= N
        buf = self._windows(offsets, T + 1)                            # (B, T+1)
        self.batches_drawn += 1
        return buf[:, :-1].astype(np.int64), buf[:, 1:].astype(np.int64)

    def _windows(self, offsets: np.ndarray, length: int) -> np.ndarray:
        """The windows ``[o, o + length)`` of the concatenation for each offset, (B, length).
        A window inside one shard is one gather through a strided view of it (the trainer asks
        for a batch every step: 32 windows of 1,025 tokens took 0.4 ms one by one); a window
        across a shard boundary goes through ``_window``."""
        out = np.empty((len(offsets), length), dtype=np.result_type(*(s.dtype for s in self.shards)))
        shard = np.searchsorted(self._starts, offsets, side="right") - 1
        done = np.zeros(len(offsets), dtype=bool)
        for i in np.unique(shard):   # the shards the batch touches (of maybe hundreds)
            self._check_size(i)
            s = self.shards[i]
            lo = offsets - self._starts[i]
            inside = (shard == i) & (lo + length <= len(s))
            if inside.any():
                out[inside] = np.lib.stride_tricks.sliding_window_view(s, length)[lo[inside]]
                done |= inside
        for b in np.flatnonzero(~done):
            out[b] = self._window(int(offsets[b]), length)
        return out

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()

    @property
    def windows(self) -> int:
        """The non-overlapping windows of ``T`` tokens (with their targets) the shards hold:
        ``eval_batches``' windows.

        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "s.bin"); write_shard(p, range(50))
        >>> DataLoader(p, 2, 4).windows
        12
        """
        return (self.n_tokens - 1) // self.T

    def eval_batches(self, n: int | None = None, *, tail: bool = False):
        """Yield ``n`` fixed batches of sequential, non-overlapping windows, the same on every
        call and independent of the random stream. Window ``k`` covers tokens ``[kT, kT + T]``.
        ``n=None`` yields every complete batch; a larger ``n`` than fits wraps to the start.
        ``n=None, tail=True`` covers every window: the windows left after the complete
        batches come as one last, smaller batch.

        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "s.bin"); write_shard(p, range(50))
        >>> [int(x[0, 0]) for x, y in DataLoader(p, 2, 4).eval_batches(2)]
        [0, 8]
        >>> [len(x) for x, y in DataLoader(p, 5, 4).eval_batches(tail=True)]   # 12 windows of 4
        [5, 5, 2]
        """
        B, T = self.B, self.T
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
            raise DataError(f"eval_batches: n must be a whole number >= 1 (None: every batch), "
                            f"got {n!r}")   # (-1 and 0 gave nothing, 1.5 one batch)
        if n is not None and tail:   # (it was ignored: n batches, no smaller last one)
            raise DataError(f"eval_batches: tail=True covers every window and takes n=None; got "
                            f"n={n}")
        n_windows = self.windows
        rest = 0
        if n is None:
            n = n_windows // B
            rest = n_windows - n * B if tail else 0
            if n == 0 and rest == 0:
                raise DataError(
                    f"eval_batches: {self.n_tokens} {plural(self.n_tokens, 'token gives', 'tokens give')} "
                    f"{n_windows} {plural(n_windows, 'window')} of {T}; "
                    f"one batch needs {B}"
                )
        # each batch through _windows: one gather a shard and one size check a shard touched
        # (window by window, the size check was an fstat a window)
        starts = ((np.arange(k * B, (k + 1) * B, dtype=np.int64) % n_windows) * T for k in range(int(n)))
        tail_starts = [np.arange(n * B, n * B + rest, dtype=np.int64) * T] if rest else []
        for wins in itertools.chain(starts, tail_starts):
            buf = self._windows(wins, T + 1)   # (B, T+1), in the shard's dtype
            yield buf[:, :-1].astype(np.int64), buf[:, 1:].astype(np.int64)   # as next_batch

    def state_dict(self) -> dict:
        """JSON-able position of the random stream (big ints stored as decimal strings).

        >>> import tempfile, os, json
        >>> p = os.path.join(tempfile.mkdtemp(), "s.bin"); write_shard(p, range(100))
        >>> s = DataLoader(p, 2, 3, seed=5).state_dict(); s["seed"], s["batches_drawn"]
        (5, 0)
        >>> s["bit_generator"]["bit_generator"], json.loads(json.dumps(s)) == s
        ('PCG64', True)
        """
        return {
            "kind": "random_windows",
            "seed": self.seed,
            "batch_size": self.B,
            "block_size": self.T,
            "n_tokens": self.n_tokens,
            "batches_drawn": self.batches_drawn,
            "bit_generator": _state_to_json(self._rng.bit_generator.state),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict()``: the following batches equal those the saved loader drew.

        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "s.bin"); write_shard(p, range(100))
        >>> a = DataLoader(p, 2, 3, seed=1); _ = a.next_batch()
        >>> b = DataLoader(p, 2, 3, seed=9); b.load_state_dict(a.state_dict())
        >>> bool((a.next_batch()[0] == b.next_batch()[0]).all()), b.batches_drawn
        (True, 2)
        """
        if not isinstance(state, dict) or not isinstance(state.get("bit_generator"), dict):
            raise DataError(f"DataLoader.load_state_dict: expected a dict from state_dict(), got {state!r:.200}")
        for key in ("batch_size", "block_size", "n_tokens", "seed", "batches_drawn"):
            v = state.get(key)   # (a checkpoint's state.json edited or damaged: "x" was a ValueError)
            if v is not None and (isinstance(v, bool) or not str(v).isdecimal()):
                raise DataError(f"DataLoader.load_state_dict: {key} must be a whole number >= 0, got {v!r:.40}")
        for key, mine in (("batch_size", self.B), ("block_size", self.T), ("n_tokens", self.n_tokens)):
            theirs = state.get(key)
            if theirs is not None and int(theirs) != mine:
                raise DataError(
                    f"DataLoader.load_state_dict: the saved loader had {key}={theirs}, this one has "
                    f"{mine}; the batches after a resume would differ from the original run"
                )
        bg = _state_from_json(state["bit_generator"])
        if bg.get("bit_generator") != "PCG64":
            raise DataError(f"DataLoader.load_state_dict: expected a PCG64 state, got {bg.get('bit_generator')!r}")
        rng = np.random.Generator(np.random.PCG64())
        try:
            rng.bit_generator.state = bg
        except (TypeError, ValueError, KeyError) as e:
            raise DataError(f"DataLoader.load_state_dict: bad generator state: {e}") from None
        self._rng = rng
        self.seed = int(state.get("seed", self.seed))
        self.batches_drawn = int(state.get("batches_drawn", 0))
