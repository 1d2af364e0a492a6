"""The core library used as a PyTorch user uses it: defects found in a QA pass of tensors, ops,
the tape and the optimizer, each test failing on the code before its fix."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml.errors import ShapeError


def test_a_tensor_truth_is_its_one_value_and_otherwise_refused():
    # ``if t:`` asked __len__: a one-element zero was True, a 0-d tensor a TypeError about len()
    assert bool(fm.tensor([0.0])) is False and bool(fm.tensor([[3.0]])) is True
    assert bool(fm.tensor(0.0)) is False and bool(fm.tensor(np.float64(-1.5))) is True
    assert bool(fm.tensor([0])) is False and bool(fm.tensor([7])) is True
    assert not fm.zeros((1, 1))
    for shape in ((2,), (0, 3), (2, 2)):
        with pytest.raises(ShapeError, match=r"ambiguous: expected one element, got"):
            bool(fm.zeros(shape))
