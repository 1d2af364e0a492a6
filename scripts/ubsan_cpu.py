"""The CPU backend's C kernels under UndefinedBehaviorSanitizer: builds the library from
native.SOURCES with -fsanitize=undefined (the first undefined operation aborts with its file,
line and stack), loads it in place of the cached one, and runs the CPU kernel and training
tests against it.

    python scripts/ubsan_cpu.py                  # gcc or $CC; a few seconds to build, ~15 s of tests
    python scripts/ubsan_cpu.py -k attention     # extra arguments go to pytest

It found exp_f32 shifting a NaN's garbage exponent into the sign bit of a signed int
(2026-12-05; the shift is unsigned now).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from forge_ml.backends.cpu import native  # noqa: E402

TESTS = ["tests/test_cpu_kernels.py", "tests/test_cpu_threads.py", "tests/test_backend_cpu.py",
         "tests/test_train.py"]
# the loader's own tests build, corrupt or refuse libraries: not this library's business
SKIP = ("not subprocess and not compile and not corrupt and not compiler and not concurrent_first "
        "and not numpy_never and not unwritable")


def main(argv) -> int:
    cc = native.compiler()
    if cc is None:
        print("no C compiler (set CC)")
        return 2
    out = Path(tempfile.mkdtemp(prefix="forge_ubsan_")) / "kernels_ubsan.so"
    # the library's own flags (native._BASE_FLAGS) at -O1 with debug lines, plus the sanitizer
    flags = [f for f in native._BASE_FLAGS if f != "-O3"] + ["-O1", "-g", "-fsanitize=undefined",
                                                             "-fno-sanitize-recover=all"]
    res = subprocess.run([cc, *flags, "-o", str(out), *map(str, native.SOURCES), "-lm"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        print(f"{cc} could not build the sanitized library:\n{res.stderr}")
        return 2
    native.build = lambda: (out, False)          # load it instead of the cached library
    import pytest
    os.environ.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")
    os.chdir(REPO)
    # -s: a sanitizer report goes to stderr as the process aborts, past pytest's capture
    return pytest.main(["-s", "-p", "no:warnings", "-p", "no:cacheprovider", "-k", SKIP,
                        *TESTS, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
