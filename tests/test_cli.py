"""The forge-ml command line, end to end in a temporary folder, through ``main([...])``."""
import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from forge_ml.cli import build_parser, main

SUBCOMMANDS = ["train", "sample", "eval", "prepare", "convert", "bench", "serve", "check"]
TEXT = ("to be or not to be that is the question\n" * 120)
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--eval-interval", "0", "--sample-interval", "0", "--no-progress"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text(TEXT)
    return tmp_path


@pytest.fixture
def trained(workdir, capsys):
    """A run folder trained for 3 steps from shards made by `forge-ml prepare`."""
    assert main(["prepare", "t.txt", "--out", "data"]) == 0
    assert main(["train", "--data", "data", "--out", "run", "--max-steps", "3", *TINY]) == 0
    capsys.readouterr()
    return workdir


def _fails(capsys, argv, *needles):
    """``main(argv)`` exits 2 with one line on stderr containing every needle, no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def holding(code: str):
    """A Python process running ``code``, which prints "locked" once it holds its lock (a run's,
    as a trainer in another process does); yields it once it has, and kills it after."""
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_every_subcommand_has_help_with_an_example(cmd, capsys):
    assert main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: forge-ml {cmd}")
    assert "example" in out and f"forge-ml {cmd}" in out.split("example", 1)[1]
    text = out.split("\nexample", 1)[0]          # usage, description and options: filled to 100
    assert max(map(len, text.splitlines())) <= 100, text


def test_every_train_flag_says_its_default():
    from forge_ml.train import TrainConfig
    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    for f in dataclasses.fields(TrainConfig):
        assert "default" in helps[f.name] and "default:" in helps[f.name], (f.name, helps[f.name])
    assert "(default: 3000000)" in helps["corpus_bytes"]


def test_top_level_help_and_no_argument(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in SUBCOMMANDS)
    assert main([]) == 0


def test_python_dash_m_forge_ml():
    src = str(Path(__file__).resolve().parents[1] / "src")
    r = subprocess.run([sys.executable, "-m", "forge_ml", "sample", "--help"], capture_output=True, text=True,
                       env={"PYTHONPATH": src, "PATH": ""}, timeout=60)
    assert r.returncode == 0 and "--max-new-tokens" in r.stdout


# a Ctrl-C while a module loads (the finder raises it as the import of ``stop`` begins), then
# the forge-ml command started as the console script (``from MODULE import FUNC``, what pip
# writes from pyproject's [project.scripts]) or as ``python -m forge_ml``
_CTRL_C_AT_IMPORT = """
import importlib, runpy, sys
stop, how = sys.argv[1], sys.argv[2]
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == stop:
            raise KeyboardInterrupt
sys.meta_path.insert(0, CtrlC())
sys.argv = ["forge-ml", "--help"]
if how == "-m":
    runpy.run_module("forge_ml", run_name="__main__", alter_sys=True)
else:
    module, func = how.split(":")
    sys.exit(getattr(importlib.import_module(module), func)())
"""


@pytest.mark.parametrize("stop", ["forge_ml.cli", "forge_ml.blas"])   # the module, or one it imports
@pytest.mark.parametrize("how", ["script", "-m"])
def test_ctrl_c_while_the_cli_loads_is_one_line_and_130(how, stop):
    """A Ctrl-C while the forge-ml command loads its CLI (before main() runs, whose own
    handler says "interrupted") printed a traceback: the console script imported
    forge_ml.cli at its top. Its entry point now imports it inside a handler."""
    root = Path(__file__).resolve().parents[1]
    if how == "script":
        import re
        how = re.search(r'^forge-ml = "([\w.]+:\w+)"', (root / "pyproject.toml").read_text(), re.M).group(1)
    r = subprocess.run([sys.executable, "-c", _CTRL_C_AT_IMPORT, stop, how], capture_output=True, text=True,
                       env={"PYTHONPATH": str(root / "src"), "PATH": ""}, timeout=60)
    assert (r.returncode, r.stderr, r.stdout) == (130, "forge-ml: interrupted\n", ""), (how, r.stderr)


def test_the_console_entry_runs_the_cli(monkeypatch, capsys):
    """Uninterrupted, the console script's function is main's: its argv, its exit status."""
    from forge_ml.__main__ import entry
    monkeypatch.setattr(sys, "argv", ["forge-ml", "bench", "--steps", "0"])
    assert entry() == main(["bench", "--steps", "0"]) == 2
    monkeypatch.setattr(sys, "argv", ["forge-ml", "--help"])
    assert entry() == 0 and "usage: forge-ml" in capsys.readouterr().out


def test_prepare_train_sample_eval_end_to_end(trained, capsys):
    run = trained / "run"
    assert (run / "ckpt" / "state.json").is_file() and (run / "log.jsonl").is_file()
    assert main(["sample", "--ckpt", "run", "--prompt", "to be", "--max-new-tokens", "30", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("to be") and len(out.rstrip("\n")) >= 5 + 25
    assert set(out) <= set(TEXT)
    # same seed, same text
    main(["sample", "--ckpt", "run/ckpt", "--prompt", "to be", "--max-new-tokens", "30", "--seed", "1"])
    assert capsys.readouterr().out == out
    assert main(["eval", "--ckpt", "run", "--data", "data/val.bin"]) == 0
    line = capsys.readouterr().out
    loss, ppl = float(line.split()[1]), float(line.split()[3])
    assert 0 < loss < 5 and ppl == pytest.approx(np.exp(loss), rel=1e-3)
    assert main(["eval", "--ckpt", "run", "--data", "t.txt", "--max-batches", "2"]) == 0
    assert "perplexity" in capsys.readouterr().out


def test_train_on_a_text_file_then_resume(workdir, capsys):
    assert main(["train", "--data", "t.txt", "--out", "r2", "--max-steps", "2", *TINY]) == 0
    assert (workdir / "r2" / "data" / "train.bin").is_file()
    assert main(["train", "--out", "r2", "--resume", "--max-steps", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "steps 2 -> 4" in out
    log = [json.loads(x) for x in (workdir / "r2" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4]


def test_train_with_the_default_corpus(workdir, capsys):
    assert main(["train", "--max-steps", "1", "--corpus-bytes", "20000", "--eval-iters", "1",
                 "--sample-interval", "0", "--no-progress"]) == 0
    assert (workdir / "runs" / "default" / "ckpt" / "state.json").is_file()
    assert "4 layers, 4 heads, 128 channels" in capsys.readouterr().out


def test_train_config_file_and_unknown_key(workdir, capsys):
    Path("c.json").write_text(json.dumps({"max_steps": 1, "n_layer": 1, "n_head": 1, "n_embd": 8,
                                          "block_size": 8, "eval_iters": 1, "sample_interval": 0,
                                          "progress": False}))
    assert main(["train", "--config", "c.json", "--data", "t.txt", "--out", "r3"]) == 0
    capsys.readouterr()
    Path("bad.json").write_text(json.dumps({"max_step": 1}))
    _fails(capsys, ["train", "--config", "bad.json", "--data", "t.txt"], "unknown key 'max_step'", "max_steps")


def test_train_config_that_is_a_folder_python_yaml_or_toml(workdir, capsys):
    """--config FOLDER said "config file not found"; a nanoGPT config/*.py, a YAML or a TOML
    file said only "not valid JSON". Each now says what it is and that --config reads JSON; a
    nanoGPT config's `key = value` lines are flags (the README maps them)."""
    Path("runs").mkdir()
    _fails(capsys, ["train", "--config", "runs"], "runs is a folder, not a config file", "JSON")
    _fails(capsys, ["train", "--config", "gone.json"], "config file not found: gone.json")
    Path("train_shakespeare_char.py").write_text('out_dir = "out-shakespeare-char"\nlearning_rate = 1e-3\n'
                                                 'max_iters = 5000\n')
    line = _fails(capsys, ["train", "--config", "train_shakespeare_char.py"], "train_shakespeare_char.py",
                  "reads JSON", "a Python file", "key = value", "--lr", "--max-steps", "README")
    assert "not valid JSON (" not in line, line
    for name, kind in (("c.yaml", "a YAML file"), ("c.yml", "a YAML file"), ("c.toml", "a TOML file")):
        Path(name).write_text("lr: 0.001\n" if "y" in name else "lr = 0.001\n")
        line = _fails(capsys, ["train", "--config", name], name, kind, "reads JSON")
        assert "nanoGPT" not in line, line
    Path("typo.json").write_text('{"max_steps": 1,}')
    _fails(capsys, ["train", "--config", "typo.json"], "typo.json: not valid JSON (", "line 1")
    # no suffix, but nanoGPT's `key = value` lines: said as such
    Path("cfg").write_text("# a comment\nbatch_size = 12\n")
    _fails(capsys, ["train", "--config", "cfg"], "cfg looks like a Python file", "key = value", "--lr")
    # a JSON file saved with a UTF-8 byte-order mark (Notepad's) is read as JSON
    Path("bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"max_step": 1}).encode())
    _fails(capsys, ["train", "--config", "bom.json", "--data", "t.txt"], "unknown key 'max_step'")


def test_convert_both_ways(trained, capsys):
    assert main(["convert", "--to-hf", "run", "--out", "hf"]) == 0
    assert (trained / "hf" / "config.json").is_file() and (trained / "hf" / "model.safetensors").is_file()
    assert main(["convert", "--from-hf", "hf", "--out", "ck"]) == 0
    assert main(["sample", "--ckpt", "hf", "--prompt", "be", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert main(["sample", "--ckpt", "ck", "--prompt", "be", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert main(["sample", "--ckpt", "run", "--prompt", "be", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    outs = capsys.readouterr().out.splitlines()[-3:]
    assert outs[0] == outs[1] == outs[2]


def test_convert_keeps_what_another_convert_wrote_into_its_out_meanwhile(trained, capsys, monkeypatch):
    """(QA) Two converts into one new --out both found it new; the slower replaced the other's
    finished export without --force. Without --force the folder must still be new or empty
    when the write's lock is taken; with --force it replaces it."""
    import forge_ml.inference.load as load
    from forge_ml.hf import save_hf_gpt2
    real = load.load_model

    def other_writes_first(*a, **kw):   # the other process finishes while this one reads
        model, tok, meta = real(*a, **kw)
        save_hf_gpt2("hf", model.config.to_dict(), model.state_dict(), tokenizer=tok.to_dict())
        return model, tok, meta
    monkeypatch.setattr(load, "load_model", other_writes_first)
    _fails(capsys, ["convert", "--to-hf", "run", "--out", "hf"],
           "now holds a Hugging Face export another process wrote", "add --force")
    theirs = {p.name: p.read_bytes() for p in Path("hf").iterdir()}   # kept whole
    assert "model.safetensors" in theirs and not Path("hf.tmp").exists()
    assert main(["convert", "--to-hf", "run", "--out", "hf", "--force"]) == 0   # --force replaces
    monkeypatch.setattr(load, "load_model", real)
    # the same for an import (a forge-ml checkpoint written meanwhile)
    from forge_ml import hf as hfmod
    real_load = hfmod.load_hf_gpt2

    def other_imports_first(src):
        config, params = real_load(src)
        from forge_ml.checkpoint import save_checkpoint
        save_checkpoint("ck", params, {"kind": "forge-ml-model", "config": config})
        return config, params
    monkeypatch.setattr(hfmod, "load_hf_gpt2", other_imports_first)
    _fails(capsys, ["convert", "--from-hf", "hf", "--out", "ck"],
           "now holds a checkpoint another process wrote", "add --force")
    assert "tokenizer" not in json.loads(Path("ck/state.json").read_text())["meta"]


def test_convert_warns_of_weights_that_are_not_finite(trained, capsys, monkeypatch):
    """(QA) convert copied NaN weights without a word; sample, eval and serve then refused the
    model. Converted as they are (a diverged run's weights may be wanted), with a warning that
    names the tensors, both ways."""
    import forge_ml.inference.load as load
    from forge_ml import hf as hfmod
    real = load.load_model

    def damaged(*a, **kw):
        model, tok, meta = real(*a, **kw)
        model.params["h.0.attn.c_attn.weight"].data[0, :3] = np.nan
        return model, tok, meta
    monkeypatch.setattr(load, "load_model", damaged)
    with pytest.warns(UserWarning, match="NaN or inf") as said:   # (forge-ml: warning: ... on stderr)
        assert main(["convert", "--to-hf", "run", "--out", "hf"]) == 0
    err = " ".join(str(w.message) for w in said)
    assert "run: 1 tensor of" in err and "h.0.attn.c_attn.weight: 3 NaN of" in err
    assert "converted as they are" in err and (Path("hf") / "model.safetensors").is_file()
    monkeypatch.setattr(load, "load_model", real)
    real_load = hfmod.load_hf_gpt2

    def damaged_hf(src):
        config, params = real_load(src)
        params["ln_f.bias"][1] = np.inf
        return config, params
    monkeypatch.setattr(hfmod, "load_hf_gpt2", damaged_hf)
    with pytest.warns(UserWarning, match="NaN or inf") as said:
        assert main(["convert", "--from-hf", "hf", "--out", "ck"]) == 0
    err = " ".join(str(w.message) for w in said)
    assert "--from-hf hf: 2 tensors of" in err and "ln_f.bias: 1 inf of" in err
    monkeypatch.setattr(hfmod, "load_hf_gpt2", real_load)
    import warnings
    with warnings.catch_warnings(record=True) as said:   # finite weights: no word
        warnings.simplefilter("always")
        assert main(["convert", "--to-hf", "run", "--out", "hf2"]) == 0
    assert not [w for w in said if "NaN or inf" in str(w.message)]


def test_convert_into_a_mount_point_says_so_before_any_work(trained, capsys, monkeypatch):
    """(QA) An empty mount point (a Docker volume) failed after the work with 'Device or
    resource busy': the folder swap cannot rename a mount point. Refused first, naming a way."""
    import os.path
    Path("vol").mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.basename(str(p)) == "vol" or real(p))
    for argv in (["convert", "--to-hf", "run", "--out", "vol"], ["convert", "--from-hf", "hf0", "--out", "vol"]):
        if argv[1] == "--from-hf":
            monkeypatch.setattr(os.path, "ismount", real)
            assert main(["convert", "--to-hf", "run", "--out", "hf0"]) == 0
            monkeypatch.setattr(os.path, "ismount", lambda p: os.path.basename(str(p)) == "vol" or real(p))
        _fails(capsys, argv, "vol: it is a mount point", "give a folder inside it", "vol/model")
    assert os.listdir("vol") == []


def test_sample_with_stdout_closed_or_its_reader_gone(trained):
    """(QA) `sample >&-` ended in a traceback (sys.stdout is None); `sample | head` exited 0
    where `train | head` exits 141. Closed: the text goes nowhere, as print's does, exit 0;
    the reader gone: 141, one status for every command."""
    import os
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    cmd = [sys.executable, "-m", "forge_ml", "sample", "--ckpt", "run", "--max-new-tokens", "20"]
    for extra in ([], ["--logprobs", "2"], ["--num-beams", "2"]):
        done = subprocess.run(cmd + extra, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                              text=True, timeout=120, preexec_fn=lambda: os.close(1))
        assert done.returncode == 0 and "Traceback" not in done.stderr, (extra, done.stderr)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    p.stdout.close()         # the reader goes away before the first token, as `| head -c 0`
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and "Traceback" not in err, err


def test_a_broken_pipe_other_than_stdouts_is_an_error_line(capsys, monkeypatch):
    """(QA) Every BrokenPipeError ended a command with status 141 and no word, as `| head`
    does; one from another pipe or socket (standard output's reader still there) is an error
    line with status 2. With standard output's reader gone it is still 141."""
    import errno
    import os
    from forge_ml import cli

    def broken(args):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")
    monkeypatch.setitem(cli._COMMANDS, "check", broken)
    r, w = os.pipe()
    out = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "__stdout__", out)
    try:
        assert not cli._stdout_reader_gone()            # the reader is there
        _fails(capsys, ["check"], "error: Broken pipe (EPIPE)")
        os.close(r)
        assert cli._stdout_reader_gone()
        monkeypatch.setattr(sys, "stdout", sys.stdout)  # the handler replaces it: put it back
        assert main(["check"]) == 141
        assert capsys.readouterr().err == ""
    finally:
        out.close()


def test_eval_refuses_a_model_whose_loss_is_not_a_number(trained, capsys):
    """(QA) A checkpoint with NaN weights printed 'loss nan  perplexity nan' and exited 0
    (sample refused it). eval says the loss is not one a model gives and names the weight."""
    from forge_ml.checkpoint import load_checkpoint, save_checkpoint
    tensors, meta = load_checkpoint("run/ckpt")
    tensors["h.0.ln_1.weight"][2] = np.nan
    save_checkpoint("bad", {k: v for k, v in tensors.items() if not k.startswith("opt.")},
                    {**meta, "kind": "forge-ml-model"})
    _fails(capsys, ["eval", "--ckpt", "bad", "--data", "t.txt"], "the loss over t.txt is nan",
           "its parameter h.0.ln_1.weight holds 1 NaN")


def test_sample_reads_its_prompt_from_standard_input_or_a_pipe(trained):
    """(QA) `echo ROMEO: | forge-ml sample --prompt-file -` said 'text file not found: -', and
    `--prompt-file <(echo ...)` 'a directory or special file'. '-' reads standard input, a
    pipe is read to its end; both give the prompt a file with the same text gives."""
    import os
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    Path("p.txt").write_text("to be or")
    base = [sys.executable, "-m", "forge_ml", "sample", "--ckpt", "run", "--max-new-tokens", "6",
            "--temperature", "0"]
    want = subprocess.run(base + ["--prompt-file", "p.txt"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert want.returncode == 0 and want.stdout.startswith("to be or"), want.stderr
    piped = subprocess.run(base + ["--prompt-file", "-"], input="to be or", capture_output=True,
                           text=True, env=env, timeout=120)
    assert (piped.returncode, piped.stdout) == (0, want.stdout), piped.stderr
    os.mkfifo("fifo")
    writer = subprocess.Popen(["sh", "-c", "printf 'to be or' > fifo"])
    fifo = subprocess.run(base + ["--prompt-file", "fifo"], capture_output=True, text=True, env=env,
                          timeout=120)
    writer.wait(timeout=30)
    assert (fifo.returncode, fifo.stdout) == (0, want.stdout), fifo.stderr
    bad = subprocess.run(base + ["--prompt-file", "-"], input=b"\xff\xfe to", capture_output=True,
                         env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.decode().strip() == (
        "forge-ml sample: error: --prompt-file standard input: not UTF-8 text (byte 0: b'\\xff')")
    # the same bytes in --prompt's argument: the model was given U+FFFD for them, in silence
    bad = subprocess.run([os.fsencode(a) for a in base] + [b"--prompt", b"to\xff be"],
                         capture_output=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stdout == b"" and bad.stderr.decode().strip() == (
        "forge-ml sample: error: --prompt: not UTF-8 text (byte 2: b'\\xff'); give the prompt "
        "in UTF-8, or its file with --prompt-file")


def test_sample_from_a_gpt2_vocab_hf_folder(workdir, capsys):
    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2
    cfg = {"vocab_size": 50257, "block_size": 16, "n_layer": 1, "n_head": 1, "n_embd": 8}
    rng = np.random.default_rng(0)
    save_hf_gpt2("gpt2ish", cfg, {k: (0.02 * rng.standard_normal(s)).astype(np.float32)
                                   for k, s in gpt2_param_shapes(cfg).items()})
    assert main(["sample", "--ckpt", "gpt2ish", "--prompt", "Hello", "--max-new-tokens", "5", "--top-k", "5"]) == 0
    assert capsys.readouterr().out.startswith("Hello")


def test_sample_refuses_a_hf_folder_whose_vocabulary_is_not_its_tokenizers(workdir, capsys):
    # a third-party GPT-2 with its own 97-token vocabulary is read with GPT-2's tokenizer: an
    # empty prompt used to fail on 'token id 50256 in the prompt', a short one to print GPT-2
    # text for the model's unrelated ids
    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2
    cfg = {"vocab_size": 97, "block_size": 16, "n_layer": 1, "n_head": 1, "n_embd": 8}
    save_hf_gpt2("small", cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    for argv in ([], ["--prompt", "!"], ["--prompt", "!", "--num-beams", "2"]):
        _fails(capsys, ["sample", "--ckpt", "small", "--max-new-tokens", "3", *argv],
               "the model has 97 tokens but its tokenizer (gpt2) has 50257")
    _fails(capsys, ["convert", "--from-hf", "small", "--out", "small_fm"],   # says why, as sample
           "the model has 97 tokens but its tokenizer (gpt2) has 50257",
           "without a tokenizer of its own is read with GPT-2's")
    # eval of a text file tokenized with that tokenizer: it printed a loss over the wrong ids
    # whenever every id of the text happened to be below 97 (a fine-tuning user's report)
    Path("letters.txt").write_text("!\"#$%&'()*+,-./" * 20)
    _fails(capsys, ["eval", "--ckpt", "small", "--data", "letters.txt"],
           "the model has 97 tokens but its tokenizer (gpt2) has 50257")
    # shards of another tokenizer: the way out is not the text file just refused (a re-test)
    from forge_ml.data import prepare
    prepare("letters.txt", "chars", tokenizer="char")
    _fails(capsys, ["eval", "--ckpt", "small", "--data", "chars"],
           "does not fit its 97-token model either: give shards made for this model")


def test_bench_builtin_and_list(capsys):
    assert main(["bench", "--steps", "1"]) == 0
    assert "ms over 1 step (" in capsys.readouterr().out          # not "1 steps"
    assert main(["bench", "--list"]) == 0


def test_bench_name_takes_the_arguments_after_it(workdir, capsys):
    """They go to benchmarks/NAME.py (they were an argparse error, and --steps was ignored);
    the built-in timing's --steps before NAME is an error, not ignored."""
    (workdir / "benchmarks").mkdir()
    (workdir / "benchmarks" / "echo_args.py").write_text(
        "import sys\nprint('args', sys.argv[1:])\nsys.exit(3 if '--fail' in sys.argv else 0)\n")
    assert main(["bench", "echo_args", "--steps", "5", "--rounds", "1"]) == 0
    assert "args ['--steps', '5', '--rounds', '1']" in capsys.readouterr().out
    assert main(["bench", "echo_args", "--fail"]) == 3
    capsys.readouterr()
    _fails(capsys, ["bench", "--steps", "5", "echo_args"], "--steps before echo_args",
           "after it")


def test_bench_shows_a_scripts_exit_message_and_hides_shared_modules(workdir, capsys):
    """(QA) A benchmark's sys.exit("message") gave status 1 and printed nothing (python SCRIPT
    prints it); a module the benchmarks import (torch_gpt2.py) was listed and ran nothing with
    status 0."""
    (workdir / "benchmarks").mkdir()
    (workdir / "benchmarks" / "says_why.py").write_text(
        "import sys\nif __name__ == '__main__':\n    sys.exit('--data: /x is not a file')\n")
    (workdir / "benchmarks" / "shared_peer.py").write_text(
        '"""A peer model."""\nimport math\nK = 2\n\n\ndef peer():\n    return math.pi\n')
    assert main(["bench", "says_why"]) == 1
    assert "--data: /x is not a file" in capsys.readouterr().err
    assert main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "says_why" in listed and "shared_peer" not in listed
    _fails(capsys, ["bench", "shared_peer"], "shared_peer.py is a module the benchmarks import",
           "not a benchmark")


def test_an_unknown_flag_is_said_by_its_subcommand_with_the_nearest_flag(capsys):
    """From a QA run: forge-ml train --reusme said "forge-ml: error: unrecognized arguments:
    --reusme", naming neither the subcommand nor the flag meant."""
    for argv, said in (
            (["train", "--reusme"], "forge-ml train: error: unrecognized argument --reusme (did you mean --resume?)"),
            (["train", "--max-iters", "5"], "forge-ml train: error: unrecognized arguments --max-iters 5 "
                                            "(did you mean --max-steps?)"),
            (["sample", "--ckpt", "x", "--max_new_tokens=3"], "(did you mean --max-new-tokens?)"),
            (["train", "stray"], "forge-ml train: error: unrecognized argument stray (see forge-ml train --help)"),
            (["--bogus"], "forge-ml: error: unrecognized argument --bogus (see forge-ml --help)"),
            (["--bogus", "train"], "forge-ml: error: unrecognized argument --bogus (see forge-ml --help)")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], (argv, err)


def test_bench_scripts_import_their_sibling_modules(workdir, capsys):
    """attention_cuda.py imports its sibling ops_cuda.py: under forge-ml bench (runpy) that
    was 'needs the Python module ops_cuda, which is not installed', even for --help. A missing
    CuPy names the extra that brings it."""
    import sys
    (workdir / "benchmarks").mkdir()
    (workdir / "benchmarks" / "helper_mod.py").write_text("VALUE = 41\n")
    (workdir / "benchmarks" / "uses_helper.py").write_text("import helper_mod\nprint('got', helper_mod.VALUE + 1)\n")
    (workdir / "benchmarks" / "needs_cupy.py").write_text("import cupy_is_not_here_module as cupy\nprint(cupy)\n")
    before = list(sys.path)
    assert main(["bench", "uses_helper"]) == 0
    assert "got 42" in capsys.readouterr().out and sys.path == before
    line = _fails(capsys, ["bench", "needs_cupy"], "cupy_is_not_here_module", "not installed")
    assert "[test]" in line
    sys.modules.pop("helper_mod", None)


def test_bench_of_a_script_leaves_the_thread_variables_to_it(workdir, capsys, monkeypatch):
    """(QA) `forge-ml bench train_cpu` ran torch with one thread where `python
    benchmarks/train_cpu.py` gave it two: the CLI had set OMP_NUM_THREADS (and the other BLAS
    variables) for itself before the script imported torch. A script runs as `python SCRIPT`."""
    import os
    from forge_ml import blas
    for v in blas.THREAD_VARS:
        monkeypatch.delenv(v, raising=False)
    Path("benchmarks").mkdir()
    Path("benchmarks/env_probe.py").write_text(
        "import os\nprint('seen', [v for v in %r if v in os.environ])\n" % (blas.THREAD_VARS,))
    before = blas.get_threads()
    try:
        assert main(["bench", "env_probe"]) == 0
        assert "seen []" in capsys.readouterr().out
    finally:
        blas.set_threads(before or 1)
    assert not any(v in os.environ for v in blas.THREAD_VARS)


def test_bench_chooses_the_cpu_threads_as_train_does(monkeypatch, capsys):
    """Where forge-ml sets the count, the built-in bench runs the trainer's ThreadTuner on its
    untimed first steps and times the count it chose (it had timed half the cores)."""
    from forge_ml import blas
    import re
    before = blas.get_threads()
    monkeypatch.setattr(blas, "tunable", lambda: True)
    monkeypatch.setattr(blas, "candidates", lambda n_cores=None: [1, 2])
    try:
        assert main(["bench", "--steps", "2"]) == 0
        out = capsys.readouterr().out
        chosen = re.search(r"BLAS threads: (\d) \(median step \d+ ms; (\d) threads?: \d+ ms\)", out)
        assert chosen and {chosen[1], chosen[2]} == {"1", "2"}, out
        threads = "1 thread" if chosen[1] == "1" else f"{chosen[1]} threads"       # not "thread(s)"
        assert f"cpu, {threads}: median" in out and blas.get_threads() == int(chosen[1])
    finally:
        blas.set_threads(before or 1)


# -- bad input: one line on stderr, exit status 2 ------------------------------------------------


def test_bad_input_exits_2_with_one_line(trained, capsys):
    _fails(capsys, ["prepare", "missing.txt", "--out", "x"], "not found", "missing.txt")
    _fails(capsys, ["train", "--data", "missing.txt", "--out", "r9"], "missing.txt")
    _fails(capsys, ["sample", "--ckpt", "nowhere"], "nowhere")
    _fails(capsys, ["eval", "--ckpt", "run", "--data", "nope.bin"], "nope.bin")
    _fails(capsys, ["sample", "--ckpt", "run", "--prompt", "to be " * 10, "--num-beams", "2"], "longer than",
           "context of 16")
    _fails(capsys, ["sample", "--ckpt", "run", "--prompt", "XYZ"], "'X'", "not in the vocabulary")
    _fails(capsys, ["train", "--out", "run", "--resume", "--n-layer", "2"], "another architecture")
    _fails(capsys, ["train", "--out", "nothing-here", "--resume"], "no checkpoint")
    _fails(capsys, ["train", "--dtype", "fp8"], "dtype")
    _fails(capsys, ["train", "--device", "tpu"], "unknown device")
    _fails(capsys, ["bench", "no_such_bench"], "unknown benchmark")
    _fails(capsys, ["train", "--max-stepz", "3"], "unrecognized arguments")
    _fails(capsys, ["convert", "--to-hf", "run"], "--out")
    Path("bad.bin").write_bytes(b"\x00" * 10)
    _fails(capsys, ["eval", "--ckpt", "run", "--data", "bad.bin"], "bad.bin")


def test_check_compares_devices_with_float64(capsys):
    from forge_ml.cli import main
    assert main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu") and " ok " in out and ("; C kernels" in out or "; NumPy kernels (" in out)
    assert main(["check", "--device", "tpu"]) == 2


def test_check_without_devices_does_not_say_one_was_asked_for(capsys):
    """`forge-ml check` alone tries cpu and cuda; where cuda cannot load it says why, not that
    cuda "was asked for" (a docs check: nobody asked)."""
    from forge_ml.backends import get
    from forge_ml.cli import main
    from forge_ml.device import Device
    from forge_ml.errors import DeviceError
    try:
        get(Device("cuda", 0))
        pytest.skip("the CUDA backend loads here")
    except DeviceError:
        pass
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("cuda"))
    assert "not available" in line and "asked for" not in line, line


def test_check_says_when_the_cpu_ran_numpy_not_the_c_kernels(monkeypatch, capsys):
    """A failed build of the C kernels printed 'cpu ok' as if they had been checked."""
    from forge_ml.backends.cpu import native
    monkeypatch.setattr(native, "lib", lambda: None)
    monkeypatch.setitem(native._state, "why", "no C compiler found (set CC, or install cc/gcc)")
    assert main(["check", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("; NumPy kernels (the C kernels are unavailable: no C compiler found "
                                 "(set CC, or install cc/gcc))"), out


def _wrong_cpu_kernel(monkeypatch, name, wrong):
    """The CPU backend's ``name`` with ``wrong`` applied to its float32 results (the float64
    reference keeps the right ones)."""
    from forge_ml.backends import load
    bk = load("cpu")
    right = getattr(bk, name)

    def kernel(*args, **kw):
        out = right(*args, **kw)
        return wrong(out) if args[0].dtype == np.float32 else out

    monkeypatch.setattr(bk, name, kernel)


def _nan_dgamma(out):
    dx, dgamma, dbeta = out
    dgamma = dgamma.copy()
    dgamma[3] = np.nan
    return dx, dgamma, dbeta


@pytest.mark.parametrize("name, wrong, needle", [
    ("attention_qkv_bwd_sums", lambda out: (out[0] * np.float32(1.01), out[1]),  # 1% off
     "e-02 (h."),
    ("layernorm_bwd_add", _nan_dgamma, "error inf (h."),           # a NaN in one gradient
])
def test_check_fails_on_a_wrong_kernel(monkeypatch, capsys, name, wrong, needle):
    _wrong_cpu_kernel(monkeypatch, name, wrong)
    assert main(["check", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("cpu      FAIL") and needle in out, out


def test_sample_generation_options(trained, capsys):
    """sample's HF-style options: min-p, repetition penalty, log-probabilities, beam search."""
    base = ["sample", "--ckpt", "run", "--prompt", "to be", "--max-new-tokens", "6", "--seed", "3"]
    assert main(base + ["--min-p", "0.05", "--repetition-penalty", "1.3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("to be") and len(out.strip()) > len("to be")
    assert main(base + ["--temperature", "0", "--logprobs", "2"]) == 0
    out = capsys.readouterr().out
    table = out.split("--- log-probabilities")[1].strip().splitlines()[1:]
    assert len(table) == 6 and all(len(r.split("|")) == 2 for r in table)
    lps = [float(r.split()[1]) for r in table]
    assert all(lp <= 0 for lp in lps)
    assert main(base + ["--temperature", "0", "--logprobs", "0"]) == 0   # no alternatives: none said
    head, rows = capsys.readouterr().out.split("--- log-probabilities")[1].split("\n", 1)
    assert "most likely" not in head and all(r == r.rstrip() for r in rows.splitlines()), (head, rows)
    assert main(base + ["--num-beams", "3", "--num-return-sequences", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sequence") == 2 and out.count("to be") == 2
    # the same beams as the library call
    from forge_ml.inference import beam_search, load_model
    model, tok, _ = load_model("run")
    seqs, _ = beam_search(model, tok.encode("to be"), 6, 3, num_return_sequences=2)
    assert ("to be" + tok.decode(seqs[0])) in out
    # no new tokens: the prompt, as without beams (it failed naming beam_search's max_new_tokens);
    # too many beams for the vocabulary: named as the option, with the most it takes
    assert main(base[:5] + ["--max-new-tokens", "0", "--num-beams", "2"]) == 0
    assert capsys.readouterr().out == "to be\n"
    V = model.config.vocab_size
    _fails(capsys, base + ["--num-beams", "1000"], "--num-beams 1000", f"{V} tokens",
           f"give at most {V // 2}")


def test_sample_logprobs_and_beams_say_when_the_context_cuts_them_short(trained, capsys):
    """--logprobs and --num-beams have no sliding window: past the context (16 here) they stop,
    and say so on stderr; a prompt that fills the context leaves beam search no room."""
    base = ["sample", "--ckpt", "run", "--prompt", "to be", "--max-new-tokens", "30", "--temperature", "0"]
    assert main(base + ["--logprobs", "1"]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.split("--- log-probabilities")[1].strip().splitlines()[1:]) == 16 - 5
    assert "no sliding window" in cap.err and "holds 11 new tokens" in cap.err and "30 asked" in cap.err
    assert main(base + ["--num-beams", "2"]) == 0
    assert "holds 11 new tokens" in capsys.readouterr().err
    assert main(base[:5] + ["--max-new-tokens", "11", "--logprobs", "1"]) == 0
    assert capsys.readouterr().err == ""                         # it fits: no note
    full = ["sample", "--ckpt", "run", "--prompt", "to be or not to ", "--max-new-tokens", "5"]
    _fails(capsys, full + ["--num-beams", "2"], "fill the model's context of 16 tokens")


def test_counts_of_one_are_singular_in_sample_and_eval(trained, capsys):
    """"holds 1 tokens", "holds 1 new tokens": a count of one takes the singular noun."""
    base = ["sample", "--ckpt", "run", "--prompt", "to be or not to", "--max-new-tokens", "5", "--temperature", "0"]
    assert main(base + ["--logprobs", "1"]) == 0
    err = capsys.readouterr().err
    assert "holds 1 new token after the prompt's 15," in err, err
    Path("one.txt").write_text("t")
    _fails(capsys, ["eval", "--ckpt", "run", "--data", "one.txt"], "one.txt holds 1 token; evaluation needs at least 2")


def test_sample_takes_a_prompt_longer_than_the_context_from_its_end(trained, capsys):
    """nanoGPT's sample.py crops its context to the model's last block_size tokens, and
    stream_tokens starts a long prompt from its end; sample refused such a prompt (a long
    --prompt-file). --logprobs and --num-beams, which have no sliding window, still refuse it."""
    from forge_ml.inference import load_model, stream_tokens
    long = "question that is " * 3                     # 51 characters, the context is 16
    argv = ["sample", "--ckpt", "run", "--prompt", long, "--max-new-tokens", "6", "--temperature", "0"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "longer than the model's context of 16" in cap.err and "its last 16 tokens" in cap.err
    model, tok, _ = load_model("run")
    want = tok.decode(list(stream_tokens(model, tok.encode(long), 6, temperature=0)))
    assert cap.out == long + want + "\n"
    assert want == tok.decode(list(stream_tokens(model, tok.encode(long[-16:]), 6, temperature=0)))
    for extra, what in ((["--logprobs", "1"], "--logprobs"), (["--num-beams", "2"], "--num-beams")):
        _fails(capsys, argv + extra, f"the prompt is {len(long)} tokens", f"{what} has no sliding window")


def test_sample_logprobs_past_the_vocabulary_fail_before_any_output(trained, capsys):
    vocab = len(sorted(set(TEXT)))
    assert main(["sample", "--ckpt", "run", "--prompt", "to be", "--logprobs", str(vocab + 1)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and f"--logprobs must be in 0..{vocab}" in cap.err


@pytest.mark.parametrize("argv,needle", [
    (["--min-p", "1.5"], "--min-p must be in [0, 1]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--num-beams", "0"], "--num-beams must be >= 1"),
    (["--num-beams", "2", "--num-return-sequences", "3"], "--num-return-sequences must be in 1..--num-beams"),
    (["--num-return-sequences", "2"], "add --num-beams K (K >= 2)"),   # named a flag not given
    (["--num-beams", "2", "--logprobs", "1"], "use one or the other"),
    (["--num-beams", "2", "--repetition-penalty", "1.3"], "beam search (--num-beams) does not take it"),
    (["--length-penalty", "2"], "--length-penalty applies to beam search; add --num-beams"),   # was ignored
    (["--early-stopping", "true"], "--early-stopping applies to beam search"),
    # a seed is 64 bits: 2**64 drew seed 0's sample
    (["--seed", str(1 << 64)], f"--seed must be in [0, 2**64), got {1 << 64}"),
    (["--seed", "-1"], "--seed must be in [0, 2**64), got -1"),
    (["--seed", str((1 << 64) - 2), "--num-samples", "3"],
     f"would draw with seeds up to {(1 << 64)}; seeds must be in [0, 2**64): give --seed <= "
     f"{(1 << 64) - 3}"),
])
def test_sample_generation_options_are_checked(trained, capsys, argv, needle):
    _fails(capsys, ["sample", "--ckpt", "run", "--prompt", "to be", *argv], needle)


def test_a_run_folder_without_a_checkpoint_says_so(trained, capsys):
    """A run that has prepared its data but saved no checkpoint yet (stopped early, or a failed
    start) got the generic "neither a forge-ml checkpoint ... nor a Hugging Face folder"."""
    Path("early").mkdir()
    Path("early/log.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    for cmd in (["sample", "--ckpt", "early", "--prompt", "to"], ["eval", "--ckpt", "early", "--data", "t.txt"]):
        _fails(capsys, cmd, "early is a run folder without a checkpoint yet", "--checkpoint-interval")


def test_a_checkpoint_without_its_state_json_says_so(trained, capsys):
    """ckpt/model.safetensors there, state.json gone: sample, eval, convert and serve called it
    'a run folder without a checkpoint yet' (train --resume named the missing file)."""
    shutil.copytree("run", "lost")
    Path("lost/ckpt/state.json").unlink()
    for cmd in (["sample", "--ckpt", "lost", "--prompt", "to"], ["eval", "--ckpt", "lost", "--data", "t.txt"],
                ["sample", "--ckpt", "lost/ckpt", "--prompt", "to"]):
        _fails(capsys, cmd, "lost/ckpt/state.json is missing")


def test_gpus_without_the_gpus_is_one_error_before_any_rank_starts(workdir, capsys, monkeypatch):
    """``--gpus 2`` on a machine that cannot run two NCCL ranks says so once, before spawning."""
    from forge_ml.distributed import launch
    started = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: started.append(a) or 0)
    for var in ("WORLD_SIZE", "RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    line = _fails(capsys, ["train", "--gpus", "100000", "--max-steps", "1", *TINY], "--gpus 100000"
                  if _has_cupy() else "NCCL")
    assert not started, line
    assert not (workdir / "runs").exists()


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def test_prepare_refuses_to_replace_shards_without_force(workdir, capsys):
    """`prepare` into a folder holding shards (here a run's own data/) had silently replaced
    them, so the run resumed on other tokens; now one line, and --force replaces them."""
    assert main(["train", "--data", "t.txt", "--out", "run", "--max-steps", "1", *TINY]) == 0
    before = (workdir / "run" / "data" / "train.bin").read_bytes()
    (workdir / "other.txt").write_text("abc " * 400)
    capsys.readouterr()
    _fails(capsys, ["prepare", "other.txt", "--out", "run/data"], "run/data already holds train.bin",
           "the run in run", "--force")
    assert (workdir / "run" / "data" / "train.bin").read_bytes() == before
    assert main(["prepare", "other.txt", "--out", "run/data", "--force"]) == 0
    assert (workdir / "run" / "data" / "train.bin").read_bytes() != before
    # --out naming a file (the text itself, say): one line, as train and convert say it (it was
    # the system's "File exists (EEXIST)"), and the file is kept
    _fails(capsys, ["prepare", "other.txt", "--out", "other.txt"], "--out other.txt exists and is not a "
           "folder", "train.bin")
    assert (workdir / "other.txt").read_text() == "abc " * 400


def test_prepare_force_refuses_a_running_trainers_data_after_its_lock_file_is_deleted(workdir, capsys):
    """`prepare --force` into a run's data/ is refused while that run's trainer runs, but the
    guard read the lock FILE: a user who deleted train.lock (it stays after a run and looks
    stale) let --force replace the shards under the running trainer. The guard now probes the
    folder's own flock too, which the trainer (RunLock, in another process here) holds."""
    import os
    assert main(["train", "--data", "t.txt", "--out", "run", "--max-steps", "1", *TINY]) == 0
    (workdir / "other.txt").write_text("abc " * 400)
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = ("import sys, time\n"
            f"sys.path.insert(0, {src!r})\n"
            "from forge_ml.runs import RunLock\n"
            "lock = RunLock('run'); lock.acquire()      # what a Trainer does for its run folder\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n")
    with holding(code) as holder:
        data = sorted((p.name, p.read_bytes()) for p in (workdir / "run" / "data").iterdir())
        capsys.readouterr()
        _fails(capsys, ["prepare", "other.txt", "--out", "run/data", "--force"], "run/data is the data of the "
               "run in run, whose trainer is running", f"pid {holder.pid} ", "even --force")
        os.unlink("run/train.lock")
        for argv in (["--force"], []):
            _fails(capsys, ["prepare", "other.txt", "--out", "run/data", *argv], "whose trainer is running "
                   "(holder unknown)", "even --force")
        assert sorted((p.name, p.read_bytes()) for p in (workdir / "run" / "data").iterdir()) == data
        assert not (workdir / "run" / "train.lock").exists()      # the probe made no lock file
    assert main(["prepare", "other.txt", "--out", "run/data", "--force"]) == 0   # the trainer is gone
    assert not (workdir / "run" / "train.lock").exists()


def test_train_step_past_max_steps_is_refused_and_says_how_to_train_on(workdir, capsys):
    """``Trainer.train_step()`` called past max_steps trained on in silence (past the end of
    the learning-rate schedule), logged those steps and saved a checkpoint that a resume with
    the run's own --max-steps then refused ("at step N already"). Now a TrainingError that
    changes nothing and says how to train on; a resume with a larger --max-steps does."""
    from forge_ml.errors import TrainingError
    from forge_ml.train import TrainConfig, Trainer
    assert main(["train", "--data", "t.txt", "--out", "run", "--max-steps", "2", *TINY]) == 0
    capsys.readouterr()
    t = Trainer(TrainConfig.from_dict(_run_config("run")),
                log=None, resume=True)
    try:
        log = (workdir / "run" / "log.jsonl").read_bytes()
        w = t.model.params["wpe.weight"].numpy().copy()
        for _ in range(2):   # the refusal changes nothing: a second call says the same
            with pytest.raises(TrainingError, match=r"the run in run is at step 2, its max_steps \(2\).*"
                                                    r"max_steps=N.*forge-ml train --out run --resume --max-steps N"):
                t.train_step()
        assert t.step == 2 and t.opt.steps == 2
        np.testing.assert_array_equal(t.model.params["wpe.weight"].numpy(), w)
    finally:
        t.close()
    assert (workdir / "run" / "log.jsonl").read_bytes() == log
    assert main(["train", "--out", "run", "--resume", "--max-steps", "3", "--no-progress"]) == 0


def _run_config(run) -> dict:
    """The TrainConfig a run's checkpoint was trained with (its ``train_config``)."""
    from forge_ml.checkpoint import read_meta
    return read_meta(Path(run) / "ckpt")["train_config"]


def test_val_fraction_with_a_data_folder_is_refused(trained, capsys):
    """--val-fraction was silently ignored for a folder (its shards are split already)."""
    _fails(capsys, ["train", "--data", "data", "--out", "r2", "--val-fraction", "0.3", *TINY],
           "--val-fraction splits a text file", "data")
    assert not (trained / "r2").exists()
    # --corpus-bytes sizes the default corpus only: with --data it was dropped in silence
    for data in ("data", "data/../t.txt"):
        _fails(capsys, ["train", "--data", data, "--out", "r2", "--corpus-bytes", "5000", *TINY],
               "--corpus-bytes sizes the default corpus, which a run with --data does not read")
    assert not (trained / "r2").exists()


def test_sample_prompt_file_and_num_samples(trained, capsys):
    """nanoGPT's sample.py reads a prompt from a file (start='FILE:...') and draws num_samples;
    --prompt "$(cat f)" lost the file's last newline, and there was no way to draw several."""
    Path("p.txt").write_text("to be\n")
    assert main(["sample", "--ckpt", "run", "--prompt-file", "p.txt", "--num-samples", "3",
                 "--max-new-tokens", "8", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    parts = out.split("--- sample ")[1:]
    assert len(parts) == 3 and all(p.split("---\n", 1)[1].startswith("to be\n") for p in parts)
    assert main(["sample", "--ckpt", "run", "--prompt", "to be\n", "--max-new-tokens", "8", "--seed", "6"]) == 0
    assert capsys.readouterr().out == parts[1].split("---\n", 1)[1]          # sample 2 is seed 5 + 1
    _fails(capsys, ["sample", "--ckpt", "run", "--prompt", "a", "--prompt-file", "p.txt"], "not both")
    _fails(capsys, ["sample", "--ckpt", "run", "--num-samples", "0"], "--num-samples must be >= 1")


def test_a_leading_utf8_bom_is_not_text_for_train_sample_or_eval(trained, capsys):
    """A UTF-8 byte-order mark at a file's start was read as a character: train's text path
    put U+FEFF in the vocabulary, --prompt-file's BOM was a character the model never saw, and
    eval of a text file counted one more token. Each now reads the file as without it."""
    bom = b"\xef\xbb\xbf"
    Path("b.txt").write_bytes(bom + TEXT.encode("utf-8"))
    for data, out in (("t.txt", "plain"), ("b.txt", "withbom")):
        assert main(["train", "--data", data, "--out", out, "--max-steps", "2", *TINY]) == 0
    logs = [[json.loads(x).get("loss") for x in Path(o, "log.jsonl").read_text().splitlines()]
            for o in ("plain", "withbom")]
    assert logs[0] == logs[1]
    Path("p.txt").write_text("to be\n")
    Path("pb.txt").write_bytes(bom + b"to be\n")
    outs = []
    for prompt in ("p.txt", "pb.txt"):
        capsys.readouterr()
        assert main(["sample", "--ckpt", "run", "--prompt-file", prompt, "--max-new-tokens", "8", "--seed", "3"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[1].startswith("to be\n")
    evals = []
    for data in ("t.txt", "b.txt"):
        assert main(["eval", "--ckpt", "run", "--data", data, "--max-batches", "2"]) == 0
        evals.append(capsys.readouterr().out)
    assert evals[0] == evals[1]


def test_nanogpt_token_files_are_not_read_as_text(workdir, capsys):
    """nanoGPT's prepare.py writes train.bin as raw uint16 ids (no llm.c header): given as
    --data, its bytes were trained on as characters without a word (eval refused it)."""
    import numpy as np
    ids = np.array([ord(c) % 65 for c in TEXT], np.uint16)
    ids.tofile("train.bin")
    ids.tofile("ids.dat")
    for name in ("train.bin", "ids.dat"):
        _fails(capsys, ["train", "--data", name, "--out", "r", *TINY, "--max-steps", "1"],
               f"{name} holds binary data, not text", "token ids?", "write_shard")
        _fails(capsys, ["prepare", name, "--out", "d"], "holds binary data, not text")
    assert not Path("r").exists() and not Path("d").exists()


def test_a_commands_error_does_not_repeat_the_commands_name(tmp_path, capsys):
    """forge-ml prepare on an empty file said "forge-ml prepare: error: prepare: ... is empty";
    a one-token text said "gives 1 tokens"."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one.txt").write_text("a")
    assert main(["prepare", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forge-ml prepare: error: ") and "error: prepare:" not in err, err
    assert main(["prepare", str(tmp_path / "one.txt"), "--out", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert "gives 1 token;" in err, err


def test_an_interrupt_before_the_command_runs_is_one_line(monkeypatch, capsys):
    """A QA report: Ctrl-C 50 ms after `forge-ml train` started (inside building the parser,
    an import) printed a KeyboardInterrupt traceback; it is the one line a later one gives."""
    import forge_ml.cli as cli

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "forge-ml: interrupted\n"


def test_sample_from_weights_with_nan_says_which_not_id_0(workdir, capsys):
    # a checkpoint whose weights hold NaN printed the prompt followed by id 0's text, once per
    # new token, greedy or sampled (a library user's report): now one line naming the weight
    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2
    cfg = {"vocab_size": 50257, "block_size": 16, "n_layer": 1, "n_head": 1, "n_embd": 8}
    rng = np.random.default_rng(0)
    w = {k: (0.02 * rng.standard_normal(s)).astype(np.float32)
         for k, s in gpt2_param_shapes(cfg).items()}
    w["h.0.mlp.c_proj.weight"][1, 2] = np.nan
    save_hf_gpt2("nan", cfg, w)
    for argv in ([], ["--temperature", "0"], ["--num-beams", "2"], ["--logprobs", "2"],
                 ["--num-samples", "2"]):
        assert main(["sample", "--ckpt", "nan", "--prompt", "Hi", "--max-new-tokens", "3", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == ""                    # the error comes before the prompt is printed
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "the model's logits for the prompt hold NaN or inf" in err
        assert "h.0.mlp.c_proj.weight holds 1 NaN of 256 values" in err


def test_a_warning_is_one_line_of_the_command(monkeypatch):
    """A warning during a command (an unwritable kernel cache, say) was Python's: the source
    file, a line number and the line of code, read as a traceback (a QA report). The command
    formats it on one line; recording warnings (catch_warnings, pytest.warns) is as before."""
    import warnings
    import forge_ml.cli as cli_mod
    import forge_ml.backends.cpu.native as native
    said = []

    def warns(argv):
        said.append(warnings.formatwarning("forge-ml: the kernel cache /x cannot be written",
                                           RuntimeWarning, native.__file__, 353))
        said.append(warnings.formatwarning("deprecated", DeprecationWarning, "/elsewhere/lib.py", 1))
        warnings.warn("forge-ml: the kernel cache /x cannot be written", RuntimeWarning)
        return 0
    before = warnings.formatwarning
    monkeypatch.setattr(cli_mod, "_main", warns)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["check"]) == 0
    assert said == ["forge-ml: warning: the kernel cache /x cannot be written\n",
                    "forge-ml: warning: DeprecationWarning: deprecated\n"]
    assert [str(w.message) for w in seen] == ["forge-ml: the kernel cache /x cannot be written"]
    assert warnings.formatwarning is before
