"""``python -m forge_ml``: the ``forge-ml`` command line (see ``forge_ml.cli``).

Example: ``python -m forge_ml train --max-steps 200``.
"""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
