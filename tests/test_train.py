"""The trainer on tiny CPU models: learning, bit-exact resume, NaN handling, architecture
checks, logs and checkpoints."""
import json
import math

import numpy as np
import pytest

from forge_ml.checkpoint import load_checkpoint
from forge_ml.errors import CheckpointError, ConfigError, TrainingError
from forge_ml.inference import load_model
from forge_ml.train import Interrupted, RunError, TrainConfig, Trainer, dropout_seed

TEXT = "".join(f"{w} " for w in ("the cat sat on the mat and the dog ran to the cat " * 60).split()) + "\n"


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text(TEXT)
    return p


def _cfg(text_file, out, **kw):
    base = dict(data=str(text_file), out_dir=str(out), n_layer=1, n_head=2, n_embd=16, block_size=16,
                batch_size=4, max_steps=6, lr=1e-2, min_lr=1e-3, warmup=2, eval_interval=0, eval_iters=2,
                sample_interval=0, checkpoint_interval=0, progress=False, seed=7)
    base.update(kw)
    return TrainConfig(**base)


def _params(trainer):
    return {k: v.numpy() for k, v in trainer.model.params.items()}


# -- config ---------------------------------------------------------------------------------


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ConfigError, match="unknown key 'batchsize'.*batch_size"):
        TrainConfig.from_dict({"batchsize": 4})
    # (QA) as keywords too: the dataclass's "unexpected keyword argument" TypeError before
    from forge_ml.models import GPT2Config
    with pytest.raises(ConfigError, match=r"TrainConfig: unknown key 'lrr' \(did you mean 'lr'\?\)"):
        TrainConfig(lrr=1e-3)
    with pytest.raises(ConfigError, match=r"GPT2Config: unknown key 'n_layers' \(did you mean 'n_layer'\?\)"):
        GPT2Config(n_layers=2)
    with pytest.raises(ConfigError, match="max_steps must be int"):
        TrainConfig(max_steps="ten")
    with pytest.raises(ConfigError, match="dropout"):
        TrainConfig(dropout=1.5)
    with pytest.raises(ConfigError, match="preset"):
        TrainConfig(model="gpt5")
    assert TrainConfig(model="gpt2").model_sizes() == {"n_layer": 12, "n_head": 12, "n_embd": 768}
    assert TrainConfig(model="gpt2", n_layer=2).model_sizes()["n_layer"] == 2


def test_config_refuses_a_seed_outside_64_bits(text_file, tmp_path):
    """A run's seed is 64 bits (dropout_seed keeps 64, as rng.seed_key and generate's row_key
    do): 2**64 trained with seed 0's dropout. It is refused before the folder is made, through
    TrainConfig, a dict and Trainer alike, in the library's words."""
    for bad in (1 << 64, (1 << 64) + 7, -1):
        want = f"TrainConfig: seed must be in [0, 2**64), got {bad}"
        with pytest.raises(ConfigError) as e:
            TrainConfig(seed=bad)
        assert str(e.value) == want
        with pytest.raises(ConfigError) as e:
            Trainer({**_cfg(text_file, tmp_path / "r").to_dict(), "seed": bad}, log=None)
        assert str(e.value) == want
    assert not (tmp_path / "r").exists()
    assert TrainConfig(seed=(1 << 64) - 1).seed == (1 << 64) - 1 and TrainConfig(seed=0).seed == 0


def test_the_largest_seed_trains_and_samples(text_file, tmp_path):
    """Seed 2**64 - 1 is a seed: the samples during training (drawn with seed + step) go on
    past 2**64 by wrapping, as generate's windows do, not stopping the run at its first sample."""
    lines = []
    t = Trainer(_cfg(text_file, tmp_path / "r", seed=(1 << 64) - 1, max_steps=2, sample_interval=1,
                     sample_tokens=4), log=lines.append)
    assert t.train()["step"] == 2
    assert sum("sample at step" in line for line in lines) == 2, lines


def test_bf16_needs_a_gpu(text_file, tmp_path):
    with pytest.raises(ConfigError, match="cuda"):
        Trainer(_cfg(text_file, tmp_path / "r", dtype="bf16"), log=None)


def test_dropout_seed_is_a_pure_function_of_seed_step_micro():
    seeds = {dropout_seed(s, t, m) for s in (0, 1) for t in range(20) for m in range(3)}
    assert len(seeds) == 2 * 20 * 3
    assert dropout_seed(5, 11, 2) == dropout_seed(5, 11, 2)
    assert all(0 <= s < 2 ** 64 for s in seeds)


# -- learning -------------------------------------------------------------------------------


def test_loss_decreases_on_a_tiny_text(text_file, tmp_path):
    t = Trainer(_cfg(text_file, tmp_path / "r", max_steps=60, warmup=5, lr=2e-2, n_embd=32), log=None)
    summary = t.train()
    losses = summary["losses"]
    assert len(losses) == 60
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    assert summary["val_loss"] < math.log(t.tokenizer.vocab_size) - 1.0


def test_sample_names_itself_for_a_bad_seed(text_file, tmp_path):
    """Trainer.sample(seed=None) said "stream_tokens: seed must be an int in [0, 2**64), got
    None", naming a function the caller never called; the message is Trainer.sample's now,
    with what it takes and what came. A NumPy integer seed is a seed."""
    t = Trainer(_cfg(text_file, tmp_path / "r", max_steps=1), log=None)
    for bad in (None, -1, 1 << 64, 2.5, "3", True):
        with pytest.raises(ConfigError) as e:
            t.sample(n_tokens=2, seed=bad)
        assert str(e.value) == f"Trainer.sample: seed must be an int in [0, 2**64), got {bad!r}"
    with pytest.raises(ConfigError, match=r"^Trainer\.sample: n_tokens must be an integer >= 0, got -1$"):
        t.sample(n_tokens=-1)
    assert t.sample(n_tokens=5, seed=np.uint64(3)) == t.sample(n_tokens=5, seed=3)


def test_log_plot_and_checkpoint_contents(text_file, tmp_path):
    out = tmp_path / "r"
    t = Trainer(_cfg(text_file, out, max_steps=4, eval_interval=2, sample_interval=2, sample_tokens=10), log=None)
    t.train()
    recs = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "time"} <= set(steps[0])
    assert [r["step"] for r in recs if "val_loss" in r] == [2, 4]
    assert (out / "loss.png").stat().st_size > 1000
    tensors, meta = load_checkpoint(out / "ckpt")
    assert meta["step"] == 4 and meta["optimizer"]["step"] == 4
    assert meta["tokenizer"]["kind"] == "char" and meta["config"]["n_layer"] == 1
    assert meta["train_config"]["max_steps"] == 4 and "bit_generator" in meta["data"]
    assert "opt.m.wte.weight" in tensors and "opt.v.h.0.mlp.c_fc.weight" in tensors
    model, tok, _ = load_model(out)
    for k, v in model.params.items():
        assert np.array_equal(v.numpy(), t.model.params[k].numpy())
    text = t.sample(n_tokens=40, prompt="the ")          # longer than the 16-token context
    assert text.startswith("the ") and len(text) == 44


# -- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [dict(), dict(dropout=0.1, grad_accum=2)],
                         ids=["plain", "dropout+accum"])
def test_resume_is_bit_exact(text_file, tmp_path, extra):
    n = 6
    full = Trainer(_cfg(text_file, tmp_path / "full", max_steps=n, **extra), log=None)
    full_losses = full.train()["losses"]

    half = Trainer(_cfg(text_file, tmp_path / "half", max_steps=n, **extra), log=None)
    first = half.train(until=n // 2)["losses"]
    assert half.step == n // 2
    resumed = Trainer(_cfg(text_file, tmp_path / "half", max_steps=n, **extra), resume=True, log=None)
    assert resumed.step == n // 2
    second = resumed.train()["losses"]

    assert first + second == full_losses                       # exact float equality
    a, b = _params(full), _params(resumed)
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    for k in full.opt.m:
        assert np.array_equal(full.opt.m[k].numpy(), resumed.opt.m[k].numpy())
        assert np.array_equal(full.opt.v[k].numpy(), resumed.opt.v[k].numpy())
    log = [json.loads(x) for x in (tmp_path / "half" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, n + 1))


def test_resume_under_other_kernels_says_it_is_not_bit_exact(text_file, tmp_path):
    """A checkpoint records the kernels its steps ran (here the C kernels' use, which
    FORGE_CPU_KERNELS changes); a resume under others goes on, with a note; under the same,
    none."""
    from forge_ml import flags
    from forge_ml.backends.cpu import native
    if native.lib() is None:
        pytest.skip("the C kernels do not build here: nothing else to switch to")
    t = Trainer(_cfg(text_file, tmp_path / "run", max_steps=4), log=None)
    t.train(until=2)
    t.close()
    assert load_checkpoint(tmp_path / "run" / "ckpt")[1]["numerics"]["cpu_kernels"] == "c"
    said = []
    Trainer(_cfg(text_file, tmp_path / "run", max_steps=4), resume=True, log=said.append).close()
    assert not [s for s in said if "not bit for bit" in s], said
    said.clear()
    with flags.override(FORGE_CPU_KERNELS="numpy"):
        Trainer(_cfg(text_file, tmp_path / "run", max_steps=4), resume=True, log=said.append).close()
    notes = [s for s in said if "not bit for bit" in s]
    assert len(notes) == 1 and "cpu_kernels: c before, numpy now" in notes[0], said


def _raising_at_call(n, real, error):
    """A stand-in for method (or function) ``real`` that raises ``error`` at its n-th call,
    else calls it."""
    calls = []

    def method(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*a, **k)
    return method


def test_an_error_in_the_loop_saves_the_steps_trained_and_the_resume_is_exact(text_file, tmp_path, monkeypatch):
    """A notebook user's report: an ordinary exception in the loop (their log function, a step
    out of memory) lost every step since the last checkpoint; only a stop saved them. Now the
    last finished step is saved (and a resume goes on bit for bit), except where an optimizer
    update was cut short."""
    n = 6
    full = Trainer(_cfg(text_file, tmp_path / "full", max_steps=n), log=None)
    full_losses = full.train()["losses"]

    def log(line):   # a user's log function that fails at step 3's line
        if line.startswith("step      3/"):
            raise ValueError("the notebook's widget went away")
    t = Trainer(_cfg(text_file, tmp_path / "a", max_steps=n, log_interval=1), log=log)
    with pytest.raises(ValueError, match="widget"):
        t.train()
    assert load_checkpoint(tmp_path / "a" / "ckpt")[1]["step"] == 3
    resumed = Trainer(_cfg(text_file, tmp_path / "a", max_steps=n), resume=True, log=None)
    assert t.losses[:3] + resumed.train()["losses"] == full_losses

    # a step that fails before the update (out of memory in the backward): steps 1-2 saved
    real = type(t.model).loss_and_grads
    monkeypatch.setattr(type(t.model), "loss_and_grads",
                        _raising_at_call(3, real, MemoryError("no room for the backward")))
    b = Trainer(_cfg(text_file, tmp_path / "b", max_steps=n), log=None)
    with pytest.raises(MemoryError):
        b.train()
    monkeypatch.setattr(type(t.model), "loss_and_grads", real)
    assert load_checkpoint(tmp_path / "b" / "ckpt")[1]["step"] == 2
    resumed = Trainer(_cfg(text_file, tmp_path / "b", max_steps=n), resume=True, log=None)
    assert b.losses[:2] + resumed.train()["losses"] == full_losses

    # an update cut short (inside AdamW.step, after its counts moved: the update's kernels;
    # a refusal before any change is not a cut, test_train_safety's NaN lr): nothing saved
    from forge_ml import ops as fm_ops
    real_update = fm_ops.adamw_update_many
    monkeypatch.setattr(fm_ops, "adamw_update_many",
                        _raising_at_call(3, real_update, RuntimeError("cut short")))
    c = Trainer(_cfg(text_file, tmp_path / "c", max_steps=n), log=None)
    with pytest.raises(RuntimeError, match="cut short"):
        c.train()
    assert not (tmp_path / "c" / "ckpt").exists()
    # the half-updated Trainer saves nothing and trains no more (a review's finding)
    with pytest.raises(RunError, match="half updated"):
        c.save()
    with pytest.raises(RunError, match="half updated"):
        c.train()
    assert not (tmp_path / "c" / "ckpt").exists()

    # a KeyboardInterrupt inside the update (no signal handler can defer it: a worker thread,
    # code that raises it): nothing saved, said so (the branch that says it had been dead)
    monkeypatch.setattr(fm_ops, "adamw_update_many",
                        _raising_at_call(3, real_update, KeyboardInterrupt()))
    d = Trainer(_cfg(text_file, tmp_path / "d", max_steps=n, checkpoint_interval=1), log=None)
    with pytest.raises(Interrupted) as info:
        d.train()
    assert not info.value.saved and load_checkpoint(tmp_path / "d" / "ckpt")[1]["step"] == 2


def test_a_failed_save_in_one_call_does_not_skip_a_later_calls_error_save(text_file, tmp_path, monkeypatch):
    """A checkpoint that failed (a full disk) in one train() call kept the flag that stops the
    after-error save from retrying it: an error in a later call, the disk free again, then
    lost every step that call had trained. Within a call, the failed save is still not retried."""
    import errno
    import forge_ml.train as train_mod
    real, calls, full = train_mod.save_checkpoint, [], [True]

    def save(folder, *a, **k):
        calls.append(folder)
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device", str(folder))
        return real(folder, *a, **k)

    def log(line):   # a user's log function that fails at step 4's line
        if line.startswith("step      4/"):
            raise ValueError("the notebook's widget went away")
    monkeypatch.setattr(train_mod, "save_checkpoint", save)
    t = Trainer(_cfg(text_file, tmp_path / "run", max_steps=6, checkpoint_interval=2, log_interval=1), log=log)
    with pytest.raises(RunError, match="No space left on device"):
        t.train(until=3)            # the checkpoint of step 2 fails
    assert len(calls) == 1 and t.step == 2
    full[0] = False                 # room again
    with pytest.raises(ValueError, match="widget"):
        t.train()
    assert load_checkpoint(tmp_path / "run" / "ckpt")[1]["step"] == 4


def _vals(out):
    return [(r["step"], r.get("val_kind"), r.get("best")) for r in
            (json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()) if "val_loss" in r]


def test_keep_best_survives_an_error_or_a_stop_at_an_evaluation(text_file, tmp_path):
    """A re-test of the day's fixes: a log function failing on an evaluation's line left a "best"
    record whose model was never kept (best/ was written after the line), and the checkpoint
    saved after the error then skipped that evaluation on resume; a stop on the last step's line
    lost its estimate, which the resume never made up."""
    C = dict(keep_best=True, eval_interval=3, max_steps=8, lr=3e-2, checkpoint_interval=0)
    ref = tmp_path / "ref"
    Trainer(_cfg(text_file, ref, **C), log=None).train()
    want = _vals(ref)
    assert want[-2] == (8, "sampled", True)   # the last step's estimate competes, and wins here

    class Boom(Exception):
        pass
    for at in ("step 3: val loss", "step      8/8"):
        out = tmp_path / at.split()[1]
        def log(line, at=at):
            if line.startswith(at):
                raise Boom(line)
        with pytest.raises(Boom):
            Trainer(_cfg(text_file, out, log_interval=1, **C), log=log).train()
        Trainer(_cfg(text_file, out, **C), resume=True, log=None).train()
        assert _vals(out) == want, at
        assert load_checkpoint(out / "best")[1]["step"] == load_checkpoint(ref / "best")[1]["step"] == 8
    # training in chunks estimates at the same steps as one call (the last step's estimate is
    # the run's last step's, not each call's: a review's finding)
    chunks = tmp_path / "chunks"
    t = Trainer(_cfg(text_file, chunks, **C), log=None)
    t.train(until=4)
    t.train()
    sampled = lambda vals: [v for v in vals if v[1] == "sampled"]   # noqa: E731
    assert sampled(_vals(chunks)) == sampled(want)


def test_a_warmup_longer_than_the_run_is_said(text_file, tmp_path):
    """A short fine-tune (20 steps) under the default 100-step warmup never reached --lr, in
    silence (a fine-tuning user's report)."""
    said = []
    Trainer(_cfg(text_file, tmp_path / "a", max_steps=4, warmup=10, lr=1e-2), log=said.append).train()
    note = [x for x in said if "warmup=10 is longer than the run's 4 steps" in x]   # the library's words
    assert len(note) == 1 and "climbs to 4.00e-03" in note[0] and "warmup=1)" in note[0], said
    said.clear()   # a decay shorter than the warmup does not cut the ramp (a re-test's finding)
    Trainer(_cfg(text_file, tmp_path / "b", max_steps=4, warmup=2, lr_decay_steps=1), log=said.append).train()
    assert not [x for x in said if "longer than the run" in x], said


def test_resume_without_a_checkpoint(text_file, tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        Trainer(_cfg(text_file, tmp_path / "empty"), resume=True, log=None)


def test_checkpoint_of_another_architecture_is_refused(text_file, tmp_path):
    out = tmp_path / "r"
    Trainer(_cfg(text_file, out, max_steps=1), log=None).train()
    # a size other than the run's is named (it listed the checkpoint's tensor shapes)
    with pytest.raises(ConfigError, match="n_layer 1, not 2 .another architecture.*drop n_layer$"):
        Trainer(_cfg(text_file, out, n_layer=2), resume=True, log=None)
    with pytest.raises(ConfigError, match="n_head 2, not 4 .another architecture.*drop n_head$"):
        Trainer(_cfg(text_file, out, n_head=4), resume=True, log=None)


# -- failures -------------------------------------------------------------------------------


def test_nan_loss_names_the_step_and_the_last_good_checkpoint(text_file, tmp_path):
    out = tmp_path / "r"
    t = Trainer(_cfg(text_file, out, max_steps=5), log=None)
    t.train(until=2)                                   # checkpoint at step 2
    t.model.params["ln_f.weight"].data[:] = np.nan     # poison the weights
    with pytest.raises(TrainingError) as e:
        t.train()
    msg = str(e.value)
    assert "step 3" in msg and str(out / "ckpt") in msg and "(step 2)" in msg and "nan" in msg
    # the checkpoint on disk is still the good one
    _, meta = load_checkpoint(out / "ckpt")
    assert meta["step"] == 2


def test_nan_before_any_checkpoint(text_file, tmp_path):
    t = Trainer(_cfg(text_file, tmp_path / "r"), log=None)
    t.model.params["wte.weight"].data[:] = np.nan
    with pytest.raises(TrainingError, match="step 1.*No checkpoint was saved yet"):
        t.train()


def test_min_lr_defaults_to_a_tenth_of_lr_and_may_not_exceed_it():
    """A fine-tune's --lr 5e-5 had a cosine that climbed to the fixed default min_lr 1e-4."""
    from forge_ml.errors import ConfigError
    from forge_ml.optim import cosine_lr
    cfg = TrainConfig(lr=5e-5, max_steps=100, warmup=0)
    assert cfg.min_lr == pytest.approx(5e-6)
    lrs = [cosine_lr(s, cfg.lr, cfg.warmup, cfg.decay_steps, cfg.min_lr) for s in range(101)]
    assert all(b <= a for a, b in zip(lrs, lrs[1:])) and lrs[-1] == pytest.approx(5e-6)
    assert TrainConfig().min_lr == pytest.approx(1e-4)               # the default run: as before
    assert TrainConfig.from_dict(cfg.to_dict()).min_lr == cfg.min_lr  # a checkpoint keeps it
    with pytest.raises(ConfigError, match="min_lr 0.0001 is above lr 5e-05"):
        TrainConfig(lr=5e-5, min_lr=1e-4)


def test_evaluate_is_the_mean_over_its_batches_and_refuses_a_bad_count(text_file, tmp_path):
    """``evaluate(n)`` is the plain mean of the loss over the first ``n`` validation batches;
    a count that is not an int >= 1 is a ConfigError (it had divided by it: 2.5 batches gave
    two batches' sum / 2.5, -1 gave -0.0, 0 a ZeroDivisionError)."""
    from forge_ml import tensor
    with Trainer(_cfg(text_file, tmp_path / "run"), log=None) as t:
        want = np.mean([t.model.loss(tensor(x), tensor(y)).item() for x, y in t.val_loader.eval_batches(3)])
        assert t.evaluate(3) == pytest.approx(want, rel=1e-12)
        for bad in (2.5, 0, -1, True, "3"):
            with pytest.raises(ConfigError, match="evaluate"):
                t.evaluate(bad)


def test_evaluate_full_refuses_a_bad_window_count(text_file, tmp_path):
    """evaluate_full(max_windows) took -1 as 'all but the last window of the first batch' and
    gave that loss silently (2.5 a TypeError, 0 a ShapeError); a count that is not None or an
    int >= 1 is now a ConfigError, and a good one is the mean over that many windows."""
    from forge_ml import tensor
    with Trainer(_cfg(text_file, tmp_path / "run"), log=None) as t:
        x, y = next(iter(t.val_loader.eval_batches(1)))
        assert t.evaluate_full(3) == (pytest.approx(t.model.loss(tensor(x[:3]), tensor(y[:3])).item(), rel=1e-6), 3)
        for bad in (-1, 0, 2.5, True, "3"):
            with pytest.raises(ConfigError, match="evaluate_full"):
                t.evaluate_full(bad)


def test_a_copy_with_another_lr_or_preset_works_its_defaults_out_again():
    """min_lr (lr / 10) and block_size (the preset's) were worked out once: a copy made with
    dataclasses.replace(cfg, lr=5e-5) kept min_lr 1e-4 and was refused as 'above lr (or leave
    it out: lr / 10)', lr=3e-4 kept 1e-4, and model="gpt2" kept a 64-token context. A copy now
    gets what TrainConfig(...) with the same values gets; values given stay as given."""
    import dataclasses
    base = TrainConfig(n_layer=1, max_steps=2)
    for kw in (dict(lr=5e-5), dict(lr=3e-4), dict(model="gpt2"), dict(model="gpt2", lr=2e-4)):
        got, want = dataclasses.replace(base, **kw), TrainConfig(n_layer=1, max_steps=2, **kw)
        assert (got.min_lr, got.block_size) == (want.min_lr, want.block_size), kw
    given = TrainConfig(min_lr=2e-4, block_size=32)
    assert (dataclasses.replace(given, lr=5e-4, model="gpt2").min_lr,
            dataclasses.replace(given, model="gpt2").block_size) == (2e-4, 32)
    assert json.loads(json.dumps(base.to_dict()))["min_lr"] == pytest.approx(1e-4)
