"""Compile forge-ml's CUDA kernel files with NVRTC on a machine without a GPU: the errors NVRTC
finds and, with ``--ptxas``, each kernel's registers, spills and shared memory as ptxas
reports them, before any device time is spent. It checks that a kernel compiles; only the GPU
suite (``scripts/gpu_check.sh``) says that it is right.

Each ``backends/cuda/<stem>.cu`` is compiled as the CUDA backend compiles it
(``runtime.kernel_source``: ``common.cuh`` pasted in place of its include line; C++17; sm_90,
or the arch-specific target ``runtime._ARCH_STEMS`` names, such as flash_hopper's sm_90a with
FORGE_ARCH_FEATURES defined). NVRTC alone is enough, no driver or toolkit:

    pip install nvidia-cuda-nvrtc-cu12                 # or set FORGE_NVRTC=/path/libnvrtc.so
    python scripts/nvrtc_check.py                      # every kernel file
    python scripts/nvrtc_check.py flash_hopper --ptxas # one file, with ptxas's resource report
    python scripts/nvrtc_check.py gelu --ptx /tmp/a    # also write gelu.ptx there: a refactor
                                                       # that should not change the code can be
                                                       # diffed against the PTX from before it
    python scripts/nvrtc_check.py decode_layers -D DL_TRACE   # a build with a macro defined

The NVRTC found may be older or newer than the device's (CuPy 14's NVRTC 13 on the H200
machine); the exit status is 1 when a file does not compile.
"""
from __future__ import annotations

import argparse
import ast
import ctypes
import glob
import os
import sys
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[1] / "src" / "forge_ml" / "backends" / "cuda"
DEFAULT_ARCH = "sm_90"


def runtime_constants() -> tuple:
    """``(_INCLUDE, _ARCH_STEMS)`` read from runtime.py's source (importing it needs CuPy)."""
    tree = ast.parse((CUDA_DIR / "runtime.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            name = getattr(node.targets[0], "id", None)
            if name in ("_INCLUDE", "_ARCH_STEMS"):
                found[name] = ast.literal_eval(node.value)
    return found["_INCLUDE"], found["_ARCH_STEMS"]


def find_nvrtc() -> str:
    """The NVRTC library: $FORGE_NVRTC, else the nvidia-cuda-nvrtc wheel's, else the loader's."""
    if os.environ.get("FORGE_NVRTC"):
        return os.environ["FORGE_NVRTC"]
    try:
        import nvidia.cuda_nvrtc as pkg
        for d in pkg.__path__:
            hits = sorted(glob.glob(os.path.join(d, "lib", "libnvrtc.so.*")))
            if hits:
                return hits[0]
    except ImportError:
        pass
    return "libnvrtc.so"


class Nvrtc:
    """The few NVRTC calls a compile check needs (ctypes)."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._ok(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = f"{major.value}.{minor.value}"

    def _ok(self, status: int, what: str) -> None:
        if status != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, source: str, name: str, options: list) -> tuple:
        """``(compiled, log, ptx)``: whether NVRTC compiled ``source``, its log, and the PTX
        (an empty string where it did not compile)."""
        prog = ctypes.c_void_p()
        self._ok(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                             0, None, None), "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._ok(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "log size")
            log = ctypes.create_string_buffer(size.value)
            self._ok(self.lib.nvrtcGetProgramLog(prog, log), "log")
            ptx = ""
            if status == 0:
                self._ok(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
                buf = ctypes.create_string_buffer(size.value)
                self._ok(self.lib.nvrtcGetPTX(prog, buf), "PTX")
                ptx = buf.value.decode(errors="replace")
            return status == 0, log.value.decode(errors="replace").strip(), ptx
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stems", nargs="*", help="kernel files by stem (default: every backends/cuda/*.cu)")
    ap.add_argument("--ptxas", action="store_true", help="print ptxas's registers/spills/shared memory")
    ap.add_argument("--ptx", metavar="DIR", help="write each file's PTX to DIR/<stem>.ptx")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME[=VALUE]",
                    help="a macro defined for every file (e.g. -D DL_TRACE: decode_layers.cu's "
                         "marks, as decode_gpu.py --trace builds it)")
    args = ap.parse_args(argv)
    include, arch_stems = runtime_constants()
    common = (CUDA_DIR / "common.cuh").read_text()
    stems = args.stems or sorted(p.stem for p in CUDA_DIR.glob("*.cu"))
    try:
        nvrtc = Nvrtc(find_nvrtc())
    except OSError as e:
        print(f"NVRTC not found ({e}): pip install nvidia-cuda-nvrtc-cu12, or set FORGE_NVRTC")
        return 2
    print(f"NVRTC {nvrtc.version}; {len(stems)} kernel file(s) in {CUDA_DIR}")
    failed = []
    for stem in stems:
        path = CUDA_DIR / f"{stem}.cu"
        if not path.is_file():
            print(f"{stem}: no such kernel file ({path})")
            failed.append(stem)
            continue
        source = path.read_text().replace(include, common, 1)
        arch = arch_stems.get(stem, (None, DEFAULT_ARCH))[1]
        options = ["--std=c++17", f"-arch={arch}"]
        if stem in arch_stems:
            options.append("-DFORGE_ARCH_FEATURES=1")
        options += [f"-D{d}" for d in args.defines]
        if args.ptxas:
            options.append("--ptxas-options=-v")
        ok, log, ptx = nvrtc.compile(source, f"{stem}.cu", options)
        if ok and args.ptx:
            Path(args.ptx).mkdir(parents=True, exist_ok=True)
            (Path(args.ptx) / f"{stem}.ptx").write_text(ptx)
        print(f"{stem}.cu ({arch}): {'ok' if ok else 'FAILED'}")
        if log and (not ok or args.ptxas):
            print("  " + log.replace("\n", "\n  "))
        if not ok:
            failed.append(stem)
    if failed:
        print(f"did not compile: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
