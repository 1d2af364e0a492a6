"""The docs as a new user reads them (README.md, docs/architecture.md), held to the code: the
numbers and defaults they state, the names and flags they use, the files and scripts they point
at, and their Python examples, run. Each claim is read from the docs' text, so a test fails when
the docs and the code disagree, whichever of the two moved. (tests/test_readme.py parses the
README's command lines; tests/test_docs_contract.py checks the contract table and step lists.)"""
from __future__ import annotations

import contextlib
import inspect
import io
import json
import math
import pickle
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import forge_ml
from forge_ml import blas, flags
from forge_ml.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
ARCH = ROOT / "docs" / "architecture.md"
PKG = ROOT / "src" / "forge_ml"
CUDA = PKG / "backends" / "cuda"


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _one(pattern: str, text: str, what: str) -> re.Match:
    """The single match of ``pattern`` in ``text`` (whitespace runs match line breaks too)."""
    found = list(re.finditer(pattern.replace(" ", r"\s+"), text))
    assert len(found) == 1, f"expected the docs to state {what} once, found {len(found)}"
    return found[0]


def _num(s: str) -> float:
    return float(s.replace(",", ""))


def _subparsers() -> dict:
    act = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
    assert len(act) == 1
    return dict(act[0].choices)


def _code_blocks(text: str, lang: str = "python") -> list:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _prose(text: str) -> str:
    """The text without its fenced blocks and 4-space indented code lines."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.startswith("    "))


def _spans(text: str, newlines: bool = False) -> list:
    """The `code` spans of ``text`` outside its fenced blocks (a fence's three backticks would
    pair the spans after it the wrong way round)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`]+)`" if newlines else r"`([^`\n]+)`", text)


def _param_default(fn, name):
    params = inspect.signature(fn).parameters
    assert name in params, f"{fn.__qualname__} has no parameter {name!r}: {list(params)}"
    return params[name].default


# --- the numbers and defaults the README states ----------------------------------------------


def _default_run_params(vocab: int) -> int:
    from forge_ml.models import GPT2Config
    from forge_ml.models.gpt2 import param_shapes
    from forge_ml.train import TrainConfig
    c = TrainConfig()
    cfg = GPT2Config(vocab_size=vocab, padded_vocab_size=vocab, block_size=c.block_size,
                     **c.model_sizes())
    return sum(math.prod(s) for s in param_shapes(cfg).values())


def test_readme_default_run_matches_trainconfig():
    """"2000 steps ... -> runs/default", "(2000 steps of a 0.8M-parameter char model, batch
    12 x 64)", "Its context is 64 characters", "the model has 0.8M parameters"."""
    from forge_ml.train import TrainConfig
    text, c = _text(README), TrainConfig()
    m = _one(r"forge-ml train +# ([\d,]+) steps, [^\n]*-> (\S+)", text, "the default run's steps")
    assert (_num(m[1]), m[2]) == (c.max_steps, c.out_dir)
    m = _one(r"the default run \(([\d,]+) steps of a ([\d.]+)M-parameter char model, batch "
             r"(\d+) x (\d+)\)", text, "the default run's size")
    assert _num(m[1]) == c.max_steps
    assert (int(m[3]), int(m[4])) == (c.batch_size, c.block_size)
    said = {float(m[2]), float(_one(r"the model has ([\d.]+)M parameters", text, "its size")[1])}
    # a char vocabulary of the stdlib's source: from ASCII's printable set to a few hundred
    got = {round(_default_run_params(v) / 1e6, 1) for v in (65, 101, 256)}
    assert said == got, f"the README says {said}M parameters, the default model has {got}M"
    ctx = _one(r"Its context is (\d+) characters", text, "the default context")
    assert int(ctx[1]) == c.block_size


def test_readme_final_eval_cap_is_the_default():
    from forge_ml.train import TrainConfig
    text = _text(README)
    m = _one(r"`--final-eval-windows` \(([\d,]+)\)", text, "--final-eval-windows' default")
    first = _one(r"evaluated on its first ([\d,]+) windows", text, "the capped evaluation")
    assert _num(m[1]) == _num(first[1]) == TrainConfig().final_eval_windows


def test_readme_serve_defaults():
    """127.0.0.1:8000, the 5 s shutdown timeout, 413 over 4 MiB."""
    from forge_ml.serve import app
    text = _text(README)
    ns = build_parser().parse_args(["serve", "--ckpt", "x"])
    m = _one(r"an OpenAI-compatible server on ([\d.]+):(\d+)", text, "serve's address")
    assert (m[1], int(m[2])) == (ns.host, ns.port)
    assert _one(r"It listens on ([\d.]+)", text, "serve's host")[1] == ns.host
    m = _one(r"`--shutdown-timeout` seconds \((\d+)\)", text, "--shutdown-timeout's default")
    assert float(m[1]) == ns.shutdown_timeout
    m = _one(r"a body over (\d+) MiB gets 413", text, "the body limit")
    assert int(m[1]) << 20 == app.DEFAULT_MAX_BODY_BYTES


def test_readme_thread_defaults():
    """"it starts on half the cores (at most 8)"; the variables that fix the count."""
    text = _text(README)
    cap = int(_one(r"it starts on half the cores \(at most (\d+)\)", text, "the thread default")[1])
    assert blas.MAX_THREADS == cap
    assert [blas.default_threads(n) for n in (1, 2, 6, 4 * cap)] == [1, 1, 3, cap]
    m = _one(r"((?:`\w+_NUM_THREADS`,? (?:or )?)+)\(a whole number >= 1\) fixes", text,
             "the thread variables")
    assert set(re.findall(r"`(\w+)`", m[1])) == set(blas.THREAD_VARS)


def test_readme_prefill_threshold_is_the_default():
    from forge_ml.inference.batch import BatchEngine
    m = _one(r"`BatchEngine\(prefill_min=(\d+)\)`", _text(README), "BatchEngine's prefill_min")
    assert _param_default(BatchEngine, "prefill_min") == int(m[1])


def test_readme_warmup_rule():
    """"warmup runs at lr (s + 1) / warmup", as `--warmup`'s help says too."""
    from forge_ml.optim import cosine_lr
    _one(r"warmup runs at lr \(s \+ 1\) / warmup", _text(README), "the warmup rule")
    for s in (0, 1, 49, 99):
        assert cosine_lr(s, 1e-3, 100, 2000, 1e-4) == pytest.approx(1e-3 * (s + 1) / 100)


# --- the names the docs use -------------------------------------------------------------------


def _resolve(dotted: str):
    import importlib
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for p in parts[i:]:
        obj = getattr(obj, p)
    return obj


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_docs_dotted_names_resolve():
    """Every `forge_ml.x.y` the README and docs/architecture.md write in code spans exists."""
    names = set()
    for path in (README, ARCH):
        for span in _spans(_text(path)):
            names |= set(re.findall(r"\bforge_ml(?:\.\w+)+", span))
    assert len(names) >= 10
    bad = []
    for n in sorted(names):
        try:
            _resolve(n)
        except (AttributeError, ImportError):
            bad.append(n)
    assert not bad, f"the docs name {bad}, which do not exist"


def _bullet(title: str) -> str:
    head = re.escape(title).replace("\\ ", " ")
    m = _one(r"\n- " + head + r"([\s\S]*?)(?=\n- |\n\n)", _text(README), f"the {title} bullet")
    return " ".join(m[1].split())


def test_readme_inference_bullet_names_exist():
    """The `forge_ml.inference` bullet: its functions and classes, and generate's knobs."""
    import forge_ml.inference as inf
    from forge_ml.inference.batch import BatchEngine
    text = _bullet("`forge_ml.inference`:")
    names = set(re.findall(r"`(\w+)(?:`|[ (=])", text))
    assert {"load_model", "generate", "beam_search", "KVCache"} <= names
    knobs = set(inspect.signature(inf.generate).parameters) | set(
        inspect.signature(inf.beam_search).parameters)
    missing = sorted(n for n in names - knobs - {"BatchEngine"}
                     if not hasattr(inf, n) and not hasattr(forge_ml, n))
    assert not missing, f"README's forge_ml.inference bullet names {missing}, which it lacks"
    assert BatchEngine.__module__.startswith("forge_ml.inference")
    for kw in re.findall(r"`generate\((\w+)=", _text(README)):
        assert kw in knobs, f"README writes generate({kw}=...): no such parameter"
    assert "model, tokenizer, meta = load_model(path)" in text


def test_readme_ops_bullet_names_exist():
    """The `forge_ml.ops` bullet beyond its op-set list (tests/test_docs_contract.py): the fused
    products, the optimizer and decoding ops, the step values, each `op(kw=...)` form."""
    from forge_ml import ops
    text = _bullet("`forge_ml.ops`:")
    words = set(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", text))
    words |= set(re.findall(r"`([A-Z][A-Za-z_]+)`", text))
    assert {"matmul_gelu", "weight_grads", "sumsq_total", "SeedAt", "STEP_SCALARS"} <= words
    assert not sorted(w for w in words if not hasattr(ops, w)), sorted(
        w for w in words if not hasattr(ops, w))
    forms = re.findall(r"\b(\w+)\((\w+)=", text) + [
        (m[1], kw) for m in re.finditer(r"\((\w+), with `(\w+)=`", text) for kw in [m[2]]]
    assert ("layernorm_bwd", "add") in forms and ("adamw_update_many", "scalars") in forms
    for op, kw in forms:
        _param_default(getattr(ops, op), kw)


def test_readme_tape_step_optim_names_exist():
    from forge_ml.autograd import Tape
    from forge_ml.optim import AdamW
    from forge_ml.step import TrainStep
    tape = _bullet("`forge_ml.Tape` / `TVar`:")
    nodes = re.findall(r"`(\w+)`", tape)
    assert nodes and all(hasattr(Tape, n) for n in nodes), nodes
    rest = _bullet("`forge_ml.models.GPT2`, `GPT2Config`;")
    m = _one(r"`forge_ml\.step\.TrainStep` \(.*?; (.*?)\)", rest, "TrainStep's methods")
    methods = re.findall(r"`(\w+)`", m[1])
    assert set(methods) == {"run", "submit", "preload"}
    assert all(callable(getattr(TrainStep, n, None)) for n in methods)
    kw = _one(r"`forge_ml\.optim\.AdamW` \(with `(\w+)=\"(\w+)\"`", rest, "AdamW's low precision")
    _param_default(AdamW, kw[1])
    assert "resume=True" in rest
    from forge_ml.train import Trainer
    assert _param_default(Trainer, "resume") is False


def test_docs_environment_names_are_declared():
    """Every FORGE_* name in the README and docs/architecture.md is a switch of forge_ml.flags
    (or the one other name a script reads)."""
    named = set()
    for path in (README, ARCH):
        named |= set(re.findall(r"\bFORGE_[A-Z0-9_]*[A-Z0-9]\b", _text(path)))
    known = set(flags.SWITCHES) | set(flags._OTHER_NAMES)
    assert named - known == set(), (
        f"the docs name switches forge_ml.flags lacks: {sorted(named - known)}")
    # and the README's table shows every switch (its rows are tests/test_flags.py's business)
    table = set(re.findall(r"^\| `(FORGE_\w+)` \|", _text(README), flags=re.M))
    assert table == set(flags.SWITCHES)


def test_readme_prose_flags_exist():
    """Every `--flag` the README's prose names: an option of a forge-ml subcommand, or, in a
    span that names a script (benchmarks/NAME.py), an option of that script; a pip or hf
    command line is not ours."""
    options = {o for sp in _subparsers().values() for a in sp._actions for o in a.option_strings}
    checked, bad = 0, []
    for span in _spans(_prose(_text(README)), newlines=True):
        flags_here = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", span)
        if not flags_here or re.match(r"(pip|hf|huggingface-cli) ", span):
            continue
        script = re.search(r"((?:benchmarks|scripts)/\w+\.py)", span)
        src = _text(ROOT / script[1]) if script else None
        for f in flags_here:
            checked += 1
            ok = f'"{f}"' in src if src is not None else f in options
            if not ok:
                bad.append((span, f))
    assert checked >= 20
    assert not bad, f"README prose names flags that do not exist: {bad}"


def test_architecture_script_commands_name_real_flags():
    """docs/architecture.md's `python scripts/X.py --flag` / `benchmarks/X.py --flag` commands."""
    spans = _spans(_text(ARCH), newlines=True)
    seen = 0
    for span in spans:
        m = re.search(r"((?:benchmarks/|scripts/)?)(\w+\.(?:py|sh))(.*)", span)
        if not m:
            continue
        if m[1]:
            path = ROOT / (m[1] + m[2])
            assert path.is_file(), f"docs/architecture.md names {path}, which does not exist"
        else:      # a bare script name (`nvrtc_check.py --ptx DIR`): where it lives
            found = [ROOT / d / m[2] for d in ("scripts", "benchmarks")
                     if (ROOT / d / m[2]).is_file()]
            if not found:
                continue
            path = found[0]
        for f in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m[3]):
            seen += 1
            assert f'"{f}"' in _text(path), f"{path.name} has no option {f} (docs: `{span}`)"
    assert seen >= 4


def test_docs_paths_exist():
    """Every repository path the README and docs/architecture.md write in code spans (a folder
    and a file name, no placeholder) exists, from the root or from src/forge_ml/."""
    paths = set()
    for path in (README, ARCH):
        for span in _spans(_text(path)):
            paths |= set(re.findall(r"(?<![\w/<>.=~-])((?:benchmarks|scripts|tests|docs|results|"
                                    r"backends|models|inference|serve|distributed)/"
                                    r"(?:[\w.-]+/)*[\w-]+\.\w+)\b", span))
    paths = {p for p in paths if "<" not in p}
    assert len(paths) >= 15
    missing = sorted(p for p in paths if not (ROOT / p).exists() and not (PKG / p).exists())
    assert not missing, f"the docs name files that do not exist: {missing}"


# --- the commands ------------------------------------------------------------------------------


def test_every_subcommand_help_has_an_example():
    """"Every command has `--help` with an example", and the architecture's cli line lists the
    subcommands there are."""
    assert "Every command has `--help` with an example" in _text(README)
    subs = _subparsers()
    lacking = [n for n, sp in subs.items() if not re.search(r"^examples?:", sp.format_help(), re.M)]
    assert not lacking, f"--help without an example: {lacking}"
    line = _one(r"\ncli +forge-ml ([^\n]+)", _text(ARCH), "the cli layer")[1]
    assert {w.strip() for w in line.split("|")} == set(subs)


def test_docs_pytest_commands_print_their_summary():
    """pyproject's addopts already give -q; a docs command that adds another -q runs at -qq,
    where pytest prints no 'N passed' line (a new user sees dots and no verdict)."""
    addopts = _one(r'\naddopts = "([^"]*)"', _text(ROOT / "pyproject.toml"), "pytest's addopts")[1]
    base_q = shlex.split(addopts).count("-q")
    for path in (README, ARCH):
        for cmd in re.findall(r"`(pytest [^`]+)`", _text(path)) + re.findall(
                r"(?:&& |^ {4})(pytest [^\n]+)", _text(path), flags=re.M):
            assert base_q + shlex.split(cmd).count("-q") <= 1, (
                f"{path.name}: `{cmd}` runs pytest at -qq (addopts: {addopts!r}): no summary line")


# --- the architecture's map ---------------------------------------------------------------------


def test_architecture_layer_map_names_real_files():
    block = _one(r"## Layers: imports point down only\n\n```\n([\s\S]*?)```", _text(ARCH),
                 "the layer map")[1]
    checked = 0
    for line in block.splitlines():
        if line.startswith((" ", "cli ")) or not line.strip():
            continue
        left = re.split(r"\s{2,}", line.strip())[0]
        for name in re.split(r",\s*", left.rstrip(",")):
            name = name.strip()
            if not name:
                continue
            target = PKG / name if ("/" in name or name.endswith(".py")) else PKG / f"{name}.py"
            assert target.exists(), (
                f"docs/architecture.md's layer map names {name}: {target} is missing")
            checked += 1
    assert checked >= 25
    for folder, files in (("inference", ("load.py", "generate.py", "decode.py", "batch.py",
                                         "engine.py")),
                          ("backends/cpu", ("reference.py", "native.py"))):
        row = [ln for ln in block.splitlines() if ln.startswith(folder + "/")]
        assert row, folder
        for f in files:
            assert f in " ".join(block.split()), f
            assert (PKG / folder / f).is_file(), f"{folder}/{f}"


def _cuda_rows() -> dict:
    rows = {}
    for line in _text(ARCH).splitlines():
        m = re.match(r"\| `(\w+\.py)` \| (.*) \|(.*)\|$", line)
        if m:
            rows[m[1]] = re.findall(r"`(\w+\.cuh?)`", m[3])
    return rows


def test_architecture_cuda_table_matches_the_tree():
    """The CUDA backend's rooms and the .cu files beside them: each room exists, each .cu file
    is in a row, and (as the page says) each .cu file's first line names its launcher module,
    one of the rooms its rows give."""
    rows = _cuda_rows()
    assert len(rows) >= 12
    rooms_of = {}
    for room, cus in rows.items():
        assert (CUDA / room).is_file(), f"docs/architecture.md's CUDA table names {room}"
        for cu in cus:
            assert (CUDA / cu).is_file(), f"docs/architecture.md's CUDA table names {cu}"
            rooms_of.setdefault(cu, set()).add(room)
    on_disk = {p.name for p in CUDA.glob("*.cu")}
    assert on_disk <= set(rooms_of), (
        f".cu files in no row of the table: {sorted(on_disk - set(rooms_of))}")
    for cu in sorted(on_disk):
        first = (CUDA / cu).read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("// launched from backends/cuda/"), (cu, first)
        assert any(room in first for room in rooms_of[cu]), (
            f"{cu}'s first line names {first!r}; the table gives it to {sorted(rooms_of[cu])}")


# --- the README's Python examples, run -----------------------------------------------------------


def _block_with(marker: str) -> str:
    blocks = [b for b in _code_blocks(_text(README)) if marker in b]
    assert len(blocks) == 1, f"expected one README python block with {marker!r}"
    return blocks[0]


def test_readme_library_example_runs_and_prints_what_it_says():
    code = _block_with("tape = fm.Tape()")
    said = [m for m in re.findall(r"^print\(.*?#\s*(.+)$", code, flags=re.M)]
    assert said, "the example's print has no '# expected' comment"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    assert out.getvalue().strip().splitlines() == [s.strip() for s in said]


def test_readme_nanogpt_snippet_makes_a_prepared_folder(tmp_path, monkeypatch):
    """The 'Coming from nanoGPT' block, run on a small nanoGPT shakespeare_char folder (as its
    prepare.py writes it: raw uint16 ids and meta.pkl): the folder it writes is a prepared
    folder whose shards hold those ids and whose tokenizer gives the text back."""
    from forge_ml.data import read_shard, shard_folder
    from forge_ml.tokenizer import tokenizer_from_dict
    code = _block_with("meta.pkl")
    src = re.search(r'src, out = "([^"]+)", "([^"]+)"', code)
    assert src
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 20
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    n = int(len(text) * 0.9)
    d = tmp_path / src[1]
    d.mkdir(parents=True)
    np.array([stoi[c] for c in text[:n]], np.uint16).tofile(d / "train.bin")
    np.array([stoi[c] for c in text[n:]], np.uint16).tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_snippet"})
    folder = shard_folder(tmp_path / src[2])
    assert folder.prepared
    tok = tokenizer_from_dict(json.loads((tmp_path / src[2] / "tokenizer.json").read_text()))
    assert tok.decode(read_shard(folder.train[0]).tolist()) == text[:n]
    assert tok.decode(read_shard(folder.val[0]).tolist()) == text[n:]
