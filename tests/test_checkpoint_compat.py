"""Checkpoints written before the house plan (forge-ml 0.1.0 as of 2026-12-03, commit 14e7f46:
tests/fixtures/run_v0_1_0, a 4-step run of a tiny char model) still load, and resume: the
resumed run ends with the weights a run of the new code from scratch reaches (the checkpoint
format did not change; the float32 masters are what it holds). The fixture's first four steps
ran on another machine, whose float32 products may round differently from this one's (another
NumPy, BLAS or vector width), so the weights agree to float32 rounding, not bit for bit; exact
resume on one machine is tested in tests/test_train.py."""
import shutil
from pathlib import Path

import numpy as np

from forge_ml.checkpoint import load_checkpoint, unpack_tensors
from forge_ml.cli import main
from forge_ml.inference import load_model

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run_v0_1_0"
ARGS = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-interval", "0", "--sample-interval", "0", "--no-progress", "--eval-iters", "2"]


def test_an_old_checkpoint_loads():
    model, tok, meta = load_model(FIXTURE)
    assert meta["step"] == 4 and tok.kind == "char"
    assert model.config.n_layer == 1 and model.num_params() > 0


def test_an_old_run_resumes_to_the_weights_of_a_new_run(tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    assert main(["train", "--out", str(old), "--resume", "--max-steps", "7"]) == 0
    new = tmp_path / "new"
    assert main(["train", "--data", str(FIXTURE / "data"), "--out", str(new), "--max-steps", "7",
                 *ARGS]) == 0
    capsys.readouterr()
    a, ma = load_checkpoint(old / "ckpt")
    b, mb = load_checkpoint(new / "ckpt")
    assert ma["step"] == mb["step"] == 7
    pa, _, _ = unpack_tensors(a)
    pb, _, _ = unpack_tensors(b)
    assert set(pa) == set(pb)
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-4, atol=1e-6, err_msg=k)
