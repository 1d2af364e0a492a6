"""QA of the forge-ml command line as a new user drives it: train, sample, eval and their bad
input (one line on stderr, status 2, no traceback), through ``main([...])``."""
from pathlib import Path

import pytest

from forge_ml.checkpoint import save_checkpoint
from forge_ml.cli import main
from forge_ml.models.gpt2 import GPT2, GPT2Config

from test_cli import _fails   # main(argv): status 2, one line on stderr, no traceback


@pytest.fixture
def ckpt(tmp_path, monkeypatch):
    """A tiny char-model checkpoint ``ck`` (vocabulary "abé" and a newline) in the current
    folder, as ``convert --from-hf`` writes one."""
    monkeypatch.chdir(tmp_path)
    cfg = GPT2Config(vocab_size=4, block_size=8, n_layer=1, n_head=1, n_embd=8)
    save_checkpoint("ck", GPT2.init(cfg, seed=0).state_dict(),
                    {"kind": "forge-ml-model", "config": cfg.to_dict(),
                     "tokenizer": {"kind": "char", "chars": "ab\u00e9\n"}})
    return "ck"


@pytest.mark.parametrize("argv, flag", [
    (["--data", ""], "--data"), (["--data", " "], "--data"),
    (["--init-from", ""], "--init-from"), (["--config", ""], "--config")])
def test_train_refuses_an_empty_path_flag(tmp_path, monkeypatch, capsys, argv, flag):
    """(QA) ``--data ''`` (``--data "$DATA"`` with the variable unset) trained on the default
    corpus, ``--init-from ''`` a model from scratch, ``--config ''`` without the file: each in
    silence, as if the flag had not been given."""
    import forge_ml.train

    class NoTrainer:
        def __init__(self, *a, **kw):
            raise AssertionError(f"a run started with {argv}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(forge_ml.train, "Trainer", NoTrainer)
    (tmp_path / "t.txt").write_text("ab\n" * 50)
    extra = [] if flag == "--data" else ["--data", "t.txt"]
    line = _fails(capsys, ["train", *argv, *extra, "--out", "run", "--max-steps", "0"],
                  f"{flag} is empty")
    assert "leave" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cmd", [["sample"], ["eval", "--data", "t.txt"]])
@pytest.mark.parametrize("value", ["", "  "])
def test_sample_and_eval_refuse_an_empty_ckpt_by_its_flag(tmp_path, monkeypatch, capsys, cmd, value):
    """(QA) ``--ckpt ''`` was refused in the library's words ("load_model: path must be ...")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("ab\n" * 50)
    line = _fails(capsys, [cmd[0], "--ckpt", value, *cmd[1:]], "--ckpt is empty")
    assert "load_model" not in line


def test_num_samples_past_every_seed_is_refused_without_a_negative_seed(capsys):
    """(QA) ``--num-samples`` above 2**64 advised "give --seed <= -99981553255926290448383"."""
    n = 10 ** 23
    line = _fails(capsys, ["sample", "--ckpt", "nope", "--num-samples", str(n)],
                  "--num-samples", str(n))
    assert "<= -" not in line


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_length_penalty_not_finite_is_refused_by_its_flag(ckpt, capsys, value):
    """(QA) It was refused after the model loaded, as beam_search's "length_penalty"."""
    line = _fails(capsys, ["sample", "--ckpt", ckpt, "--num-beams", "2", f"--length-penalty={value}",
                           "--max-new-tokens", "2"], "--length-penalty must be a finite number")
    assert "beam_search" not in line


def test_a_prompt_outside_the_vocabulary_names_its_flag_and_checkpoint(ckpt, capsys):
    """(QA) It said only "CharTokenizer: character 'z' ..." (eval names --data and the
    checkpoint for the same error)."""
    _fails(capsys, ["sample", "--ckpt", ckpt, "--prompt", "abz"], "--prompt ", ckpt, "'z'",
           "not in the vocabulary")
    Path("p.txt").write_text("zz")
    _fails(capsys, ["sample", "--ckpt", ckpt, "--prompt-file", "p.txt"], "--prompt-file p.txt",
           ckpt, "'z'")


def test_a_utf8_prompt_read_under_an_ascii_locale_is_its_text(ckpt, capsys):
    """(QA) Under an ASCII locale without UTF-8 mode, argv's UTF-8 bytes reach Python as
    surrogates (U+DC80-U+DCFF); sample checked they were valid UTF-8 but kept the surrogates:
    a char model refused "\\udcc3", a GPT-2 model was given U+FFFD in place of the text."""
    raw = "a\u00e9".encode("utf-8").decode("ascii", "surrogateescape")   # what argv holds
    assert main(["sample", "--ckpt", ckpt, "--prompt", raw, "--max-new-tokens", "0"]) == 0
    assert capsys.readouterr().out == "a\u00e9\n"


def test_train_sample_prompt_read_under_an_ascii_locale_is_its_text(tmp_path, monkeypatch):
    """(QA) As sample's --prompt: train's --sample-prompt kept argv's surrogates, refused by a
    char vocabulary ("--sample-prompt 'a\\udcc3\\udca9' cannot be encoded")."""
    import forge_ml.train
    got = []

    class Stop(Exception):
        pass

    class Recorder:
        def __init__(self, cfg, *a, **kw):
            got.append(cfg.sample_prompt)
            raise Stop
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(forge_ml.train, "Trainer", Recorder)
    (tmp_path / "t.txt").write_text("ab\u00e9\n" * 50)
    raw = "a\u00e9".encode("utf-8").decode("ascii", "surrogateescape")
    with pytest.raises(Stop):
        main(["train", "--data", "t.txt", "--out", "run", "--sample-prompt", raw])
    assert got == ["a\u00e9"]
