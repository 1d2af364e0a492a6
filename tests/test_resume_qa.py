"""QA of runs that must not lose data and must resume exactly: a stop during the setup, after
the data was prepared, and a SIGKILL midway through a checkpoint's swap. Tiny char models on
the CPU."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import forge_ml.train as train_mod
from forge_ml.checkpoint import load_checkpoint
from forge_ml.cli import main
from forge_ml.train import Interrupted, TrainConfig, Trainer, read_log

SRC = str(Path(__file__).resolve().parents[1] / "src")
TEXT = "the quick brown fox jumps over the lazy dog\n" * 100
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--eval-interval", "3", "--sample-interval", "0", "--no-progress",
        "--log-interval", "0", "--warmup", "2", "--seed", "5"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text(TEXT)
    return tmp_path


def _records(run):
    """The log's records without their timings (which differ from run to run)."""
    drop = ("tokens_per_s", "time", "dt_ms", "blas_threads")
    return [{k: v for k, v in r.items() if k not in drop} for r in read_log(Path(run) / "log.jsonl")[0]]


def _stop_in_model_init(monkeypatch, sig):
    """Send ``sig`` to this process as the setup builds the model: after data/ is written."""
    init = train_mod.GPT2.init

    def stopped(*a, **kw):
        os.kill(os.getpid(), sig)
        return init(*a, **kw)
    monkeypatch.setattr(train_mod.GPT2, "init", staticmethod(stopped))
    return init


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_a_stop_after_the_data_is_prepared_lets_the_same_command_start_again(workdir, monkeypatch):
    """A SIGTERM (or Ctrl-C) during the setup, after data/ was prepared (as the model is built:
    seconds for a GPT-2 size), said "stopped by SIGTERM during setup, before the first step;
    the same command starts it again", but left data/ and train.lock, and the same command was
    refused ("holds a run stopped before its first checkpoint ... add --overwrite"). What the
    setup wrote is taken back, as ``Interrupted`` says, and the same command trains."""
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]
    init = _stop_in_model_init(monkeypatch, signal.SIGTERM)
    assert main(argv) == 143
    assert not Path("r").exists(), sorted(os.listdir("r"))
    cfg = TrainConfig(data="t.txt", out_dir="lib", n_layer=1, n_head=2, n_embd=16, block_size=16,
                      batch_size=4, max_steps=2, eval_interval=0, sample_interval=0, progress=False)
    with pytest.raises(Interrupted, match="during setup"):
        Trainer(cfg, log=None)
    assert not Path("lib").exists()
    Path("mine").mkdir()
    (Path("mine") / "notes.txt").write_text("kept")   # a user's file in --out stays, with its folder
    _stop_in_model_init(monkeypatch, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        Trainer(TrainConfig(**dict(cfg.to_dict(), out_dir="mine")), log=None)
    assert sorted(os.listdir("mine")) == ["notes.txt"]
    monkeypatch.setattr(train_mod.GPT2, "init", staticmethod(init))
    assert main(argv) == 0 and Trainer(cfg, log=None).train()["step"] == 2
    assert Trainer(TrainConfig(**dict(cfg.to_dict(), out_dir="mine")), log=None).train()["step"] == 2


_KILL_IN_SWAP = """
import os, signal, sys
from forge_ml.cli import main
real, seen = os.rename, [0]
def rename(src, dst, *a, **kw):
    real(src, dst, *a, **kw)
    if os.path.basename(str(src)) == "ckpt":      # the old checkpoint moved aside
        seen[0] += 1
        if seen[0] == int(sys.argv[1]):
            os.kill(os.getpid(), signal.SIGKILL)
os.rename = rename
sys.exit(main(sys.argv[2:]))
"""


def test_sigkill_between_a_checkpoints_renames_resumes_bit_for_bit(workdir):
    """kill -9 after the old checkpoint was moved aside and before the new one was moved in
    (ckpt/ gone, ckpt.old/ and ckpt.tmp/ there): --resume goes on from the last complete
    checkpoint, and the final weights and every logged record equal an uninterrupted run's."""
    argv = ["train", "--data", "t.txt", *TINY, "--max-steps", "9", "--checkpoint-interval", "2"]
    assert main(argv + ["--out", "ref"]) == 0
    env = dict(os.environ, PYTHONPATH=SRC, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _KILL_IN_SWAP, "2", *argv, "--out", "run"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert not Path("run/ckpt").exists() and Path("run/ckpt.old/model.safetensors").is_file()
    assert main(argv + ["--out", "run", "--resume"]) == 0
    assert _records("run") == _records("ref")
    (ta, ma), (tb, mb) = load_checkpoint("ref/ckpt"), load_checkpoint("run/ckpt")
    assert ma["step"] == mb["step"] == 9 and ma["data"] == mb["data"] and sorted(ta) == sorted(tb)
    assert all(np.array_equal(ta[k], tb[k]) for k in ta)
    assert sorted(os.listdir("run")) == sorted(os.listdir("ref"))


def test_replace_file_takes_a_str_path(tmp_path):
    """``runs.replace_file`` with a str path (as ``read_log`` and the others take) raised
    AttributeError: 'str' object has no attribute 'name'."""
    from forge_ml.runs import replace_file
    p = tmp_path / "state.json"
    replace_file(str(p), '{"step": 1}')
    replace_file(str(p), b'{"step": 2}')
    assert p.read_text() == '{"step": 2}' and os.listdir(tmp_path) == ["state.json"]
