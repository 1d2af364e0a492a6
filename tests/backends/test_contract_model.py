"""The contract is complete: a backend with the core ops only (``corenp``) trains GPT-2 and
generates through the composed defaults, with the CPU backend's numbers."""
from __future__ import annotations

import numpy as np

import forge_ml as fm
from core_numpy import register_backend
from forge_ml.inference import generate
from forge_ml.models.gpt2 import GPT2, GPT2Config
from forge_ml.optim import AdamW, clip_grad_norm

register_backend()
CFG = GPT2Config(vocab_size=29, block_size=16, n_layer=2, n_head=2, n_embd=16)


def _models():
    cpu = GPT2.init(CFG, seed=3, dtype="float64")
    return cpu, GPT2.from_state_dict(CFG, cpu.state_dict(), device="corenp", dtype="float64")


def test_training_steps_match_the_cpu_backend():
    rs = np.random.default_rng(0)
    cpu, core = _models()
    assert core.device.type == "corenp"
    opts = [AdamW(m.params, lr=1e-2) for m in (cpu, core)]
    for step in range(3):
        ids = rs.integers(0, CFG.vocab_size, (2, 9))
        losses = []
        for m, opt in zip((cpu, core), opts):
            dev = m.device
            loss, grads = m.loss_and_grads(fm.tensor(ids[:, :-1], device=dev),
                                           fm.tensor(ids[:, 1:], device=dev))
            _, scale = clip_grad_norm(grads, 1.0)
            opt.step(grads, grad_scale=scale)
            losses.append(loss)
        assert abs(losses[0] - losses[1]) < 1e-10, (step, losses)
    for k, p in cpu.params.items():
        np.testing.assert_allclose(core.params[k].numpy(), p.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=k)


def test_generate_matches_the_cpu_backend():
    cpu, core = _models()
    prompts = [[1, 2, 3], [4, 5]]
    for kw in (dict(temperature=0), dict(temperature=0.9, top_k=5, seed=7)):
        a = [[(e.row, e.token) for e in s] for s in generate(cpu, prompts, 6, **kw)]
        b = [[(e.row, e.token) for e in s] for s in generate(core, prompts, 6, **kw)]
        assert a == b, kw
