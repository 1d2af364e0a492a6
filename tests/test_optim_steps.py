"""AdamW counts steps per parameter, as torch.optim.AdamW does: a parameter whose gradient is
None at first starts its bias correction where it starts updating."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml.optim import AdamW

torch = pytest.importorskip("torch")


def test_a_parameter_without_gradient_at_first_moves_like_torch():
    rs = np.random.default_rng(0)
    init = {"w": rs.standard_normal((3, 4)), "b": rs.standard_normal(4), "late": rs.standard_normal((2, 3))}
    grads = [{k: rs.standard_normal(v.shape) for k, v in init.items()} for _ in range(4)]
    grads[0]["late"] = None                      # no gradient at step 1
    grads[2]["b"] = None                         # and one gap later on
    lr, betas, eps, wd = 0.1, (0.9, 0.95), 1e-8, 0.1

    ours = {k: fm.tensor(v.astype(np.float32)) for k, v in init.items()}
    opt = AdamW(ours, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    theirs = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float32)) for k, v in init.items()}
    # forge-ml decays tensors of rank >= 2 only: the same two groups in torch
    topt = torch.optim.AdamW(
        [{"params": [p for p in theirs.values() if p.ndim >= 2], "weight_decay": wd},
         {"params": [p for p in theirs.values() if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, betas=betas, eps=eps)

    late0 = init["late"].astype(np.float32)
    for i, g in enumerate(grads):
        opt.step({k: None if v is None else fm.tensor(v.astype(np.float32)) for k, v in g.items()})
        for k, p in theirs.items():
            p.grad = None if g[k] is None else torch.tensor(g[k], dtype=torch.float32)
        topt.step()
        for k in init:
            np.testing.assert_allclose(ours[k].numpy(), theirs[k].detach().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{k} after step {i + 1}")
        if i == 0:
            np.testing.assert_array_equal(ours["late"].numpy(), late0)  # untouched without a gradient
        if i == 1:
            # its first update is a full lr-sized step (bias-corrected m/sqrt(v) = sign(g)), then decay
            want = late0 * (1 - lr * wd) - lr * np.sign(grads[1]["late"]).astype(np.float32)
            np.testing.assert_allclose(ours["late"].numpy(), want, rtol=1e-5, atol=1e-6)
    assert opt.param_steps == {"w": 4, "b": 3, "late": 3}
