"""The switchboard: parsing, overrides, and the README's table of switches."""
from pathlib import Path

import pytest

from forge_ml import flags
from forge_ml.errors import ConfigError

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_lists_every_switch_as_declared():
    text = README.read_text(encoding="utf-8")
    for row in flags.table().splitlines():
        assert row in text, f"README.md lacks or differs on the row: {row}"
    assert flags.table() in text, "README.md's switch rows are not in flags.table()'s order"
    listed = {ln.split("`")[1] for ln in text.splitlines() if ln.startswith("| `FORGE_")}
    assert listed == set(flags.SWITCHES)


def test_environment_values_are_parsed_once_and_checked(monkeypatch):
    sw = flags.SWITCHES["FORGE_GEMV"]
    assert sw.parse("0") == "off" and sw.parse(" ON ") == "on" and sw.parse("true") == "on"
    assert flags.SWITCHES["FORGE_ATTENTION"].parse("v1") == "composed"   # the old spelling
    with pytest.raises(ConfigError, match="FORGE_ATTENTION='fast' is not one of flash|composed"):
        flags.SWITCHES["FORGE_ATTENTION"].parse("fast")
    fused = flags.SWITCHES["FORGE_FUSED_DECODE"]   # on/off with a third value: 1/0 still work
    assert [fused.parse(v) for v in ("1", "no", "Layers", "on")] == ["on", "off", "layers", "on"]
    with pytest.raises(ConfigError, match="not one of on|off|layers"):
        fused.parse("two")
    monkeypatch.setitem(flags._values, "FORGE_PDL", "off")
    monkeypatch.setenv("FORGE_PDL", "1")                  # read once: a later change is not seen
    assert flags.on("FORGE_PDL") is False


def test_override_nests_and_restores():
    before = flags.get("FORGE_ATTENTION")
    with flags.override(FORGE_ATTENTION="composed"):
        assert flags.get("FORGE_ATTENTION") == "composed"
        with flags.override(FORGE_ATTENTION="flash", FORGE_GEMV=False):
            assert flags.get("FORGE_ATTENTION") == "flash" and not flags.on("FORGE_GEMV")
        assert flags.get("FORGE_ATTENTION") == "composed"
    assert flags.get("FORGE_ATTENTION") == before
    with pytest.raises(ConfigError, match="unknown switch 'FORGE_GRAPH'"):
        with flags.override(FORGE_GRAPH="off"):
            pass


def test_no_forge_switch_is_read_outside_flags():
    src = Path(flags.__file__).resolve().parent
    offenders = [str(p.relative_to(src)) for p in src.rglob("*.py")
                 if p.name != "flags.py" and "os.environ" in p.read_text(encoding="utf-8")
                 and "FORGE_" in "".join(ln for ln in p.read_text(encoding="utf-8").splitlines()
                                         if "os.environ" in ln)]
    assert offenders == []


@pytest.fixture
def bad_switch(monkeypatch):
    """FORGE_CUDA_GRAPH=x in the environment, not yet read (a CPU run never asks for it)."""
    monkeypatch.setenv("FORGE_CUDA_GRAPH", "x")
    monkeypatch.delitem(flags._values, "FORGE_CUDA_GRAPH", raising=False)


def test_a_bad_switch_fails_the_command_before_any_work(bad_switch, tmp_path, capsys):
    """Not after the run (the final sample used to be the first to read FORGE_CUDA_GRAPH, and
    the run ended with no checkpoint), nor after --overwrite removed the earlier run."""
    from forge_ml.cli import main
    (tmp_path / "t.txt").write_text("to be or not to be\n" * 100)
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "log.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    argv = ["train", "--data", str(tmp_path / "t.txt"), "--out", str(run), "--overwrite",
            "--max-steps", "2", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
            "--block-size", "16", "--batch-size", "2", "--eval-interval", "0", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "FORGE_CUDA_GRAPH='x' is not one of on|off (or 1/0)" in err and "Traceback" not in err
    assert (run / "log.jsonl").read_text() == '{"step": 1, "loss": 4.0}\n'
    assert main(["bench", "--steps", "1"]) == 2


def test_a_bad_switch_fails_a_trainer_when_made(bad_switch, tmp_path):
    from forge_ml.train import TrainConfig, Trainer
    (tmp_path / "t.txt").write_text("ab\n" * 500)
    with pytest.raises(ConfigError, match="FORGE_CUDA_GRAPH='x' is not one of on|off"):
        Trainer(TrainConfig(data=str(tmp_path / "t.txt"), out_dir=str(tmp_path / "r"), n_layer=1,
                            n_head=1, n_embd=8, block_size=8, max_steps=2, progress=False), log=None)
    assert not (tmp_path / "r").exists()


def test_cache_dir_expands_a_leading_tilde(monkeypatch, tmp_path):
    """Not a folder named '~' in the working folder (FORGE_CACHE_DIR=~/x from a .env file)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with flags.override(FORGE_CACHE_DIR="~/kernels"):
        assert flags.cache_root("cpu") == tmp_path / "home" / "kernels" / "cpu"
    with flags.override(FORGE_CACHE_DIR="rel"):
        assert flags.cache_root("cpu") == tmp_path / "rel" / "cpu"


def test_a_misspelled_switch_is_named_once_and_other_tools_names_are_left_alone(monkeypatch, capsys):
    """FORGE_CUDA_GRAPHS=off (a typo of FORGE_CUDA_GRAPH) changed nothing, silently."""
    import warnings

    from forge_ml.cli import main
    monkeypatch.setattr(flags, "_reported", set())
    monkeypatch.setenv("FORGE_CUDA_GRAPHS", "off")
    monkeypatch.setenv("FORGE_EMAIL", "me@example.com")      # another tool's variable
    assert main(["bench", "--list"]) == 0
    err = capsys.readouterr().err
    assert err.count("FORGE_CUDA_GRAPHS is not a forge-ml switch") == 1 and "FORGE_CUDA_GRAPH?" in err
    assert "FORGE_EMAIL" not in err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flags.check_environment()          # said once already: no second warning
    monkeypatch.setattr(flags, "_reported", set())
    with pytest.warns(RuntimeWarning, match="did you mean FORGE_CUDA_GRAPH"):
        flags.check_environment()          # a library user (a Trainer) is told through warnings
