"""(QA) `forge-ml check` and the switchboard: defects found by using them as a new user."""
import numpy as np
import pytest

from forge_ml import flags
from forge_ml.cli import main
from forge_ml.errors import ConfigError


def _wrong_kernel(monkeypatch, name, wrong, dtypes=(np.float32, np.float64)):
    """The CPU backend's ``name`` (C or NumPy kernel, whichever runs) with ``wrong`` applied
    to its arguments and results for inputs of ``dtypes``."""
    from forge_ml.backends import load
    bk = load("cpu")
    right = getattr(bk, name)

    def kernel(*args, **kw):
        if args[0].dtype not in dtypes:
            return right(*args, **kw)
        return wrong(right, *args, **kw)

    monkeypatch.setattr(bk, name, kernel)


def _check_cpu(capsys) -> tuple:
    rc = main(["check", "--device", "cpu"])
    return rc, capsys.readouterr().out


def test_check_sees_a_backward_wrong_in_float64_too(monkeypatch, capsys):
    """A backward wrong in both precisions (as the NumPy kernels are on a CPU without a C
    compiler: float32 and the float64 reference run the same code) passed `forge-ml check`:
    float32 agreed with a float64 run that was just as wrong."""
    def wrong(right, *a, **kw):
        dx, dgamma, dbeta = right(*a, **kw)
        return dx, dgamma * dgamma.dtype.type(1.01), dbeta       # dgamma 1% off

    _wrong_kernel(monkeypatch, "layernorm_bwd_add", wrong)
    rc, out = _check_cpu(capsys)
    assert rc == 1, out
    line = out.splitlines()[0]
    assert line.startswith("float64  FAIL the gradient of h.") and "ln_" in line, out
    assert "central differences" in line, out


def test_check_sees_a_forward_wrong_in_float64_too(monkeypatch, capsys):
    """The MLP's product and GELU off by 1% in both precisions passed `forge-ml check`."""
    def wrong(right, *a, **kw):
        out = right(*a, **kw)
        return tuple(o * o.dtype.type(1.01) for o in out) if isinstance(out, tuple) \
            else out * out.dtype.type(1.01)

    _wrong_kernel(monkeypatch, "matmul_gelu", wrong)
    rc, out = _check_cpu(capsys)
    assert rc == 1, out
    assert out.startswith("float64  FAIL the float64 loss "), out
    assert "plain NumPy's GPT-2 loss" in out, out


def test_check_sees_a_layernorm_that_drops_its_bias(monkeypatch, capsys):
    """A float32 layernorm that leaves beta out passed: the check's model had init's biases
    (0) and gains (1), where a kernel without them computes the same."""
    def wrong(right, x, gamma, beta, eps):
        return right(x, gamma, np.zeros_like(beta), eps)

    _wrong_kernel(monkeypatch, "layernorm", wrong, dtypes=(np.float32,))
    rc, out = _check_cpu(capsys)
    assert rc == 1, out
    assert out.startswith("cpu      FAIL"), out


def test_check_passes_a_right_install(capsys):
    """The reference's own checks do not fail a right install (and say nothing then)."""
    rc, out = _check_cpu(capsys)
    assert rc == 0 and out.startswith("cpu      ok") and "FAIL" not in out, out


def test_check_reference_of_a_right_model():
    """``diagnose.check_reference`` on forge-ml's own float64 model, biases and gains not
    at init's values: None; a gradient 0.1% off in one element-group: named."""
    from forge_ml.diagnose import check_reference, gpt2_loss_numpy
    from forge_ml.models.gpt2 import GPT2, GPT2Config
    from forge_ml.tensor import tensor
    cfg = GPT2Config(vocab_size=13, block_size=8, n_layer=1, n_head=2, n_embd=8,
                     tied_head=False)
    rs = np.random.default_rng(5)
    state = {k: v + rs.normal(0, 0.1, v.shape)
             for k, v in GPT2.init(cfg, seed=2, dtype="float64").state_dict().items()}
    m = GPT2.from_state_dict(cfg, state, dtype="float64")
    x, y = rs.integers(0, 13, (2, 6)), rs.integers(0, 13, (2, 6))
    loss, g = m.loss_and_grads(tensor(x), tensor(y))
    g = {k: t.numpy() for k, t in g.items()}
    assert abs(gpt2_loss_numpy(cfg, state, x, y) - loss) < 1e-12 * loss
    assert check_reference(cfg, state, x, y, loss, g) is None
    g["lm_head.weight"] = g["lm_head.weight"] * 1.001
    said = check_reference(cfg, state, x, y, loss, g)
    assert said is not None and said.startswith("the gradient of lm_head.weight"), said


def test_fused_decode_error_says_1_0_work(monkeypatch):
    """FORGE_FUSED_DECODE takes 1/0 for on/off as every on/off switch does, but its error
    did not say so (only a switch of exactly on|off had the hint)."""
    monkeypatch.setenv("FORGE_FUSED_DECODE", "2")
    monkeypatch.delitem(flags._values, "FORGE_FUSED_DECODE", raising=False)
    with pytest.raises(ConfigError) as e:
        flags.get("FORGE_FUSED_DECODE")
    assert str(e.value) == "FORGE_FUSED_DECODE='2' is not one of on|off|layers (or 1/0)"
    assert flags.SWITCHES["FORGE_FUSED_DECODE"].parse("1") == "on"


@pytest.mark.parametrize("name", ["FORGE_API_KEY", "FORGE_CACHE_DIR", "FORGE_PDL"])
def test_override_refuses_none(name):
    """``flags.override(FORGE_API_KEY=None)`` set the key to the text "None" (a server then
    required 'Bearer None'), and FORGE_CACHE_DIR=None a folder named None."""
    with pytest.raises(ConfigError, match=f"flags.override: {name}=None; expected "):
        with flags.override(**{name: None}):
            pytest.fail(f"{name} = {flags.get(name)!r}")
