"""The core library used as a PyTorch user uses it: defects found in a QA pass of tensors, ops,
the tape and the optimizer, each test failing on the code before its fix."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml.errors import ConfigError, DTypeError, ShapeError
from forge_ml.optim import AdamW


def test_a_tensor_truth_is_its_one_value_and_otherwise_refused():
    # ``if t:`` asked __len__: a one-element zero was True, a 0-d tensor a TypeError about len()
    assert bool(fm.tensor([0.0])) is False and bool(fm.tensor([[3.0]])) is True
    assert bool(fm.tensor(0.0)) is False and bool(fm.tensor(np.float64(-1.5))) is True
    assert bool(fm.tensor([0])) is False and bool(fm.tensor([7])) is True
    assert not fm.zeros((1, 1))
    for shape in ((2,), (0, 3), (2, 2)):
        with pytest.raises(ShapeError, match=r"ambiguous: expected one element, got"):
            bool(fm.zeros(shape))


@pytest.mark.parametrize("bad, error, said", [
    (fm.zeros((4,)), ShapeError, "g is (4,) but p is (3,)"),
    (fm.tensor(np.zeros(3, np.int64)), DTypeError, "g must be a float tensor, got int64"),
    (np.zeros(3, np.float32), TypeError, "ndarray"),
])
def test_a_refused_adamw_step_names_the_parameter_and_changes_nothing(bad, error, said):
    """A gradient that does not fit its parameter was refused only after AdamW.step had
    counted the step (every later bias correction shifted by one), by a message that named no
    parameter (g is (4,) but p is (3,)); update() likewise."""
    params = {"a": fm.tensor(np.ones((2, 2), np.float32)), "b": fm.tensor(np.ones(3, np.float32))}
    opt = AdamW(params, lr=0.1)
    good = fm.tensor(np.full((2, 2), 0.5, np.float32))
    with pytest.raises(error) as e:
        opt.step({"a": good, "b": bad})
    assert "the gradient of 'b'" in str(e.value) and said in str(e.value), str(e.value)
    assert opt.steps == 0 and opt.param_steps == {"a": 0, "b": 0}
    assert (params["a"].numpy() == 1).all() and (opt.m["a"].numpy() == 0).all()
    with pytest.raises(error, match="AdamW.update, the gradient of 'b'"):
        opt.update({"a": good, "b": bad}, opt.prepare())
    assert (params["a"].numpy() == 1).all() and opt.steps == 0
    # the same step with a fitting gradient takes the first step
    opt.step({"a": good, "b": fm.zeros((3,))})
    assert opt.steps == 1 and opt.param_steps == {"a": 1, "b": 1}


@pytest.mark.parametrize("call", [
    lambda x: fm.ops.matmul(x, x, trans_a="no"),
    lambda x: fm.ops.matmul(x, x, trans_b=1),
    lambda x: fm.ops.softmax(x, causal="false"),
    lambda x: fm.ops.layernorm_bwd(x, fm.full((2,), 1.0), x, sums="yes"),
])
def test_a_switch_takes_a_bool_only(call):
    """``trans_a="no"`` transposed (any non-empty string is true), and ``trans_b=1`` was taken
    as True; a switch is True or False (a NumPy bool too), else a ConfigError naming it."""
    x = fm.tensor(np.arange(4, dtype=np.float32).reshape(2, 2))
    with pytest.raises(ConfigError, match="must be True or False, got"):
        call(x)
    assert fm.ops.matmul(x, x, trans_a=np.True_).numpy().tolist() == (x.numpy().T @ x.numpy()).tolist()


def test_a_scale_factor_is_no_bool():
    """``ops.scale(x, True)`` scaled by 1 (a bool is an int to Python): a DTypeError now, as a
    string was."""
    with pytest.raises(DTypeError, match="must be a number or a one-element Tensor, got bool"):
        fm.ops.scale(fm.full((2,), 1.0), True)
    assert fm.ops.scale(fm.full((2,), 1.0), np.float32(2)).numpy().tolist() == [2.0, 2.0]
