"""Runs that lose nothing (issue 13): exact resume after SIGINT / SIGTERM, no run replaced
without --overwrite, one trainer per run folder, a log that never stops a run, options checked
before any work, write failures as one line, the user's umask, the final evaluation over the
whole validation shard, BLAS threads, fine-tuning with --init-from, the origin of a NaN, and
--batch-size auto. Tiny char models on the CPU."""
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import forge_ml.train as train_mod
from forge_ml.checkpoint import load_checkpoint, save_checkpoint
from forge_ml import blas
from forge_ml.cli import main
from forge_ml.data import DataLoader
from forge_ml.errors import ConfigError, OutOfMemoryError, TrainingError
from forge_ml.runs import RunLock
from forge_ml.train import Interrupted, RunError, TrainConfig, Trainer, read_log, search_batch_size
from test_cli import _fails, holding  # _fails: main(argv) exits 2 with one line, no traceback

SRC = str(Path(__file__).resolve().parents[1] / "src")
TEXT = "to be or not to be that is the question\n" * 120
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--eval-interval", "0", "--sample-interval", "0", "--no-progress",
        "--checkpoint-interval", "0", "--seed", "3"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text(TEXT)
    return tmp_path


def _cfg(out, **kw):
    base = dict(data="t.txt", out_dir=str(out), n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4,
                max_steps=4, lr=1e-2, warmup=2, eval_interval=0, eval_iters=2, sample_interval=0,
                checkpoint_interval=0, progress=False, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def _snapshot(folder):
    """Every file under ``folder`` with its bytes and mtime (train.lock aside)."""
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and p.name != "train.lock"}


def _train_losses(run):
    return [r["loss"] for r in read_log(Path(run) / "log.jsonl")[0] if "loss" in r]


def _same_checkpoints(a, b):
    ta, ma = load_checkpoint(Path(a) / "ckpt")
    tb, mb = load_checkpoint(Path(b) / "ckpt")
    assert ma["step"] == mb["step"] and ma["data"] == mb["data"]
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert np.array_equal(ta[k], tb[k]), k


# -- 2. SIGINT / SIGTERM: a consistent checkpoint, then an exact resume ------------------------------


def test_sigint_and_sigterm_then_resume_equal_an_uninterrupted_run(workdir):
    """A real ``python -m forge_ml train`` stopped by a signal mid-run, then --resume: the final
    checkpoint and every logged loss equal an uninterrupted run's, bit for bit."""
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "forge_ml", "train", "--data", "t.txt", *TINY, "--max-steps", "800",
            "--log-interval", "1"]
    ref = subprocess.run(args + ["--out", "ref"], env=env, capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    for sig, status in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        run = f"run_{sig.name}"
        p = subprocess.Popen(args + ["--out", run], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        for line in p.stdout:  # let it take a few steps, then stop it in the middle of one
            if line.startswith("step") and "/800" in line and int(line.split()[1].split("/")[0]) >= 5:
                p.send_signal(sig)
                break
        out, err = p.communicate(timeout=120)
        assert p.returncode == status, (out, err)
        _, meta = load_checkpoint(Path(run) / "ckpt")
        stopped = meta["step"]
        assert 5 <= stopped < 800 and meta["optimizer"]["step"] == stopped
        assert meta["data"]["batches_drawn"] == stopped          # the loader matches the saved step
        r = subprocess.run([sys.executable, "-m", "forge_ml", "train", "--out", run, "--resume"], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        _same_checkpoints("ref", run)
        assert _train_losses(run) == _train_losses("ref")
        # one line says it (the trainer's own line, the same words, was printed as well)
        assert "stopped" not in out, out[-300:]
        assert "Traceback" not in err and err.count("stopped") == 1, err
        assert (f"stopped by {sig.name} at step {stopped}; checkpoint of step {stopped} saved in "
                f"{Path(run) / 'ckpt'}; continue with: forge-ml train --out {run} --resume") in err, err


def test_the_library_says_where_a_signal_stopped_it(workdir):
    """Through Trainer (a notebook) the trainer's own line says the stop, the checkpoint and
    how to go on in the library's words; forge-ml train says it in its own one line instead."""
    lines = []

    def log(msg):
        lines.append(msg)
        if msg.split()[:2] == ["step", "3/50"]:
            os.kill(os.getpid(), signal.SIGINT)

    t = Trainer(_cfg("lib", max_steps=50, log_interval=1), log=log)
    with pytest.raises(Interrupted) as info:
        t.train()
    step = info.value.step
    said = [m for m in lines if "stopped" in m]
    assert said == [f"SIGINT: stopped at step {step}; checkpoint of step {step} saved in "
                    f"{Path('lib') / 'ckpt'} (resume with resume=True)"], said


def test_a_signal_whose_checkpoint_cannot_be_saved_is_still_its_stop(workdir, monkeypatch, capsys):
    """A review's find: SIGTERM with a full disk said only "No space left on device" (exit 2),
    neither the signal nor that the checkpoint was not saved. It is the signal's stop (its exit
    status) with the reason, and the earlier checkpoint kept; in the library and the CLI."""
    real = train_mod.save_checkpoint
    saves = []

    def full_disk_after_one(folder, tensors, meta):
        saves.append(meta.get("step"))
        if len(saves) > 1:                         # step 2's checkpoint saves, the stop's does not
            raise OSError(errno.ENOSPC, "No space left on device", str(folder))
        real(folder, tensors, meta)

    say = Trainer._say

    def say_and_stop(self, msg, **kw):   # SIGTERM during step 3's line
        if msg.split()[:2] == ["step", "3/50"]:
            os.kill(os.getpid(), signal.SIGTERM)
        return say(self, msg, **kw)

    monkeypatch.setattr(train_mod, "save_checkpoint", full_disk_after_one)
    monkeypatch.setattr(Trainer, "_say", say_and_stop)
    t = Trainer(_cfg("lib", max_steps=50, checkpoint_interval=2, log_interval=1), log=lambda m: None)
    with pytest.raises(Interrupted) as info:
        t.train()
    e = info.value
    assert e.exit_status == 143 and not e.saved and "No space left on device (ENOSPC)" in e.reason, e
    assert "the last good checkpoint" in e.reason and "(step 2)" in e.reason, e.reason
    saves.clear()
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY[:-4], "--checkpoint-interval", "2",
                 "--max-steps", "50", "--seed", "3", "--log-interval", "1"]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("forge-ml: stopped by SIGTERM at step ") \
        and "its checkpoint could not be saved: cannot write" in err[0] and "(step 2)" in err[0] \
        and err[0].endswith("continue from the kept one with: forge-ml train --out r --resume"), err


def test_a_second_signal_gives_up_the_step_in_flight(workdir):
    """The second signal during a step's forward/backward discards that step: the loader goes
    back, the checkpoint is the previous step's, and the resumed run is still exact."""
    full = Trainer(_cfg("full", max_steps=6), log=None)
    full.train()
    t = Trainer(_cfg("cut", max_steps=6), log=None)
    inner = t.model.loss_and_grads
    calls = []

    def loss_and_grads(*a, **kw):
        calls.append(1)
        if len(calls) == 4:                      # inside step 4
            t._on_signal(signal.SIGINT, None)    # first Ctrl-C: finish the step ...
            t._on_signal(signal.SIGINT, None)    # ... second: give it up
        return inner(*a, **kw)

    t.model.loss_and_grads = loss_and_grads
    with pytest.raises(Interrupted) as e:
        t.train()
    assert e.value.step == 3 and e.value.saved and e.value.exit_status == 130
    _, meta = load_checkpoint(Path("cut") / "ckpt")
    assert meta["step"] == 3 and meta["data"]["batches_drawn"] == 3
    Trainer(_cfg("cut", max_steps=6), resume=True, log=None).train()
    _same_checkpoints("full", "cut")
    assert _train_losses("cut") == _train_losses("full")


def test_a_signal_inside_the_optimizer_update_lets_it_finish(workdir):
    t = Trainer(_cfg("r", max_steps=6), log=None)
    inner = t.opt.step

    def step(*a, **kw):
        if t.step == 2:
            t._on_signal(signal.SIGTERM, None)
            t._on_signal(signal.SIGTERM, None)   # even twice: the update is never cut in half
        return inner(*a, **kw)

    t.opt.step = step
    with pytest.raises(Interrupted) as e:
        t.train()
    assert e.value.step == 3 and e.value.exit_status == 143
    _, meta = load_checkpoint(Path("r") / "ckpt")
    assert meta["step"] == 3 and meta["optimizer"]["step"] == 3 and meta["data"]["batches_drawn"] == 3


# -- 3. a folder that holds a run: --resume or --overwrite --------------------------------------------


def test_training_into_a_run_without_resume_touches_nothing(workdir, capsys):
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    before = _snapshot("r")
    # the same run again, or the default corpus (no --data) into it: refused before any write
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"],
           "holds a run", "--resume", "--overwrite")
    _fails(capsys, ["train", "--out", "r", "--max-steps", "1"], "holds a run")
    Path("only").mkdir()
    Path("only/log.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    # (QA) no checkpoint: --resume is no way out (it then said "no checkpoint"), not offered
    line = _fails(capsys, ["train", "--data", "t.txt", "--out", "only", *TINY],
                  "only holds a run stopped before its first checkpoint (log.jsonl), so there is "
                  "nothing to resume; add --overwrite")
    assert "--resume" not in line
    assert _snapshot("r") == before
    # --overwrite starts over: a new log, new data, a new checkpoint
    Path("u.txt").write_text("abcd efgh\n" * 200)
    assert main(["train", "--data", "u.txt", "--out", "r", *TINY, "--max-steps", "3", "--overwrite"]) == 0
    assert "removed the earlier run" in capsys.readouterr().out
    assert [r["step"] for r in read_log("r/log.jsonl")[0] if "loss" in r] == [1, 2, 3]
    _, meta = load_checkpoint(Path("r") / "ckpt")
    assert meta["step"] == 3 and set(meta["tokenizer"]["chars"]) == set("abcdefgh \n")
    _fails(capsys, ["train", "--out", "r", "--resume", "--overwrite"], "not allowed with")


def test_the_library_names_its_own_arguments_and_the_command_its_flags(workdir, capsys):
    """The same refusal through Trainer (a notebook) says resume=True / overwrite=True, the
    names its user typed; through forge-ml train it says --resume / --overwrite (a notebook
    user's report: the library's errors spoke the command line's flags)."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    capsys.readouterr()
    with pytest.raises(RunError) as info:
        Trainer(TrainConfig(data="t.txt", out_dir="r", n_layer=1, n_head=2, n_embd=16, block_size=16,
                            batch_size=4, max_steps=2, progress=False), log=None)
    msg = str(info.value)
    assert "resume=True" in msg and "overwrite=True" in msg and "--resume" not in msg, msg
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"],
           "holds a run", "--resume", "--overwrite")
    with pytest.raises(RunError, match="resume=True"):   # main() gives the library its words back
        Trainer(TrainConfig(data="t.txt", out_dir="r", n_layer=1, n_head=2, n_embd=16, block_size=16,
                            batch_size=4, max_steps=2, progress=False), log=None)


def test_a_device_that_cannot_load_is_said_before_the_run_folder_is_made(workdir, capsys):
    """--device cuda without CuPy: the text was prepared into OUT/data before the device failed,
    and the same command on the CPU was then refused as a run that holds data/ (a new user's
    test). The backend loads first now: no folder, and the retry needs no flag."""
    from forge_ml.backends import get
    from forge_ml.device import Device
    from forge_ml.errors import DeviceError
    try:
        get(Device("cuda", 0))
        pytest.skip("the CUDA backend loads here")
    except DeviceError:
        pass
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", "--device", "cuda", *TINY,
                    "--max-steps", "1"], "device cuda", "cannot load")
    assert not Path("r").exists()
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "1"]) == 0


def test_a_new_run_in_an_empty_or_new_folder_needs_no_flag(workdir):
    Path("empty").mkdir()
    assert Trainer(_cfg("empty", max_steps=1), log=None).train()["step"] == 1
    assert Trainer(_cfg("new/deep", max_steps=1), log=None).train()["step"] == 1


class _CtrlC:
    """A Ctrl-C at one change to the files: ``os.unlink``, ``remove``, ``rmdir``, ``rename`` and
    ``replace`` (what Path's methods, shutil.rmtree and replace_file call) made inside
    ``Trainer._setup`` are counted (``calls``), and the ``at``-th raises KeyboardInterrupt
    before it is made, or (``after``) once it is; the calls after it go through."""

    def __init__(self, mp, at=0, after=False):
        self.calls, self.at, self.after, self.armed = 0, at, after, False
        for name in ("unlink", "remove", "rmdir", "rename", "replace"):
            mp.setattr(os, name, self._wrap(getattr(os, name)))
        setup = Trainer._setup

        def armed(trainer, *args, **kwargs):
            self.armed = True
            try:
                return setup(trainer, *args, **kwargs)
            finally:
                self.armed = False
        mp.setattr(Trainer, "_setup", armed)

    def _wrap(self, fn):
        def call(*args, **kwargs):
            if not self.armed:
                return fn(*args, **kwargs)
            self.calls += 1
            if self.calls == self.at and not self.after:
                raise KeyboardInterrupt
            out = fn(*args, **kwargs)
            if self.calls == self.at:
                raise KeyboardInterrupt
            return out
        return call


def _names(folder):
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


def test_ctrl_c_during_overwrite_leaves_the_earlier_run_whole_or_gone(workdir, capsys):
    """A Ctrl-C at any change --overwrite makes (removing the earlier run, then writing the new
    run's data) left a half-removed run: a checkpoint without its weights, a log without its
    checkpoint. Now the earlier run is whole (a Ctrl-C as its files go: they come back) or
    wholly gone, the user's files stay, the lock is free, --resume says in one line why it
    cannot go on, and the next --overwrite starts cleanly, leaving nothing of the earlier run."""
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2", "--keep-best",
            "--eval-interval", "1"]
    assert main(argv) == 0
    Path("r/notes.txt").write_text("mine")
    Path("r/data/notes.txt").write_text("mine too")
    shutil.copytree("r", "pristine")                       # (copy2: the same mtimes)
    capsys.readouterr()

    def restore():
        shutil.rmtree("r")
        shutil.copytree("pristine", "r")
        return _snapshot("r")

    def overwrite_setup():        # the next --overwrite, as far as its setup (the run is tested below)
        with Trainer(_cfg("r", max_steps=2, keep_best=True, eval_interval=1), log=None, overwrite=True) as t:
            assert t.step == 0
        return _names("r")

    with pytest.MonkeyPatch.context() as mp:
        count = _CtrlC(mp)
        clean = overwrite_setup()
    assert count.calls >= 5 and "ckpt" not in clean and "notes.txt" in clean, (count.calls, clean)
    whole = []
    for at in range(1, count.calls + 1):
        for after in (False, True):
            where = f"Ctrl-C at change {at} of {count.calls}" + (" (after it)" if after else "")
            before = restore()
            with pytest.MonkeyPatch.context() as mp:
                _CtrlC(mp, at, after)
                code = main(argv + ["--overwrite"])
            err = capsys.readouterr().err
            assert code == 130 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (where, err)
            lock = RunLock("r")
            lock.acquire()                                 # free: a RunError if still held
            lock.release()
            now = _snapshot("r")
            assert now["r/notes.txt"] == before["r/notes.txt"], where
            assert now["r/data/notes.txt"] == before["r/data/notes.txt"], where
            left = sorted(f for f in before if "notes" not in f and now.get(f) == before[f])
            if now == before:
                whole.append((at, after))
            else:
                assert left == [], (where, left)           # none of the earlier run's files, or all
                _fails(capsys, ["train", "--out", "r", "--resume"], "cannot resume")
            assert overwrite_setup() == clean, where
    # a Ctrl-C as the earlier run's files go brings them back
    assert (1, False) in whole and (1, True) in whole and (2, True) in whole, whole
    # and a whole run after one
    restore()
    with pytest.MonkeyPatch.context() as mp:
        _CtrlC(mp, count.calls - 1, True)
        assert main(argv + ["--overwrite"]) == 130
    assert main(argv + ["--overwrite"]) == 0
    assert [r["step"] for r in read_log("r/log.jsonl")[0] if "loss" in r] == [1, 2]
    assert _names("r") == sorted(set(_names("pristine")) | {"train.lock"})


# A child's script: after the first call of os.<argv[1]> (or the calls named: "rename@3,4")
# it sends itself the signal argv[2]
_SEND_ONCE = """
import os, signal, sys
from forge_ml.cli import main
from forge_ml.train import Interrupted, TrainConfig, Trainer
fn, _, at = sys.argv[1].partition("@")
sig, at = getattr(signal, sys.argv[2]), {int(a) for a in at.split(",")} if at else {1}
real, calls = getattr(os, fn), [0]
def once(*args, **kwargs):
    out = real(*args, **kwargs)
    calls[0] += 1
    if calls[0] in at:
        os.kill(os.getpid(), sig)
    return out
setattr(os, fn, once)
"""
_REAL_SIGNAL = _SEND_ONCE + "sys.exit(main(sys.argv[3:]))\n"


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="signals are held with pthread_sigmask")
def test_real_signals_during_overwrite_are_undone_or_wait(workdir):
    """The same with real signals, in a process of their own: a SIGINT sent as the earlier
    run's first file is moved aside lands there and the file is put back; one sent as the first
    is deleted waits until all are (SIGINT held), so no trash folder is left behind; a SIGTERM
    waits until the files are all gone, then stops the setup as a Ctrl-C does (exit 143, one
    line; it ended the process there, status -15)."""
    # (BLAS threads as usual: the OS may hand a signal to any thread, so a thread's signal
    # mask held nothing; a second Ctrl-C as the files went back left the run half in the trash)
    env = dict(os.environ, PYTHONPATH=SRC, OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2")
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]
    assert main(argv) == 0
    before = _snapshot("r")
    for fn, sig in (("rename", "SIGINT"), ("unlink", "SIGINT"), ("rename", "SIGTERM"),
                    ("rename@3,4", "SIGINT"), ("rename@2,3,4,5", "SIGTERM")):
        r = subprocess.run([sys.executable, "-c", _REAL_SIGNAL, fn, sig, *argv, "--overwrite"], env=env,
                           capture_output=True, text=True, timeout=120)
        if sig == "SIGTERM":
            assert r.returncode == 143 and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert "stopped by SIGTERM during setup" in r.stderr, r.stderr
        else:
            assert r.returncode == 130 and r.stderr.strip().splitlines()[-1:] == ["forge-ml: interrupted"], r.stderr
        if fn.startswith("rename") and sig == "SIGINT":   # during the moves: all put back
            assert _snapshot("r") == before, fn
        else:
            assert _names("r") == ["train.lock"], (fn, sig)
            assert main(argv + ["--overwrite"]) == 0
            before = _snapshot("r")


# -- 4. one trainer per run folder --------------------------------------------------------------------


def test_a_second_trainer_on_the_same_folder_is_refused(workdir, capsys):
    first = Trainer(_cfg("r", max_steps=2), log=None)
    before = _snapshot("r")
    line = _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--overwrite"], "in use by another trainer")
    assert f"pid {os.getpid()} on {socket.gethostname()}" in line
    with pytest.raises(RunError, match="in use"):
        Trainer(_cfg("r", max_steps=2), log=None, overwrite=True)
    assert _snapshot("r") == before
    first.train()                                # releases the folder when done
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3", "--no-progress"]) == 0


def test_a_deleted_lock_file_does_not_let_a_second_trainer_in(workdir, capsys):
    """train.lock stays after a run and looks stale: a user who deleted it while a trainer ran
    let a second one in (an --overwrite deleted the running trainer's checkpoint and log, a
    --resume interleaved the log). The folder itself is flocked too."""
    first = Trainer(_cfg("r", max_steps=2), log=None)
    os.unlink("r/train.lock")
    before = _snapshot("r")
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--overwrite"],
           "in use by another trainer (holder unknown)")
    with pytest.raises(RunError, match="in use"):
        Trainer(_cfg("r", max_steps=2), log=None, overwrite=True)
    assert _snapshot("r") == before                 # not even a new lock file
    first.train()
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3", "--no-progress"]) == 0


def test_notebook_reruns_an_old_trainer_a_dropped_one_and_the_plot_backend(workdir):
    """From a notebook user's test: an older Trainer object trained again after a newer one had
    taken the run further rolled its checkpoint back (and logged its steps twice), and so did
    its save(); a Trainer dropped without close() kept the folder locked until the kernel
    restarted (the folder's own descriptor was never closed); plot() switched matplotlib to
    Agg for the whole process (a notebook's inline plots stopped)."""
    import gc
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("svg")
    old = Trainer(_cfg("r", max_steps=8), log=None)
    old.train(until=4)
    assert matplotlib.get_backend() == "svg"
    newer = Trainer(_cfg("r", max_steps=8), log=None, resume=True)
    with pytest.raises(RunError, match="a Trainer of this process: close"):
        Trainer(_cfg("r", max_steps=8), log=None, resume=True)
    newer.train()
    before = _snapshot("r")
    with pytest.raises(RunError, match="moved on since this Trainer last held it .its checkpoint is now "
                                       "at step 8; this Trainer is at step 4"):
        old.train(until=6)
    with pytest.raises(RunError, match="moved on"):
        old.save()
    assert _snapshot("r") == before
    assert newer.train(until=8)["step"] == 8           # its own checkpoint: no complaint
    for bad in (-1, "5", 2.5):
        with pytest.raises(ConfigError, match="until must be an integer >= 0"):
            newer.train(until=bad)
    with pytest.raises(ConfigError, match="n_tokens must be an integer >= 0"):
        newer.sample(n_tokens=-1)
    with pytest.raises(ConfigError, match="log must be a function"):   # before data/ is written
        Trainer(_cfg("r3", max_steps=2), log="yes")
    assert not Path("r3").exists()
    held = Trainer(_cfg("r2", max_steps=2), log=None)  # built, never trained, then dropped
    del held
    gc.collect()
    assert Trainer(_cfg("r2", max_steps=2), log=None, overwrite=True).train()["step"] == 2


def test_a_broken_pipe_in_a_log_function_stops_that_run_only(workdir):
    """From a notebook user's test: a BrokenPipeError from a log function of the user's replaced
    sys.stdout with /dev/null for good (every later print vanished) and left the Trainer
    unable to train (each later train() stopped at once)."""
    from forge_ml.train import Interrupted
    lines, broken = [], [True]

    def log(msg):
        if broken[0] and msg.startswith("step"):
            broken[0] = False
            raise BrokenPipeError(32, "Broken pipe")
        lines.append(msg)
    stdout = sys.stdout
    t = Trainer(_cfg("r", max_steps=6, log_interval=1), log=log)
    with pytest.raises(Interrupted):
        t.train()
    assert sys.stdout is stdout
    stopped = t.step
    assert 1 <= stopped < 6
    summary = t.train()
    assert summary["step"] == 6                        # the next call trains on
    assert len(summary["losses"]) == 6 - stopped       # the losses of this call, as documented
    t.close()


def test_a_dead_trainers_lock_is_not_stale(workdir, capsys):
    Path("r").mkdir()
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open('r/train.lock', os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, b'pid %d on elsewhere since then\\n' % os.getpid())\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n")
    with holding(code) as holder:
        _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY], f"pid {holder.pid} on elsewhere")
        assert sorted(os.listdir("r")) == ["train.lock"]
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "1"]) == 0


def test_a_full_disk_at_the_lock_file_is_a_run_error_that_leaves_nothing(workdir, monkeypatch):
    import forge_ml.runs as runs_mod
    real = runs_mod.os.fdopen

    class Full:  # a buffered file on a full disk: writes are kept, flush and close fail
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def flush(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self):
            self.f.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(runs_mod.os, "fdopen", lambda *a, **kw: Full(real(*a, **kw)))
    with pytest.raises(RunError, match="cannot write r/sub/train.lock: No space left on device"):
        Trainer(_cfg("r/sub", max_steps=1), log=None)
    monkeypatch.undo()
    assert not Path("r").exists()


# -- 5. log.jsonl is a record, never a reason to stop ------------------------------------------------------


def test_a_damaged_log_is_dropped_with_one_warning(workdir):
    Trainer(_cfg("r", max_steps=3), log=None).train()
    with open("r/log.jsonl", "a") as f:
        f.write('{"step": 2, "lo\x00ss": \nnot json at all\n[1, 2]\n{"step": 3, "loss": 1.')  # torn last line
    said = []
    t = Trainer(_cfg("r", max_steps=5), resume=True, log=said.append)
    warnings = [s for s in said if "warning" in s]
    assert len(warnings) == 1 and "dropped 4 damaged line(s)" in warnings[0], said
    t.train()
    lines = Path("r/log.jsonl").read_text().splitlines()
    recs = [json.loads(ln) for ln in lines]                   # every line is JSON again
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4, 5]
    assert (Path("r") / "loss.png").is_file()


def test_read_log_never_raises(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe garbage\n{"step": true}\n{"loss": 1}\n\n{"step": 2, "val_loss": 1.5}\n')
    recs, bad = read_log(p)
    assert [r["step"] for r in recs] == [1, 2] and bad == [2, 3, 4]
    assert read_log(tmp_path / "missing.jsonl") == ([], [])


# -- option values checked before any work ----------------------------------------------------------------


def test_options_are_checked_before_any_work(workdir, capsys):
    _fails(capsys, ["train", "--data", "t.txt", "--out", "p", *TINY, "--sample-prompt", "XYZ",
                    "--sample-interval", "1"], "--sample-prompt", "'X'", "not in the vocabulary")
    assert not Path("p").exists()                           # no trace: not even the folder
    _fails(capsys, ["train", "--data", "missing.txt", "--out", "deep/er"], "missing.txt")
    assert not Path("deep").exists()
    _fails(capsys, ["train", "--data", "t.txt", "--out", "q", *TINY, "--sample-temperature", "-0.5"],
           "--sample-temperature", ">= 0")
    assert not Path("q").exists()
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    _fails(capsys, ["train", "--out", "r", "--resume", "--tokenizer", "gpt2", "--max-steps", "4"],
           "--tokenizer gpt2", "char tokenizer", "drop --tokenizer")
    line = _fails(capsys, ["train", "--out", "r", "--resume"], "finished", "step 2", "raise --max-steps")
    assert "--max-steps 4" in line
    _fails(capsys, ["train", "--out", "r", "--resume", "--init-from", "r"], "--init-from", "--resume")
    _, meta = load_checkpoint(Path("r") / "ckpt")
    assert meta["train_config"]["tokenizer"] == "char" and meta["step"] == 2


@pytest.mark.parametrize("seed", [str(1 << 64), str((1 << 64) + 3), "-1"])
def test_train_refuses_a_seed_outside_64_bits(workdir, capsys, seed):
    """forge-ml train --seed is refused outside [0, 2**64) as forge-ml sample --seed is (2**64
    trained with seed 0's dropout), naming the flag, before the folder is made; a config
    file's seed in TrainConfig's words."""
    line = _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--seed", seed])
    assert line == f"forge-ml train: error: --seed must be in [0, 2**64), got {seed}"
    Path("c.json").write_text(json.dumps({"seed": int(seed)}))
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY[:-2], "--config", "c.json"],
           f"seed must be in [0, 2**64), got {seed}")
    assert not Path("r").exists()


def test_overwrite_with_data_too_short_keeps_the_earlier_run(workdir, capsys):
    """A text whose train or val part holds no window of --block-size, or a bad seed, is refused
    before --overwrite removes anything, and a new folder gets no data/ that would block the
    next try."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    before = _snapshot("r")
    Path("short.txt").write_text("abcdefghij" * 10)                # 100 tokens: 90 train, 10 val
    _fails(capsys, ["train", "--data", "short.txt", "--out", "r", *TINY, "--overwrite"],
           "val part of short.txt", "holds 10 tokens", "--block-size 16", "--val-fraction")
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--overwrite", "--block-size", "5000"],
           "train part of t.txt", "--block-size 5000")
    Path("three.txt").write_text("abc")
    _fails(capsys, ["train", "--data", "three.txt", "--out", "r", *TINY, "--overwrite"],
           "3 train and 0 val tokens, but each needs at least 2")
    Path("empty.txt").write_text("")
    _fails(capsys, ["train", "--data", "empty.txt", "--out", "r", *TINY, "--overwrite"], "empty.txt is empty")
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--overwrite", "--seed", "-1"],
           "--seed must be in [0, 2**64), got -1")
    assert _snapshot("r") == before
    Path("prep").mkdir()
    assert main(["prepare", "short.txt", "--out", "prep"]) == 0
    capsys.readouterr()
    _fails(capsys, ["train", "--data", "prep", "--out", "r", *TINY, "--overwrite"], "val.bin holds 10 tokens")
    assert _snapshot("r") == before
    _fails(capsys, ["train", "--data", "short.txt", "--out", "new", *TINY], "val part of short.txt")
    assert not Path("new").exists()
    assert main(["train", "--data", "short.txt", "--out", "new", *TINY, "--block-size", "8", "--max-steps", "1"]) == 0


@pytest.mark.parametrize("flag", ["--lr", "--min-lr", "--weight-decay", "--grad-clip"])
def test_an_infinite_rate_is_refused_before_any_work(workdir, capsys, flag):
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, flag, "inf"], f"{flag} must be a finite number >= 0", "inf")
    assert not Path("r").exists()


def test_resume_with_another_text_is_refused(workdir, capsys):
    """--resume keeps the tokens the run was prepared from: --data naming another text is an
    error (it was ignored, while the checkpoint recorded it), the same text by another path is not."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    before = _snapshot("r")
    Path("other.txt").write_text("a new text to fine-tune on\n" * 100)
    _fails(capsys, ["train", "--data", "other.txt", "--out", "r", "--resume", "--max-steps", "4"],
           "trained on t.txt", "drop --data other.txt", "--init-from r")
    assert _snapshot("r") == before
    Path("sub").mkdir()
    Path("sub/copy.txt").write_text(TEXT)
    assert main(["train", "--data", str(workdir / "t.txt"), "--out", "r", "--resume", "--max-steps", "3"]) == 0
    assert main(["train", "--data", "sub/copy.txt", "--out", "r", "--resume", "--max-steps", "4"]) == 0
    assert load_checkpoint(Path("r") / "ckpt")[1]["step"] == 4


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_special_file_as_data_is_not_called_missing(workdir, capsys):
    os.mkfifo("pipe")
    _fails(capsys, ["train", "--data", "pipe", "--out", "r", *TINY], "expected a text file", "pipe", "special file")
    assert not Path("r").exists()


# -- full disk, read-only folders: one line, the last good checkpoint kept ---------------------------------------


def test_a_full_disk_at_a_checkpoint_keeps_the_last_good_one(workdir, capsys, monkeypatch):
    import safetensors.numpy
    real = safetensors.numpy.save_file
    saves = []

    def save_file(*a, **kw):
        saves.append(1)
        if len(saves) >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*a, **kw)

    with monkeypatch.context() as m:
        m.setattr(safetensors.numpy, "save_file", save_file)
        line = _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "6",
                               "--checkpoint-interval", "2"], "ckpt", "No space left on device", "(step 2)")
    assert "step 4" in line
    _, meta = load_checkpoint(Path("r") / "ckpt")
    assert meta["step"] == 2
    assert sorted(p.name for p in Path("r").iterdir() if p.name.startswith("ckpt")) == ["ckpt"]


def test_a_full_disk_at_a_log_write_stops_with_one_line(workdir, capsys, monkeypatch):
    real_open = open

    def full_open(path, mode="r", *a, **kw):
        if str(path).endswith("log.jsonl") and "a" in mode and len(_train_losses("r")) >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(train_mod, "open", full_open, raising=False)
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "6",
                    "--checkpoint-interval", "2"], "cannot write r/log.jsonl", "No space left on device (ENOSPC)",
           "(step 2)")
    _, meta = load_checkpoint(Path("r") / "ckpt")
    assert meta["step"] == 2


class _Filling:
    """A file on a disk that fills after ``room`` bytes: what fits is written and flushed,
    then the write raises ENOSPC (a torn record, a truncated file)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        if len(data) > self.room:
            self.f.write(data[:self.room])
            self.f.flush()
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)


def test_training_on_after_a_failed_log_write_loses_no_record(workdir, monkeypatch):
    real_open = open

    t = Trainer(_cfg("r", max_steps=6), log=None)
    t.train(until=2)
    with monkeypatch.context() as m:
        m.setattr(train_mod, "open", lambda p, mode="r", *a, **kw: _Filling(real_open(p, mode, *a, **kw), 20)
                  if str(p).endswith("log.jsonl") else real_open(p, mode, *a, **kw), raising=False)
        for _ in range(2):
            with pytest.raises(RunError, match="No space left on device"):
                t.train()
    t.train()  # space freed: the same Trainer goes on
    records, bad = read_log("r/log.jsonl")
    assert bad == []
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_a_read_only_data_folder_is_one_line(workdir, capsys, monkeypatch):
    import forge_ml.data as data_mod

    def mkstemp(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), kw.get("dir"))

    monkeypatch.setattr(data_mod.tempfile, "mkstemp", mkstemp)
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY], "cannot write", "train.bin",
           "Read-only file system (EROFS)")
    _fails(capsys, ["prepare", "t.txt", "--out", "d"], "cannot write", "Read-only file system")


@pytest.mark.parametrize("data", [[], ["--data", "t.txt"]])  # the default corpus (data/corpus.txt) or a text
def test_a_full_disk_while_preparing_the_data_leaves_nothing_to_refuse_the_next_try(workdir, capsys, monkeypatch, data):
    import forge_ml.data as data_mod
    real = data_mod.tempfile.mkstemp

    def mkstemp(*a, **kw):  # the corpus is written, the shards are not
        if kw.get("prefix", "").startswith(".train.bin"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*a, **kw)

    argv = ["train", *(data or ["--corpus-bytes", "20000"]), "--out", "r", *TINY, "--max-steps", "1"]
    with monkeypatch.context() as m:
        m.setattr(data_mod.tempfile, "mkstemp", mkstemp)
        _fails(capsys, argv, "cannot write", "train.bin", "No space left on device")
    assert not Path("r").exists()
    assert main(argv) == 0, capsys.readouterr().err  # space freed: the same command trains


def test_resuming_a_run_that_died_before_its_first_checkpoint_says_what_works(workdir, capsys, monkeypatch):
    real_open = open

    def full_open(path, mode="r", *a, **kw):  # the disk fills at step 3, before any checkpoint
        if str(path).endswith("log.jsonl") and "a" in mode and len(_train_losses("r")) >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, mode, *a, **kw)

    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "4"]
    with monkeypatch.context() as m:
        m.setattr(train_mod, "open", full_open, raising=False)
        _fails(capsys, argv, "cannot write r/log.jsonl", "no checkpoint was saved yet")
    _fails(capsys, argv, "holds a run", "--overwrite")
    # --resume must not send the user back to the command just refused
    line = _fails(capsys, argv + ["--resume"], "cannot resume", "no checkpoint", "--overwrite")
    assert "without --resume" not in line
    assert main(argv + ["--overwrite"]) == 0


def test_a_full_disk_at_loss_png_keeps_the_earlier_plot(workdir, monkeypatch):
    import builtins
    import forge_ml.runs as runs_mod
    pytest.importorskip("matplotlib")
    said = []
    t = Trainer(_cfg("r", max_steps=2), log=said.append)
    t.train()
    before = Path("r/loss.png").read_bytes()

    real_open, real_fdopen = builtins.open, runs_mod.os.fdopen
    with monkeypatch.context() as m:  # however loss.png is written, the disk fills
        m.setattr(builtins, "open", lambda p, mode="r", *a, **kw: _Filling(real_open(p, mode, *a, **kw), 100)
                  if str(p).endswith("loss.png") and "w" in mode else real_open(p, mode, *a, **kw))
        m.setattr(runs_mod.os, "fdopen", lambda *a, **kw: _Filling(real_fdopen(*a, **kw), 100))
        assert t.plot() is None
    assert "cannot write r/loss.png: No space left on device" in said[-1]
    assert Path("r/loss.png").read_bytes() == before
    assert sorted(os.listdir("r")) == ["ckpt", "data", "log.jsonl", "loss.png", "train.lock"]


def test_a_run_on_a_prepared_folder_resumes_from_another_folder(workdir, capsys, monkeypatch):
    assert main(["prepare", "t.txt", "--out", "p"]) == 0
    assert main(["train", "--data", "p", "--out", "r", *TINY, "--max-steps", "4", "--checkpoint-interval", "2"]) == 0
    assert main(["train", "--data", "p", "--out", "whole", *TINY, "--max-steps", "6"]) == 0
    Path("elsewhere").mkdir()
    monkeypatch.chdir("elsewhere")  # --data p, as recorded, names nothing from here
    assert main(["train", "--out", "../r", "--resume", "--max-steps", "6"]) == 0, capsys.readouterr().err
    monkeypatch.chdir("..")
    _same_checkpoints("r", "whole")
    os.rename("p", "moved")
    line = _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "8"], "cannot resume", "p", "--data")
    assert "text file" not in line
    assert main(["train", "--out", "r", "--resume", "--max-steps", "8", "--data", "moved"]) == 0


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_run_folder_is_one_line(workdir, capsys):
    Path("r").mkdir()
    os.chmod("r", 0o555)
    try:
        _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY], "cannot write", "r")
    finally:
        os.chmod("r", 0o755)


# -- files get the user's umask -----------------------------------------------------------------------------------


def test_files_a_run_writes_get_the_umask(workdir):
    old = os.umask(0o002)
    try:
        Trainer(_cfg("r", max_steps=1), log=None).train()
    finally:
        os.umask(old)
    for f in ("data/train.bin", "data/val.bin", "data/tokenizer.json", "ckpt/model.safetensors",
              "ckpt/state.json", "log.jsonl"):
        assert oct(os.stat(Path("r") / f).st_mode & 0o777) == oct(0o664), f


# -- clear figures: the final evaluation covers the whole val shard -------------------------------------------------


def test_the_final_val_loss_covers_every_window(workdir):
    said = []
    t = Trainer(_cfg("r", max_steps=4, eval_interval=2), log=said.append)
    summary = t.train()
    vals = [r for r in read_log("r/log.jsonl")[0] if "val_loss" in r]
    assert [(r["step"], r["val_kind"]) for r in vals] == [(2, "sampled"), (4, "full")]
    loader = DataLoader(Path("r/data/val.bin"), 1, 16)
    n_windows = (loader.n_tokens - 1) // 16
    assert vals[1]["val_windows"] == n_windows and n_windows % 4 != 0      # a partial last batch too
    losses = [t.model.forward(train_mod.Tape(), train_mod.tensor(x), train_mod.tensor(y), train=False)[1].t.item()
              for x, y in loader.eval_batches()]
    assert len(losses) == n_windows
    assert summary["val_loss"] == pytest.approx(np.mean(losses), rel=1e-6)
    assert summary["val_kind"] == "full" and load_checkpoint(Path("r/ckpt"))[1]["val_kind"] == "full"
    assert any("an estimate on 2 val batches" in s for s in said)
    assert any(f"every window of the val shard: {n_windows:,} x 16 tokens" in s for s in said)


def test_forge_ml_eval_covers_every_window_as_the_final_val_loss_does(workdir, capsys):
    """``forge-ml eval`` on the run's val shard gives the trainer's final ("full") val loss: the
    windows past the last whole batch count too."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    full = [r for r in read_log("r/log.jsonl")[0] if r.get("val_kind") == "full"][-1]
    assert full["val_windows"] % 8 != 0                                   # eval's default batch of 8
    capsys.readouterr()
    assert main(["eval", "--ckpt", "r", "--data", "r/data/val.bin"]) == 0
    line = capsys.readouterr().out
    assert f"{full['val_windows']} windows of 16" in line, line
    assert float(line.split()[1]) == pytest.approx(full["val_loss"], abs=1e-4)


# -- BLAS threads ---------------------------------------------------------------------------------------------------


def test_blas_threads_leave_room_on_a_shared_machine(monkeypatch):
    assert [blas.default_threads(c) for c in (1, 2, 4, 16, 128)] == [1, 1, 2, 8, 8]
    for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(blas, "_chosen_here", blas._chosen_here)   # restored after
    monkeypatch.setenv("OMP_NUM_THREADS", "3")             # the user's choice wins
    assert blas.limit_default() is None and "OPENBLAS_NUM_THREADS" not in os.environ
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = blas.get_threads()
    try:
        assert blas.limit_default() == 1
        assert os.environ["OMP_NUM_THREADS"] == os.environ["OPENBLAS_NUM_THREADS"] == "1"
        if before is not None:
            assert blas.get_threads() == 1       # NumPy's OpenBLAS, already loaded, follows
    finally:
        if before is not None:
            blas.set_threads(before)


# -- fine-tuning: --init-from ------------------------------------------------------------------------------------------


def test_init_from_a_checkpoint_starts_a_new_run(workdir, capsys):
    assert main(["train", "--data", "t.txt", "--out", "base", *TINY, "--max-steps", "3"]) == 0
    Path("more.txt").write_text("not to be that is a question\n" * 60)
    # lr 0: the new run's weights stay the source's, bit for bit
    assert main(["train", "--init-from", "base", "--data", "more.txt", "--out", "ft", "--lr", "0", "--min-lr", "0",
                 "--max-steps", "2", "--block-size", "8", "--batch-size", "4", "--eval-iters", "1",
                 "--sample-interval", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "init from base" in out and "fresh optimizer, step 0" in out
    tb, mb = load_checkpoint(Path("base") / "ckpt")
    tf, mf = load_checkpoint(Path("ft") / "ckpt")
    assert mf["step"] == 2 and mf["optimizer"]["step"] == 2 and mf["config"] == mb["config"]
    assert mf["tokenizer"] == mb["tokenizer"] and mf["train_config"]["init_from"] == "base"
    for k in tb:
        if not k.startswith("opt."):
            assert np.array_equal(tb[k], tf[k]), k
    # the fine-tuning run resumes like any other
    assert main(["train", "--out", "ft", "--resume", "--max-steps", "3", "--no-progress"]) == 0
    assert load_checkpoint(Path("ft") / "ckpt")[1]["step"] == 3
    # the architecture comes from the source; text outside its characters is refused at once
    _fails(capsys, ["train", "--init-from", "base", "--data", "more.txt", "--out", "x", "--n-layer", "2"],
           "n_layer 1", "drop --n-layer)")
    # a preset's size: the preset is what to drop (it said "drop --n-layer", never given)
    _fails(capsys, ["train", "--init-from", "base", "--data", "more.txt", "--out", "x", "--model", "gpt2"],
           "but 12 was asked (by --model gpt2)", "(drop --model)")
    Path("odd.txt").write_text("QQQ zzz\n" * 100)
    _fails(capsys, ["train", "--init-from", "base", "--data", "odd.txt", "--out", "y"], "characters", "init-from")
    assert not Path("y/data").exists()


def test_the_context_defaults_to_the_sources_and_the_presets(workdir, capsys):
    """Without --block-size a fine-tune trained on 64-token windows whatever the source's
    context (GPT-2's 1024 included), and --model gpt2 on 64-token windows; now the source's
    context, the preset's (1024), else 64."""
    from forge_ml.train import TrainConfig
    assert (TrainConfig().block_size, TrainConfig(model="gpt2").block_size,
            TrainConfig(model="gpt2-xl", block_size=256).block_size) == (64, 1024, 256)
    tiny = [a for a in TINY]
    at = tiny.index("--block-size")
    del tiny[at:at + 2]
    Path("long.txt").write_text(TEXT * 3)
    assert main(["train", "--data", "long.txt", "--out", "base", *tiny, "--block-size", "96", "--max-steps", "1"]) == 0
    assert main(["train", "--init-from", "base", "--data", "long.txt", "--out", "ft", *tiny, "--max-steps", "1"]) == 0
    assert load_checkpoint(Path("ft") / "ckpt")[1]["train_config"]["block_size"] == 96
    capsys.readouterr()


def test_a_fine_tune_resumed_from_python_keeps_the_sources_context(workdir):
    """Trainer(TrainConfig(init_from=..., block_size left out), resume=True), the same config
    the run was started with, failed with a TypeError (None + 1): the source is not loaded on a
    resume, so the context stayed None. It is now the context the run recorded."""
    Trainer(_cfg("base", block_size=24, max_steps=1), log=None).train()
    ft = dict(init_from="base", n_layer=0, n_head=0, n_embd=0, block_size=None)
    Trainer(_cfg("ft", max_steps=2, **ft), log=None).train()
    t = Trainer(_cfg("ft", max_steps=4, **ft), resume=True, log=None)
    assert (t.cfg.block_size, t.train()["step"]) == (24, 4)
    assert load_checkpoint(Path("ft") / "ckpt")[1]["train_config"]["block_size"] == 24


def test_a_library_resume_keeps_the_runs_split_or_says_why_not(workdir):
    """Trainer(..., resume=True) with another val_fraction (or, on the default corpus, another
    corpus_bytes) trained on the run's own split and recorded the new value, falsely (a library
    QA; the CLI refused it): now a ConfigError naming the run's value; the same value resumes."""
    Trainer(_cfg("r", max_steps=2, val_fraction=0.2), log=None).train()
    with pytest.raises(ConfigError, match="val_fraction=0.1: the run in r split its tokens with "
                                          "val_fraction=0.2"):
        Trainer(_cfg("r", max_steps=4), resume=True, log=None)
    # (a text-file run ignores corpus_bytes, resumed without --data: no refusal of it)
    t = Trainer(_cfg("r", max_steps=3, data="", val_fraction=0.2, corpus_bytes=20_000), resume=True,
                log=None)
    assert t.train()["step"] == 3
    t.close()
    t = Trainer(_cfg("r", max_steps=4, val_fraction=0.2), resume=True, log=None)
    assert t.train()["step"] == 4
    t.close()
    assert load_checkpoint(Path("r") / "ckpt")[1]["train_config"]["val_fraction"] == 0.2
    t = Trainer(_cfg("r", max_steps=5, data=str(Path("r") / "data")), resume=True, log=None)
    assert t.train()["step"] == 5        # (a folder of shards has no split: no refusal)
    t.close()
    Trainer(_cfg("d", data="", max_steps=1, corpus_bytes=20_000), log=None).train()
    with pytest.raises(ConfigError, match="corpus_bytes=30000: .* default corpus of corpus_bytes=20000"):
        Trainer(_cfg("d", data="", max_steps=2, corpus_bytes=30_000), resume=True, log=None)


def test_init_from_a_hugging_face_folder(workdir, capsys):
    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2
    cfg = {"vocab_size": 50257, "block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 8}
    rng = np.random.default_rng(0)
    params = {k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in gpt2_param_shapes(cfg).items()}
    save_hf_gpt2("hf", cfg, params)
    assert main(["train", "--init-from", "hf", "--data", "t.txt", "--out", "ft", "--lr", "0", "--min-lr", "0",
                 "--max-steps", "1", "--block-size", "16", "--batch-size", "2", "--eval-iters", "1",
                 "--sample-interval", "0", "--no-progress"]) == 0
    tf, mf = load_checkpoint(Path("ft") / "ckpt")
    assert mf["tokenizer"]["kind"] == "gpt2" and mf["config"]["vocab_size"] == 50257
    assert mf["config"]["block_size"] == 32 and mf["train_config"]["block_size"] == 16
    from forge_ml.inference import load_model
    src, _, _ = load_model("hf")
    for k, v in src.params.items():
        assert np.array_equal(v.numpy(), tf[k]), k
    # eval of the run's checkpoint on its val data reads the run's windows (16 of the model's 32):
    # the run's final val loss (a fine-tuning user's report: eval took windows of the context)
    final = [r for r in read_log("ft/log.jsonl")[0] if r.get("val_kind") == "full"][-1]
    capsys.readouterr()
    assert main(["eval", "--ckpt", "ft", "--data", "ft/data"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"loss {final['val_loss']:.4f} ") and " of 16 in " in out, (out, final)
    # best/ (a model checkpoint) records the windows too (a re-test's finding)
    assert main(["train", "--init-from", "hf", "--data", "t.txt", "--out", "ft2", "--max-steps", "2",
                 "--block-size", "16", "--batch-size", "2", "--eval-iters", "1", "--eval-interval", "1",
                 "--keep-best", "--sample-interval", "0", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["eval", "--ckpt", "ft2/best", "--data", "ft2/data"]) == 0
    assert " of 16 in " in capsys.readouterr().out
    assert main(["eval", "--ckpt", "ft", "--data", "ft/data", "--block-size", "32"]) == 0
    assert " of 32 in " in capsys.readouterr().out
    _fails(capsys, ["eval", "--ckpt", "ft", "--data", "ft/data", "--block-size", "33"], "--block-size must be in 1..32")
    # a resumed fine-tune keeps the source's sizes: another --n-layer or --model is refused (it
    # was ignored, and recorded in the checkpoint's train_config: a fine-tuning user's report)
    before = _snapshot("ft")
    _fails(capsys, ["train", "--out", "ft", "--resume", "--max-steps", "2", "--n-layer", "4"],
           "--n-layer: the run in ft fine-tunes a model with n_layer 1, not 4", "drop --n-layer")
    _fails(capsys, ["train", "--out", "ft", "--resume", "--max-steps", "2", "--model", "gpt2"],
           "--model: the run in ft fine-tunes a model with n_layer 1, not 12")
    _fails(capsys, ["train", "--out", "ft", "--resume", "--max-steps", "2", "--block-size", "8"],
           "--block-size 8: the run in ft was trained on windows of 16 tokens", "drop --block-size")
    # the library's resume with another init_from (the CLI refuses --init-from with --resume): the
    # source was ignored and recorded (a re-test's finding); the same source is the run's own
    with pytest.raises(ConfigError, match="init_from=t.txt: the run in ft fine-tunes hf, which a resumed run keeps"):
        Trainer(_cfg("ft", init_from="t.txt", max_steps=2), resume=True, log=None)
    assert _snapshot("ft") == before
    assert main(["train", "--out", "ft", "--resume", "--max-steps", "2", "--no-progress"]) == 0
    # --resume on an HF folder or a model-only checkpoint points to --init-from
    _fails(capsys, ["train", "--out", "hf", "--resume"], "--init-from hf")
    save_checkpoint(Path("imported") / "ckpt", {k: v.numpy() for k, v in src.params.items()},
                    {"kind": "forge-ml-model", "config": src.config.to_dict(), "tokenizer": {"kind": "gpt2"}})
    _fails(capsys, ["train", "--out", "imported", "--resume"], "model only", "--init-from")
    with pytest.raises(RunError, match="init_from=imported/ckpt out_dir=NEW_FOLDER"):
        Trainer(_cfg("imported"), resume=True, log=None)


def test_init_from_a_hugging_face_folder_of_another_vocabulary_is_refused_at_once(workdir, capsys):
    """A 65-token HF model read with GPT-2's tokenizer (50257 ids): refused before any data is
    prepared, not at the first step with a token id out of range."""
    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2
    cfg = {"vocab_size": 65, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 8}
    save_hf_gpt2("hf", cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    _fails(capsys, ["train", "--init-from", "hf", "--data", "t.txt", "--out", "ft", "--max-steps", "1",
                    "--batch-size", "2", "--no-progress"], "65 tokens", "(gpt2) has 50257")
    assert not Path("ft").exists()


# -- a NaN names its origin ----------------------------------------------------------------------------------------------


def test_a_nan_names_the_op_and_layer_that_made_it_forward(workdir):
    t = Trainer(_cfg("r", n_layer=2, max_steps=5), log=None)
    t.train(until=2)
    t.model.params["h.1.mlp.c_fc.weight"].data[:] = 3e38    # finite, but its product overflows
    with pytest.raises(TrainingError) as e:
        t.train()
    msg = str(e.value)
    assert "step 3" in msg and "(step 2)" in msg
    assert ("forward: mlp in layer 1 (h.1.mlp.c_fc.weight, h.1.mlp.c_fc.bias, h.1.mlp.c_proj.weight, "
            "h.1.mlp.c_proj.bias) produced") in msg, msg
    assert "from finite inputs" in msg and len(msg.splitlines()) == 1


def test_a_nan_names_the_op_that_made_it_backward(workdir, monkeypatch):
    import forge_ml.ops as ops
    t = Trainer(_cfg("r", n_layer=2, max_steps=3), log=None)
    real = ops.matmul_dgelu

    def matmul_dgelu(dy, w, pre):
        dpre, db = real(dy, w, pre)
        dpre.data[0, 0] = np.nan
        return dpre, db

    monkeypatch.setattr(ops, "matmul_dgelu", matmul_dgelu)
    with pytest.raises(TrainingError) as e:
        t.train()
    msg = str(e.value)
    assert "gradient norm is nan at step 1" in msg
    # GELU's backward is part of the mlp node: its NaN reaches that node's input gradient
    assert ("backward of mlp in layer 1 (h.1.mlp.c_fc.weight, h.1.mlp.c_fc.bias, h.1.mlp.c_proj.weight, "
            "h.1.mlp.c_proj.bias) produced") in msg, msg
    assert "gradient of its input (the output of layernorm)" in msg, msg



def test_a_nan_in_the_lm_head_loss_is_named(workdir, monkeypatch):
    import forge_ml.ops as ops
    t = Trainer(_cfg("r", n_layer=2, max_steps=3), log=None)
    real = ops.linear_cross_entropy

    def linear_cross_entropy(*args, **kw):
        loss, dx, dw = real(*args, **kw)
        loss.data[...] = np.nan
        return loss, dx, dw

    monkeypatch.setattr(ops, "linear_cross_entropy", linear_cross_entropy)
    with pytest.raises(TrainingError) as e:
        t.train()
    msg = str(e.value)
    assert "forward: linear_cross_entropy in the LM head (wte.weight) produced 1 NaN" in msg, msg

def test_a_nan_in_the_unfused_loss_is_named_in_the_lm_head(workdir, monkeypatch):
    """cross_entropy uses no parameter: it belongs where the op before it (the LM head's
    product) does, not with the embeddings that share wte.weight."""
    import forge_ml.ops as ops
    from forge_ml import flags
    real = ops.cross_entropy

    def cross_entropy(*args, **kw):
        loss = real(*args, **kw)
        loss.data[...] = np.nan
        return loss

    monkeypatch.setattr(ops, "cross_entropy", cross_entropy)
    with flags.override(FORGE_FUSED_LOSS="off"):
        t = Trainer(_cfg("r", n_layer=2, max_steps=3), log=None)
        with pytest.raises(TrainingError) as e:
            t.train()
    msg = str(e.value)
    assert "forward: cross_entropy in the LM head produced 1 NaN" in msg, msg


def test_a_nan_in_the_weights_is_named(workdir):
    t = Trainer(_cfg("r", max_steps=3), log=None)
    t.model.params["ln_f.weight"].data[1] = np.inf
    with pytest.raises(TrainingError, match=r"the parameter ln_f.weight already held 1 inf of 16 values"):
        t.train()


# -- --batch-size auto ------------------------------------------------------------------------------------------------


def _oom_above(n, tried):
    def trial(b):
        tried.append(b)
        if b > n:
            raise OutOfMemoryError(f"{b} sequences do not fit")
    return trial


def test_search_batch_size_doubles_then_backs_off():
    tried = []
    assert search_batch_size(_oom_above(37, tried)) == 37
    assert tried[:8] == [1, 2, 4, 8, 16, 32, 64, 48]              # doubling, then bisection
    tried.clear()
    assert search_batch_size(_oom_above(37, tried), total=48) == 24   # a divisor: 2 x 24 = 48
    assert max(tried) <= 48
    assert search_batch_size(_oom_above(100, []), total=32) == 32
    assert search_batch_size(_oom_above(5, []), total=7) == 1
    with pytest.raises(OutOfMemoryError, match="not even one"):
        search_batch_size(_oom_above(0, []))


def test_batch_size_auto_on_the_cpu_is_an_error(workdir, capsys):
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", "--batch-size", "auto"], "GPU", "cpu")
    _fails(capsys, ["train", "--batch-size", "many"], "whole number or auto")
    assert not Path("r").exists()


def test_batch_size_auto_keeps_the_global_batch(workdir, monkeypatch):
    real = train_mod.device_has
    monkeypatch.setattr(train_mod, "device_has", lambda d, cap: False if cap == "host_memory" else real(d, cap))
    tried = []
    monkeypatch.setattr(Trainer, "_trial_step", lambda self, b: _oom_above(6, tried)(b))
    said = []
    t = Trainer(_cfg("r", batch_size="auto", total_batch_size=12, max_steps=1), log=said.append)
    assert (t.cfg.batch_size, t.cfg.grad_accum) == (6, 2) and t.train_loader.B == 6
    assert any("batch size auto: micro-batch 6" in s and "grad_accum 2 -> 12 sequences" in s for s in said), said
    t.train()
    _, meta = load_checkpoint(Path("r") / "ckpt")
    assert meta["train_config"]["batch_size"] == 6 and meta["train_config"]["grad_accum"] == 2
    with pytest.raises(ConfigError, match="multiple"):
        TrainConfig(batch_size=5, total_batch_size=12)


def test_shard_writers_never_replace_special_files(tmp_path):
    from forge_ml.data import write_shard
    from forge_ml.errors import DataError
    fifo = tmp_path / "pipe.bin"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file"):
        write_shard(fifo, [1, 2, 3])
    assert fifo.is_fifo()
    with pytest.raises(DataError, match="not a regular file"):
        write_shard(tmp_path, [1, 2, 3])


def test_out_naming_a_file_says_so(workdir, capsys):
    Path("notes.txt").write_text("mine")
    _fails(capsys, ["train", "--data", "t.txt", "--out", "notes.txt", *TINY], "notes.txt exists and is not a folder")
    assert Path("notes.txt").read_text() == "mine"


def test_resume_with_a_lower_lr_names_the_runs_recorded_min_lr(workdir, capsys):
    """A run started without --min-lr records lr / 10; resumed with a lower --lr, it was refused
    with 'give a min_lr <= lr (or leave it out: lr / 10)', though --min-lr had been left out.
    The error now says the min_lr is the run's recorded one and to give --min-lr."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "1"]) == 0
    capsys.readouterr()
    line = _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "2", "--lr", "5e-5"],
                  "min_lr 0.0001", "recorded in its checkpoint", "--min-lr")
    assert "leave it out" not in line
    assert main(["train", "--out", "r", "--resume", "--max-steps", "2", "--lr", "5e-5", "--min-lr", "5e-6"]) == 0


def test_a_tokenizer_asked_against_the_datas_or_the_sources_is_refused(workdir, capsys):
    """--tokenizer gpt2 on a folder prepared with the char tokenizer, or on --init-from a char
    model, was silently ignored: the run trained with the char tokenizer. It is now refused
    before anything is written; the same tokenizer named, or none, trains as before."""
    assert main(["prepare", "t.txt", "--out", "pc"]) == 0
    assert main(["train", "--data", "t.txt", "--out", "src", *TINY, "--max-steps", "1"]) == 0
    capsys.readouterr()
    _fails(capsys, ["train", "--data", "pc", "--tokenizer", "gpt2", "--out", "a", *TINY],
           "--tokenizer gpt2", "pc/tokenizer.json: char", "drop --tokenizer")
    _fails(capsys, ["train", "--init-from", "src", "--data", "t.txt", "--tokenizer", "gpt2", "--out", "b",
                    "--max-steps", "1", "--no-progress"], "--tokenizer gpt2", "char tokenizer", "drop --tokenizer")
    assert not Path("a").exists() and not Path("b").exists()
    assert main(["train", "--data", "pc", "--tokenizer", "char", "--out", "c", *TINY, "--max-steps", "1"]) == 0
    assert main(["train", "--init-from", "src", "--data", "t.txt", "--tokenizer", "char", "--out", "d",
                 "--max-steps", "1", "--no-progress", "--batch-size", "4"]) == 0
    # a run on a GPT-2 folder from before the tokenizer was worked out from the data recorded the
    # default, char, as its tokenizer: it resumes as it did
    assert main(["prepare", "t.txt", "--out", "pg", "--tokenizer", "gpt2"]) == 0
    assert main(["train", "--data", "pg", "--out", "old", *TINY, "--max-steps", "1"]) == 0
    tensors, meta = load_checkpoint(Path("old/ckpt"))
    meta["train_config"]["tokenizer"] = "char"
    save_checkpoint(Path("old/ckpt"), tensors, meta)
    assert main(["train", "--out", "old", "--resume", "--max-steps", "2", "--no-progress"]) == 0


@pytest.mark.parametrize("where", ["evaluate_full", "sample"])
def test_a_failed_final_eval_or_sample_keeps_the_steps_trained(workdir, monkeypatch, where):
    """The final evaluation and sample ran before the final save: an error there (the GPU out
    of memory, say) lost every step since the last checkpoint. Now they are saved first."""
    def boom(self, *a, **kw):
        raise OutOfMemoryError("out of device memory in the final " + where)
    monkeypatch.setattr(Trainer, where, boom)
    t = Trainer(_cfg("r", max_steps=5, checkpoint_interval=2, sample_interval=5), log=None)
    with pytest.raises(OutOfMemoryError, match="final " + where):
        t.train()
    assert load_checkpoint(Path("r/ckpt"))[1]["step"] == 5


def test_resume_with_a_config_file_resumes_the_files_run(workdir, capsys):
    """--resume --config FILE took the run folder from the flags only: with the file's out_dir
    elsewhere, it loaded runs/default's checkpoint settings (another run's lr, dropout, decay)
    and laid them over the file's run. The file's out_dir names the run now."""
    cfg = {"data": "t.txt", "out_dir": "cfgrun", "n_layer": 1, "n_head": 2, "n_embd": 16,
           "block_size": 16, "batch_size": 4, "eval_iters": 2, "eval_interval": 0,
           "sample_interval": 0, "checkpoint_interval": 0, "progress": False, "seed": 3,
           "max_steps": 2}
    Path("c2.json").write_text(json.dumps(cfg))
    Path("c4.json").write_text(json.dumps(dict(cfg, max_steps=4)))
    assert main(["train", "--config", "c2.json"]) == 0
    # another run in the default folder, with other settings, must not be what is resumed
    assert main(["train", "--data", "t.txt", "--out", "runs/default", *TINY, "--max-steps", "2",
                 "--lr", "0.02", "--dropout", "0.3"]) == 0
    assert main(["train", "--resume", "--config", "c4.json"]) == 0
    _, meta = load_checkpoint(Path("cfgrun") / "ckpt")
    assert meta["step"] == 4 and meta["train_config"]["dropout"] == 0.0
    assert meta["train_config"]["lr"] != 0.02
    _, other = load_checkpoint(Path("runs/default") / "ckpt")
    assert other["step"] == 2        # the other run was left alone


def test_a_missing_relative_text_file_names_the_folder_it_was_looked_for_in(workdir, capsys):
    """A --config file's relative "data" is taken from the current folder, not the file's; the
    error said only "text file not found: t2.txt"."""
    Path("sub").mkdir()
    Path("sub/c.json").write_text(json.dumps({"data": "t2.txt", "max_steps": 1}))
    _fails(capsys, ["train", "--config", "sub/c.json", "--out", "r"], "text file not found: t2.txt",
           f"relative to the current folder, {Path.cwd()}")
    assert not Path("r").exists()


def test_new_betas_on_resume_take_effect(workdir):
    """--beta2 on resume was recorded in the new checkpoint's train_config while the optimizer
    kept the checkpoint's betas (the weights came out bit-identical to a resume without it)."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    shutil.copytree("r", "r2")
    assert main(["train", "--out", "r", "--resume", "--max-steps", "4", "--no-progress"]) == 0
    assert main(["train", "--out", "r2", "--resume", "--max-steps", "4", "--no-progress",
                 "--beta2", "0.5"]) == 0
    (a, ma), (b, mb) = load_checkpoint(Path("r") / "ckpt"), load_checkpoint(Path("r2") / "ckpt")
    assert list(mb["optimizer"]["betas"]) == [mb["train_config"]["beta1"], 0.5]
    assert any(not np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a if not k.startswith("opt."))


# -- a new user's test of runs and checkpoints (nineteenth session) -----------------------------------


def test_a_killed_saves_temporary_file_in_ckpt_tmp_blocks_nothing(workdir):
    """A save killed while safetensors wrote its own temporary file (``.tmpXXXXXX``) left it in
    ckpt.tmp, which the next save called a file forge-ml did not write: every resume trained to
    its first checkpoint and failed, and --overwrite deleted the good checkpoint first."""
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--checkpoint-interval", "2"]
    assert main(argv + ["--max-steps", "2"]) == 0
    Path("r/ckpt.tmp").mkdir()
    Path("r/.ckpt.swap").touch()          # the killed save's marker
    Path("r/ckpt.tmp/.tmpugYTss").write_bytes(os.urandom(300))
    assert main(argv + ["--max-steps", "4", "--resume"]) == 0
    assert load_checkpoint("r/ckpt")[1]["step"] == 4 and not Path("r/ckpt.tmp").exists()
    Path("r/ckpt.tmp").mkdir()
    Path("r/.ckpt.swap").touch()
    Path("r/ckpt.tmp/.tmpA1b2C3").write_bytes(b"x")
    assert main(argv + ["--max-steps", "2", "--overwrite"]) == 0
    assert load_checkpoint("r/ckpt")[1]["step"] == 2


@pytest.mark.parametrize("case", ["user file in ckpt.tmp", "ckpt a file", "ckpt a dangling link",
                                  "user file in ckpt"])
def test_a_checkpoint_place_in_the_way_is_refused_before_the_first_step(workdir, capsys, case):
    """Found only at the first save before, after training to it ('training stopped at step
    20; no checkpoint was saved yet'), and with --overwrite after deleting the earlier run."""
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "3"]
    if case == "user file in ckpt":
        assert main(argv) == 0
        Path("r/ckpt/notes.txt").write_text("mine")
        argv.append("--overwrite")
    else:
        Path("r").mkdir()
        if case == "user file in ckpt.tmp":
            Path("r/ckpt.tmp").mkdir()
            Path("r/ckpt.tmp/mine").write_text("x")
        elif case == "ckpt a file":
            Path("r/ckpt").write_text("x")
            argv.append("--overwrite")
        else:
            os.symlink("/nonexistent/place", "r/ckpt")
    before = _snapshot("r")
    line = _fails(capsys, argv, "r/ckpt")
    assert "training stopped" not in line and "step" not in line
    assert _snapshot("r") == before
    assert Path("r/log.jsonl").exists() == (case == "user file in ckpt")   # its earlier run's, kept


def test_a_signal_during_the_final_evaluation_is_finished_by_resume(workdir, capsys, monkeypatch):
    """The stop message said 'continue with --resume', and --resume said the run was finished:
    no whole-shard val loss, no loss.png. The resume now runs the final evaluation."""
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "3"]
    real = Trainer.evaluate_full

    def cut(self, *a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(Trainer, "evaluate_full", cut)
    assert main(argv) == 130
    assert "--resume" in capsys.readouterr().err
    monkeypatch.setattr(Trainer, "evaluate_full", real)
    assert main(["train", "--out", "r", "--resume"]) == 0
    assert "finishing it" in capsys.readouterr().err
    full = [r for r in read_log("r/log.jsonl")[0] if r.get("val_kind") == "full"]
    assert [r["step"] for r in full] == [3] and load_checkpoint("r/ckpt")[1]["val_kind"] == "full"
    _fails(capsys, ["train", "--out", "r", "--resume"], "is finished")   # and now it is


def test_a_signal_during_a_periodic_evaluation_keeps_its_record(workdir, monkeypatch):
    """Resumed after a signal cut the evaluation of step 2 short, the log had no val record of
    step 2; the resumed run evaluates first, and its log is the uninterrupted run's."""
    kw = dict(max_steps=4, eval_interval=2, checkpoint_interval=2)
    Trainer(_cfg("ref", **kw), log=None).train()
    real, calls = Trainer.evaluate, []

    def cut(self, *a, **k):
        calls.append(self.step)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(Trainer, "evaluate", cut)
    with pytest.raises(Interrupted):
        Trainer(_cfg("r", **kw), log=None).train()
    Trainer(_cfg("r", **kw), resume=True, log=None).train()
    assert calls == [2, 2]

    def records(run):
        return [{k: v for k, v in r.items() if k not in ("dt_ms", "tokens_per_s", "elapsed", "time")}
                for r in read_log(Path(run) / "log.jsonl")[0]]
    assert records("r") == records("ref")
    _same_checkpoints("r", "ref")


@pytest.mark.parametrize("name", ["loss.png", "train.lock"])
def test_a_users_loss_png_or_train_lock_in_the_folder_is_not_replaced(workdir, capsys, name):
    """A folder with a user's file of the name a run writes: train.lock was rewritten as the
    lock was taken (even by a run then refused), loss.png replaced at the end."""
    Path("u").mkdir()
    Path("u", name).write_bytes(b"my notes\n")
    _fails(capsys, ["train", "--data", "t.txt", "--out", "u", *TINY, "--max-steps", "2"], f"u/{name}",
           "move it away")
    assert Path("u", name).read_bytes() == b"my notes\n" and os.listdir("u") == [name]
    # a run's own files are its own: a plot it drew, an empty lock, a dead trainer's lock line
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    for f in ("ckpt", "data", "log.jsonl"):
        shutil.rmtree(Path("r", f)) if Path("r", f).is_dir() else Path("r", f).unlink()
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0


@pytest.mark.parametrize("step", ['"abc"', "null", "-5", "true", "2.5"])
def test_a_damaged_step_in_state_json_is_one_line_and_keeps_the_log(workdir, capsys, step):
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "3"]
    assert main(argv) == 0
    state = json.loads(Path("r/ckpt/state.json").read_text())
    state["meta"]["step"] = json.loads(step)
    Path("r/ckpt/state.json").write_text(json.dumps(state))
    before = _snapshot("r")
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "6"], "step must be an integer >= 0")
    assert _snapshot("r") == before


def test_a_reader_racing_a_save_never_reports_a_false_corruption(tmp_path, monkeypatch):
    """load_checkpoint read state.json, then the model a trainer had just swapped in: 'sha256
    mismatch ... altered or corrupted' for a healthy checkpoint (4 loads in 1,500 in a new
    user's test). A read during a swap now reads the new checkpoint."""
    import forge_ml.checkpoint as ck
    d = tmp_path / "ckpt"
    save_checkpoint(d, {"w": np.zeros(4, np.float32)}, {"step": 1})
    real, swapped = ck.sha256_file, []

    def racing(path, *a, **kw):
        if not swapped:       # the trainer's next save lands between the reader's two files
            swapped.append(1)
            save_checkpoint(d, {"w": np.ones(4, np.float32)}, {"step": 2})
        return real(path, *a, **kw)
    monkeypatch.setattr(ck, "sha256_file", racing)
    tensors, meta = load_checkpoint(d)
    assert swapped and meta["step"] == 2 and np.array_equal(tensors["w"], np.ones(4, np.float32))


def test_resume_from_a_text_prepared_again_with_other_tokens_is_refused(workdir, capsys):
    """data/ deleted, and the text edited to the same length: the resume prepared it again and
    trained on other tokens without a word. The checkpoint records the tokens' digest."""
    Path("s.txt").write_text(TEXT)
    argv = ["train", "--data", "s.txt", "--out", "r", *TINY, "--max-steps", "2"]
    assert main(argv) == 0
    assert isinstance(load_checkpoint("r/ckpt")[1]["tokens_sha256"], str)
    shutil.rmtree("r/data")
    Path("s.txt").write_text(TEXT.replace("to be", "be to"))
    before = _snapshot("r")
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "4"], "cannot resume", "tokens")
    assert _snapshot("r") == before
    # the text as it was: prepared again, the same tokens, resumed
    Path("s.txt").write_text(TEXT)
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3"]) == 0
    # the shards replaced in place (prepare --force) from an edited text, the same sizes: the
    # names and sizes the checkpoint records match, the digest does not
    Path("e.txt").write_text(TEXT.replace("to be", "be to"))
    assert main(["prepare", "e.txt", "--out", "r/data", "--force"]) == 0
    capsys.readouterr()
    before = _snapshot("r")
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "4"], "cannot resume", "tokens")
    assert _snapshot("r") == before


def test_small_resume_and_out_mistakes_are_one_line(workdir, capsys):
    """--out '' trained into the working folder; --val-fraction on resume did nothing;
    --batch-size on resume gave the data loader's internal message; --resume while another
    trainer holds a run without a checkpoint advised --overwrite."""
    _fails(capsys, ["train", "--data", "t.txt", "--out", "", *TINY, "--max-steps", "1"], "--out is empty")
    assert sorted(os.listdir(".")) == ["t.txt"]
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]
    assert main(argv) == 0
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "4", "--val-fraction", "0.5"],
           "--val-fraction 0.5", "keeps its shards")
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "4", "--batch-size", "2"],
           "--batch-size 2", "batches of 4", "--grad-accum")
    holder = Trainer(_cfg("busy", max_steps=1), log=None)      # holds busy/, no checkpoint yet
    try:
        _fails(capsys, ["train", "--out", "busy", "--resume"], "in use by another trainer")
    finally:
        holder.close()


def test_a_stop_after_the_final_evaluation_is_finished_by_resume(workdir, capsys, monkeypatch):
    """A signal during the final sample (after the final evaluation), or a crash before the
    loss curve was drawn: the resume said the run was finished, and no command drew loss.png."""
    pytest.importorskip("matplotlib")
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "3", "--sample-interval", "3",
            "--sample-tokens", "4"]      # the one sample is the final one, after the final evaluation
    real = Trainer.sample

    def cut(self, *a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(Trainer, "sample", cut)
    assert main(argv) == 130
    monkeypatch.setattr(Trainer, "sample", real)
    assert load_checkpoint("r/ckpt")[1]["val_kind"] == "full"
    assert not Path("r/loss.png").exists() and "--resume" in capsys.readouterr().err
    assert main(["train", "--out", "r", "--resume"]) == 0
    assert "finishing it: its loss curve" in capsys.readouterr().err and Path("r/loss.png").is_file()
    _fails(capsys, ["train", "--out", "r", "--resume"], "is finished")


def test_extending_a_finished_run_does_not_evaluate_its_last_step_again(workdir):
    kw = dict(eval_interval=2, checkpoint_interval=2)
    Trainer(_cfg("r", max_steps=4, **kw), log=None).train()
    Trainer(_cfg("r", max_steps=6, lr_decay_steps=6, **kw), resume=True, log=None).train()
    vals = [(r["step"], r["val_kind"]) for r in read_log("r/log.jsonl")[0] if "val_loss" in r]
    assert vals == [(2, "sampled"), (4, "full"), (6, "full")]


def test_resuming_a_fine_tune_whose_data_is_gone_tokenizes_with_the_runs_alphabet(workdir):
    """A char fine-tune from a source whose alphabet is larger than the text's: with data/
    deleted, the resume prepared the text with the text's own alphabet (other ids) and then
    said the text was edited."""
    Path("src.txt").write_text(TEXT + "XYZ\n")
    Trainer(_cfg("source", data="src.txt", max_steps=2), log=None).train()
    kw = dict(init_from="source", max_steps=4, checkpoint_interval=2)
    Trainer(_cfg("ft", **kw), log=None).train(until=2)
    shutil.rmtree("ft/data")
    Trainer(_cfg("ft", **kw), resume=True, log=None).train()
    assert load_checkpoint("ft/ckpt")[1]["step"] == 4


def test_a_shard_folder_run_records_its_tokens_digest(workdir, capsys):
    """Finding 7 for --data FOLDER: the shards prepared again from an edited text of the same
    length (prepare --force) were trained on without a word."""
    Path("s.txt").write_text(TEXT)
    assert main(["prepare", "s.txt", "--out", "pf"]) == 0
    argv = ["train", "--data", "pf", "--out", "r", *TINY]
    assert main(argv + ["--max-steps", "2"]) == 0
    assert isinstance(load_checkpoint("r/ckpt")[1]["tokens_sha256"], str)
    Path("s.txt").write_text(TEXT.replace("to be", "be to"))
    assert main(["prepare", "s.txt", "--out", "pf", "--force"]) == 0
    capsys.readouterr()
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "4"], "cannot resume", "tokens")


def test_a_resume_probe_or_a_damaged_lock_leaves_the_folder_as_it_was(workdir, capsys):
    """--resume into a folder without a run left a train.lock behind; a run's own lock file
    zero-filled (a power loss) was refused as a user's file."""
    Path("uf").mkdir()
    Path("uf/notes.txt").write_text("mine")
    _fails(capsys, ["train", "--out", "uf", "--resume"], "cannot resume")
    assert os.listdir("uf") == ["notes.txt"]
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2", "--checkpoint-interval", "1"]
    assert main(argv) == 0
    Path("r/train.lock").write_bytes(b"\0" * 40)
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3"]) == 0
    Path("r/train.lock").write_text("\nnot a lock line\n")
    assert main(["train", "--out", "r", "--resume", "--max-steps", "4"]) == 0


def test_train_flag_mistakes_found_by_a_new_user_are_refused(workdir, capsys):
    """An explicit --grad-accum 1 against --total-batch-size was overridden in silence (1 is
    also the default); val_fraction in a --config file was taken with a data folder (the flag
    is refused); --corpus-bytes -5, --n-layer 0 (silently the default) and --bucket-mb -3 were
    accepted."""
    base = ["train", "--out", "r", *TINY, "--max-steps", "1"]
    _fails(capsys, base + ["--data", "t.txt", "--grad-accum", "1", "--total-batch-size", "12"],
           "--grad-accum 1 x --batch-size 4 is not --total-batch-size 12")
    assert main(["prepare", "t.txt", "--out", "pf"]) == 0
    Path("c.json").write_text(json.dumps({"data": "pf", "val_fraction": 0.3}))
    _fails(capsys, base + ["--config", "c.json"], "val_fraction (in c.json)")
    _fails(capsys, base + ["--corpus-bytes", "-5"], "--corpus-bytes must be >= 1")
    _fails(capsys, base + ["--data", "t.txt", "--n-layer", "0"], "--n-layer must be >= 1")
    _fails(capsys, base + ["--data", "t.txt", "--bucket-mb", "-3"], "--bucket-mb must be a size")
    assert not Path("r").exists()
    # 0 is one bucket per parameter (the session that refused -3 refused 0 too, and the GPU
    # suite's torchrun run, which passes 0, failed)
    assert main(base + ["--data", "t.txt", "--bucket-mb", "0", "--out", "r0"]) == 0
    assert main(base + ["--data", "t.txt", "--grad-accum", "3", "--total-batch-size", "12"]) == 0


def test_keep_best_keeps_the_model_of_the_lowest_val_loss(workdir, capsys):
    """nanoGPT's always_save_checkpoint=False: the checkpoint of the best val loss, which a run
    could not keep (one ckpt/, the last). --keep-best writes OUT/best, a model checkpoint that
    sample and eval read, kept across a resume and removed by --overwrite."""
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--eval-interval", "2", "--keep-best",
            "--lr", "3e-2", "--checkpoint-interval", "4"]
    assert main(argv + ["--max-steps", "4"]) == 0
    assert main(["train", "--out", "r", "--resume", "--max-steps", "8", "--lr-decay-steps", "8"]) == 0
    vals = [r for r in read_log("r/log.jsonl")[0] if "val_loss" in r]
    bests = [r for r in vals if r.get("best")]
    assert bests and all(b["val_loss"] < a["val_loss"] for a, b in zip(bests, bests[1:]))
    low = min(r["val_loss"] for r in vals if r["val_kind"] == "sampled")   # the estimates compete
    tensors, meta = load_checkpoint("r/best")
    assert meta["kind"] == "forge-ml-model" and meta["val_loss"] == low == bests[-1]["val_loss"]
    assert meta["step"] == bests[-1]["step"] and "opt.m.wte.weight" not in tensors
    capsys.readouterr()
    assert main(["sample", "--ckpt", "r/best", "--prompt", "to", "--max-new-tokens", "4"]) == 0
    assert main(["eval", "--ckpt", "r/best", "--data", "r/data/val.bin"]) == 0
    # best/ holding what this run did not keep: a training checkpoint, or another run's best
    shutil.copytree("r/best", "other_best")
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "1", "--overwrite"]) == 0
    assert not Path("r/best").exists()
    shutil.copytree("r/ckpt", "r/best")
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "2", "--keep-best"], "r/best")
    shutil.rmtree("r/best")
    shutil.copytree("other_best", "r/best")
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "2", "--keep-best"],
           "a model that this run did not keep")


def test_keep_best_lets_the_last_steps_model_compete(workdir, capsys):
    """The last step's model is estimated as the periodic ones are, so best/ can be the final
    model (a user's check: with the last step left out, best/ held step 4 of 6 while the final
    model scored lower on the same data). A last step off the interval competes too."""
    for steps in (6, 7):
        out = f"r{steps}"
        assert main(["train", "--data", "t.txt", "--out", out, *TINY, "--eval-interval", "2", "--keep-best",
                     "--lr", "3e-2", "--max-steps", str(steps)]) == 0
        vals = [r for r in read_log(f"{out}/log.jsonl")[0] if r.get("val_kind") == "sampled"]
        assert [r["step"] for r in vals] == [2, 4, 6] + ([7] if steps == 7 else [])
        low = min(vals, key=lambda r: r["val_loss"])
        _, meta = load_checkpoint(f"{out}/best")
        assert meta["step"] == low["step"] and meta["val_loss"] == low["val_loss"]
        assert low["step"] == steps, vals   # at lr 3e-2 the loss falls at every evaluation


_KILL_AT_CHECKPOINT = """
import os, sys
from forge_ml import train
from forge_ml.cli import main
step = int(sys.argv[1])
real = train.Trainer._save
def save(self, where, *a, **k):       # killed after best/ of this step, before its checkpoint
    if os.path.basename(str(where)) == "ckpt" and self.step == step:
        os._exit(9)
    return real(self, where, *a, **k)
train.Trainer._save = save
sys.exit(main(sys.argv[2:]))
"""


def test_keep_best_after_a_stop_between_best_and_checkpoint_and_under_overwrite(workdir, capsys):
    """From a kill-and-resume campaign: a kill after best/ was kept at step s but before step s's
    checkpoint made the resume compare step s's val loss with best/'s, its own future: the log
    lost s's "best" mark. And --overwrite refused every run that had kept a best/."""
    argv = ["train", "--data", "t.txt", *TINY, "--eval-interval", "2", "--keep-best", "--lr", "3e-2",
            "--checkpoint-interval", "2", "--max-steps", "8"]
    assert main(argv + ["--out", "ref"]) == 0
    want = read_log("ref/log.jsonl")[0]
    best_steps = [r["step"] for r in want if r.get("best")]
    assert len(best_steps) >= 2, want
    last = best_steps[-1]
    env = dict(os.environ, PYTHONPATH=SRC, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _KILL_AT_CHECKPOINT, str(last), *argv, "--out", "r"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert load_checkpoint("r/best")[1]["step"] == last > load_checkpoint("r/ckpt")[1]["step"]
    capsys.readouterr()
    assert main(["train", "--out", "r", "--resume"]) == 0
    got = read_log("r/log.jsonl")[0]
    same = lambda rs: [{k: v for k, v in r.items() if k not in ("tokens_per_s", "time", "dt_ms")}
                       for r in rs]
    assert [r["step"] for r in got if r.get("best")] == best_steps
    assert same(got) == same(want)
    # --overwrite starts over (and removes the earlier run's best/)
    assert main(argv + ["--out", "r", "--overwrite"]) == 0
    assert read_log("r/log.jsonl")[0][0]["step"] == 1


def _killed_after_best_at_8() -> None:
    """Run r (keep_best, estimates and checkpoints every 2 steps, 8 steps) killed at step 8's
    checkpoint: best/ holds step 8's model, ckpt/ step 6's."""
    argv = ["train", "--data", "t.txt", *TINY, "--eval-interval", "2", "--keep-best", "--lr", "3e-2",
            "--checkpoint-interval", "2", "--max-steps", "8"]
    env = dict(os.environ, PYTHONPATH=SRC, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _KILL_AT_CHECKPOINT, "8", *argv, "--out", "r"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr


def test_a_resume_that_ends_before_its_best_steps_is_refused(workdir, capsys):
    """A kill after best/ was kept at step 8 but before step 8's checkpoint (step 6), then a
    resume with --max-steps 6: the run ended at step 6 with best/ holding step 8's model, from
    steps it gave up, and a log that never names it (at 7 an estimate replaced it in silence).
    Such a resume is refused before any write, naming the steps and --max-steps; --max-steps 8
    trains step 8 again, and with best/ moved away the run ends at step 6."""
    _killed_after_best_at_8()
    assert load_checkpoint("r/best")[1]["step"] == 8 and load_checkpoint("r/ckpt")[1]["step"] == 6
    shutil.copytree("r", "r2")
    before = _snapshot("r")
    capsys.readouterr()
    for more in (["--max-steps", "6"], ["--max-steps", "7"], ["--max-steps", "7", "--no-keep-best"]):
        _fails(capsys, ["train", "--out", "r", "--resume", *more],
               f"--max-steps {more[1]}: r/best holds the model of step 8", "last checkpoint (step 6)",
               "--max-steps 8 or more", "move r/best away")
    cfg = TrainConfig.from_dict(dict(load_checkpoint("r/ckpt")[1]["train_config"], max_steps=7))
    with pytest.raises(ConfigError, match=r"max_steps=7: r/best holds the model of step 8.*max_steps=8 or more"):
        Trainer(cfg, resume=True, log=None)
    assert _snapshot("r") == before
    assert main(["train", "--out", "r", "--resume"]) == 0
    assert load_checkpoint("r/best")[1]["step"] == 8 == load_checkpoint("r/ckpt")[1]["step"]
    shutil.move("r2/best", "best8")
    assert main(["train", "--out", "r2", "--resume", "--max-steps", "6"]) == 0
    assert load_checkpoint("r2/ckpt")[1]["step"] == 6 and not Path("r2/best").exists()


def test_a_resume_that_trains_past_its_best_otherwise_says_best_is_not_its_model(workdir, capsys):
    """A QA report: kill after best/ was kept at step 8 but before step 8's checkpoint (6),
    then a resume to step 8 with another lr: its estimates did not beat the best up to step 6,
    so best/ kept the stopped attempt's step-8 model, a model of steps this run trained
    otherwise, and nothing said so. The run says it at the end; the same flags reproduce step
    8, replace best/ and say nothing."""
    _killed_after_best_at_8()
    shutil.copytree("r", "r2")
    orphan = _snapshot("r/best")
    capsys.readouterr()
    assert main(["train", "--out", "r", "--resume", "--lr", "1e-12", "--min-lr", "0"]) == 0
    out = capsys.readouterr().out
    assert _snapshot("r/best") == orphan                 # nothing of this run beat the best before
    assert "r/best still holds the model of step 8" in out and "not one of this run's" in out, out
    assert main(["train", "--out", "r2", "--resume"]) == 0
    out = capsys.readouterr().out
    assert load_checkpoint("r2/best")[1]["step"] == 8 and "still holds" not in out, out


def test_a_resumed_run_refuses_a_preset_of_other_sizes(workdir, capsys):
    """A QA report: --resume --model gpt2 on a 1-layer run from scratch trained the 1-layer
    model and recorded model "gpt2" in its checkpoint; it is refused as --n-layer is, with
    nothing written, and the run's own preset (or none) still resumes."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    before = _snapshot("r")
    capsys.readouterr()
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "3", "--model", "gpt2"],
           "--model gpt2: the run in r trains a model with n_layer", "drop --model")
    assert _snapshot("r") == before
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3"]) == 0
    assert load_checkpoint("r/ckpt")[1]["train_config"]["model"] in ("", None)


def test_a_resume_to_a_step_before_the_checkpoints_is_refused(workdir, capsys):
    """A QA report: --resume --max-steps 1 on a run at step 3 said "steps 3 -> 1", evaluated
    and rewrote the checkpoint recording max_steps 1; it is refused with nothing written."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "3"]) == 0
    before = _snapshot("r")
    capsys.readouterr()
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "1"],
           "--max-steps 1: the run in r is at step 3 already", "--max-steps 4 or more")
    assert _snapshot("r") == before
    cfg = TrainConfig.from_dict(dict(load_checkpoint("r/ckpt")[1]["train_config"], max_steps=2))
    with pytest.raises(ConfigError, match="max_steps=2: the run in r is at step 3 already"):
        Trainer(cfg, resume=True, log=None)
    assert main(["train", "--out", "r", "--resume", "--max-steps", "4"]) == 0


def test_a_first_save_cut_before_its_rename_is_named_not_advised_away(workdir, capsys):
    """A QA report: a run whose first save wrote ckpt.tmp whole but stopped before renaming
    it to ckpt/ said "start it over with --overwrite", which removes that checkpoint. The
    message names ckpt.tmp and the rename; renamed, it resumes (its sha256 checked)."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    os.replace("r/ckpt", "r/ckpt.tmp")
    capsys.readouterr()
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "3"],
           "r/ckpt.tmp holds one whose save stopped before its last rename", "rename it to r/ckpt",
           "--overwrite would remove it")
    assert Path("r/ckpt.tmp/state.json").is_file()
    os.replace("r/ckpt.tmp", "r/ckpt")
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3"]) == 0


def test_convert_force_does_not_replace_a_runs_kept_best(workdir, capsys):
    """convert --from-hf X --out RUN/best --force replaced the model --keep-best kept (both are
    model checkpoints); --force replaces only an earlier conversion."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--eval-interval", "2", "--keep-best",
                 "--max-steps", "4"]) == 0
    assert main(["convert", "--to-hf", "r", "--out", "hf"]) == 0
    before = _snapshot("r/best")
    _fails(capsys, ["convert", "--from-hf", "hf", "--out", "r/best", "--force"],
           "holds the model a training run kept")
    assert _snapshot("r/best") == before
    assert main(["convert", "--from-hf", "hf", "--out", "conv"]) == 0
    assert main(["convert", "--from-hf", "hf", "--out", "conv", "--force"]) == 0     # its own


def test_a_failed_or_killed_data_preparation_leaves_a_folder_the_same_command_takes(workdir, capsys,
                                                                                   monkeypatch):
    """From a kill-and-resume campaign: a full disk at val.bin's rename, after train.bin's, left
    data/train.bin, and the same command was then refused ("holds a run (data/)"); a kill
    midway through a write left .train.bin.XXXXXXXX.tmp (and the log's, the plot's) for good,
    and data/ holding only that was refused as a run's data too."""
    import errno as _errno
    real = os.replace

    def full(src, dst, *a, **k):
        if str(dst).endswith("val.bin"):
            raise OSError(_errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst, *a, **k)
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]
    with monkeypatch.context() as m:
        m.setattr(os, "replace", full)
        _fails(capsys, argv, "No space left on device")
    assert not Path("r/data/train.bin").exists()
    assert main(argv) == 0
    shutil.rmtree("r")
    Path("r/data").mkdir(parents=True)
    for f in ("r/data/.train.bin.a1b2c3d4.tmp", "r/.log.jsonl.zz09_xyq.tmp", "r/.loss.png.abcdefgh.tmp"):
        Path(f).write_bytes(b"partial")
    Path("r/notes.tmp").write_text("a user's")
    Path("r/.log.jsonl.BACKUP01.tmp").write_text("a user's")   # not a name mkstemp makes
    assert main(argv) == 0
    assert sorted(p.name for p in Path("r").iterdir() if p.name.startswith(".")) == [".log.jsonl.BACKUP01.tmp"]
    assert not any(p.name.endswith(".tmp") for p in Path("r/data").iterdir())
    assert Path("r/notes.tmp").read_text() == "a user's"


def test_a_folder_that_cannot_be_flocked_falls_back_to_the_lock_file(workdir, monkeypatch):
    """From a re-test: on NFS, flock of a folder opened for reading fails with EBADF (a
    byte-range lock wants a descriptor open for writing), and every trainer stopped there.
    The lock file alone guards the folder then, as before."""
    import errno as _errno
    import fcntl
    import stat as _stat
    real = fcntl.flock

    def nfs(fd, op):
        if _stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(_errno.EBADF, "Bad file descriptor")
        return real(fd, op)
    monkeypatch.setattr(fcntl, "flock", nfs)
    first = Trainer(_cfg("r", max_steps=2), log=None)
    with pytest.raises(RunError, match="in use"):            # the lock file still guards it
        Trainer(_cfg("r", max_steps=2), log=None, overwrite=True)
    assert first.train()["step"] == 2


def test_keep_best_is_this_folders_only(workdir, capsys):
    """From a re-test: --overwrite --keep-best deleted another run's best/ moved into the
    folder, and a plain --overwrite a user's conversion written to RUN/best; convert --from-hf
    without --force replaced RUN/best (or RUN/ckpt) when a kill had left only its .old copy."""
    keep = ["--eval-interval", "2", "--keep-best"]
    assert main(["train", "--data", "t.txt", "--out", "a", *TINY, *keep, "--max-steps", "4"]) == 0
    assert main(["train", "--data", "t.txt", "--out", "b", *TINY, "--max-steps", "2"]) == 0
    shutil.copytree("a/best", "b/best")                        # another run's best, moved here
    before = _snapshot("b/best")
    _fails(capsys, ["train", "--data", "t.txt", "--out", "b", *TINY, *keep, "--max-steps", "2",
                    "--overwrite"], "a model that this run did not keep")
    assert main(["train", "--data", "t.txt", "--out", "b", *TINY, "--max-steps", "2", "--overwrite"]) == 0
    assert _snapshot("b/best") == before                       # not this folder's: kept
    # a kill between the two renames of a save: only best.old (and ckpt.old) are there
    assert main(["convert", "--to-hf", "a", "--out", "hf"]) == 0
    for name in ("best", "ckpt"):
        os.rename(f"a/{name}", f"a/{name}.old")
        kept = _snapshot(f"a/{name}.old")
        _fails(capsys, ["convert", "--from-hf", "hf", "--out", f"a/{name}"], f"a/{name}")
        assert _snapshot(f"a/{name}.old") == kept and not Path(f"a/{name}").exists()
        os.rename(f"a/{name}.old", f"a/{name}")
    assert main(["train", "--out", "a", "--resume", "--max-steps", "5"]) == 0
    # a run folder moved as a whole: its best/ names the old folder, its checkpoint the run
    os.rename("a", "moved")
    assert main(["train", "--data", "t.txt", "--out", "moved", *TINY, *keep, "--max-steps", "2",
                 "--overwrite"]) == 0
    # the earlier run's best/ removed; the new run's last step kept its own
    assert load_checkpoint("moved/best")[1]["run_id"] == load_checkpoint("moved/ckpt")[1]["run_id"]
    assert load_checkpoint("moved/best")[1]["step"] == 2


def test_a_hangup_or_a_closed_stdout_stops_the_run_with_a_checkpoint(workdir):
    """From a new user's test in hostile environments: SIGHUP (an SSH session dropping) killed
    the run without a save; `forge-ml train | head` ended the run at the pipe's end with exit 0,
    the steps since the last checkpoint lost. Both now stop at a step boundary with a checkpoint
    of that step, as SIGINT does (exit 129, 141)."""
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "forge_ml", "train", "--data", "t.txt", *TINY, "--max-steps", "100000",
            "--log-interval", "1", "--checkpoint-interval", "50"]
    # "both": `train 2>&1 | head`, the stop's message going to the closed pipe too, exited 0
    for how, status in (("hup", 129), ("pipe", 141), ("both", 141)):
        run = f"run_{how}"
        p = subprocess.Popen(args + ["--out", run], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT if how == "both" else subprocess.PIPE)
        seen = 0
        for line in p.stdout:
            seen += line.startswith(b"step")
            if seen >= 8:
                break
        if how == "hup":
            p.send_signal(signal.SIGHUP)
            p.stdout.read()
        else:
            p.stdout.close()         # the reader goes away, as `| head` does
        err = p.stderr.read().decode() if how != "both" else ""
        assert p.wait(timeout=120) == status, err
        step = load_checkpoint(Path(run) / "ckpt")[1]["step"]
        assert step >= 8 and max(r["step"] for r in read_log(Path(run) / "log.jsonl")[0]) == step
        assert "Traceback" not in err and ("--resume" in err or how == "both")


def test_overwrite_removes_only_what_a_run_wrote(workdir):
    """A QA report: a user's own log.jsonl was called "a run" and --overwrite deleted it; with
    one, --overwrite also replaced a user's loss.png (the plot check was skipped for a folder
    "holding a run"), and shards a user prepared into OUT/data were removed as a run's. Each is
    now refused, with or without --overwrite, and left as it was."""
    from forge_ml.errors import ForgeError
    png = b"\x89PNG\r\n\x1a\n" + b"not forge-ml's" * 10
    Path("u1").mkdir()
    Path("u1/log.jsonl").write_text('{"event": "deploy"}\n')
    for over in (False, True):
        with pytest.raises(ForgeError, match=r"u1/log.jsonl is not a log that forge-ml wrote"):
            Trainer(_cfg("u1"), overwrite=over)
    assert Path("u1/log.jsonl").read_text() == '{"event": "deploy"}\n'
    Path("u1/train.lock").write_text("my notes\n")        # (review) rewritten before the refusal
    with pytest.raises(ForgeError, match=r"u1/train.lock is not a lock file that forge-ml wrote"):
        Trainer(_cfg("u1"), overwrite=True)
    assert Path("u1/train.lock").read_text() == "my notes\n"
    Trainer(_cfg("u2")).train()                       # a run, then a user's picture over its plot
    Path("u2/loss.png").write_bytes(png)
    with pytest.raises(ForgeError, match=r"u2/loss.png is not a loss curve that forge-ml drew"):
        Trainer(_cfg("u2"), overwrite=True)
    assert Path("u2/loss.png").read_bytes() == png and Path("u2/ckpt").is_dir()
    Trainer(_cfg("u3")).train()                       # a run's own data is removed with it ...
    Path("u3/loss.png").unlink()
    Trainer(_cfg("u3", max_steps=2), overwrite=True).train()
    from forge_ml.cli import main
    assert main(["prepare", "t.txt", "--out", "u4/data"]) == 0   # ... a user's prepared data is not
    before = sorted(p.name for p in Path("u4/data").iterdir())
    for over in (False, True):
        with pytest.raises(ForgeError, match=r"u4/data holds data and u4 no run .* (--data |data=)u4/data"):
            Trainer(_cfg("u4"), overwrite=over)
    assert sorted(p.name for p in Path("u4/data").iterdir()) == before
    # (review) a run's own things stay the run's: data a setup wrote before it failed, a log
    # torn by a full disk beside its checkpoint, a plot an older forge-ml drew (no mark)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(train_mod.GPT2, "init", classmethod(lambda *a, **k: (_ for _ in ()).throw(MemoryError("x"))))
        with pytest.raises(MemoryError):
            Trainer(_cfg("u5"))
    with pytest.raises(ForgeError, match="u5 holds a run"):
        Trainer(_cfg("u5"))
    Trainer(_cfg("u5", max_steps=2), overwrite=True).train()
    Path("u3/log.jsonl").write_text('{"step": 1, "loss": 3.')        # torn
    Path("u3/loss.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"Software\x00Matplotlib version3.9")
    Trainer(_cfg("u3", max_steps=2), overwrite=True).train()
    assert b"forge-ml train" in Path("u3/loss.png").read_bytes() or not Path("u3/loss.png").exists()


def test_prepare_force_does_not_replace_a_running_runs_data(workdir, capsys):
    """prepare --force into a run's data/ while its trainer held the run replaced the shards
    under it (its resume was then refused); --val-fraction 1.5 was said as val_fraction."""
    t = Trainer(_cfg("r"))                                   # holds r until closed
    before = Path("r/data/train.bin").read_bytes()
    line = _fails(capsys, ["prepare", "t.txt", "--out", "r/data", "--force"], "r")
    assert "in use" in line or "running" in line, line
    assert Path("r/data/train.bin").read_bytes() == before
    t.close()
    assert main(["prepare", "t.txt", "--out", "r/data", "--force"]) == 0   # a run at rest: --force goes
    _fails(capsys, ["prepare", "t.txt", "--out", "p", "--val-fraction", "1.5"],
           "--val-fraction must be a number in (0, 1), got 1.5")


def test_a_stdout_that_cannot_encode_the_text_does_not_end_the_run(workdir):
    """PYTHONIOENCODING=ascii (or a POSIX locale) and a sample with non-ASCII text: a
    UnicodeEncodeError ended the run at its first sample, before any checkpoint."""
    Path("u.txt").write_text("h\u00e9llo w\u00f6rld \U0001F600 \u65e5\u672c " * 200)
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONIOENCODING="ascii")
    r = subprocess.run([sys.executable, "-m", "forge_ml", "train", "--data", "u.txt", "--out", "r\u00e9", *TINY,
                        "--max-steps", "4", "--sample-interval", "2", "--sample-tokens", "20"],
                       env=env, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert b"\\u" in r.stdout or b"\\x" in r.stdout                # escaped, not an error
    r = subprocess.run([sys.executable, "-m", "forge_ml", "sample", "--ckpt", "r\u00e9", "--prompt",
                        "h\u00e9", "--max-new-tokens", "5"], env=env, capture_output=True, timeout=120)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode()


def test_no_home_folder_a_tilde_path_and_memory_errors(workdir, monkeypatch, capsys):
    """No HOME and no passwd entry (a container's uid): Path.home() raised and every command
    gave a traceback. --out=~/x made a folder named '~'. A MemoryError was a NumPy traceback."""
    from forge_ml import flags
    import forge_ml.cli as cli_mod
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home(cls=None):
        raise RuntimeError("Could not determine home directory")
    monkeypatch.setattr(Path, "home", classmethod(no_home))
    # FORGE_CACHE_DIR unset: flags.get reads the environment once and keeps the value, so
    # deleting the variable here changed nothing where it was set; an override is read first
    with flags.override(FORGE_CACHE_DIR=""):
        assert "forge-ml-cache" in str(flags.cache_root("cpu"))
    monkeypatch.undo()
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HOME", str(workdir / "home"))
    assert main(["train", "--data", "t.txt", "--out=~/r", *TINY, "--max-steps", "1"]) == 0
    assert (workdir / "home" / "r" / "ckpt").is_dir() and not Path("~").exists()

    def oom(args):
        raise MemoryError("Unable to allocate 38.1 GiB for an array")
    monkeypatch.setitem(cli_mod._COMMANDS, "eval", oom)
    _fails(capsys, ["eval", "--ckpt", "x", "--data", "t.txt"], "out of memory", "38.1 GiB", "--batch-size")


# -- QA re-test: the run folder's own sources, inherited ignored signals, nested runs ----------------


def test_overwrite_refuses_an_init_from_inside_the_run_folder(workdir, capsys):
    """From a QA test: `--init-from runs/a --out runs/a --overwrite` removed runs/a's run (its
    own source model) before training from it: a Ctrl-C after the removal left nothing. Now
    refused before anything is removed, for the folder, its ckpt/ and best/, by a relative
    path or through a link; the library names init_from / out_dir."""
    keep = ["--eval-interval", "2", "--keep-best"]
    assert main(["train", "--data", "t.txt", "--out", "a", *TINY, *keep, "--max-steps", "4"]) == 0
    os.symlink("a", "link")
    before = _snapshot("a")
    capsys.readouterr()
    for src in ("a", "a/", "./a/ckpt", "a/best", "link", "link/best", str(workdir / "a")):
        line = _fails(capsys, ["train", "--data", "t.txt", "--out", "a", *TINY, *keep, "--max-steps", "2",
                               "--init-from", src, "--overwrite"], f"--init-from {src}", "--out", "--overwrite",
                      "copy")
        assert _snapshot("a") == before, (src, line)
    _fails(capsys, ["train", "--data", "t.txt", "--out", "link", *TINY, "--max-steps", "2",
                    "--init-from", "a/ckpt", "--overwrite"], "--init-from a/ckpt")
    assert _snapshot("a") == before
    with pytest.raises(ConfigError) as e:
        Trainer(_cfg("a", max_steps=2, init_from="a/best"), log=None, overwrite=True)
    assert "init_from" in str(e.value) and "out_dir" in str(e.value) and "--init-from" not in str(e.value)
    assert _snapshot("a") == before
    # elsewhere, or a copy of the user's own inside the run folder, which --overwrite keeps
    # (the refusal took every model in the folder), and without --overwrite (refused as a run
    # the folder holds), as before
    shutil.copytree("a/best", "mine")
    shutil.copytree("a/best", "a/mine")
    for src in ("mine", "a/mine"):
        assert main(["train", "--data", "t.txt", "--out", "a", *TINY, "--max-steps", "2", "--init-from", src,
                     "--overwrite"]) == 0, src
    assert Path("a/mine/model.safetensors").is_file()
    _fails(capsys, ["train", "--data", "t.txt", "--out", "a", *TINY, "--max-steps", "2", "--init-from", "a"],
           "holds a run")


_IGNORING = """
import os, signal, sys
for name in sys.argv[1].split(","):            # as nohup (SIGHUP) or a shell's background job (SIGINT)
    signal.signal(getattr(signal, name), signal.SIG_IGN)
os.execv(sys.executable, [sys.executable, "-m", "forge_ml", *sys.argv[2:]])
"""


def test_a_signal_the_process_inherited_as_ignored_stays_ignored(workdir):
    """From a QA test: `nohup forge-ml train ... &` and a logout stopped the run: train()
    put its own handler over the SIGHUP that nohup ignores (and over the SIGINT a
    non-interactive shell's background job ignores). A signal ignored when train() starts
    stays ignored; SIGTERM, not ignored, still stops the run with a checkpoint."""
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    args = ["train", "--data", "t.txt", *TINY, "--max-steps", "300", "--log-interval", "1"]
    for ignored, sent, status in (("SIGHUP,SIGINT", ("SIGHUP", "SIGINT"), 0), ("SIGHUP", ("SIGTERM",), 143)):
        run = f"run_{sent[0]}"
        p = subprocess.Popen([sys.executable, "-c", _IGNORING, ignored, *args, "--out", run], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in p.stdout:
            if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 5:
                for s in sent:
                    p.send_signal(getattr(signal, s))
                break
        out, err = p.communicate(timeout=120)
        assert p.returncode == status, (ignored, out[-500:], err)
        step = load_checkpoint(Path(run) / "ckpt")[1]["step"]
        if status == 0:
            assert step == 300 and "done: step 300" in out and "stopped" not in err, (out[-500:], err)
        else:
            assert 5 <= step < 300 and "stopped by SIGTERM" in err, err


def test_out_inside_another_runs_ckpt_best_or_data_is_refused(workdir, capsys):
    """From a QA test: `--out runs/r/ckpt` wrote a run into run r's checkpoint folder, and r's
    --resume then failed with a message about a folder that is not a checkpoint. An --out
    inside another run's ckpt/, best/ or data/ is refused in one line naming that run, before
    anything is written (new, --overwrite or --resume)."""
    keep = ["--eval-interval", "2", "--keep-best"]
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, *keep, "--max-steps", "2"]) == 0
    before = _snapshot("r")
    capsys.readouterr()
    for out in ("r/ckpt", "r/best", "r/data", "r/data/sub/x", "./r/ckpt/", str(workdir / "r" / "best")):
        for more in ([], ["--overwrite"]):
            run = str(workdir / "r") if out.startswith("/") else "r"
            _fails(capsys, ["train", "--data", "t.txt", "--out", out, *TINY, "--max-steps", "2", *more],
                   f"--out {out}", f"inside the run in {run} (its ")
            assert _snapshot("r") == before, out
        assert not (Path(out) / "train.lock").exists()
    with pytest.raises(RunError) as e:
        Trainer(_cfg("r/ckpt", max_steps=2), log=None)
    assert "out_dir" in str(e.value) and "--out" not in str(e.value)
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3"]) == 0   # r is whole
    # beside the run, or a folder of the run's own that is none of those: as before
    assert main(["train", "--data", "t.txt", "--out", "r/more", *TINY, "--max-steps", "1"]) == 0
    assert main(["train", "--data", "t.txt", "--out", "ckpt", *TINY, "--max-steps", "1"]) == 0
    # a path through the run's ckpt/ that leads out of it (r/ckpt/../sub is r/sub)
    assert main(["train", "--data", "t.txt", "--out", "r/ckpt/../sub", *TINY, "--max-steps", "1"]) == 0
    assert Path("r/sub/log.jsonl").is_file()


_SIGNAL_IN_SETUP = _SEND_ONCE + """
if sys.argv[3] == "cli":
    sys.exit(main(sys.argv[4:]))
try:
    Trainer(TrainConfig(data="t.txt", out_dir="r", n_layer=1, n_head=2, n_embd=16, block_size=16,
                        max_steps=2, progress=False), log=None)
except Interrupted as e:
    print("Interrupted", e.signum, e.step, e.saved, e.exit_status, signal.getsignal(sig) is signal.SIG_DFL)
    sys.exit(3)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is POSIX")
def test_sigterm_or_sighup_during_setup_cleans_up_as_sigint_does(workdir):
    """From a QA test: a SIGTERM while the trainer prepared a large text killed the process
    (status -15) and left data/.train.bin.XXXXXXXX.tmp and train.lock, where a SIGINT at the
    same moment exits 130 and leaves nothing. SIGTERM and SIGHUP during setup now do as SIGINT
    does: the temporaries, the lock and the folder made go, one line, exit 143 / 129; the
    library raises Interrupted (saved False) and puts the earlier handler back."""
    env = dict(os.environ, PYTHONPATH=SRC, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]
    for sig, status in (("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)):
        # os.fsync: the first is the train shard's temporary file, written but not renamed
        r = subprocess.run([sys.executable, "-c", _SIGNAL_IN_SETUP, "fsync", sig, "cli", *argv], env=env,
                           capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == status and len(lines) == 1 and "Traceback" not in r.stderr, (sig, r.stderr)
        if sig != "SIGINT":
            assert sig in lines[0] and "before the first step" in lines[0], lines
        assert not Path("r").exists(), (sig, _names("r"))    # no data/, no temporary, no lock
    r = subprocess.run([sys.executable, "-c", _SIGNAL_IN_SETUP, "fsync", "SIGTERM", "lib"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3 and r.stdout.split() == ["Interrupted", "15", "0", "False", "143", "True"], \
        (r.stdout, r.stderr)
    assert not Path("r").exists()
    assert main(argv) == 0


def test_a_bad_number_names_its_own_flag(workdir, capsys):
    """From a QA test: --log-interval -3 (and --checkpoint-interval -1, --sample-tokens -1) said
    "TrainConfig: intervals, counts and sizes must be >= 0", naming none; --lr -1 spoke of a
    min_lr never given; --eval-iters 0 and --max-steps -5 named the fields, not the flags. Each
    names its one flag on the command line, and its field (TrainConfig's) in the library."""
    base = ["train", "--data", "t.txt", "--out", "r", *TINY]
    for flag, value in (("--log-interval", "-3"), ("--checkpoint-interval", "-1"), ("--sample-tokens", "-1"),
                        ("--eval-interval", "-2"), ("--sample-interval", "-1"), ("--lr", "-1"),
                        ("--eval-iters", "0"), ("--max-steps", "-5"), ("--warmup", "-1"),
                        ("--lr-decay-steps", "-1"), ("--beta2", "1"), ("--grad-clip", "-1")):
        line = _fails(capsys, base + [flag, value], f"error: {flag} must be", f"got {float(value):g}"[:6])
        assert "TrainConfig" not in line and "min_lr" not in line and "--min-lr" not in line, line
        assert "_" not in line.split("must")[0], line
    assert not Path("r").exists()
    for field, value in (("log_interval", -3), ("lr", -1.0), ("eval_iters", 0), ("max_steps", -5)):
        with pytest.raises(ConfigError) as e:
            TrainConfig(**{field: value})
        assert str(e.value).startswith(f"TrainConfig: {field} must be") and f"got {value}" in str(e.value), e.value


def test_sizes_and_a_short_text_name_the_flags(workdir, capsys):
    """From a QA run of the README: --n-head 3 (with the default 128 channels) said
    "GPT2Config: n_embd 128 must be divisible by n_head 3", and a 4-character text "prepare:
    ... with val_fraction=0.1 ..."; forge-ml train names its flags, the library its fields."""
    line = _fails(capsys, ["train", "--data", "t.txt", "--out", "r", "--n-head", "3", "--n-embd", "16",
                           "--max-steps", "1"], "--n-embd 16 must be divisible by --n-head 3")
    assert "GPT2Config" not in line and "n_embd" not in line, line
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", "--model", "gpt2", "--n-head", "7"],
           "holds 480 tokens; --block-size 1024 needs at least 1025 (one window plus its next-token "
           "target): give a smaller --block-size or more tokens")
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", "--model", "gpt2", "--n-head", "7",
                    "--block-size", "16"], "--n-embd 768 (from --model gpt2) must be divisible by --n-head 7")
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", "--n-head", "3"],
           "--n-embd 128 (the default) must be divisible by --n-head 3")
    Path("tiny.txt").write_text("abcd")
    line = _fails(capsys, ["train", "--data", "tiny.txt", "--out", "r2", *TINY, "--max-steps", "1"],
                  "tiny.txt gives 4 tokens; with --val-fraction 0.1 the val split gets 0 tokens")
    assert "prepare" not in line and "val_fraction" not in line, line
    with pytest.raises(ConfigError, match="^n_embd 16 must be divisible by n_head 3"):
        Trainer(TrainConfig(data="t.txt", out_dir="r3", n_layer=1, n_head=3, n_embd=16, block_size=16,
                            batch_size=4, max_steps=1, progress=False), log=None)
    assert not any(Path(p).exists() for p in ("r", "r2", "r3"))


def test_resume_with_another_size_says_drop_the_flag(workdir, capsys):
    """From a QA test: --resume --n-embd 128 on a run trained from scratch at 16 listed ~30
    tensor shapes; now one line, as a fine-tune's resume says it ("drop --n-embd")."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    before = _snapshot("r")
    capsys.readouterr()
    for flag, value, have in (("--n-embd", "32", "n_embd 16"), ("--n-layer", "3", "n_layer 1"),
                              ("--n-head", "4", "n_head 2")):
        line = _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "4", flag, value],
                      f"{flag}:", have, f"not {value}", f"drop {flag}")
        assert "shape" not in line and len(line) < 250, line
    assert _snapshot("r") == before
    with pytest.raises(ConfigError, match=r"^n_embd: .* n_embd 16, not 32.* drop n_embd$"):
        Trainer(_cfg("r", n_embd=32), resume=True, log=None)
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3", "--n-embd", "16"]) == 0


def test_overwrite_of_a_folder_without_a_run_says_nothing_was_removed(workdir, capsys):
    """From a QA test: --overwrite on a folder holding only a user's file printed
    "--overwrite: removed the earlier run's checkpoint, log and data" though nothing was."""
    Path("r").mkdir()
    Path("r/notes.txt").write_text("mine")
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "1", "--overwrite"]) == 0
    assert "removed" not in capsys.readouterr().out
    assert Path("r/notes.txt").read_text() == "mine"
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "1", "--overwrite"]) == 0
    assert "--overwrite: removed the earlier run's" in capsys.readouterr().out
    # an empty ckpt/ is no run either (remove_together counted its folder as a removal)
    Path("e/ckpt").mkdir(parents=True)
    assert main(["train", "--data", "t.txt", "--out", "e", *TINY, "--max-steps", "1", "--overwrite"]) == 0
    assert "removed" not in capsys.readouterr().out


def test_a_file_or_folder_in_the_way_of_the_runs_own_is_named(workdir, capsys):
    """From a QA test: a file named data in the run folder gave a bare "File exists (EEXIST)";
    a folder named log.jsonl made --resume fail and advise --overwrite, which removed the
    earlier run's checkpoint and then failed the same way. Both are refused before any write,
    in one line naming the path in the way."""
    Path("d").mkdir()
    Path("d/data").write_text("mine")
    for more in ([], ["--overwrite"]):
        _fails(capsys, ["train", "--data", "t.txt", "--out", "d", *TINY, "--max-steps", "1", *more],
               "d/data is a file", "move it away")
    assert _names("d") == ["data"]
    assert main(["train", "--data", "t.txt", "--out", "e", *TINY, "--max-steps", "2"]) == 0
    os.unlink("e/log.jsonl")
    os.mkdir("e/log.jsonl")
    before = _snapshot("e")
    for argv in (["--resume", "--max-steps", "3"], ["--data", "t.txt", *TINY, "--max-steps", "3", "--overwrite"]):
        line = _fails(capsys, ["train", "--out", "e", *argv], "e/log.jsonl is a folder", "move it away")
        assert "--overwrite" not in line.split("move it away")[1], line
        assert _snapshot("e") == before
    os.rmdir("e/log.jsonl")
    assert main(["train", "--out", "e", "--resume", "--max-steps", "3"]) == 0


def test_resume_refuses_a_corpus_size_and_reads_lr_from_a_config_file(workdir, capsys):
    """From a QA run: `--resume --corpus-bytes N` trained on the old corpus without a word and
    recorded N, so a resume that prepared the data again failed on characters the run never
    saw; `lr` from `--config FILE` on resume fell through to TrainConfig's "--min-lr ... (or
    leave it out: --lr / 10)", where the min_lr is the checkpoint's, not the user's."""
    small = ["--corpus-bytes", "20000"]
    assert main(["train", "--out", "r", *TINY, "--max-steps", "2", *small]) == 0
    capsys.readouterr()
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "3", "--corpus-bytes", "40000"],
           "--corpus-bytes 40000: the run in r trains on 20000 bytes of the default corpus",
           "drop --corpus-bytes")
    Path("big.json").write_text('{"corpus_bytes": 40000}')
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "3", "--config", "big.json"],
           "corpus_bytes (in big.json) 40000", "drop it from big.json")
    state = json.loads(Path("r/ckpt/state.json").read_text())
    assert state["meta"]["train_config"]["corpus_bytes"] == 20000      # nothing recorded
    # the same size, given again, is the run's: it resumes (and prepares the data again alike)
    shutil.rmtree("r/data")
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3", *small]) == 0
    Path("lr.json").write_text('{"lr": 0.00005}')
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "4", "--config", "lr.json"],
           "lr (in lr.json) 5e-05: the run in r has min_lr", "recorded in its checkpoint",
           "give --min-lr too")


def test_log_interval_0_prints_the_first_steps_line_as_documented(workdir, capsys):
    # --help and the error of a negative value said "0: only the first step's line"; none came
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "4",
                 "--log-interval", "0"]) == 0
    steps = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")
             and "loss" in ln and "val" not in ln]
    assert len(steps) == 1 and steps[0].startswith("step      1/4"), steps


def test_a_resume_with_other_optimisation_settings_says_so(workdir, capsys):
    """A resume trains on with the settings it is given, which may differ from the run's: a
    longer --max-steps moves the cosine's end (the learning rate jumps up at the resumed step),
    a library resume with TrainConfig's default lr drops a run's own. Neither was said; the
    resume now notes each changed setting and the learning rate's jump. The same settings say
    nothing."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "4", "--warmup", "1"]) == 0
    shutil.copytree("r", "r2")
    capsys.readouterr()
    assert main(["train", "--out", "r", "--resume", "--max-steps", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("note: this resume changes"))
    assert "max_steps 4 -> 8" in note and "the learning rate at step 4 goes from" in note
    assert "lr " not in note.replace("learning rate", "")          # only max_steps changed
    # the library: a Trainer resumed with another lr (and the run's lr otherwise kept)
    was = load_checkpoint(Path("r2") / "ckpt")[1]["train_config"]
    lines = []
    cfg = TrainConfig.from_dict(dict(was, out_dir="r2", lr=was["lr"] * 2, min_lr=was["min_lr"],
                                     max_steps=6, progress=False))
    Trainer(cfg, resume=True, log=lines.append)
    assert any(f"lr {was['lr']:g} -> {was['lr'] * 2:g}" in str(x) for x in lines), lines
    # a damaged record ("abc" for a number) is no reason to stop a resume: not noted
    shutil.copytree("r2", "r4", ignore=shutil.ignore_patterns("*.lock"))
    tensors, meta = load_checkpoint(Path("r4/ckpt"))
    meta["train_config"]["weight_decay"] = "abc"
    save_checkpoint(Path("r4/ckpt"), tensors, meta)
    damaged = []
    Trainer(TrainConfig.from_dict(dict(was, out_dir="r4", progress=False)), resume=True, log=damaged.append)
    assert not any("this resume changes" in str(x) for x in damaged), damaged
    # the run's own settings: no note
    shutil.copytree("r2", "r3", ignore=shutil.ignore_patterns("*.lock"))
    same = []
    Trainer(TrainConfig.from_dict(dict(was, out_dir="r3", progress=False)), resume=True, log=same.append)
    assert not any("this resume changes" in str(x) for x in same), same
    # a finished run given another lr: refused as finished, with no note of a change before it
    capsys.readouterr()
    assert main(["train", "--out", "r3", "--resume", "--lr", "0.5", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert "is finished" in err and "this resume changes" not in out + err, (out, err)


def test_eval_iters_past_the_val_set_is_noted(workdir):
    """--eval-iters 100000 on a val set of a few batches was logged as "an estimate on 100000
    val batches" while it read the same windows over and over (a QA report): noted, with the
    count that reads every batch once; a count within the val set says nothing."""
    for iters, noted in ((50, True), (1, False)):
        lines = []
        Trainer(_cfg(f"e{iters}", eval_interval=2, eval_iters=iters), log=lines.append).train()
        said = [str(x) for x in lines if "--eval-iters" in str(x) or "eval_iters" in str(x)]
        assert bool(said) == noted, said
        if noted:
            assert "more than the 7 batches the val set holds" in said[0], said
            assert "reads it 7.1 times over" in said[0] and "7 reads every batch once" in said[0], said


def test_a_cpu_batch_past_the_hosts_free_memory_is_refused_before_anything_is_written(
        workdir, monkeypatch, capsys):
    """--batch-size 300000 on the CPU ran 53 s and was killed by the kernel (exit 137, no word:
    Linux hands out the arrays, then kills the process as they fill). The step's memory is
    estimated first (``host_step_bytes``) and a batch that cannot fit the free memory is a
    one-line error; the run folder is not made. A batch that fits runs."""
    cfg_args = ["train", "--data", "t.txt", "--out", "big", "--max-steps", "1"] + TINY
    monkeypatch.setattr(train_mod, "host_available_bytes", lambda: 64 << 20)   # 64 MiB free
    line = _fails(capsys, cfg_args[:-len(TINY)] + [a if a != "4" else "4000" for a in TINY],
                  "--batch-size 4000 x --block-size 16: a training step on the CPU would hold about",
                  "more than the 0.1 GiB this machine has free", "--total-batch-size")
    assert "GiB" in line and not (workdir / "big").exists()
    assert main(cfg_args) == 0                # batch 4 fits the same 64 MiB
    from forge_ml import flags
    with flags.override(FORGE_HOST_MEMORY_CHECK="off"):   # the user's word over the estimate
        assert main(["train", "--data", "t.txt", "--out", "off", "--max-steps", "1"]
                    + [a if a != "4" else "40" for a in TINY]) == 0
    monkeypatch.setattr(train_mod, "host_available_bytes", lambda: None)   # unknown: no check
    assert main(["train", "--data", "t.txt", "--out", "other", "--max-steps", "1"] + TINY) == 0


@pytest.mark.parametrize("layers,width,vocab,block,batch,peak_gb", [
    (2, 32, 65, 32, 20000, 3.12),     # forge-ml train's peak RSS on the CPU, 2026-12-07
    (4, 128, 65, 64, 2000, 4.58),
    (2, 64, 50257, 64, 128, 0.34),    # GPT-2's vocabulary: the LM head's loss in chunks
    (2, 512, 65, 256, 16, 0.43),
])
def test_the_host_memory_estimate_against_measured_peaks(layers, width, vocab, block, batch,
                                                         peak_gb):
    """``host_step_bytes`` against peaks measured with /usr/bin/time: within 12% below them
    where the tokens dominate (less the process's own ~0.15 GB), and never more than 0.25 GB
    above them. It charged every token the logits and their gradient, 2 x the vocabulary: a
    GPT-2-vocabulary batch that peaks at 0.3 GB was refused as 3.2 GB (a review's finding);
    the CPU's linear_cross_entropy holds one chunk of logits at a time."""
    import inspect
    from forge_ml.backends.cpu import LCE_CHUNK_BYTES
    from forge_ml.models import GPT2Config
    default = inspect.signature(train_mod.host_step_bytes).parameters["logits_chunk_bytes"]
    assert default.default == LCE_CHUNK_BYTES      # (train.py imports no backend)
    cfg = GPT2Config(vocab_size=vocab, block_size=block, n_layer=layers, n_head=2, n_embd=width)
    est = train_mod.host_step_bytes(cfg, batch, block) / 1e9
    assert est <= peak_gb + 0.25 and est >= 0.88 * peak_gb - 0.15, (est, peak_gb)


def test_init_from_weights_holding_nan_is_refused_before_any_step(workdir, capsys):
    """A source whose weights hold NaN trained to step 1, then said the loss was NaN and to
    lower --lr; the weights are read first now (as convert warns of them), a one-line error
    naming the tensors, and no run folder is made."""
    assert main(["train", "--data", "t.txt", "--out", "base", *TINY, "--max-steps", "1"]) == 0
    state, meta = load_checkpoint(Path("base") / "ckpt")
    name = next(k for k in state if k.endswith("attn.c_proj.weight"))
    state[name] = state[name].copy()
    state[name][0, :3] = [np.nan, np.inf, np.nan]
    save_checkpoint(Path("bad") / "ckpt", state, meta)
    capsys.readouterr()
    _fails(capsys, ["train", "--init-from", "bad", "--data", "t.txt", "--out", "ft", "--max-steps", "1",
                    "--no-progress"],
           "--init-from bad: 1 of its", "weight tensors hold NaN or inf", "2 NaN and 1 inf")
    assert not Path("ft").exists()


def test_resume_and_overwrite_must_be_bools_a_string_removed_the_run(workdir):
    """Trainer(..., overwrite="False") (a string from a YAML file or the environment) took the
    string as true and removed the finished run's checkpoint and log when it was built;
    resume="False" resumed. Both are checked as bools now, before anything is touched."""
    c = dict(data="t.txt", out_dir="ow", n_layer=1, n_head=2, n_embd=16, block_size=16,
             batch_size=4, max_steps=2, eval_interval=0, sample_interval=0, progress=False)
    Trainer(TrainConfig(**c), log=None).train()
    before = sorted(os.listdir("ow"))
    for kw in ({"overwrite": "False"}, {"resume": "False"}, {"overwrite": 1}, {"resume": None}):
        with pytest.raises(ConfigError, match=f"Trainer: {next(iter(kw))} must be True or False"):
            Trainer(TrainConfig(**c), log=None, **kw)
    assert sorted(os.listdir("ow")) == before and "ckpt" in before
    Trainer(TrainConfig(**c), log=None, overwrite=np.bool_(True)).close()   # NumPy's bool: a bool


def test_a_log_callable_that_fails_as_the_data_is_prepared_leaves_the_run_its_data(workdir):
    """The "prepared ..." line was said inside the data write, before the folder became the
    run's: a log callable raising there (or a Ctrl-C from it) left data/ without the
    trainer's lock, and the same call was then refused as a folder of someone's data ("holds
    data and no run"). Now the line comes once the data is the run's, as after any failure
    past the data's write: the run stopped before its first checkpoint, and overwrite=True
    starts it over."""
    c = dict(data="t.txt", out_dir="lg", n_layer=1, n_head=2, n_embd=16, block_size=16,
             batch_size=4, max_steps=1, eval_interval=0, sample_interval=0, progress=False)

    def failing(line):
        if line.startswith("prepared"):
            raise ValueError("the notebook's widget went away")
    with pytest.raises(ValueError, match="widget"):
        Trainer(TrainConfig(**c), log=failing)
    assert (workdir / "lg" / "data" / "train.bin").exists()
    with pytest.raises(RunError, match="stopped before its first checkpoint .*overwrite=True"):
        Trainer(TrainConfig(**c), log=None)
    assert Trainer(TrainConfig(**c), log=None, overwrite=True).train()["step"] == 1


def test_an_update_adamw_refuses_before_any_change_is_not_a_torn_step(workdir, monkeypatch):
    """A NaN learning rate reaching AdamW (a schedule gone wrong after the Trainer was built;
    ``cosine_lr`` itself refuses a NaN rate now, so the schedule is replaced): AdamW refuses
    the update before its first change, but the trainer marked the model half updated and
    refused every later train(). The step is given up instead (its batches drawn again), and
    the run goes on to the losses of a run that never met the refusal."""
    import forge_ml.train as train_mod
    c = dict(data="t.txt", n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4,
             max_steps=3, eval_interval=0, sample_interval=0, progress=False)
    plain = Trainer(TrainConfig(out_dir="a", **c), log=None).train()
    t = Trainer(TrainConfig(out_dir="b", **c), log=None)
    schedule = train_mod.cosine_lr
    monkeypatch.setattr(train_mod, "cosine_lr", lambda *a: float("nan"))
    with pytest.raises(ConfigError, match="AdamW.step: lr must be a finite number"):
        t.train_step()
    monkeypatch.setattr(train_mod, "cosine_lr", schedule)
    assert t.train()["losses"] == plain["losses"]


@pytest.mark.parametrize("path,value,needle", [
    (("model_file", "bytes"), "59280", "model_file.bytes is '59280'; expected an int >= 0"),
    (("meta",), [1], "meta is [1]; expected an object"),
    (("meta", "tokenizer"), [1], "meta.tokenizer is [1]; expected an object"),
    (("meta", "rng"), "x", "meta.rng is 'x'; expected an object"),
    (("meta", "optimizer"), "x", "meta.optimizer is 'x'; expected an object"),
])
def test_a_damaged_state_json_is_one_line_on_resume_not_a_traceback(workdir, capsys, path, value,
                                                                    needle):
    """A QA report: a field of state.json of the wrong type (a string for the model file's
    size, a list for meta or its tokenizer, a string for rng or the optimizer) was a TypeError
    or AttributeError traceback from `train --resume` and `sample`."""
    import json
    argv = ["train", "--data", "t.txt", "--out", "r", *TINY, "--checkpoint-interval", "2"]
    assert main(argv + ["--max-steps", "2"]) == 0
    capsys.readouterr()
    state = json.loads(Path("r/ckpt/state.json").read_text())
    at = state
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    Path("r/ckpt/state.json").write_text(json.dumps(state))
    assert main(argv + ["--max-steps", "4", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and needle in err and len(err.strip().splitlines()) == 1, err
