"""What `forge-ml prepare` and `forge-ml train` say instead of going on in silence: a val split
too short to evaluate, the step a resume goes on from (and the steps it trains again), a text
file changed since the run was prepared from it, data-parallel flags on one process, and the
char tokenizer a GPT-2 preset gets from a text file."""
import json
import shutil

import pytest

from forge_ml.cli import main
from forge_ml.data import prepare
from forge_ml.errors import DataError
from forge_ml.train import TrainConfig, Trainer

import test_cli
from test_cli import TEXT, TINY, _fails

workdir = test_cli.workdir   # a fixture: a folder with t.txt, the current directory

def _meta(run) -> dict:
    return json.loads((run / "ckpt" / "state.json").read_text())["meta"]


# -- 1. prepare: a val split of 1 token (eval and a run's evaluation need a window of 2) -------------

def test_prepare_refuses_a_val_split_too_short_to_evaluate_and_writes_nothing(workdir, capsys):
    (workdir / "s.txt").write_text("abcdefghijklmnopqrs")      # 19 chars: val 0.1 -> 1 token
    _fails(capsys, ["prepare", "s.txt", "--out", "d"],
           "s.txt gives 19 tokens; with --val-fraction 0.1 the val split gets 1 token",
           "evaluation needs at least 2", "give a larger --val-fraction (at least 0.106)")
    assert not (workdir / "d").exists()
    # --force over earlier shards: refused before any write, the earlier set kept as it was
    assert main(["prepare", "t.txt", "--out", "d"]) == 0
    before = {f: (workdir / "d" / f).read_bytes() for f in ("train.bin", "val.bin", "tokenizer.json")}
    capsys.readouterr()
    _fails(capsys, ["prepare", "s.txt", "--out", "d", "--force"], "the val split gets 1 token")
    assert {f: (workdir / "d" / f).read_bytes() for f in before} == before
    assert sorted(p.name for p in (workdir / "d").iterdir()) == sorted(before)   # no temporary file
    # the fraction it advises works
    assert main(["prepare", "s.txt", "--out", "d2", "--val-fraction", "0.106"]) == 0
    assert "2 val tokens" in capsys.readouterr().out
    # too short for both parts, and a train part of 1 token
    (workdir / "f.txt").write_text("abc")
    _fails(capsys, ["prepare", "f.txt", "--out", "d3", "--val-fraction", "0.5"],
           "each needs at least 2", "give more text (at least 4 tokens)")
    _fails(capsys, ["prepare", "t.txt", "--out", "d3", "--val-fraction", "0.9999"],
           "the train split gets 1 token", "give a smaller --val-fraction (at most 0.999)")
    assert not (workdir / "d3").exists()
    # the library says its parameter's name
    with pytest.raises(DataError, match=r"with val_fraction 0\.1 the val split gets 1 token.*larger val_fraction"):
        prepare("s.txt", "d4")
    assert not (workdir / "d4").exists()


# -- 2. --resume says the checkpoint's step, and the steps past it that are trained again -----------

def test_resume_says_its_checkpoint_step_and_how_many_steps_are_trained_again(workdir, capsys):
    assert main(["train", "--data", "t.txt", "--out", "r", "--max-steps", "2", *TINY]) == 0
    shutil.copytree(workdir / "r" / "ckpt", workdir / "ckpt2")     # the checkpoint of step 2
    capsys.readouterr()
    # a resume of a run stopped at its checkpoint (a Ctrl-C saves one): the step alone
    assert main(["train", "--out", "r", "--resume", "--max-steps", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "resuming the run in r from its checkpoint of step 2\n" in out, out
    assert "trained again" not in out
    # a kill after step 4 before its checkpoint: the log went on past the checkpoint of step 2
    shutil.rmtree(workdir / "r" / "ckpt")
    shutil.copytree(workdir / "ckpt2", workdir / "r" / "ckpt")
    assert main(["train", "--out", "r", "--resume", "--max-steps", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert ("resuming the run in r from its checkpoint of step 2; its log had gone on to step 4, so the 2 "
            "steps after the checkpoint (lost when the run stopped) are trained again") in out, out
    log = [json.loads(x) for x in (workdir / "r" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4]


# -- 3. --resume with a text file changed since the run was prepared from it ------------------------

def test_resume_warns_when_the_text_file_changed_since_the_run_was_prepared(workdir, capsys):
    assert main(["train", "--data", "t.txt", "--out", "r", "--max-steps", "1", *TINY]) == 0
    rec = _meta(workdir / "r")["data_file"]
    assert rec["path"] == "t.txt" and rec["size"] == len(TEXT) and len(rec["sha256"]) == 64
    capsys.readouterr()
    assert main(["train", "--out", "r", "--resume", "--max-steps", "2", "--no-progress"]) == 0
    assert "has changed" not in capsys.readouterr().out          # the same text: no word
    (workdir / "t.txt").write_text(TEXT + "more\n")
    assert main(["train", "--out", "r", "--resume", "--max-steps", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert (f"warning: t.txt has changed since the run in r was prepared from it ({len(TEXT):,} -> "
            f"{len(TEXT) + 5:,} bytes); the resumed run goes on with the tokens prepared then") in out, out
    assert "--init-from r --data t.txt --out NEW_FOLDER" in out
    assert _meta(workdir / "r")["data_file"] == rec       # the run's own text stays recorded
    (workdir / "t.txt").write_text(TEXT.replace("to be", "TO be", 1))   # same size, other bytes
    assert main(["train", "--out", "r", "--resume", "--max-steps", "4", "--no-progress"]) == 0
    assert "warning: t.txt has changed since the run in r was prepared from it (the same size, other bytes)" \
        in capsys.readouterr().out
    # a run from before the fingerprint was recorded: no check, no error
    state = workdir / "r" / "ckpt" / "state.json"
    d = json.loads(state.read_text())
    del d["meta"]["data_file"]
    state.write_text(json.dumps(d))
    assert main(["train", "--out", "r", "--resume", "--max-steps", "5", "--no-progress"]) == 0
    assert "has changed" not in capsys.readouterr().out
    assert _meta(workdir / "r")["data_file"] is None


# -- 4. --zero / --bucket-mb on one process: a note (a single-process --bucket-mb 0 is taken) ------

NOTE = ("only to data-parallel training over N processes (--gpus N, or a torchrun or mpirun launch); this run "
        "is one process, where")


@pytest.mark.parametrize("extra,said", [
    (["--zero", "1"], "--zero 1 applies " + NOTE + " it does nothing"),
    (["--bucket-mb", "5"], "--bucket-mb 5 applies " + NOTE + " it does nothing"),
    (["--zero", "1", "--bucket-mb", "0"], "--zero 1 and --bucket-mb 0 apply " + NOTE + " they do nothing"),
])
def test_data_parallel_flags_on_one_process_are_noted(workdir, capsys, extra, said):
    assert main(["train", "--data", "t.txt", "--out", "r", "--max-steps", "1", *extra, *TINY]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [f"forge-ml: note: {said}"], err
    assert (workdir / "r" / "ckpt" / "state.json").is_file()


def test_data_parallel_flags_at_their_defaults_say_nothing_and_an_error_stays_one_line(workdir, capsys):
    assert main(["train", "--data", "t.txt", "--out", "r", "--max-steps", "1", "--zero", "0",
                 "--bucket-mb", "25", *TINY]) == 0
    assert "note" not in capsys.readouterr().err
    _fails(capsys, ["train", "--data", "missing.txt", "--out", "r2", "--zero", "1", *TINY], "missing.txt")


# -- 5. a GPT-2 preset on a text file without --tokenizer: the char tokenizer, said ---------------

def test_gpt2_preset_on_a_text_file_says_it_gets_the_char_tokenizer(workdir, capsys):
    argv = ["train", "--model", "gpt2", "--data", "t.txt", "--max-steps", "1", *TINY]
    assert main([*argv, "--out", "r"]) == 0
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if line.startswith("note: --model gpt2")]
    assert note == ["note: --model gpt2 with no --tokenizer: t.txt is tokenized by characters (char tokenizer, "
                    "14 tokens in the vocabulary), not with GPT-2's BPE; add --tokenizer gpt2 for GPT-2's "
                    "50,257 tokens"], out
    assert main([*argv, "--out", "r2", "--tokenizer", "char"]) == 0      # asked for: no note
    assert "GPT-2's BPE" not in capsys.readouterr().out
    said = []   # the library, in its own names
    Trainer(TrainConfig(model="gpt2", data="t.txt", out_dir="r3", n_layer=1, n_head=2, n_embd=16, block_size=16,
                        batch_size=4, max_steps=1), log=said.append).close()
    assert any("model=gpt2 with no tokenizer" in s and "add tokenizer=gpt2" in s for s in said), said


def test_a_config_changed_after_it_was_built_is_checked_again(workdir):
    """(QA of the Python API) TrainConfig checks ran once, when it was built: tc.lr = 1e-5 after
    kept min_lr at the old lr / 10 (the rate climbed from 1e-5 toward 1e-4), and
    tc.max_steps = "3" wrote data/ before a TypeError. The Trainer checks a copy again."""
    tc = TrainConfig(data="t.txt", out_dir="run", n_layer=1, n_head=1, n_embd=8, block_size=8,
                     batch_size=2, max_steps=4, warmup=1, eval_interval=0, sample_interval=0,
                     progress=False)
    tc.lr = 1e-5
    t = Trainer(tc, log=None)
    assert t.cfg.min_lr == pytest.approx(1e-6) and tc.min_lr == pytest.approx(1e-4)
    lrs = [t.train_step()["lr"] for _ in range(4)]
    t.close()
    assert max(lrs) <= 1e-5 and lrs[-1] < lrs[1]
    tc.max_steps, tc.out_dir = "3", "run2"
    with pytest.raises(Exception, match="max_steps") as e:
        Trainer(tc, log=None)
    assert type(e.value).__name__ == "ConfigError" and not (workdir / "run2").exists()
