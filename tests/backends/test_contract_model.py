"""The contract is complete: a backend with the core ops only (``corenp``) trains GPT-2 and
generates through the composed defaults, with the CPU backend's numbers."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

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


@pytest.mark.parametrize("device", ["cpu", "corenp"])
@pytest.mark.parametrize("seed_form", ["int", "tensor"])
def test_fused_attention_dropout_equals_the_composed_path(device, seed_form):
    """With dropout, the fused attention op (attention_qkv_dropout: a backend's kernel or the
    composed default) draws the composed path's masks: the same loss and gradients, with the
    step seed an int or a one-element int64 Tensor (a captured step's, read as ops.SeedAt)."""
    cfg = dataclasses.replace(CFG, dropout=0.2)
    m = GPT2.init(cfg, seed=5, dtype="float64").to(device)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
    x, y = (fm.tensor(a, device=device) for a in (ids[:, :-1], ids[:, 1:]))
    seed = 2**63 + 11 if seed_form == "int" else fm.tensor(np.array([-7], np.int64), device=device)
    lf, gf = m.loss_and_grads(x, y, dropout_seed=seed)
    lc, gc = m.loss_and_grads(x, y, dropout_seed=seed, fused_attention=False)
    ln, _ = m.loss_and_grads(x, y, dropout_seed=seed, train=False)
    assert abs(lf - lc) <= 1e-12 * abs(lc) and lf != ln, (lf, lc, ln)
    for k in gc:
        np.testing.assert_allclose(gf[k].numpy(), gc[k].numpy(), rtol=1e-10, atol=1e-13, err_msg=k)


def test_generate_matches_the_cpu_backend():
    cpu, core = _models()
    prompts = [[1, 2, 3], [4, 5]]
    for kw in (dict(temperature=0), dict(temperature=0.9, top_k=5, seed=7)):
        a = [[(e.row, e.token) for e in s] for s in generate(cpu, prompts, 6, **kw)]
        b = [[(e.row, e.token) for e in s] for s in generate(core, prompts, 6, **kw)]
        assert a == b, kw
