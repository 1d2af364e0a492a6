"""QA of the data path a new user takes with their own text: `forge-ml prepare`, the loader's
API and what they say when something is in the way."""
import os
import subprocess
import sys

import numpy as np
import pytest

from forge_ml.cli import main
from forge_ml.data import DataLoader, prepare, read_shard, write_prepared
from forge_ml.errors import DataError
from forge_ml.tokenizer import CharTokenizer

# a kill that lands while prepare writes its shards: SIGTERM sent from inside the first fsync
_KILLED_PREPARE = """
import os, signal, sys
real = os.fsync
def fsync(fd):
    os.kill(os.getpid(), signal.SIGTERM)
    real(fd)
os.fsync = fsync
from forge_ml.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_prepare_stopped_by_sigterm_leaves_no_temporary_shards(tmp_path):
    """(QA) SIGTERM (or SIGHUP: a closed terminal) while `forge-ml prepare --force` wrote its
    shards killed it where it was: OUT kept `.train.bin.XXXXXXXX.tmp` files as large as the
    shards, which no later prepare removed. It ends as Ctrl-C does now: the temporary files
    go, the earlier shards stay as they were, and it exits 143 saying so."""
    text = tmp_path / "t.txt"
    text.write_text("hello world, a tiny text to prepare\n" * 20, encoding="utf-8")
    out = tmp_path / "d"
    assert main(["prepare", str(text), "--out", str(out)]) == 0
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    p = subprocess.run([sys.executable, "-c", _KILLED_PREPARE, "prepare", str(text),
                        "--out", str(out), "--force", "--val-fraction", "0.3"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 143, (p.returncode, p.stderr)
    assert "stopped by SIGTERM" in p.stderr
    assert sorted(os.listdir(out)) == sorted(before)   # no temporary file beside them
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def test_prepare_into_a_link_to_nothing_says_so(tmp_path, capsys):
    """(QA) --out a link whose target does not exist (a disk not mounted) tokenized the whole
    text and then said "cannot write out: File exists (EEXIST)". It is said before, naming the
    link and its target."""
    text = tmp_path / "t.txt"
    text.write_text("abcdefgh" * 10, encoding="utf-8")
    (tmp_path / "out").symlink_to(tmp_path / "gone")
    with pytest.raises(DataError, match=r"out is a link to .*gone, which does not exist"):
        prepare(text, tmp_path / "out")
    assert main(["prepare", str(text), "--out", str(tmp_path / "out" / "sub")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a link to" in err and "does not exist" in err
    assert not (tmp_path / "gone").exists()


def test_from_tokens_refuses_uint64_ids_past_int64(tmp_path):
    """(QA) DataLoader.from_tokens took uint64 ids of 2**63 and more, and its int64 batches
    gave them back as negative ids, in silence."""
    big = np.array([2**63 + 5, 1, 2, 3], dtype=np.uint64)
    with pytest.raises(DataError, match=r"below 2\*\*63.*9223372036854775813"):
        DataLoader.from_tokens(big, 1, 2)
    ok = DataLoader.from_tokens(np.array([7, 1, 2, 3], dtype=np.uint64), 1, 3)
    x, y = next(ok.eval_batches(1))
    assert x.tolist() == [[7, 1, 2]] and y.tolist() == [[1, 2, 3]]


def test_more_characters_than_a_shard_holds_names_the_text_and_gpt2(tmp_path, capsys):
    """(QA) A text of more than 65,536 distinct characters was tokenized whole, then refused
    with "prepare: the tokenizer has 66000 ids but shards hold uint16" (under `forge-ml
    train` too), naming neither the text nor a way out. It names both now, before any write."""
    chars = "".join(chr(c) for c in range(0x10000, 0x10000 + 66_000))
    text = tmp_path / "many.txt"
    text.write_text(chars * 2, encoding="utf-8")
    assert main(["prepare", str(text), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "many.txt" in err and "66,000" in err and "--tokenizer gpt2" in err
    assert not (tmp_path / "d").exists()
    with pytest.raises(DataError, match=r"many\.txt: the char tokenizer .*tokenizer='gpt2'"):
        prepare(text, tmp_path / "d")
    with pytest.raises(DataError, match=r"the shards for .*w: the char tokenizer has 66,000 ids"):
        write_prepared(tmp_path / "w", [0, 1], [1, 0], CharTokenizer(chars))
    assert not (tmp_path / "w").exists()
    # an alphabet of exactly 65,536 characters still fits
    info = prepare(_write(tmp_path / "fits.txt", chars[:65_536] * 2), tmp_path / "f")
    assert info["vocab_size"] == 65_536
    assert int(read_shard(tmp_path / "f" / "val.bin").max()) == 65_535


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path
