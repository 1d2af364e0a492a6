"""The README's commands: every ``forge-ml`` line in its code blocks is one the CLI's parser
takes (its subcommand and flags exist), and the OpenAI client example asks for the model id
that the README's ``forge-ml serve`` line serves (the folder's name)."""
import re
import shlex
from pathlib import Path

import pytest

from forge_ml.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(text):
    """The README's code: fenced blocks and 4-space indented lines."""
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    indented = [line[4:] for line in text.splitlines() if line.startswith("    ")]
    return fenced + ["\n".join(indented)]


def _commands():
    cmds = []
    for block in _blocks(README.read_text(encoding="utf-8")):
        block = block.replace("\\\n", " ")
        for line in block.splitlines():
            for part in line.split("&&"):
                part = part.split("  #")[0].strip()
                if part.startswith("forge-ml "):
                    cmds.append(part)
    return cmds


def test_readme_has_commands():
    cmds = _commands()
    assert len(cmds) >= 15
    assert any(c.startswith("forge-ml serve") for c in cmds)


@pytest.mark.parametrize("cmd", _commands())
def test_readme_command_parses(cmd):
    args = shlex.split(cmd)[1:]
    ns = build_parser().parse_args(args)    # an unknown flag or value exits with status 2
    assert ns.cmd == args[0]


def test_readme_openai_example_asks_for_the_served_model():
    text = README.read_text(encoding="utf-8")
    serve = re.search(r"^forge-ml serve --ckpt (\S+)", text, flags=re.M)
    asked = re.search(r'completions\.create\(model="([^"]+)"', text)
    assert serve and asked
    assert asked.group(1) == Path(serve.group(1)).name, (
        f"the README serves {serve.group(1)} (model id {Path(serve.group(1)).name!r}) "
        f"but its client example asks for {asked.group(1)!r}")
