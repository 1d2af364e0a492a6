"""Whether two PTX files of the same kernel file are the same code up to the names of their
registers: the check that a refactor of CUDA code changed nothing the GPU runs, on a machine
without a GPU. Make the PTX before and after with ``scripts/nvrtc_check.py STEM --ptx DIR``.

Line by line (comments, ``.loc`` and ``.file`` left out), both files must hold the same
instructions with their registers renamed one to one within each function; registers that
start as the same constant (or a copy of it), as an accumulator array's elements do, may
trade names (the compiler numbers such loop-carried registers in any order). Where no one-to-one
renaming of a whole function fits (PTX reuses registers, and the compiler may pick another of
two zeroed ones for one use only), the files are still the same code when every read sees the
same value on both sides (``dataflow_differences``: each value named by the instruction that
made it, a constant by itself, a copy by its source's).

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


NO_DEST = ("st.", "bar.", "bra", "ret", "cp.async", "prefetch", "red.", "membar", "fence",
           "griddepcontrol", "barrier", "exit", "trap", "wgmma.fence", "wgmma.commit_group",
           "wgmma.wait_group", "call")


def _operands(line: str):
    """(guard reads, destination registers, read registers) of one PTX instruction: the first
    operand (a register or a {tuple}) is written unless the instruction writes none; an
    accumulating mma / wgmma reads its destination too, and a guarded (@p) write keeps the old
    value where the guard is false, so its destinations are read as well."""
    guard = []
    if line.startswith("@"):
        g, line = line.split(None, 1)
        guard = REG.findall(g)
    parts = line.rstrip(";").split(None, 1)
    if len(parts) < 2:
        return guard, [], []
    op, rest = parts
    if op.startswith(NO_DEST) or not rest.lstrip().startswith(("%", "{")):
        return guard, [], REG.findall(rest)
    if rest.startswith("{"):
        cut = rest.index("}") + 1
    else:
        cut = rest.index(",") if "," in rest else len(rest)
    dest, reads = REG.findall(rest[:cut]), REG.findall(rest[cut:])
    if op.startswith(("mma", "wgmma")) or guard:
        reads = reads + dest
    return guard, dest, reads


def dataflow_differences(a: list, b: list, most: int = 10) -> list:
    """The first ``most`` lines where ``a`` and ``b`` (the same instructions up to register
    names) read different values: each value named by the instruction and slot that made it, a
    constant by itself, a copy by its source's. For register reuse ``differences`` cannot map
    one to one (the compiler trading which zero-initialised accumulators an mma uses). Two
    passes over each function, the second starting from the first's last values, so a
    loop-carried read sees its back edge's value as well as its entry's.

    >>> dataflow_differences(["mov.f32 %f1, 0f00000000;", "mov.f32 %f2, 0f00000000;",
    ...                       "add.f32 %f3, %f1, %f4;", "mul.f32 %f5, %f2, %f3;"],
    ...                      ["mov.f32 %f2, 0f00000000;", "mov.f32 %f1, 0f00000000;",
    ...                       "add.f32 %f3, %f2, %f4;", "mul.f32 %f5, %f1, %f3;"])
    []
    >>> dataflow_differences(["add.f32 %f3, %f1, %f4;", "mul.f32 %f5, %f3, %f4;"],
    ...                      ["add.f32 %f3, %f1, %f4;", "mul.f32 %f5, %f4, %f3;"])
    ['mul.f32 %f5, %f3, %f4; | mul.f32 %f5, %f4, %f3;']
    """
    a, b = [x.strip() for x in a if x.strip()], [y.strip() for y in b if y.strip()]
    if len(a) != len(b):
        return [f"{len(a)} lines against {len(b)}"]
    starts = [i for i, x in enumerate(a) if x.startswith((".visible .entry", ".entry", ".func",
                                                           ".visible .func", ".weak .entry"))]
    bad = []
    for lo, hi in zip([0] + starts, starts + [len(a)]):
        va, vb = {}, {}
        for _ in range(2):
            for i in range(lo, hi):
                x, y = a[i], b[i]
                if LABEL.sub("L", REG.sub("R", x)) != LABEL.sub("L", REG.sub("R", y)):
                    bad.append(f"{x} | {y}")
                    break
                gx, dx, rx = _operands(x)
                gy, dy, ry = _operands(y)
                if any(va.get(u, u) != vb.get(v, v) for u, v in zip(gx + rx, gy + ry)):
                    bad.append(f"{x} | {y}")
                    if len(bad) >= most:
                        return bad
                if (m := CONST.match(x)) and (n := CONST.match(y)):
                    va[m.group(1)], vb[n.group(1)] = ("const", m.group(2)), ("const", n.group(2))
                elif (m := COPY.match(x)) and (n := COPY.match(y)):
                    va[m.group(1)] = va.get(m.group(2), m.group(2))
                    vb[n.group(1)] = vb.get(n.group(2), n.group(2))
                else:
                    for k, (u, v) in enumerate(zip(dx, dy)):
                        va[u] = vb[v] = (i, k)
            if bad:
                break
    return bad


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: ptx_same.py BEFORE.ptx AFTER.ptx")
        return 2
    a, b = code_lines(args[0]), code_lines(args[1])
    bad = differences(a, b)
    if not bad:
        print(f"the same code up to register names ({len(a)} lines)")
        return 0
    if not dataflow_differences(a, b):
        print(f"the same code up to register names and which registers holding the same value "
              f"each instruction uses ({len(a)} lines; every read sees the same value)")
        return 0
    print(f"not the same code ({len(a)} and {len(b)} lines); first differences:")
    print("\n".join("  " + d for d in bad))
    return 1


if __name__ == "__main__":
    sys.exit(main())
