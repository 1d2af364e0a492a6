"""Token shards (llm.c layout), text loading, prepare, and the loader's determinism/resume."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from forge_ml import data
from forge_ml.data import DataLoader, default_corpus, load_text, prepare, read_shard, split_tokens, write_shard
from forge_ml.errors import DataError
from forge_ml.tokenizer import CharTokenizer, tokenizer_from_dict


def shard(tmp_path, tokens, name="s.bin"):
    p = tmp_path / name
    write_shard(p, tokens)
    return p


# ---------------------------------------------------------------------------------------------
# Shards


def test_shard_layout_is_llmc(tmp_path):
    toks = np.array([0, 1, 65535, 50256, 7], dtype=np.int64)
    p = shard(tmp_path, toks)
    raw = p.read_bytes()
    assert len(raw) == 1024 + 2 * len(toks)
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[0] == 20240520 and header[1] == 1 and header[2] == len(toks)
    assert not header[3:].any()
    assert np.frombuffer(raw[1024:], dtype="<u2").tolist() == toks.tolist()


def test_shard_round_trip(tmp_path):
    toks = np.random.default_rng(0).integers(0, 65536, size=10_000)
    got = read_shard(shard(tmp_path, toks))
    assert isinstance(got, np.memmap) and got.dtype == np.uint16
    np.testing.assert_array_equal(got, toks)


def test_shard_empty(tmp_path):
    assert len(read_shard(shard(tmp_path, []))) == 0


@pytest.mark.parametrize("bad", [65536, -1, 100_000])
def test_write_shard_rejects_out_of_range(tmp_path, bad):
    with pytest.raises(DataError, match=str(bad)):
        write_shard(tmp_path / "x.bin", [1, 2, bad])
    assert not (tmp_path / "x.bin").exists()


def test_write_shard_rejects_floats_and_2d(tmp_path):
    with pytest.raises(DataError, match="integers"):
        write_shard(tmp_path / "x.bin", [1.5, 2.0])
    with pytest.raises(DataError, match="1-D"):
        write_shard(tmp_path / "x.bin", [[1, 2]])


def test_write_shard_is_atomic(tmp_path, monkeypatch):
    p = shard(tmp_path, [1, 2, 3])

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(data.os, "replace", boom)
    with pytest.raises(OSError):
        write_shard(p, [9, 9, 9, 9])
    monkeypatch.undo()
    assert read_shard(p).tolist() == [1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["s.bin"]  # no temp file left


def _with_header_int(p, i, value):
    """The shard ``p`` with int32 ``i`` of its header set to ``value``."""
    raw = bytearray(p.read_bytes())
    raw[4 * i:4 * i + 4] = np.int32(value).tobytes()
    p.write_bytes(bytes(raw))
    return p


def test_read_shard_bad_magic(tmp_path):
    p = _with_header_int(shard(tmp_path, [1, 2, 3]), 0, 12345)
    with pytest.raises(DataError, match=f"{p} is not a token shard: expected magic 20240520 .* got 12345"):
        read_shard(p)


def test_read_shard_bad_version(tmp_path):
    p = _with_header_int(shard(tmp_path, [1, 2, 3]), 1, 2)
    with pytest.raises(DataError, match="version 1.*got 2"):
        read_shard(p)


def test_read_shard_size_mismatch(tmp_path):
    p = shard(tmp_path, list(range(10)))
    p.write_bytes(p.read_bytes()[:-4])  # lose 2 tokens
    with pytest.raises(DataError, match="header says 10 tokens but file holds 8 tokens"):
        read_shard(p)
    p.write_bytes(p.read_bytes() + b"\x00\x00\x00\x00\x00")
    with pytest.raises(DataError, match="header says 10 tokens but file holds 10 tokens and a stray byte"):
        read_shard(p)


def test_read_shard_short_or_missing(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(b"\x00" * 100)
    with pytest.raises(DataError, match="shorter than the 1024-byte header"):
        read_shard(p)
    with pytest.raises(DataError, match="not found"):
        read_shard(tmp_path / "nope.bin")


def test_counts_of_one_are_singular(tmp_path):
    """"holds 1 tokens", "is 1 bytes": a count of one takes the singular noun (and verb)."""
    one = tmp_path / "one.bin"
    one.write_bytes(b"\x01")
    with pytest.raises(DataError, match=r"is 1 byte, shorter than"):
        read_shard(one)
    p = shard(tmp_path, [7], "p.bin")
    _with_header_int(p, 2, 1)
    p.write_bytes(p.read_bytes()[:data.HEADER_BYTES + 2])
    assert read_shard(p).tolist() == [7]
    p.write_bytes(p.read_bytes()[:data.HEADER_BYTES] + b"\x07\x00\x08\x00")   # 2 tokens, the header says 1
    with pytest.raises(DataError, match=r"header says 1 token but file holds 2 tokens"):
        read_shard(p)
    _with_header_int(p, 2, 3)
    p.write_bytes(p.read_bytes()[:data.HEADER_BYTES + 2])
    with pytest.raises(DataError, match=r"header says 3 tokens but file holds 1 token:"):
        read_shard(p)
    with pytest.raises(DataError, match=r"holds 1 token; block_size=4 needs at least 5"):
        DataLoader(shard(tmp_path, [3], "one_token.bin"), 2, 4)
    with pytest.raises(DataError, match=r"eval_batches: 6 tokens give 1 window of 4; one batch needs 2"):
        list(DataLoader(shard(tmp_path, [1] * 6, "six.bin"), 2, 4).eval_batches())
    with pytest.raises(DataError, match=r"eval_batches: 1 token gives 0 windows of 4"):
        loader = DataLoader(shard(tmp_path, [1] * 6, "six2.bin"), 2, 4)
        loader.n_tokens = 1
        list(loader.eval_batches())
    ids = tmp_path / "ids.bin"
    ids.write_bytes(b"abc\x00def")
    with pytest.raises(DataError, match=r"\(1 NUL byte\)"):
        load_text(ids)


# ---------------------------------------------------------------------------------------------
# Text


def test_load_text_errors(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_text(tmp_path / "missing.txt")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"not UTF-8: byte 0xe9 at offset 3"):
        load_text(bad)
    with pytest.raises(DataError, match="directory"):
        load_text(tmp_path)
    # UTF-16 (with its byte-order mark or without) is said as such: it was taken for token ids
    for enc in ("utf-16", "utf-16-le", "utf-16-be"):
        u = tmp_path / f"{enc}.txt"
        u.write_bytes("To be, or not to be\n".encode(enc))
        with pytest.raises(DataError, match="UTF-16 text.*iconv -f utf-16"):
            load_text(u)
    ids = tmp_path / "ids.txt"     # raw uint16 ids: still token ids
    ids.write_bytes(np.array([15496, 11, 995, 7, 200], np.uint16).tobytes() * 20)
    with pytest.raises(DataError, match=r"holds binary data, not text .*token ids\?"):
        load_text(ids)
    good = tmp_path / "ok.txt"
    good.write_text("naïve 🎉", encoding="utf-8")
    assert load_text(good) == "naïve 🎉"



@pytest.mark.parametrize("head, said", [
    (b"\x7fELF\x02\x01\x01\x00" + bytes(200), "is a program (ELF), not text; give a UTF-8 text file"),
    (b"PK\x03\x04\x14\x00\x00\x00" + bytes(50), "is a zip archive"),
    (b"\x1f\x8b\x08\x00\xf3\x9e", "is gzip-compressed, not text; decompress it first: gzip -dc "),
    (b"\x93NUMPY\x01\x00v\x00{'descr'", "is a NumPy array (.npy), not text"),
    (b"\x80\x04\x95\x0b\x00\x00\x00", "is a Python pickle"),
    (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n", "is a PDF, not text; extract its text first"),
])
def test_a_known_binary_file_is_named_not_taken_for_token_ids(tmp_path, head, said):
    """From a QA run: forge-ml prepare on a program said it held token ids and pointed to
    nanoGPT's train.bin; a gzip file was "not UTF-8" with an iconv hint. A file that is not text
    (NULs, or not UTF-8) whose first bytes are a known binary kind's is named as that kind."""
    f = tmp_path / "thing"
    f.write_bytes(head + b"more \xff\xfe bytes")
    with pytest.raises(DataError, match="^" + re.escape(f"{f} {said}")) as e:
        load_text(f)
    assert "holds token ids" not in str(e.value) and "iconv" not in str(e.value)


def test_token_ids_and_latin1_text_that_begin_like_a_binary_kind_keep_their_messages(tmp_path):
    """A review's finds: nanoGPT's uint16 ids whose first token is 640 (bytes 80 02, a pickle's
    start) were called a pickle, and a Latin-1 text beginning "MZ" a Windows program."""
    ids = tmp_path / "train.bin"
    ids.write_bytes(np.array([640, 11, 995, 7, 200], np.uint16).tobytes() * 20)
    with pytest.raises(DataError, match=r"holds binary data, not text .*token ids\?"):
        load_text(ids)
    latin = tmp_path / "old.txt"
    latin.write_bytes("MZ caf\u00e9 au lait\n".encode("latin-1") * 5)
    with pytest.raises(DataError, match="is not UTF-8.*iconv"):
        load_text(latin)


def test_a_text_that_begins_like_a_binary_file_is_read(tmp_path):
    """Only a file that is not text already is asked what binary kind it is: a text starting
    "MZ", "BZh" or "%PDF" is text."""
    for start in ("MZ is a name", "BZh, said he", "%PDF is a comment here"):
        f = tmp_path / "t.txt"
        f.write_text(start + "\nand more text\n", encoding="utf-8")
        assert load_text(f).startswith(start)


# A UTF-16 or UTF-32 file (with its byte-order mark or without) and a Latin-1 file: each is named
# as such, and the iconv command the message suggests names the file by the path given (quoted
# for a shell) and writes beside it; run as printed, it gives UTF-8 that load_text reads.
_UNICODE_CASES = [("utf-32", "UTF-32", "utf-32"), ("utf-32-le", "UTF-32", "utf-32le"),
                  ("utf-32-be", "UTF-32", "utf-32be"), ("utf-16", "UTF-16", "utf-16"),
                  ("utf-16-le", "UTF-16", "utf-16le"), ("utf-16-be", "UTF-16", "utf-16be"),
                  ("latin-1", "not UTF-8", "latin1")]


@pytest.mark.parametrize("enc,said,iconv_from", _UNICODE_CASES)
@pytest.mark.parametrize("rel", ["enc/u.txt", "my files/it's.txt"])
def test_load_text_names_the_encoding_and_its_iconv_command_works(tmp_path, monkeypatch, enc, said, iconv_from, rel):
    text = "hello world, to be or not to be\n" if enc != "latin-1" else "café au lait, to be or not\n"
    monkeypatch.chdir(tmp_path)
    p = Path(rel)
    p.parent.mkdir(parents=True)
    p.write_bytes(text.encode(enc))
    with pytest.raises(DataError) as e:
        load_text(rel)
    msg = str(e.value)
    assert "\n" not in msg and said in msg, msg
    out = p.with_name(p.stem + "-utf8" + p.suffix)
    cmd = f"iconv -f {iconv_from} -t utf-8 {shlex.quote(rel)} > {shlex.quote(str(out))}"
    assert msg.endswith(cmd), msg
    if enc.startswith("utf-32"):
        assert "UTF-16" not in msg and "token ids" not in msg, msg
    if shutil.which("iconv") is None:
        return
    run = re.search(r"iconv -f .*$", msg).group(0)
    subprocess.run(run, shell=True, check=True, cwd=tmp_path)
    assert load_text(out) == text


def test_a_leading_utf8_bom_is_not_text(tmp_path):
    """A UTF-8 byte-order mark at a file's start (Notepad writes one) became a character of the
    text: U+FEFF in a char vocabulary and one more token, or gpt2 tokens. Python's utf-8-sig
    and most tools drop it; a U+FEFF further on is text and stays."""
    text = "To be, or not to be\n" * 20
    (tmp_path / "plain.txt").write_bytes(text.encode("utf-8"))
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert load_text(tmp_path / "bom.txt") == text
    (tmp_path / "mid.txt").write_bytes(b"\xef\xbb\xbf" + "a\ufeffb".encode("utf-8"))
    assert load_text(tmp_path / "mid.txt") == "a\ufeffb"
    (tmp_path / "bad.txt").write_bytes(b"\xef\xbb\xbf" + "café".encode("latin-1"))  # the offset is the file's
    with pytest.raises(DataError, match=r"not UTF-8: byte 0xe9 at offset 6 "):
        load_text(tmp_path / "bad.txt")
    (tmp_path / "only.txt").write_bytes(b"\xef\xbb\xbf")
    with pytest.raises(DataError, match="is empty"):
        prepare(tmp_path / "only.txt", tmp_path / "o_only")
    for kind in ("char", "gpt2"):
        a = prepare(tmp_path / "plain.txt", tmp_path / f"a_{kind}", kind)
        b = prepare(tmp_path / "bom.txt", tmp_path / f"b_{kind}", kind)
        counts = ("train_tokens", "val_tokens", "vocab_size")
        assert [a[k] for k in counts] == [b[k] for k in counts], (kind, a, b)
        for f in ("train.bin", "val.bin", "tokenizer.json"):
            assert (tmp_path / f"a_{kind}" / f).read_bytes() == (tmp_path / f"b_{kind}" / f).read_bytes(), (kind, f)


def test_default_corpus_is_deterministic_and_sized():
    a = default_corpus()
    assert a == default_corpus()
    assert 2_000_000 <= len(a) <= 4_000_000
    assert "def " in a and "import " in a
    small = default_corpus(max_bytes=50_000)
    assert a.startswith(small)


# ---------------------------------------------------------------------------------------------
# prepare


def test_prepare_char_end_to_end(tmp_path):
    text = "To be, or not to be, that is the question.\n" * 50
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    info = prepare(src, out, tokenizer="char", val_fraction=0.1)
    n = len(text)
    assert info["train_tokens"] + info["val_tokens"] == n
    assert info["val_tokens"] == int(n * 0.1)
    assert sorted(os.listdir(out)) == ["tokenizer.json", "train.bin", "val.bin"]
    tok = tokenizer_from_dict(json.loads((out / "tokenizer.json").read_text()))
    assert isinstance(tok, CharTokenizer) and tok.vocab_size == info["vocab_size"]
    train, val = read_shard(out / "train.bin"), read_shard(out / "val.bin")
    assert tok.decode(train) + tok.decode(val) == text  # val is the tail
    x, y = DataLoader(out / "train.bin", 4, 16, seed=1).next_batch()
    assert x.shape == (4, 16)


def test_prepare_gpt2(tmp_path):
    text = "Hello world! Ünïcödé and 日本語.\n" * 20
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    info = prepare(src, tmp_path / "o", tokenizer="gpt2", val_fraction=0.25)
    assert info["vocab_size"] == 50257 and info["tokenizer"] == "gpt2"
    assert json.loads((tmp_path / "o" / "tokenizer.json").read_text()) == {"kind": "gpt2"}
    tok = tokenizer_from_dict({"kind": "gpt2"})
    ids = np.concatenate([read_shard(tmp_path / "o" / "train.bin"), read_shard(tmp_path / "o" / "val.bin")])
    assert tok.decode(ids) == text


def test_prepare_errors(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("ab", encoding="utf-8")
    with pytest.raises(DataError, match="val_fraction"):
        prepare(src, tmp_path / "o", val_fraction=1.0)
    with pytest.raises(DataError, match="the split gets 2 train and 0 val tokens, but each needs at least 2"):
        prepare(src, tmp_path / "o", val_fraction=0.1)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        prepare(tmp_path / "empty.txt", tmp_path / "o")


@pytest.mark.parametrize("fail_at", [1, 2, 3])  # the write of train.bin, val.bin, tokenizer.json
def test_prepare_over_an_earlier_one_on_a_full_disk_keeps_the_earlier_set(tmp_path, monkeypatch, fail_at):
    import errno
    (tmp_path / "a.txt").write_text("abcdefgh" * 40, encoding="utf-8")
    (tmp_path / "b.txt").write_text("XYZ" * 80, encoding="utf-8")
    out = tmp_path / "out"
    prepare(tmp_path / "a.txt", out)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(data.os, "fsync", fsync)
    with pytest.raises(DataError, match="No space left on device"):
        prepare(tmp_path / "b.txt", out)
    monkeypatch.undo()
    # never the new train.bin beside the old tokenizer.json (ids read with another vocabulary)
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


# ---------------------------------------------------------------------------------------------
# DataLoader


def test_loader_batches_are_shifted_windows(tmp_path):
    toks = np.arange(1000) % 60000
    p = shard(tmp_path, toks)
    dl = DataLoader(p, batch_size=8, block_size=32, seed=3)
    for _ in range(5):
        x, y = dl.next_batch()
        assert x.dtype == np.int64 and y.dtype == np.int64 and x.shape == y.shape == (8, 32)
        # arange data: each row is consecutive, y = x + 1
        np.testing.assert_array_equal(x[:, 1:] - x[:, :-1], 1)
        np.testing.assert_array_equal(y, x + 1)
        assert x.min() >= 0 and y.max() <= 999


def test_loader_offsets_are_seeded_pcg64(tmp_path):
    p = shard(tmp_path, np.arange(500))
    B, T = 4, 10
    x, _ = DataLoader(p, B, T, seed=42).next_batch()
    want = np.random.Generator(np.random.PCG64(42)).integers(0, 500 - T, size=B)
    np.testing.assert_array_equal(x[:, 0], want)


def test_loader_covers_the_last_token(tmp_path):
    n, T = 40, 8
    dl = DataLoader(shard(tmp_path, np.arange(n)), 64, T, seed=0)
    seen_last = any((dl.next_batch()[1] == n - 1).any() for _ in range(20))
    assert seen_last


def test_loader_determinism(tmp_path):
    p = shard(tmp_path, np.random.default_rng(0).integers(0, 50257, size=5000))
    a = DataLoader(p, 4, 64, seed=7)
    b = DataLoader(p, 4, 64, seed=7)
    c = DataLoader(p, 4, 64, seed=8)
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = a.next_batch(), b.next_batch(), c.next_batch()
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert not np.array_equal(xa, xc)


def test_loader_state_round_trip_through_json(tmp_path):
    p = shard(tmp_path, np.random.default_rng(1).integers(0, 50257, size=5000))
    dl = DataLoader(p, 4, 32, seed=11)
    for _ in range(5):
        dl.next_batch()
    state = json.loads(json.dumps(dl.state_dict()))  # must survive JSON unchanged
    want = [dl.next_batch() for _ in range(4)]

    fresh = DataLoader(p, 4, 32, seed=999)
    fresh.load_state_dict(state)
    assert fresh.batches_drawn == 5
    for wx, wy in want:
        x, y = fresh.next_batch()
        np.testing.assert_array_equal(x, wx)
        np.testing.assert_array_equal(y, wy)
    assert fresh.state_dict() == dl.state_dict()


def test_loader_state_mismatch_is_an_error(tmp_path):
    p = shard(tmp_path, np.arange(5000))
    state = DataLoader(p, 4, 32, seed=0).state_dict()
    with pytest.raises(DataError, match="block_size=32"):
        DataLoader(p, 4, 16, seed=0).load_state_dict(state)
    with pytest.raises(DataError, match="PCG64"):
        DataLoader(p, 4, 32).load_state_dict(dict(state, bit_generator={"bit_generator": "MT19937"}))
    with pytest.raises(DataError):
        DataLoader(p, 4, 32).load_state_dict({"nope": 1})


def test_loader_multiple_shards_span_boundaries(tmp_path):
    a = shard(tmp_path, np.arange(0, 30), "a.bin")
    b = shard(tmp_path, np.arange(30, 70), "b.bin")
    c = shard(tmp_path, np.arange(70, 100), "c.bin")
    dl = DataLoader([a, b, c], batch_size=64, block_size=12, seed=0)
    assert dl.n_tokens == 100
    for _ in range(10):
        x, y = dl.next_batch()
        np.testing.assert_array_equal(x[:, 1:] - x[:, :-1], 1)  # windows glue shards seamlessly
        np.testing.assert_array_equal(y, x + 1)
    # a glob pattern finds the same shards, sorted
    dl2 = DataLoader(str(tmp_path / "*.bin"), batch_size=64, block_size=12, seed=0)
    assert dl2.paths == [a, b, c]


def test_loader_small_shard_names_file(tmp_path):
    p = shard(tmp_path, np.arange(16), "tiny.bin")
    with pytest.raises(DataError, match="tiny.bin holds 16 tokens; block_size=16 needs at least 17"):
        DataLoader(p, 2, 16)
    DataLoader(p, 2, 15)  # exactly T + 1 is enough
    with pytest.raises(DataError, match="no token shards match"):
        DataLoader(str(tmp_path / "*.nope"), 2, 4)


_TRUNCATE = """
import os, sys
import numpy as np
from forge_ml.data import DataLoader, write_shard
from forge_ml.errors import DataError
a, b = sys.argv[1:3]
write_shard(a, np.arange(100_000) % 500)     # 50 pages of tokens: a truncation leaves most unmapped
write_shard(b, np.arange(100_000) % 500)
dl = DataLoader([a, b], batch_size=8, block_size=64, seed=0)
dl.next_batch()
os.truncate(a, 4096)                          # another process cuts the shard short
for what, read in (("batch", dl.next_batch), ("eval", lambda: next(dl.eval_batches(4)))):
    try:
        read()
    except DataError as e:
        print(what, "|", e)
"""


def test_a_shard_truncated_while_read_is_a_data_error_not_a_sigbus(tmp_path):
    """A shard file cut short while a loader had it memory-mapped killed the process with SIGBUS
    at the next read of its tokens; each read checks the file's size first and says what it
    expected and what it found. Run in a child process, which a SIGBUS would kill (not pytest)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    a, b = tmp_path / "a_train.bin", tmp_path / "b_train.bin"
    r = subprocess.run([sys.executable, "-c", _TRUNCATE, str(a), str(b)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=src))
    assert r.returncode == 0, (r.returncode, r.stderr)   # -7: killed by SIGBUS
    lines = r.stdout.strip().splitlines()
    assert [ln.split(" |")[0] for ln in lines] == ["batch", "eval"], r.stdout
    for ln in lines:
        assert (f"token shard {a} changed while it was read: expected 201,024 bytes (its 100,000 tokens), "
                f"the file now holds 4,096") in ln, ln
    # an intact shard reads as before
    x, y = DataLoader(b, 8, 64, seed=0).next_batch()
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])


def test_eval_batches_sequential_and_fixed(tmp_path):
    p = shard(tmp_path, np.arange(1000))
    dl = DataLoader(p, batch_size=3, block_size=10, seed=0)
    before = dl.state_dict()
    batches = list(dl.eval_batches(4))
    assert len(batches) == 4
    starts = np.concatenate([x[:, 0] for x, _ in batches])
    np.testing.assert_array_equal(starts, np.arange(12) * 10)  # non-overlapping, in order
    for x, y in batches:
        np.testing.assert_array_equal(y, x + 1)
    again = list(dl.eval_batches(4))
    for (x1, _), (x2, _) in zip(batches, again):
        np.testing.assert_array_equal(x1, x2)
    assert dl.state_dict() == before  # eval does not touch the random stream
    full = list(dl.eval_batches())
    assert len(full) == (999 // 10) // 3


def test_eval_batches_wrap_when_asked_for_more(tmp_path):
    p = shard(tmp_path, np.arange(41))  # 4 windows of 10
    dl = DataLoader(p, batch_size=3, block_size=10)
    starts = np.concatenate([x[:, 0] for x, _ in dl.eval_batches(2)])
    np.testing.assert_array_equal(starts, [0, 10, 20, 30, 0, 10])


def test_shard_edges_a_new_user_met(tmp_path):
    """llm.c's llama-3 shards are named as such (they were 'not a token shard'); 2^31 tokens, past
    the header's int32 count, are refused before anything is written (an OverflowError); the
    val split is the floor of n * fraction even where the float product lands just under it."""
    p = _with_header_int(shard(tmp_path, [1, 2, 3]), 0, 20240801)
    with pytest.raises(DataError, match="llama-3 shards .* uint32"):
        read_shard(p)
    big = np.broadcast_to(np.uint16(1), (2**31,))
    with pytest.raises(DataError, match="2,147,483,648 tokens do not fit one shard"):
        write_shard(tmp_path / "big.bin", big)
    assert not (tmp_path / "big.bin").exists()
    assert [len(a) for a in split_tokens(range(100), 0.29)] == [71, 29]
    assert [len(a) for a in split_tokens(range(100), 0.57)] == [43, 57]


def test_the_data_api_refuses_plain_mistakes_in_words(tmp_path):
    """From a new user's test: these were a bare TypeError, FileExistsError or ValueError, a
    misleading 'must be 1-D, got shape ()' for a generator, or a silent truncation (a batch
    size of 1.5 became 1)."""
    from forge_ml.errors import TokenizerError
    from forge_ml.tokenizer import GPT2Tokenizer
    p = tmp_path / "t.txt"
    p.write_text("abcd" * 50)
    for bad in ("0.1", None, float("nan"), True):
        with pytest.raises(DataError, match="val_fraction must be a number in"):
            prepare(p, tmp_path / "out", val_fraction=bad)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match="exists and is not a folder"):
        prepare(p, tmp_path / "afile")
    with pytest.raises(DataError, match="val_fraction must be a number in"):
        split_tokens(range(10), float("nan"))
    with pytest.raises(TokenizerError, match="allowed_special must be"):
        GPT2Tokenizer().encode("a", allowed_special=1)
    write_shard(tmp_path / "g.bin", (i for i in range(3)))              # a generator of ids
    assert read_shard(tmp_path / "g.bin").tolist() == [0, 1, 2]
    for bad in (1.5, "2", True):
        with pytest.raises(DataError, match="batch_size must be a whole number"):
            DataLoader(tmp_path / "g.bin", batch_size=bad, block_size=1)
    assert DataLoader(tmp_path / "g.bin", batch_size=np.int64(1), block_size=1).B == 1
    for bad in (-1, 1.7, "3", True):   # -1 a NumPy ValueError, 1.7 silently seed 1
        with pytest.raises(DataError, match="seed must be a whole number >= 0"):
            DataLoader(tmp_path / "g.bin", batch_size=1, block_size=1, seed=bad)
    dl = DataLoader(tmp_path / "g.bin", batch_size=1, block_size=1)
    for bad in (-1, 0, 1.5, True):      # -1 and 0 gave nothing, 1.5 one batch
        with pytest.raises(DataError, match="eval_batches: n must be a whole number >= 1"):
            list(dl.eval_batches(bad))
    assert len(list(dl.eval_batches(np.int64(2)))) == 2


def test_decoding_checks_every_id_at_numpys_speed():
    """The per-id loop took 0.5 s for a million GPT-2 ids (17x tiktoken); the array check
    refuses the same ids with the same message, and bools are still not ids."""
    from forge_ml.errors import TokenizerError
    from forge_ml.tokenizer import GPT2Tokenizer
    tok = GPT2Tokenizer()
    ids = tok.encode("hello world, the quick brown fox")
    assert tok.decode(np.array(ids, np.uint16)) == tok.decode(ids) == "hello world, the quick brown fox"
    for bad, needle in (([1, 50257], "id 50257 at position 1 is out of range"),
                        (np.array([3, -1]), "id -1 at position 1"), ([True, 2], "id True at position 0"),
                        ([1, 2.0], "id 2.0 at position 1 is not an integer")):
        with pytest.raises(TokenizerError, match=needle):
            tok.decode(bad)
    c = CharTokenizer("abc")
    assert c.decode(np.array([2, 0, 1], np.int8)) == "cab"
    with pytest.raises(TokenizerError, match="id 3 at position 0 is out of range; expected 0 <= id < vocab_size=3"):
        c.decode([3])


def test_a_prepared_set_cut_between_two_renames_is_never_taken_as_whole(tmp_path, monkeypatch):
    """Ctrl-C (or a kill) landing between the renames of ``prepare --force`` left a new
    train.bin beside the old val.bin and the old tokenizer.json: a folder taken as prepared,
    whose char ids a GPT-2 tokenizer read in silence. The tokenizer.json now goes first and
    comes last: the cut folder lacks it, and readers refuse it."""
    from forge_ml.tokenizer import GPT2Tokenizer
    d = tmp_path / "p"
    data.write_prepared(d, [1, 2, 3, 4], [5, 6], GPT2Tokenizer())
    real, renamed = os.replace, []

    def cut(src, dst):
        real(src, dst)
        renamed.append(dst)
        if len(renamed) == 1:
            raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", cut)
    with pytest.raises(KeyboardInterrupt):
        data.write_prepared(d, [0, 1, 0, 1], [1, 0], CharTokenizer("ab"))
    assert sorted(os.listdir(d)) == ["train.bin", "val.bin"]   # no tokenizer.json, no temporary file
    assert not data.shard_folder(d).prepared


def test_prepare_into_a_folder_under_a_file_says_so_before_tokenizing(tmp_path):
    """``prepare(text, "afile/sub")`` was a bare NotADirectoryError (the CLI: "Not a directory
    (ENOTDIR): afile/sub"), after the whole text had been tokenized."""
    p = tmp_path / "t.txt"
    p.write_text("abcd" * 50)
    (tmp_path / "afile").write_text("x")
    for out in ("afile/sub", "afile/sub/deeper"):
        with pytest.raises(DataError, match=r"out_dir '.*afile/sub.*' cannot be made: .*afile is a file, not a "
                                            r"folder; expected the folder"):
            prepare(p, tmp_path / out)
    assert (tmp_path / "afile").read_text() == "x"


def test_prepare_of_a_tiny_split_says_the_real_minimum(tmp_path):
    """A split that gave val no token said "expected at least 1 each" (split_tokens' check
    ran first) where evaluation needs 2 and named no fraction that works; 0.9999999 was
    said as "val_fraction 1"."""
    p = tmp_path / "t.txt"
    p.write_text("abc")
    with pytest.raises(DataError, match="the split gets 3 train and 0 val tokens, but each needs at least 2"):
        prepare(p, tmp_path / "o", val_fraction=0.25)
    p.write_text("abcd" * 50)
    with pytest.raises(DataError, match=r"with val_fraction 0\.001 the val split gets 0 tokens, .*at least 0\.01"):
        prepare(p, tmp_path / "o", val_fraction=0.001)
    with pytest.raises(DataError, match=r"with val_fraction 0\.9999999 the train split gets 1 token, .*at most 0\.99\)"):
        prepare(p, tmp_path / "o", val_fraction=0.9999999)
    assert not (tmp_path / "o").exists()


def test_a_damaged_loader_state_is_a_data_error(tmp_path):
    """A checkpoint's loader state with a bit_generator that is not a dict, or a count that is
    not a number, was an AttributeError or ValueError traceback on ``train --resume``."""
    p = shard(tmp_path, range(100))
    good = DataLoader(p, 2, 4).state_dict()
    for bad, needle in (({**good, "bit_generator": 5}, "expected a dict from state_dict"),
                        ({**good, "batches_drawn": "x"}, "batches_drawn must be a whole number >= 0, got 'x'"),
                        ({**good, "batch_size": "two"}, "batch_size must be a whole number"),
                        ({**good, "seed": -1}, "seed must be a whole number")):
        with pytest.raises(DataError, match=needle):
            DataLoader(p, 2, 4).load_state_dict(bad)
    dl = DataLoader(p, 2, 4)
    dl.load_state_dict(json.loads(json.dumps(good)))   # the JSON form still loads
    assert dl.batches_drawn == 0


def test_write_shard_of_something_that_is_not_a_sequence_says_so(tmp_path):
    """``write_shard(path, None)`` and ``write_shard(path, 5)`` were a bare TypeError, a str
    "must be 1-D, got shape ()"."""
    for bad, kind in ((None, "NoneType"), (5, "int"), ("abc", "str")):
        with pytest.raises(DataError, match=f"tokens must be a 1-D sequence of integer ids, got {kind} of shape"):
            write_shard(tmp_path / "s.bin", bad)
    assert not (tmp_path / "s.bin").exists()


def test_loader_and_read_shard_name_a_wrong_path_argument(tmp_path):
    """DataLoader(5, ...) gave "'int' object is not iterable"; read_shard of a folder said the
    shard was not found, of a path that exists."""
    for bad in (5, None, [1, 2]):
        with pytest.raises(DataError, match="expected a shard path, a glob pattern or a list"):
            DataLoader(bad, 2, 4)
    with pytest.raises(DataError, match="is a folder, not a token shard .*train"):
        read_shard(tmp_path)
    with pytest.raises(DataError, match="is a folder, not a token shard"):
        DataLoader(str(tmp_path), 2, 4)
