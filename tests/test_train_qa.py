"""The training path as a new user takes it (prepare, train, resume, eval, the Trainer), from
a QA pass: each test names what a user saw before its fix. Tiny char models on the CPU."""
import shutil
from pathlib import Path

import pytest

from forge_ml.cli import main
from forge_ml.train import TrainConfig, Trainer, read_log
from test_cli import _fails  # main(argv) exits 2 with one line, no traceback

TEXT = "to be or not to be that is the question\n" * 120
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--eval-interval", "0", "--sample-interval", "0", "--no-progress",
        "--checkpoint-interval", "0", "--seed", "3", "--warmup", "1"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text(TEXT)
    for var in ("WORLD_SIZE", "RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def _steps(run):
    """The (step, loss, lr) of every training step in the run's log."""
    return [(r["step"], r["loss"], r["lr"]) for r in read_log(Path(run) / "log.jsonl")[0] if "loss" in r]


def test_a_resume_that_changes_grad_accum_says_so(workdir, capsys):
    """A resume with another --grad-accum (or --total-batch-size) trains every later step on
    another batch, but its note listed only the schedule's settings: it said nothing at all
    when the batch was the only change besides --max-steps."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "3"]) == 0
    shutil.copytree("r", "r2")
    capsys.readouterr()
    assert main(["train", "--out", "r", "--resume", "--max-steps", "5", "--grad-accum", "2"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if line.startswith("note: this resume changes"))
    assert "grad_accum 1 -> 2" in note, note
    assert "batch 4 x 2" in out
    # --total-batch-size sets it the same way; the library's resume says it too
    assert main(["train", "--out", "r2", "--resume", "--max-steps", "5", "--total-batch-size", "12"]) == 0
    assert "grad_accum 1 -> 3" in capsys.readouterr().out
    shutil.rmtree("r2")
    shutil.copytree("r", "r2", ignore=shutil.ignore_patterns("*.lock"))
    lines = []
    Trainer(TrainConfig(data="t.txt", out_dir="r2", n_layer=1, n_head=2, n_embd=16, block_size=16,
                        batch_size=4, grad_accum=4, max_steps=8, warmup=1, seed=3, progress=False),
            resume=True, log=lines.append).close()
    assert any("grad_accum 2 -> 4" in str(x) for x in lines), lines


def test_resume_grad_accum_of_a_run_started_with_total_batch_size(workdir, capsys):
    """A run started with --total-batch-size 8 (batch 4) could not be resumed with another
    --grad-accum: "--grad-accum 4 x --batch-size 4 is not --total-batch-size 8; give one of
    --grad-accum and --total-batch-size", naming a flag the user never gave on that call (the
    run's recorded one). The --grad-accum given now sets the step's batch, said as such."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2",
                 "--total-batch-size", "8"]) == 0
    capsys.readouterr()
    assert main(["train", "--out", "r", "--resume", "--max-steps", "4", "--grad-accum", "4"]) == 0
    out = capsys.readouterr().out
    assert "grad_accum 2 -> 4" in out and "batch 4 x 4" in out, out
    # both given, and at odds: still refused, as on a fresh run
    _fails(capsys, ["train", "--out", "r", "--resume", "--max-steps", "6", "--grad-accum", "3",
                    "--total-batch-size", "8"], "--grad-accum 3 x --batch-size 4 is not --total-batch-size 8")


def test_a_stray_world_size_does_not_make_a_cpu_run_distributed(workdir, capsys, monkeypatch):
    """WORLD_SIZE=1 in the environment (no RANK: no launcher started this process) turned a
    plain CPU run into NCCL training: "NCCL training needs CuPy" on a CPU machine, a silent
    NCCL world of one on cuda:0 on a GPU one. It is one process on --device now; a WORLD_SIZE of
    several without a RANK is a broken launch, said as such."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "2"]) == 0
    assert [s for s, _, _ in _steps("r")] == [1, 2]
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "4")
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r4", *TINY, "--max-steps", "2"],
           "WORLD_SIZE is 4 but no rank is set")
    assert not Path("r4").exists()


@pytest.mark.parametrize("env, said", [
    ({"RANK": "1", "WORLD_SIZE": "", "MASTER_ADDR": "h", "MASTER_PORT": "29500"},
     "WORLD_SIZE must be an integer, got ''"),
    ({"RANK": "1"}, "RANK is set, so torchrun's variables are expected"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE is 2 but no rank is set"),
])
def test_a_partial_launch_is_refused_not_trained_as_one_process(workdir, capsys, monkeypatch,
                                                               env, said):
    """RANK with an empty WORLD_SIZE, RANK alone, or mpirun's size without its rank trained one
    process and wrote the run, in silence: the CLI looked at WORLD_SIZE only."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _fails(capsys, ["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "1"], said)
    assert not Path("r").exists()


def test_gpus_with_device_cpu_is_refused(workdir, capsys, monkeypatch):
    """--gpus 2 --device cpu (or a torchrun launch of --device cpu) trained on cuda:0 and cuda:1,
    the --device replaced in silence by the ranks' GPUs (on a machine without CuPy the error
    was a missing NCCL). Refused before anything starts, naming both flags."""
    from forge_ml.distributed import launch
    started = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: started.append(a) or 0)
    monkeypatch.setattr(launch, "preflight", lambda n: None)       # as on a machine with 2 GPUs
    _fails(capsys, ["train", "--gpus", "2", "--device", "cpu", "--data", "t.txt", "--out", "r", *TINY],
           "--device cpu: --gpus 2 trains on GPUs", "drop --device")
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512").items():
        monkeypatch.setenv(k, v)
    _fails(capsys, ["train", "--device", "cpu", "--data", "t.txt", "--out", "r", *TINY],
           "--device cpu: this torchrun launch trains on GPUs")
    assert not started and not Path("r").exists()


def test_a_val_set_smaller_than_one_batch_is_noted(workdir, capsys):
    """A val set of fewer windows than one batch (a small text, a large --batch-size) was
    logged as "an estimate on 20 val batches" while every batch read those few windows again,
    hundreds of times each, with no word of it: --eval-iters past the val set's whole batches
    was noted, but not when it held none."""
    Path("s.txt").write_text(TEXT[:300])
    args = ["train", "--data", "s.txt", "--out", "r", *TINY, "--max-steps", "2", "--eval-interval", "1"]
    assert main(args + ["--batch-size", "64", "--block-size", "8"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if "fewer than one batch" in line)
    assert "the val set holds 3 windows of 8 tokens" in note and "of 64" in note, note
    assert "--eval-iters 2 reads them 42.7 times over" in note, note
    # a val set of whole batches says nothing of it
    assert main(args + ["--batch-size", "2", "--block-size", "8", "--out", "r2"]) == 0
    assert "fewer than one batch" not in capsys.readouterr().out


def test_a_run_of_zero_steps_evaluates_and_saves(workdir, capsys):
    """``--max-steps 0`` (evaluate the initial model, save it): the warmup note asked the
    schedule for step -1, which ``cosine_lr`` refuses since it checks its counts."""
    assert main(["train", "--data", "t.txt", "--out", "r", *TINY, "--max-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert "done: step 0" in out and "warmup" not in out
    assert (workdir / "r" / "ckpt").is_dir()


def test_train_on_a_text_too_short_to_split_says_what_each_part_needs(tmp_path, capsys):
    """(QA, forty-fourth session) `forge-ml train --data` on a 4-character text said "expected
    at least 1 each" (split_tokens' floor) where each part needs 2 tokens (a window and its
    target) and prepare said so; train says what prepare says now, with the way out."""
    from forge_ml.cli import main
    text = tmp_path / "t.txt"
    text.write_text("abcd", encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--data", str(text), "--device", "cpu", "--max-steps", "1",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "evaluation needs at least 2" in err and "--val-fraction (at least 0.5)" in err, err
    assert "at least 1 each" not in err
    assert not (out / "log.jsonl").exists()
