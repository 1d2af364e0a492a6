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
