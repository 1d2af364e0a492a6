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
    listed = {ln.split("`")[1] for ln in text.splitlines() if ln.startswith("| `FORGE_")}
    assert listed == set(flags.SWITCHES)


def test_environment_values_are_parsed_once_and_checked(monkeypatch):
    sw = flags.SWITCHES["FORGE_GEMV"]
    assert sw.parse("0") == "off" and sw.parse(" ON ") == "on" and sw.parse("true") == "on"
    assert flags.SWITCHES["FORGE_ATTENTION"].parse("v1") == "composed"   # the old spelling
    with pytest.raises(ConfigError, match="FORGE_ATTENTION='fast' is not one of flash|composed"):
        flags.SWITCHES["FORGE_ATTENTION"].parse("fast")
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
