"""NumPy's BLAS threads on the CPU (forge_ml.blas): the tuner keeps the count the
steps run faster with and tries again when they slow down; a run whose count changes under
it trains to the same bits as a run at one fixed count; the user's choice and the switch
turn it off."""
import json
import os

import numpy as np
import pytest

from forge_ml import flags
from forge_ml import blas
from forge_ml.checkpoint import load_checkpoint, unpack_tensors
from forge_ml.cli import main


def run_tuner(times_by_count, steps, **kw):
    """Feed a ThreadTuner the step time each count gives (a function of the step index);
    returns the counts it ran the steps at and the lines it said."""
    told, used, said = [], [], []
    t = blas.ThreadTuner([1, 2], set_threads=told.append, **kw)
    current = 1
    for i in range(steps):
        t.before_step()
        current = told[-1] if told else current
        used.append(current)
        line = t.after_step(times_by_count(current, i))
        if line:
            said.append(line)
    return used, said


def test_the_tuner_keeps_the_faster_count_after_trying_each_in_turn():
    used, said = run_tuner(lambda c, i: {1: 0.060, 2: 0.045}[c], 20, skip=2, trials=3)
    assert used[:2] == [1, 1]                             # skipped: the count it started with
    assert used[2:8] == [1, 2, 1, 2, 1, 2]                # in turns
    assert set(used[8:]) == {2}
    assert said == ["BLAS threads: 2 (median step 45 ms; 1 thread: 60 ms)"]
    # the slower count wins when it is the faster one (a busy neighbour)
    used, said = run_tuner(lambda c, i: {1: 0.075, 2: 0.222}[c], 12, skip=0, trials=2)
    assert set(used[4:]) == {1} and said[0].startswith("BLAS threads: 1 ")


def test_the_tuner_tries_again_when_steps_slow_down_and_every_so_often():
    # two threads are faster until a neighbour arrives at step 30, then one is
    slow_from = 30
    used, said = run_tuner(lambda c, i: ({1: 0.075, 2: 0.222} if i >= slow_from
                                         else {1: 0.060, 2: 0.045})[c], 60, skip=0, trials=2)
    assert used[10:slow_from] == [2] * (slow_from - 10)
    assert set(used[slow_from + 6:]) == {1}
    assert len(said) == 2 and said[1].startswith("BLAS threads: 1 ")
    # one slow step alone (a hiccup) is no reason to try again
    used, said = run_tuner(lambda c, i: 0.5 if i == 30 else {1: 0.060, 2: 0.045}[c], 60,
                           skip=0, trials=2)
    assert len(said) == 1 and set(used[4:]) == {2}
    # steady times: a new trial every `every` steps only
    used, said = run_tuner(lambda c, i: {1: 0.060, 2: 0.045}[c], 50, skip=0, trials=1, every=20)
    assert len(said) == 3                                 # at steps 2, 24 and 46
    t = blas.ThreadTuner([2], set_threads=pytest.fail)    # one count: nothing to choose
    t.before_step()
    assert t.after_step(1.0) is None and t.threads is None


def test_candidates_and_defaults():
    assert blas.candidates(2) == [1, 2] and blas.candidates(16) == [8] and blas.candidates(6) == [3, 6]
    assert [blas.default_threads(c) for c in (1, 2, 4, 16, 128)] == [1, 1, 2, 8, 8]


TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "1", "--eval-interval", "0", "--sample-interval", "0", "--no-progress",
        "--checkpoint-interval", "0", "--seed", "3", "--max-steps", "14"]


@pytest.mark.skipif(blas.cores() < 2 or blas.get_threads() is None,
                    reason="needs 2 cores and NumPy's OpenBLAS")
def test_a_tuned_run_trains_to_the_bits_of_a_run_at_one_count(tmp_path, monkeypatch, capsys):
    (tmp_path / "t.txt").write_text("to be or not to be that is the question\n" * 80)
    monkeypatch.chdir(tmp_path)
    before = blas.get_threads()
    absent = [v for v in blas.THREAD_VARS if v not in os.environ]
    runs = {}
    try:
        for name, env in (("fixed", "1"), ("tuned", None)):
            for v in blas.THREAD_VARS:
                monkeypatch.delenv(v, raising=False)
            if env:
                monkeypatch.setenv("OPENBLAS_NUM_THREADS", env)   # the user's count: no tuner
                blas.set_threads(int(env))      # as a process started with it has (OpenBLAS reads it at load)
            monkeypatch.setattr(blas, "_chosen_here", False)
            with flags.override(FORGE_BLAS_TUNE=True):
                assert main(["train", "--data", "t.txt", "--out", name, *TINY]) == 0
            out = capsys.readouterr().out
            recs = [json.loads(x) for x in (tmp_path / name / "log.jsonl").read_text().splitlines()]
            runs[name] = (out, [r.get("blas_threads") for r in recs if "loss" in r])
        fixed_out, fixed_counts = runs["fixed"]
        tuned_out, tuned_counts = runs["tuned"]
        assert "(1 BLAS thread)" in fixed_out and set(fixed_counts) == {None}
        assert "BLAS threads 1 or 2, chosen from the steps' times" in tuned_out
        assert "BLAS threads: " in tuned_out and {1, 2} <= set(tuned_counts)
        a, _ = load_checkpoint(tmp_path / "fixed" / "ckpt")
        b, _ = load_checkpoint(tmp_path / "tuned" / "ckpt")
        pa, _, _ = unpack_tensors(a)
        pb, _, _ = unpack_tensors(b)
        for k in pa:
            np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
        # the switch off: the count the CLI starts with, no tuner
        for v in blas.THREAD_VARS:
            monkeypatch.delenv(v, raising=False)
        monkeypatch.setattr(blas, "_chosen_here", False)
        with flags.override(FORGE_BLAS_TUNE=False):
            assert main(["train", "--data", "t.txt", "--out", "off", *TINY]) == 0
        assert "chosen from the steps' times" not in capsys.readouterr().out
    finally:
        blas.set_threads(before)
        for v in absent:                      # limit_default set them; monkeypatch did not
            os.environ.pop(v, None)


@pytest.mark.parametrize("value", ["0", "-1", "abc", "2.5"])
def test_a_thread_variable_that_is_not_a_count_is_one_error(monkeypatch, capsys, value):
    """OpenBLAS would quietly take its own count for it (and the trainer's line said
    "(abc BLAS threads)")."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert main(["bench", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"OMP_NUM_THREADS={value!r} is not a thread count: expected a whole number >= 1" in err


@pytest.mark.skipif(blas.get_threads() is None, reason="needs NumPy's OpenBLAS")
def test_the_trainer_says_the_thread_count_in_use(tmp_path, monkeypatch, capsys):
    """Not the variable's text: OpenBLAS caps a count above its own limit."""
    (tmp_path / "t.txt").write_text("to be or not to be that is the question\n" * 80)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1000")
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY[:-2], "--max-steps", "1"]) == 0
    out = capsys.readouterr().out
    n = blas.get_threads()
    assert f"({n} BLAS thread{'s' if n != 1 else ''}; OMP_NUM_THREADS=1000)" in out, out


@pytest.mark.skipif(blas.cores() < 2 or blas.get_threads() is None,
                    reason="needs 2 cores and NumPy's OpenBLAS")
def test_a_users_count_is_applied_even_from_mkl_num_threads(monkeypatch):
    """MKL_NUM_THREADS=1 alone turned the tuner off but NumPy's OpenBLAS does not read it, so
    the run took every core untuned; a count the user set is now applied as it is."""
    before = blas.get_threads()
    try:
        blas.set_threads(2)
        for v in blas.THREAD_VARS:
            monkeypatch.delenv(v, raising=False)
        monkeypatch.setenv("MKL_NUM_THREADS", "1")
        monkeypatch.setattr(blas, "_chosen_here", False)
        assert blas.limit_default() is None and not blas.tunable()
        assert blas.get_threads() == 1
    finally:
        blas.set_threads(before)
