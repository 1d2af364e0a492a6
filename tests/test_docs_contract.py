"""The backend contract's three accounts agree: the name tuples of ``backends/contract.py`` (what
the loader reads), its ``Protocol`` classes (the documentation of each member) and the contract
table of ``docs/architecture.md``; and what the docs' step lists name exists. An op added to one
and not the others fails here. Text and names only: nothing is computed, no backend loaded."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import forge_ml.ops
from forge_ml.backends import contract

ROOT = Path(__file__).resolve().parents[1]
ARCH = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"


def protocol_members(cls) -> set:
    """The members a Protocol class declares: its public methods and annotated attributes."""
    names = {n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v)}
    return names | {n for n in vars(cls).get("__annotations__", {}) if not n.startswith("_")}


@pytest.mark.parametrize("cls,names", [
    (contract.Memory, contract.MEMORY),
    (contract.CoreKernels, contract.CORE),
    (contract.FusedKernels, contract.FUSED),
    (contract.Capabilities, ("name", *contract.CAPABILITIES)),
], ids=["memory", "core", "fused", "capabilities"])
def test_protocol_classes_declare_the_tuples_names(cls, names):
    """The loader reads the tuples and never the classes: a member written only in a class is
    no part of the contract, a name only in a tuple has no documentation."""
    members = protocol_members(cls)
    assert len(names) == len(set(names)), f"a name repeated in the tuple of {cls.__name__}"
    assert members == set(names), (
        f"contract.{cls.__name__} and its tuple differ: only in the class "
        f"{sorted(members - set(names))}, only in the tuple {sorted(set(names) - members)}")


def _unparenthesized_code(text: str) -> list:
    """The `code` spans of ``text`` outside parentheses (the prose in parentheses may name other
    ops), ``name(_bwd)`` read as ``name`` and ``name_bwd``."""
    names, depth, i = [], 0, 0
    while i < len(text):
        c = text[i]
        if c == "`":
            end = text.index("`", i + 1)
            if depth == 0:
                m = re.fullmatch(r"(\w+)(?:\((\w+)\))?", text[i + 1:end])
                assert m, f"not an op name: `{text[i + 1:end]}`"
                names += [m[1]] + ([m[1] + m[2]] if m[2] else [])
            i = end + 1
            continue
        depth += (c == "(") - (c == ")")
        i += 1
    assert depth == 0, f"unbalanced parentheses in: {text[:80]}..."
    return names


def table_row(group: str) -> list:
    """The names in the members column of the contract table's row for ``group``."""
    rows = [line for line in ARCH.read_text(encoding="utf-8").splitlines()
            if line.startswith(f"| {group} |")]
    assert len(rows) == 1, f"docs/architecture.md: expected one table row '| {group} |'"
    cells = [c.strip() for c in rows[0].strip("|").split(" | ")]
    assert len(cells) == 3, f"docs/architecture.md: the '{group}' row has {len(cells)} cells"
    return _unparenthesized_code(cells[1])


@pytest.mark.parametrize("group,names", [
    ("memory", contract.MEMORY),
    ("core kernels", contract.CORE),
    ("fused kernels", contract.FUSED),
], ids=["memory", "core", "fused"])
def test_architecture_table_lists_the_contract(group, names):
    """docs/architecture.md's contract table names every op of each group and no other."""
    listed = table_row(group)
    assert len(listed) == len(set(listed)), f"'{group}': a name listed twice: {sorted(listed)}"
    only_docs, only_code = sorted(set(listed) - set(names)), sorted(set(names) - set(listed))
    assert not only_docs and not only_code, (
        f"docs/architecture.md's '{group}' row and contract.py differ: only in the docs "
        f"{only_docs}, only in contract.py {only_code}")


def test_architecture_table_lists_the_optional_members():
    """Every OPTIONAL member is named in the table's capabilities row or one of its optional
    rows (a docs check found decode_gpt2 in none)."""
    listed = set()
    for group in ("capabilities", "whole-model optimizer ops (optional)", "whole-step decoding (optional)"):
        rows = [line for line in ARCH.read_text(encoding="utf-8").splitlines() if line.startswith(f"| {group} |")]
        assert len(rows) == 1, f"docs/architecture.md: expected one table row '| {group} |'"
        listed |= set(re.findall(r"`(\w+)", rows[0].strip("|").split(" | ")[1]))
    assert not sorted(set(contract.OPTIONAL) - listed), sorted(set(contract.OPTIONAL) - listed)


def test_readme_op_list_names_ops():
    """README's "the op set (...)" list (the public ops, core and fused) names functions of
    ``forge_ml.ops``: an op renamed or dropped there fails here."""
    text = README.read_text(encoding="utf-8")
    m = re.search(r"`forge_ml\.ops`: the op set \(([^()]*)\)", text)
    assert m, "README.md: the `forge_ml.ops` bullet's op list was not found"
    listed = []
    for item in re.split(r",\s*", " ".join(m[1].split())):
        listed += ["split_heads", "merge_heads"] if item == "split/merge heads" else [item]
    public = {n for n, v in vars(forge_ml.ops).items()
              if not n.startswith("_") and inspect.isfunction(v)}
    assert set(listed) <= public, (
        f"README.md lists ops that forge_ml.ops lacks: {sorted(set(listed) - public)}")
    known = set(contract.CORE) | set(contract.FUSED) | set(contract.GRAPH)
    assert set(listed) <= known, (
        f"README.md lists ops outside the contract: {sorted(set(listed) - known)}")


def _section(title: str) -> str:
    text = ARCH.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


@pytest.mark.parametrize("title", ["Add a backend", "Add an op"])
def test_step_lists_name_files_that_exist(title):
    """Every file path the two step lists name in `code` (one with a folder, no placeholder:
    ``scripts/nvrtc_check.py``, not ``cuda/<stem>.cu``) exists, from the repository's root or
    from src/forge_ml/."""
    spans = re.findall(r"`([^`]+)`", _section(title))
    paths = {p for span in spans
             for p in re.findall(r"(?<![\w/<>.=-])((?:[\w.-]+/)+[\w-]+\.\w+)\b", span)}
    assert paths, title
    missing = [p for p in sorted(paths)
               if not (ROOT / p).exists() and not (ROOT / "src" / "forge_ml" / p).exists()]
    assert not missing, f"docs/architecture.md '{title}' names files that do not exist: {missing}"


# what "Add a backend" and "Add an op" tell a contributor to use or copy, by the file that
# defines it
DEFINED = {
    "tests/backends/test_contract_ops.py": ["_available", "both", "close", "host", "dev",
                                            "test_corenp_has_only_core_ops"],
    "tests/backends/core_numpy.py": ["register_backend"],
    "tests/test_autograd.py": ["CASES"],
    "tests/test_cuda.py": ["test_gelu"],
    "src/forge_ml/autograd.py": ["_Saved", "_check", "_record", "records", "gelu", "layernorm",
                                 "matmul_gelu"],
    "src/forge_ml/ops.py": ["_float", "_same", "_shape_eq", "_wrap"],
    "src/forge_ml/backends/cpu/__init__.py": ["_fused", "gelu"],
    "src/forge_ml/backends/cpu/native.py": ["_SIGNATURES"],
    "src/forge_ml/backends/cuda/runtime.py": ["_guarded", "_launch", "_float_sfx"],
    "src/forge_ml/backends/cuda/pointwise.py": ["gelu"],
}


@pytest.mark.parametrize("path", sorted(DEFINED))
def test_step_lists_name_code_that_exists(path):
    """The helpers, tests and patterns the step lists point at are still defined where they
    were (read as text: the CUDA modules import CuPy)."""
    src = (ROOT / path).read_text(encoding="utf-8")
    defines = r"^\s*(?:def {0}\(|class {0}\b|(?:self\.)?{0}\s*[:=])"
    gone = [n for n in DEFINED[path] if not re.search(defines.format(n), src, flags=re.M)]
    assert not gone, f"{path} no longer defines {gone} (docs/architecture.md names them)"


def test_record_takes_into_and_sums():
    """The tape's conventions as documented: ``_record(t, f, into=None, sums=False)``."""
    from forge_ml.autograd import Tape
    params = inspect.signature(Tape._record).parameters
    assert {"into", "sums"} <= set(params), sorted(params)
