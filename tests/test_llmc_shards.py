"""``forge-ml train --data FOLDER`` and ``forge-ml eval --data FOLDER`` on a folder of llm.c token
shards (``*train*.bin``, ``*val*.bin``, GPT-2 ids, no tokenizer.json), through ``main([...])``."""
import json
from pathlib import Path

import numpy as np
import pytest

from forge_ml.checkpoint import load_checkpoint
from forge_ml.cli import main
from forge_ml.data import write_shard
from forge_ml.runs import read_log
from forge_ml.tokenizer import load_tokenizer

from test_cli import TINY, _fails

WORDS = "the king is dead long live the queen and all her loyal subjects who cheer".split()


def _gpt2_ids(n: int, seed: int) -> np.ndarray:
    """``n`` GPT-2 token ids of a random text of English words."""
    rs = np.random.default_rng(seed)
    ids = load_tokenizer("gpt2").encode(" ".join(rs.choice(WORDS, size=n)))
    assert len(ids) >= n
    return np.asarray(ids[:n])


@pytest.fixture
def llmc(tmp_path, monkeypatch):
    """A folder as llm.c's dev/data/<name>/ holds it: 3 train shards, 1 val shard, no tokenizer.json."""
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "fw"
    for i in range(3):
        write_shard(d / f"fw_train_{i + 1:06d}.bin", _gpt2_ids(300, i))
    write_shard(d / "fw_val_000000.bin", _gpt2_ids(250, 9))
    return d


def _losses(run) -> list:
    return [r["loss"] for r in read_log(Path(run) / "log.jsonl")[0] if "loss" in r]


def test_train_on_llmc_shards_and_resume_exactly(llmc, capsys):
    assert main(["train", "--data", "fw", "--out", "full", "--max-steps", "3", *TINY]) == 0
    out = capsys.readouterr().out
    assert "3 train shards (900 tokens) and 1 val shard (250 tokens)" in out and "GPT-2's BPE" in out, out
    assert main(["train", "--data", "fw", "--out", "cut", "--max-steps", "1", *TINY]) == 0
    assert main(["train", "--out", "cut", "--resume", "--max-steps", "3", *TINY]) == 0
    assert _losses("cut") == _losses("full") and len(_losses("full")) == 3
    (a, ma), (b, mb) = load_checkpoint(Path("full/ckpt")), load_checkpoint(Path("cut/ckpt"))
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert ma["tokenizer"] == {"kind": "gpt2"} and ma["train_config"]["tokenizer"] == "gpt2"
    assert ma["config"]["vocab_size"] == 50257
    assert [n for n, _ in ma["shards"]["train"]] == [f"fw_train_{i:06d}.bin" for i in (1, 2, 3)]
    assert ma["shards"]["val"] == [["fw_val_000000.bin", 1024 + 2 * 250]] and mb["shards"] == ma["shards"]


@pytest.mark.parametrize("change", ["add", "remove", "resize"])
def test_resume_refuses_a_folder_whose_shards_changed(llmc, capsys, change):
    assert main(["train", "--data", "fw", "--out", "r", "--max-steps", "1", *TINY]) == 0
    if change == "add":
        write_shard(llmc / "fw_train_000004.bin", _gpt2_ids(300, 4))
        needle = "train shards new: fw_train_000004.bin"
    elif change == "remove":
        (llmc / "fw_train_000002.bin").unlink()
        needle = "train shards missing: fw_train_000002.bin"
    else:
        write_shard(llmc / "fw_val_000000.bin", _gpt2_ids(260, 9))
        needle = "val shards changed size: fw_val_000000.bin (1,524 -> 1,544 bytes)"
    capsys.readouterr()
    before = (Path("r/ckpt/state.json").read_bytes(), Path("r/log.jsonl").read_bytes())
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "2", *TINY], "cannot resume", needle,
           "--init-from r --data")
    assert (Path("r/ckpt/state.json").read_bytes(), Path("r/log.jsonl").read_bytes()) == before


def test_a_char_tokenizer_cannot_be_guessed_for_llmc_shards(llmc, capsys):
    _fails(capsys, ["train", "--data", "fw", "--out", "r", "--tokenizer", "char", *TINY],
           "--tokenizer char", "no tokenizer.json", "GPT-2")
    assert not Path("r").exists()
    assert main(["train", "--data", "fw", "--out", "g", "--tokenizer", "gpt2", "--max-steps", "1", *TINY]) == 0


def test_a_folder_without_train_shards_says_what_it_holds(llmc, capsys):
    for p in llmc.glob("*train*"):
        p.unlink()
    (llmc / "README.txt").write_text("x")
    _fails(capsys, ["train", "--data", "fw", "--out", "r", *TINY], "data folder fw has no train shard",
           "README.txt, fw_val_000000.bin", "*train*.bin and *val*.bin")
    assert not Path("r").exists()


def test_eval_on_an_llmc_folder_covers_its_val_shards(llmc, capsys):
    assert main(["train", "--data", "fw", "--out", "r", "--max-steps", "2", *TINY]) == 0
    full = [r for r in read_log("r/log.jsonl")[0] if r.get("val_kind") == "full"][-1]
    assert full["val_windows"] == (250 - 1) // 16
    capsys.readouterr()
    assert main(["eval", "--ckpt", "r", "--data", "fw"]) == 0
    line = capsys.readouterr().out
    assert f"of 1 val shard in fw: {full['val_windows']} windows of 16" in line, line
    assert float(line.split()[1]) == pytest.approx(full["val_loss"], abs=1e-4)
    for p in llmc.glob("*train*"):   # evaluation needs only the val shards
        p.unlink()
    assert main(["eval", "--ckpt", "r", "--data", "fw"]) == 0
    assert float(capsys.readouterr().out.split()[1]) == pytest.approx(full["val_loss"], abs=1e-4)
    (llmc / "fw_val_000000.bin").unlink()
    _fails(capsys, ["eval", "--ckpt", "r", "--data", "fw"], "data folder fw has no val shard", "*val*.bin")


def test_eval_refuses_a_folder_made_with_another_tokenizer(llmc, capsys):
    """eval --data FOLDER read the folder's val shards whatever its tokenizer.json said: a char
    run evaluated on a folder prepared from other text (ids that fit its vocabulary, other
    characters) got a loss, silently wrong. Now the folder's tokenizer must be the checkpoint's
    (and llm.c's shards, GPT-2 ids, need a GPT-2 model)."""
    Path("a.txt").write_text("to be or not to be, that is the question\n" * 60)
    Path("b.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    assert main(["prepare", "a.txt", "--out", "pa"]) == 0 and main(["prepare", "b.txt", "--out", "pb"]) == 0
    assert main(["train", "--data", "pb", "--out", "r", "--max-steps", "1", *TINY]) == 0
    capsys.readouterr()
    assert main(["eval", "--ckpt", "r", "--data", "pb"]) == 0
    capsys.readouterr()
    _fails(capsys, ["eval", "--ckpt", "r", "--data", "pa"], "pa/tokenizer.json", "another tokenizer", "char")
    _fails(capsys, ["eval", "--ckpt", "r", "--data", "fw"], "no tokenizer.json", "GPT-2 ids", "char tokenizer")
    # one shard, as the README writes it (--data FOLDER/val.bin): the tokenizer.json beside it
    # counts as the folder's did (a new user got a loss from the other text's ids, no error)
    assert main(["eval", "--ckpt", "r", "--data", "pb/val.bin"]) == 0
    capsys.readouterr()
    _fails(capsys, ["eval", "--ckpt", "r", "--data", "pa/val.bin"], "the shard pa/val.bin",
           "another tokenizer", "char")


def test_a_run_on_llmc_shards_resumes_from_another_folder(llmc, capsys, monkeypatch):
    """The run recorded --data fw (relative); resumed from elsewhere, it finds the folder it recorded."""
    assert main(["train", "--data", "fw", "--out", "r", "--max-steps", "1", *TINY]) == 0
    (llmc.parent / "elsewhere").mkdir()
    monkeypatch.chdir(llmc.parent / "elsewhere")
    assert main(["train", "--out", "../r", "--resume", "--max-steps", "2", *TINY]) == 0
    assert len(_losses("../r")) == 2


def test_the_final_eval_of_a_large_val_set_is_capped_and_says_so(llmc, capsys):
    assert main(["train", "--data", "fw", "--out", "r", "--max-steps", "2", "--final-eval-windows", "5", *TINY]) == 0
    out = capsys.readouterr().out
    last = [r for r in read_log("r/log.jsonl")[0] if "val_loss" in r][-1]
    assert last["val_kind"] == "capped" and last["val_windows"] == 5 and last["val_windows_total"] == 15
    assert "the first 5 of the val shards' 15 windows" in out, out
    assert load_checkpoint(Path("r/ckpt"))[1]["val_kind"] == "capped"
    assert main(["eval", "--ckpt", "r", "--data", "fw", "--batch-size", "5", "--max-batches", "1"]) == 0
    line = capsys.readouterr().out
    assert "5 windows of 16" in line and float(line.split()[1]) == pytest.approx(last["val_loss"], abs=1e-4)


def test_a_tokenizer_json_beside_llmc_shards_is_used(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    d = tmp_path / "chars"
    rs = np.random.default_rng(0)
    write_shard(d / "c_train.bin", rs.integers(0, 5, 200))
    write_shard(d / "c_val.bin", rs.integers(0, 5, 100))
    (d / "tokenizer.json").write_text(json.dumps({"kind": "char", "chars": "abcde"}))
    assert main(["train", "--data", "chars", "--out", "r", "--max-steps", "1", *TINY]) == 0
    assert "tokenizer chars/tokenizer.json" in capsys.readouterr().out
    meta = load_checkpoint(Path("r/ckpt"))[1]
    assert meta["config"]["vocab_size"] == 5 and meta["train_config"]["tokenizer"] == "char"
    write_shard(d / "c_val.bin", [1, 2, 7] * 30)
    _fails(capsys, ["train", "--data", "chars", "--out", "r2", *TINY], "c_val.bin holds token 7",
           "has 5 ids")


def test_each_shard_is_checked_at_the_start(llmc, capsys):
    write_shard(llmc / "fw_train_000002.bin", _gpt2_ids(10, 2))
    _fails(capsys, ["train", "--data", "fw", "--out", "r", *TINY], "fw_train_000002.bin holds 10 tokens",
           "--block-size 16")
    raw = bytearray((llmc / "fw_train_000003.bin").read_bytes())
    raw[4:8] = (2).to_bytes(4, "little")   # another shard version
    (llmc / "fw_train_000003.bin").write_bytes(bytes(raw))
    write_shard(llmc / "fw_train_000002.bin", _gpt2_ids(300, 2))
    _fails(capsys, ["train", "--data", "fw", "--out", "r", *TINY], "expected shard version 1",
           "got 2 in file fw/fw_train_000003.bin")
    assert not Path("r").exists()


def test_shards_named_like_prepare_s_without_tokenizer_json_need_tokenizer_gpt2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_shard(tmp_path / "d" / "train.bin", _gpt2_ids(300, 0))
    write_shard(tmp_path / "d" / "val.bin", _gpt2_ids(100, 1))
    _fails(capsys, ["train", "--data", "d", "--out", "r", *TINY], "lacks tokenizer.json", "--tokenizer gpt2")
    assert main(["train", "--data", "d", "--out", "r", "--tokenizer", "gpt2", "--max-steps", "1", *TINY]) == 0


def test_a_pattern_or_a_shard_given_to_data_names_the_folder(llmc, capsys):
    _fails(capsys, ["train", "--data", "fw/fw_train_*.bin", "--out", "r", *TINY],
           "a pattern is not taken", "--data fw)")
    _fails(capsys, ["train", "--data", "fw/fw_train_000001.bin", "--out", "r", *TINY],
           "is a token shard", "--data fw)")
