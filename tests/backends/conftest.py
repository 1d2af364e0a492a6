"""The contract suite: every core and fused op of every available backend against
tests/reference.py (the float64 specification). ``core_numpy`` is a minimal backend that
implements the core ops only, registered here as device type ``corenp``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: reference, _gpu_checks
sys.path.insert(0, str(Path(__file__).resolve().parent))       # core_numpy
