"""``python -m forge_ml``: the ``forge-ml`` command line (see ``forge_ml.cli``), and the
console script's function (``entry``, pyproject's [project.scripts]).

Example: ``python -m forge_ml train --max-steps 200``.
"""
import sys


def entry() -> int:
    """The ``forge-ml`` command: ``forge_ml.cli.main``, imported here, so that a Ctrl-C while
    the CLI loads exits 130 with one line, as ``main`` does once it runs (the console script
    imported the CLI at its top, outside any handler: a traceback)."""
    try:
        from .cli import main
    except KeyboardInterrupt:
        print("forge-ml: interrupted", file=sys.stderr)
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(entry())
