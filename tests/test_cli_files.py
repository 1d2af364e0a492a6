"""What the forge-ml commands may write and what they say when a file is missing, unreadable,
or cannot be written: `convert` writes only a new or empty folder, or (with --force) its own
earlier output, never the folder it reads; a full disk, a read-only filesystem, a permission
or a bad option is one line on stderr and exit status 2, with nothing touched."""
import errno
import json
import os
import shutil
import sys

import numpy as np
import pytest

from forge_ml.checkpoint import save_checkpoint
from forge_ml.cli import main
from forge_ml.data import read_shard, write_shard
from forge_ml.models.gpt2 import GPT2, GPT2Config

CHARS = "\n abehinorstqu"
TEXT = "to be or not to be that is the question\n" * 20


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A run folder as `forge-ml train` leaves it (ckpt/, data/, log.jsonl, loss.png) plus a
    note of the user's, in the current folder; no training needed."""
    monkeypatch.chdir(tmp_path)
    cfg = GPT2Config(vocab_size=len(CHARS), block_size=16, n_layer=1, n_head=2, n_embd=16)
    r = tmp_path / "run"
    save_checkpoint(r / "ckpt", GPT2.init(cfg, seed=0).state_dict(),
                    {"kind": "forge-ml-train", "config": cfg.to_dict(),
                     "tokenizer": {"kind": "char", "chars": CHARS}, "step": 3})
    ids = [CHARS.index(c) for c in TEXT]
    write_shard(r / "data" / "train.bin", ids)
    write_shard(r / "data" / "val.bin", ids[:200])
    (r / "log.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    (r / "loss.png").write_bytes(b"\x89PNG...")
    (r / "notes.txt").write_text("lr 3e-4 looked better")
    (tmp_path / "t.txt").write_text(TEXT)
    return r


def tree(root):
    """Every path under ``root`` with its bytes (None for a folder)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def fails(capsys, argv, *needles):
    """``main(argv)`` exits 2 with one line on stderr holding every needle, no traceback, and
    prints nothing on stdout."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    assert out == "", out
    return lines[0]


def denied_open(monkeypatch, suffix):
    """``open`` raises PermissionError for paths ending in ``suffix`` (tests run as root, where
    chmod does not take a file away)."""
    real = open

    def fake(file, *a, **k):
        if str(file).endswith(suffix):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real(file, *a, **k)

    monkeypatch.setattr("builtins.open", fake)


# -- convert: where it may write -----------------------------------------------------------------


@pytest.mark.parametrize("out,needle", [
    ("run", "it is run, the folder this command reads from"), ("run/ckpt", "the folder this command reads"),
    (".", "it holds run, which this command reads"), ("..", "it holds run"),
    ("run/data", "not empty (it holds train.bin, val.bin)"), ("elsewhere", "not empty (it holds thesis.tex)"),
])
def test_convert_never_empties_a_folder_it_did_not_write(run, capsys, out, needle):
    """Into a run folder, into the checkpoint it reads, into the current folder or one holding
    it, into a folder of the user's: refused, one line, nothing touched (`--out run` deleted
    ckpt/, data/, log.jsonl, loss.png and notes.txt; `--out .` was a ValueError traceback)."""
    (run.parent / "elsewhere").mkdir()
    (run.parent / "elsewhere" / "thesis.tex").write_text("mine")
    before = tree(run.parent)
    for force in ([], ["--force"]):
        fails(capsys, ["convert", "--to-hf", "run", "--out", out, *force], needle)
    assert tree(run.parent) == before


def test_convert_never_writes_the_current_folder(run, capsys, monkeypatch):
    (run.parent / "empty").mkdir()
    monkeypatch.chdir(run.parent / "empty")
    fails(capsys, ["convert", "--to-hf", "../run", "--out", ".", "--force"], "current folder")
    assert os.listdir(".") == []


@pytest.mark.parametrize("first", [True, False])
def test_sigterm_during_convert_leaves_the_output_as_it_was(run, capsys, monkeypatch, first):
    """A QA report: SIGTERM midway through convert ended the process where it was, leaving
    <out>.tmp (sometimes holding a whole model) and the lock, without a word. It now ends as
    Ctrl-C does: the output as it was (none, or the earlier conversion), nothing beside it,
    exit 143 with one line."""
    import signal
    import threading

    import forge_ml.hf as hf
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")   # (the SIGTERM would end the runner)
    if not first:
        assert main(["convert", "--to-hf", "run", "--out", "hf"]) == 0
    capsys.readouterr()
    before = tree(run.parent)
    real = hf.write_safetensors

    def killed(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
    monkeypatch.setattr(hf, "write_safetensors", killed)
    argv = ["convert", "--to-hf", "run", "--out", "hf"] + ([] if first else ["--force"])
    assert main(argv) == 143
    err = capsys.readouterr().err.strip()
    assert err == "forge-ml convert: stopped by SIGTERM; hf is as it was", err
    assert tree(run.parent) == before
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_convert_to_a_dangling_link_says_so(run, capsys):
    """It said "dang exists and is not a folder"."""
    os.symlink("nowhere/at/all", "dang")
    fails(capsys, ["convert", "--to-hf", "run", "--out", "dang"], "dang is a link to nothing",
          "nowhere/at/all")
    assert os.path.islink("dang") and not os.path.exists("dang")


def test_convert_from_hf_never_writes_into_its_source(run, capsys):
    assert main(["convert", "--to-hf", "run", "--out", "hf"]) == 0
    capsys.readouterr()
    before = tree(run.parent)
    fails(capsys, ["convert", "--from-hf", "hf", "--out", "hf", "--force"], "refusing to write hf", "reads")
    fails(capsys, ["convert", "--from-hf", "hf", "--out", "run", "--force"], "run is not empty", "ckpt")
    # a training checkpoint (optimizer state, data position) is not an earlier conversion
    fails(capsys, ["convert", "--from-hf", "hf", "--out", "run/ckpt", "--force"], "run/ckpt is not empty")
    assert tree(run.parent) == before


def test_convert_never_writes_inside_the_model_folder_it_reads(run, capsys):
    """`--to-hf run --out run/ckpt/exp` was accepted, and the run's next save refused its own
    checkpoint folder (a folder it did not write inside it); `--from-hf hf --out hf/sub`
    likewise. Beside the checkpoint, inside the run folder, stays allowed."""
    assert main(["convert", "--to-hf", "run", "--out", "hf"]) == 0
    capsys.readouterr()
    before = tree(run.parent)
    fails(capsys, ["convert", "--to-hf", "run", "--out", "run/ckpt/exp"], "run/ckpt/exp: it is inside",
          "the model folder this command reads")
    fails(capsys, ["convert", "--from-hf", "hf", "--out", "hf/sub"], "hf/sub: it is inside")
    assert tree(run.parent) == before
    assert main(["convert", "--to-hf", "run", "--out", "run/exp"]) == 0


@pytest.mark.parametrize("argv", [["--from-hf", "", "--out", "o"], ["--to-hf", "", "--out", "o"],
                                  ["--to-hf", "run", "--out", " "]])
def test_convert_with_an_empty_path_says_which(run, capsys, argv):
    """`--from-hf ''` took the --to-hf branch with None: a TypeError traceback; `--to-hf ''`
    named ".", `--out ''` "refusing to write : ..."."""
    flag = argv[0] if argv[1].strip() == "" else "--out"
    before = tree(run.parent)
    fails(capsys, ["convert", *argv], f"{flag} is empty; expected a folder")
    assert tree(run.parent) == before


def test_convert_writes_a_new_or_empty_folder_and_replaces_its_own_export_with_force(run, capsys):
    (run.parent / "empty").mkdir()
    assert main(["convert", "--to-hf", "run", "--out", "empty"]) == 0
    assert main(["convert", "--to-hf", "run", "--out", "new/hf"]) == 0
    assert main(["convert", "--to-hf", "run", "--out", "run/hf"]) == 0  # a new folder inside the run
    capsys.readouterr()
    hf = run.parent / "new" / "hf"
    assert sorted(os.listdir(hf)) == ["config.json", "forge_ml_tokenizer.json", "model.safetensors",
                                      "tokenizer.json", "tokenizer_config.json"]
    before = tree(run.parent)
    fails(capsys, ["convert", "--to-hf", "run", "--out", "new/hf"], "earlier Hugging Face export", "--force")
    assert tree(run.parent) == before
    assert main(["convert", "--to-hf", "run", "--out", "new/hf", "--force"]) == 0
    assert tree(run.parent) == before                                   # the same bytes again
    # checkpoints the same way
    assert main(["convert", "--from-hf", "new/hf", "--out", "ck"]) == 0
    capsys.readouterr()
    fails(capsys, ["convert", "--from-hf", "new/hf", "--out", "ck"], "earlier forge-ml checkpoint", "--force")
    assert main(["convert", "--from-hf", "new/hf", "--out", "ck", "--force"]) == 0
    capsys.readouterr()
    # an export the user added a file to is theirs now
    (hf / "README.md").write_text("my model card")
    before = tree(run.parent)
    fails(capsys, ["convert", "--to-hf", "run", "--out", "new/hf", "--force"], "not empty", "README.md",
          "--force replaces only an earlier Hugging Face export: a folder of its files alone")
    assert tree(run.parent) == before
    # refused with --force for what they are (both said "a folder of its files alone", which
    # each was: a QA report): a run's own checkpoint, and a link to an earlier conversion
    os.symlink("ck", "cklink")
    before = tree(run.parent)
    fails(capsys, ["convert", "--from-hf", "new/hf", "--out", "run/ckpt", "--force"],
          "it is a training run's checkpoint (its optimizer state and data position), not an "
          "earlier forge-ml checkpoint")
    fails(capsys, ["convert", "--from-hf", "new/hf", "--out", "cklink", "--force"],
          "it is a symbolic link (to ck)", "give the folder itself")
    assert tree(run.parent) == before


# -- convert: full disk, read-only filesystem ----------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
@pytest.mark.parametrize("way", ["--to-hf", "--from-hf"])
def test_convert_on_a_full_or_read_only_disk_keeps_the_earlier_output(run, capsys, monkeypatch, code, way):
    import safetensors.numpy
    assert main(["convert", "--to-hf", "run", "--out", "hf"]) == 0
    assert main(["convert", "--from-hf", "hf", "--out", "ck"]) == 0
    capsys.readouterr()
    before = tree(run.parent)

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 64)                    # part of the file, then the error
        raise OSError(code, os.strerror(code), filename)

    monkeypatch.setattr(safetensors.numpy, "save_file", broken)
    argv = ["convert", "--to-hf", "run", "--out", "hf"] if way == "--to-hf" else \
        ["convert", "--from-hf", "hf", "--out", "ck"]
    fails(capsys, argv + ["--force"], "cannot write", os.strerror(code), "unchanged")
    assert tree(run.parent) == before              # the earlier export kept, no .tmp left


# -- unreadable or missing files -----------------------------------------------------------------


def test_an_unreadable_hf_weights_file_is_named_with_its_cause(run, capsys, monkeypatch):
    assert main(["convert", "--to-hf", "run", "--out", "hf"]) == 0
    capsys.readouterr()
    denied_open(monkeypatch, "model.safetensors")
    for argv in (["sample", "--ckpt", "hf"], ["convert", "--from-hf", "hf", "--out", "ck"],
                 ["eval", "--ckpt", "hf", "--data", "t.txt"]):
        fails(capsys, argv, "hf/model.safetensors", "Permission denied")
    assert not (run.parent / "ck").exists()


def test_an_unreadable_checkpoint_is_named_with_its_cause(run, capsys, monkeypatch):
    denied_open(monkeypatch, "state.json")
    fails(capsys, ["sample", "--ckpt", "run"], "run/ckpt/state.json", "Permission denied")
    fails(capsys, ["convert", "--to-hf", "run", "--out", "hf"], "state.json", "Permission denied")


def test_eval_data_unreadable_or_missing(run, capsys, monkeypatch):
    fails(capsys, ["eval", "--ckpt", "run", "--data", "nope.bin"], "nope.bin", "no such file")
    fails(capsys, ["eval", "--ckpt", "run", "--data", "run"], "run", "folder")
    denied_open(monkeypatch, "val.bin")
    fails(capsys, ["eval", "--ckpt", "run", "--data", "run/data/val.bin"], "val.bin", "Permission denied")
    denied_open(monkeypatch, "t.txt")
    fails(capsys, ["eval", "--ckpt", "run", "--data", "t.txt"], "t.txt", "Permission denied")
    # a character the run's tokenizer lacks: said with the file and the checkpoint
    with open("om.txt", "w", encoding="utf-8") as f:
        f.write("to be or not to be \u03a9 " * 20)
    fails(capsys, ["eval", "--ckpt", "run", "--data", "om.txt"],
          "--data om.txt cannot be tokenized with run's tokenizer", "'\u03a9'")


def test_sample_missing_checkpoint(run, capsys):
    fails(capsys, ["sample", "--ckpt", "nowhere"], "nowhere", "not found")


# -- options checked before any work ---------------------------------------------------------------


@pytest.mark.parametrize("opt,needle", [
    (["--temperature", "-0.5"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    (["--temperature", "1e308"], "--temperature must be a number >= 0 (0 is greedy) and at most 3.4e38"),
    (["--top-k", "-1"], "--top-k"), (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"), (["--seed", "-3"], "--seed"),
    (["--prompt", "to be ZZ"], "'Z'"),
])
def test_sample_checks_its_options_before_printing_the_prompt(run, capsys, opt, needle):
    argv = ["sample", "--ckpt", "run", "--max-new-tokens", "4"] + (["--prompt", "to be"] if "--prompt" not in opt else [])
    fails(capsys, argv + opt, needle)


def test_sample_finds_a_checkpoint_in_the_half_renamed_state(run, capsys):
    """A save killed between its two renames leaves ckpt.old and no ckpt; `--resume` recovers
    from that, and so does sample, given the run or the checkpoint path."""
    os.rename(run / "ckpt", run / "ckpt.old")
    (run / ".ckpt.swap").touch()        # the killed save's marker
    for ckpt in ("run", "run/ckpt"):
        assert main(["sample", "--ckpt", ckpt, "--prompt", "to", "--max-new-tokens", "5", "--seed", "1"]) == 0
    a, b = capsys.readouterr().out.splitlines()
    assert a == b and a.startswith("to") and len(a) == 7
    assert main(["eval", "--ckpt", "run/ckpt", "--data", "run/data/val.bin"]) == 0


@pytest.mark.parametrize("n", ["0", "-2"])
def test_eval_max_batches_must_be_at_least_one(run, capsys, n):
    fails(capsys, ["eval", "--ckpt", "run", "--data", "run/data/val.bin", "--max-batches", n],
          "--max-batches must be >= 1", n)
    assert main(["eval", "--ckpt", "run", "--data", "run/data/val.bin", "--max-batches", "1"]) == 0
    assert "in 1 batch of" in capsys.readouterr().out


def test_eval_cap_past_the_data_a_shard_named_otherwise_and_short_data(run, capsys):
    """A --max-batches past the whole batches dropped the tail windows (a cap never reached
    changed the loss); a shard not named *.bin was read as text ('not UTF-8 ... iconv'); data
    shorter than the model's context gave shorter windows without saying so; --data '' and
    prepare --out '' took the working folder."""
    base = ["eval", "--ckpt", "run", "--data", "run/data/val.bin", "--batch-size", "7"]
    assert main(base) == 0
    whole = capsys.readouterr().out
    assert main(base + ["--max-batches", "100000"]) == 0
    assert capsys.readouterr().out.split(",")[0] == whole.split(",")[0]
    shutil.copy("run/data/val.bin", "val.dat")
    assert main(["eval", "--ckpt", "run", "--data", "val.dat", "--batch-size", "7"]) == 0
    assert capsys.readouterr().out.split("(")[0] == whole.split("(")[0]
    with open("short.txt", "w") as f:
        f.write("to be or")
    assert main(["eval", "--ckpt", "run", "--data", "short.txt"]) == 0
    assert "shorter than the model's context of 16" in capsys.readouterr().out
    fails(capsys, ["eval", "--ckpt", "run", "--data", ""], "--data is empty")
    fails(capsys, ["prepare", "t.txt", "--out", ""], "--out is empty")
    assert not os.path.exists("train.bin")


# -- bench ---------------------------------------------------------------------------------------


def test_bench_without_a_benchmarks_folder_says_where_it_looked(tmp_path, capsys, monkeypatch):
    """An installed package has no benchmarks/ (they come with a clone): the error names the
    folders looked in and says so, instead of "available: none found"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("forge_ml.cli._bench_dirs", lambda: [tmp_path / "benchmarks"])
    fails(capsys, ["bench", "train_cpu"], "'train_cpu'", str(tmp_path / "benchmarks"),
          "clone")
    assert main(["bench", "--list"]) == 0
    assert str(tmp_path / "benchmarks") in capsys.readouterr().out


def test_bench_with_a_missing_dependency_names_the_module(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "peer_demo.py").write_text("import torch\nprint('ran')\n")
    monkeypatch.setitem(sys.modules, "torch", None)      # as if torch were not installed
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    fails(capsys, ["bench", "peer_demo"], "peer_demo", "'torch'", "not installed")


def test_eval_of_a_loose_shard_takes_a_hf_folder_whose_tokenizer_is_not_gpt2s(tmp_path, capsys):
    """A QA report: a transformers folder with its own 97-token vocabulary (vocab.json not
    GPT-2's) was refused by eval on a token shard, "its text would be wrong", though a shard is
    ids alone; it evaluates now (the loss of the same weights under an unreadable tokenizer and
    a readable one agree), while text data is still refused."""
    import json as _json

    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2

    cfg = {"vocab_size": 97, "block_size": 16, "n_layer": 1, "n_head": 1, "n_embd": 8}
    rs = np.random.default_rng(0)
    w = {k: (rs.standard_normal(s) * 0.1).astype(np.float32) for k, s in gpt2_param_shapes(cfg).items()}
    save_hf_gpt2(tmp_path / "plain", cfg, w)
    save_hf_gpt2(tmp_path / "own", cfg, w)
    (tmp_path / "own" / "vocab.json").write_text(_json.dumps({chr(65 + i): i for i in range(97)}))
    write_shard(tmp_path / "ids.bin", rs.integers(0, 97, 500))
    (tmp_path / "t.txt").write_text("hello there\n" * 20)
    losses = []
    for d in ("plain", "own"):
        assert main(["eval", "--ckpt", str(tmp_path / d), "--data", str(tmp_path / "ids.bin")]) == 0
        losses.append(capsys.readouterr().out)
    assert losses[0] == losses[1].replace(str(tmp_path / "own"), str(tmp_path / "plain")), losses
    assert main(["eval", "--ckpt", str(tmp_path / "own"), "--data", str(tmp_path / "t.txt")]) == 2
    assert "not GPT-2's" in capsys.readouterr().err


def test_eval_of_val_shards_whose_last_is_shorter_than_a_window(run, capsys):
    """(QA) A val folder of two shards, the last holding fewer tokens than one window, was
    refused ("block_size=16 needs at least 17"), though windows run across shards: it gives the
    loss of the same tokens in one shard."""
    ids = read_shard(run / "data" / "val.bin")
    os.makedirs("two")
    write_shard("two/x_val_000.bin", ids[:-9])
    write_shard("two/x_val_001.bin", ids[-9:])
    with open("two/tokenizer.json", "w") as f:    # the run's tokenizer, as prepare writes it
        json.dump({"kind": "char", "chars": CHARS}, f)
    assert main(["eval", "--ckpt", "run", "--data", "run/data/val.bin"]) == 0
    one = capsys.readouterr().out
    assert main(["eval", "--ckpt", "run", "--data", "two"]) == 0
    two = capsys.readouterr().out
    assert one.split("(")[0] == two.split("(")[0] and "of 2 val shards" in two


def test_eval_names_the_device_refused_and_reads_a_damaged_run_config(run, capsys):
    """(QA) --device cpu:1 was refused as "device cpu: ..."; a state.json whose train_config was
    not an object (hand-edited) gave a traceback."""
    fails(capsys, ["eval", "--ckpt", "run", "--data", "run/data/val.bin", "--device", "cpu:1"],
          "device cpu:1:", "one device, cpu:0")
    p = run / "ckpt" / "state.json"
    state = json.loads(p.read_text())
    state["meta"]["train_config"] = ["x"]
    p.write_text(json.dumps(state))
    assert main(["eval", "--ckpt", "run", "--data", "run/data/val.bin"]) == 0
    assert "loss " in capsys.readouterr().out


def test_a_checkpoints_unreadable_tokenizer_is_said_with_the_checkpoint(run, capsys):
    """A QA report: meta.tokenizer {"kind": "char"} failed with "CharTokenizer.from_dict: the
    dict has no 'chars' key", naming neither the checkpoint nor its state.json."""
    p = run / "ckpt" / "state.json"
    state = json.loads(p.read_text())
    state["meta"]["tokenizer"] = {"kind": "char"}
    p.write_text(json.dumps(state))
    fails(capsys, ["sample", "--ckpt", "run", "--max-new-tokens", "2"],
          "ckpt: the tokenizer its state.json records cannot be read", "chars")
