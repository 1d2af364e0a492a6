"""Whether two PTX files of the same kernel file are the same code up to the names of their
registers: the check that a refactor of CUDA code changed nothing the GPU runs, on a machine
without a GPU. Make the PTX before and after with ``scripts/nvrtc_check.py STEM --ptx DIR``.

Line by line (comments, ``.loc`` and ``.file`` left out), both files must hold the same
instructions with their registers renamed one to one within each function; registers that
start as the same constant (or a copy of it), as an accumulator array's elements do, may
trade names (the compiler numbers such loop-carried registers in any order).

    python scripts/nvrtc_check.py attention --ptx /tmp/before     # before the change
    python scripts/nvrtc_check.py attention --ptx /tmp/after      # after it
    python scripts/ptx_same.py /tmp/before/attention.ptx /tmp/after/attention.ptx

Exit status 0 when they are the same code, 1 with the first lines that differ.
"""
from __future__ import annotations

import re
import sys

REG = re.compile(r"%(?:rd|rs|r|fd|f|p|hh|h|b)\d+\b")
LABEL = re.compile(r"\$L__BB\d+_\d+")
CONST = re.compile(r"mov\.[a-z0-9]+\s+(%\w+), (0[fd][0-9A-Fa-f]+|-?\d+);$")
COPY = re.compile(r"mov\.[a-z0-9]+\s+(%\w+), (%\w+);$")


def code_lines(path: str) -> list:
    out = []
    with open(path) as f:
        for line in f:
            s = line.strip()
            if s and not s.startswith(("//", ".loc", ".file")):
                out.append(s)
    return out


def differences(a: list, b: list, most: int = 10) -> list:
    """The first ``most`` lines where ``a`` and ``b`` are not the same code (see the module's
    docstring); empty when they are.

    >>> differences(["mov.f32 %f1, 0f00000000;", "mov.f32 %f2, %f1;", "add.f32 %f3, %f1, %f4;"],
    ...             ["mov.f32 %f1, 0f00000000;", "mov.f32 %f2, %f1;", "add.f32 %f3, %f2, %f4;"])
    []
    >>> differences(["add.f32 %f3, %f1, %f4;"], ["sub.f32 %f3, %f1, %f4;"])
    ['add.f32 %f3, %f1, %f4; | sub.f32 %f3, %f1, %f4;']
    """
    a, b = [x.strip() for x in a if x.strip()], [y.strip() for y in b if y.strip()]
    if len(a) != len(b):
        return [f"{len(a)} lines against {len(b)}"]
    bad, fwd, bwd, start = [], {}, {}, {}
    for x, y in zip(a, b):
        if x.startswith((".visible .entry", ".entry", ".func", ".visible .func")):
            fwd, bwd, start = {}, {}, {}
        if LABEL.sub("L", REG.sub("R", x)) != LABEL.sub("L", REG.sub("R", y)):
            bad.append(f"{x} | {y}")
        elif x == y and (m := CONST.match(x)):   # a constant's register: settled by its uses
            start.setdefault(m.group(1), m.group(2))
            continue
        elif x == y and (m := COPY.match(x)) and m.group(2) in start:
            start.setdefault(m.group(1), start[m.group(2)])
            continue
        else:
            for rx, ry in zip(REG.findall(x), REG.findall(y)):
                if rx not in fwd and ry not in bwd and start.get(rx) is not None \
                        and start.get(rx) == start.get(ry):
                    fwd[rx], bwd[ry] = ry, rx
                elif fwd.setdefault(rx, ry) != ry or bwd.setdefault(ry, rx) != rx:
                    bad.append(f"{x} | {y}")
                    break
        if len(bad) >= most:
            break
    return bad


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: ptx_same.py BEFORE.ptx AFTER.ptx")
        return 2
    a, b = code_lines(args[0]), code_lines(args[1])
    bad = differences(a, b)
    if bad:
        print(f"not the same code ({len(a)} and {len(b)} lines); first differences:")
        print("\n".join("  " + d for d in bad))
        return 1
    print(f"the same code up to register names ({len(a)} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
