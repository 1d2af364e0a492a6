"""scripts/ptx_same.py: the check that a CUDA refactor changed nothing the GPU runs (two PTX
files the same code up to register names). Runs without a GPU."""
import pytest

import _scripts


@pytest.fixture(scope="module")
def ps():
    return _scripts.load("scripts/ptx_same.py")


BEFORE = """.visible .entry k(
\tmov.f32 \t%f1, 0f00000000;
\tmov.f32 \t%f2, %f1;
\tld.global.f32 \t%f3, [%rd1];
\tfma.rn.f32 \t%f1, %f3, %f3, %f1;
\tfma.rn.f32 \t%f2, %f3, %f4, %f2;
\tst.shared.f32 \t[%rd2], %f1;
\tst.shared.f32 \t[%rd2+4], %f2;
"""


def test_registers_renamed_one_to_one_are_the_same_code(ps):
    # the two accumulators, both starting at 0, trade names: the same code
    after = (BEFORE.replace("%f1, %f3, %f3, %f1", "%fA, %f3, %f3, %fA")
             .replace("%f2, %f3, %f4, %f2", "%f1, %f3, %f4, %f1")
             .replace("%fA", "%f2").replace("[%rd2], %f1", "[%rd2], %fX")
             .replace("[%rd2+4], %f2", "[%rd2+4], %f1").replace("%fX", "%f2"))
    assert after != BEFORE
    assert ps.differences(BEFORE.splitlines(), after.splitlines()) == []


@pytest.mark.parametrize("change", [
    ("fma.rn.f32 \t%f1", "fma.rz.f32 \t%f1"),              # another rounding
    ("[%rd2+4], %f2", "[%rd2+4], %f1"),                    # the wrong value stored
    ("%f3, %f4, %f2", "%f3, %f3, %f2"),                    # another operand
])
def test_a_changed_instruction_is_found(ps, change):
    after = BEFORE.replace(*change)
    assert after != BEFORE
    assert ps.differences(BEFORE.splitlines(), after.splitlines()), change


REUSED = BEFORE + """\tmov.f32 \t%f1, 0f00000000;
\tmov.f32 \t%f2, 0f00000000;
\tfma.rn.f32 \t%f1, %f3, %f3, %f1;
\tfma.rn.f32 \t%f2, %f3, %f4, %f2;
\tst.shared.f32 \t[%rd3], %f1;
\tst.shared.f32 \t[%rd3+4], %f2;
"""


def test_reused_zero_registers_trading_roles_are_the_same_dataflow(ps, tmp_path):
    # the second pair of accumulators reuses %f1 and %f2 (both zeroed again) in the other
    # roles: no one-to-one renaming of the whole function maps the two, but every read sees
    # the same value (the compiler's choice between two zero registers)
    tail = REUSED[len(BEFORE):]
    after = BEFORE + (tail.replace("%f1, %f3, %f3, %f1", "%fA, %f3, %f3, %fA")
                      .replace("%f2, %f3, %f4, %f2", "%f1, %f3, %f4, %f1").replace("%fA", "%f2")
                      .replace("[%rd3], %f1", "[%rd3], %fX")
                      .replace("[%rd3+4], %f2", "[%rd3+4], %f1").replace("%fX", "%f2"))
    a, b = REUSED.splitlines(), after.splitlines()
    assert after != REUSED and ps.differences(a, b)
    assert ps.dataflow_differences(a, b) == []
    assert ps.main([str(p) for p in _write(tmp_path, a, b)]) == 0


@pytest.mark.parametrize("change", [
    ("fma.rn.f32 \t%f1", "fma.rz.f32 \t%f1"),
    ("[%rd2+4], %f2", "[%rd2+4], %f1"),
    ("%f3, %f4, %f2", "%f3, %f3, %f2"),
    ("[%rd3+4], %f2", "[%rd3+4], %f1"),                    # the reused pair: the wrong value
])
def test_a_changed_instruction_is_found_by_the_dataflow_too(ps, change, tmp_path):
    after = REUSED.replace(*change)
    assert after != REUSED
    a, b = REUSED.splitlines(), after.splitlines()
    assert ps.dataflow_differences(a, b), change
    assert ps.main([str(p) for p in _write(tmp_path, a, b)]) == 1


def _write(d, a, b):
    (d / "a.ptx").write_text("\n".join(a))
    (d / "b.ptx").write_text("\n".join(b))
    return d / "a.ptx", d / "b.ptx"
