"""The whole GPT-2 on the GPU against the CPU path: loss and every gradient (float32 and bf16
mixed precision), KV-cache logits, and the loss curve of a short training run."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml import Tape, ops
from forge_ml.models import GPT2, GPT2Config
from _gpu_checks import cuda_or_skip, round_bf16

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", autouse=True)
def gpu():
    cuda_or_skip()


CFG = GPT2Config(vocab_size=500, block_size=128, n_layer=2, n_head=4, n_embd=128)


def rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def batch(seed, B=4, T=96, V=500):
    rs = np.random.default_rng(seed)
    ids = rs.integers(0, V, (B, T + 1))
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("fused", [True, False])
def test_loss_and_every_gradient_float32(fused):
    x, y = batch(1)
    cpu = GPT2.init(CFG, seed=3)
    gpu = cpu.to("cuda")
    lc, gc = cpu.loss_and_grads(fm.tensor(x), fm.tensor(y), fused_attention=fused)
    lg, gg = gpu.loss_and_grads(fm.tensor(x, device="cuda"), fm.tensor(y, device="cuda"),
                                fused_attention=fused)
    assert abs(lc - lg) / abs(lc) < 1e-5
    for k in gc:
        assert rel(gg[k].numpy(), gc[k].numpy()) < 1e-4, k


def test_loss_and_gradients_bf16_mixed_precision():
    x, y = batch(2)
    cpu = GPT2.init(CFG, seed=4)
    gpu = cpu.to("cuda")
    lowp = gpu.to(dtype="bfloat16")              # a model whose parameters are bf16
    lc, gc = cpu.loss_and_grads(fm.tensor(x), fm.tensor(y))
    lg, gg = lowp.loss_and_grads(fm.tensor(x, device="cuda"), fm.tensor(y, device="cuda"))
    assert gg["wte.weight"].dtype == fm.bfloat16
    assert abs(lc - lg) / abs(lc) < 1e-2
    for k in gc:
        # bf16 activations: compare by norm, the per-element error of bf16 is ~1e-2
        a, b = gg[k].numpy(), gc[k].numpy()
        assert np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30) < 5e-2, k


def test_kv_cache_logits_match_full_forward_on_gpu():
    m = GPT2.init(CFG, seed=5).to("cuda")
    x, _ = batch(3, B=2, T=20)
    full = m.logits(fm.tensor(x, device="cuda")).numpy()
    cache = m.new_cache(2, 32)
    a = m.forward_cached(fm.tensor(x[:, :12], device="cuda"), cache).numpy()
    outs = [a]
    for t in range(12, 20):
        outs.append(m.forward_cached(fm.tensor(x[:, t:t + 1], device="cuda"), cache).numpy())
    got = np.concatenate(outs, axis=1)[..., :CFG.vocab_size]
    assert rel(got, full) < 1e-4


def _train(device, steps=8):
    m = GPT2.init(CFG, seed=6).to(device)
    mom = {k: (fm.zeros(v.shape, "float32", device), fm.zeros(v.shape, "float32", device))
           for k, v in m.params.items()}
    losses = []
    x, y = batch(100)                  # one fixed batch: the loss must fall as it is fitted
    for step in range(1, steps + 1):
        tape = Tape()
        _, loss, leaves = m.forward(tape, fm.tensor(x, device=device), fm.tensor(y, device=device))
        tape.backward(loss)
        losses.append(loss.t.item())
        for k, leaf in leaves.items():
            ops.adamw_update(m.params[k], tape.grad(leaf), *mom[k], lr=1e-3, beta1=0.9,
                             beta2=0.95, eps=1e-8, weight_decay=0.1 if m.params[k].ndim == 2 else 0.0,
                             step=step)
    return np.array(losses)


def test_cpu_and_gpu_loss_curves_agree():
    c, g = _train("cpu"), _train("cuda")
    assert c[-1] < c[0]
    np.testing.assert_allclose(g, c, rtol=1e-4)


def test_dropout_identical_masks_in_the_model():
    cfg = GPT2Config(vocab_size=500, block_size=128, n_layer=1, n_head=4, n_embd=128, dropout=0.2)
    x, y = batch(9)
    cpu = GPT2.init(cfg, seed=7)
    lc, _ = cpu.loss_and_grads(fm.tensor(x), fm.tensor(y), dropout_seed=11)
    lg, _ = cpu.to("cuda").loss_and_grads(fm.tensor(x, device="cuda"), fm.tensor(y, device="cuda"),
                                          dropout_seed=11)
    assert abs(lc - lg) / lc < 1e-5


def test_ops_on_different_devices_name_both():
    a = fm.tensor(np.ones((2, 2), np.float32))
    b = a.to("cuda")
    with pytest.raises(fm.DeviceError, match="cpu.*cuda|cuda.*cpu"):
        ops.add(a, b)


# -- the decoding step as a CUDA graph ------------------------------------------------------

def _varied(m, seed):
    """GPT-2's init gives near-uniform logits; add noise so greedy choices have margins."""
    rs = np.random.default_rng(seed)
    for k, v in m.params.items():
        m.params[k] = fm.tensor(v.numpy() + 0.3 * rs.standard_normal(v.shape).astype(np.float32))
    return m


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_graph_matches_op_by_op_and_cpu(dtype):
    """The graph replays the op-by-op step bit for bit; both match the CPU's float32 step
    within 1e-4 (float32), or (bf16) within twice the error of the GPU's bf16 forward_cached
    (whose attention rounds its scores to bf16) plus 1e-2."""
    from forge_ml.inference.decode import DecodeStep
    cpu = _varied(GPT2.init(CFG, seed=8), 1)
    gpu = cpu.to("cuda", dtype=dtype)
    rs = np.random.default_rng(2)
    ids = rs.integers(0, CFG.vocab_size, (3, 40))
    caches = [cpu.new_cache(3, 64)] + [gpu.new_cache(3, 64) for _ in range(3)]
    cpu.forward_cached(fm.tensor(ids[:, :10]), caches[0])
    for c in caches[1:]:
        gpu.forward_cached(fm.tensor(ids[:, :10], device="cuda"), c)
    eager = DecodeStep(gpu, caches[1], graph=False)
    graph = DecodeStep(gpu, caches[2])
    ref = DecodeStep(cpu, caches[0])
    err = lambda got, want: np.linalg.norm(got - want) / np.linalg.norm(want)  # noqa: E731
    for t in range(10, 40):
        want = ref(ids[:, t], t)
        a, b = eager(ids[:, t], t), graph(ids[:, t], t)
        assert graph.captured == (t >= 11) and not eager.captured
        # the graph replays exactly the op-by-op step (same kernels, same inputs)
        np.testing.assert_array_equal(b, a)
        if dtype == "float32":
            assert err(b, want) < 1e-4, t
        else:
            old = gpu.forward_cached(fm.tensor(ids[:, t:t + 1], device="cuda"), caches[3])
            old = old.numpy()[:, 0, :CFG.vocab_size]
            assert err(b, want) < 2 * err(old, want) + 1e-2, (t, err(b, want), err(old, want))
    for i in range(CFG.n_layer):                 # the replays wrote the caches too
        np.testing.assert_array_equal(caches[2].k[i].numpy(), caches[1].k[i].numpy())


def test_greedy_generation_on_gpu_equals_cpu():
    from forge_ml.inference import generate
    cpu = _varied(GPT2.init(CFG, seed=9), 3)
    gpu = cpu.to("cuda")
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    want = list(generate(cpu, prompts, max_new_tokens=30, temperature=0))
    got = list(generate(gpu, prompts, max_new_tokens=30, temperature=0))
    assert [[(e.row, e.token) for e in s] for s in got] == [[(e.row, e.token) for e in s] for s in want]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_chain_graph_equals_op_by_op(dtype):
    """DecodeStep.greedy on the GPU (a CUDA graph of step + argmax, replayed ahead of the host)
    gives the tokens of the op-by-op chain and of argmax over DecodeStep's logits."""
    from forge_ml.inference.decode import DecodeStep
    gpu = _varied(GPT2.init(CFG, seed=10), 4).to("cuda", dtype=dtype)
    ids = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, 8))
    caches = [gpu.new_cache(2, 64) for _ in range(3)]
    for c in caches:
        gpu.forward_cached(fm.tensor(ids, device="cuda"), c)
    graph = DecodeStep(gpu, caches[0])
    eager = DecodeStep(gpu, caches[1], graph=False)
    g = list(graph.greedy(ids[:, -1], 8, 40, chunk=8))   # 5 chunks: 1 eager, 4 replays
    assert ("greedy", 8) in graph._graphs and caches[0].pos == 48
    e = list(eager.greedy(ids[:, -1], 8, 40))
    np.testing.assert_array_equal(np.stack(g), np.stack(e))
    host = DecodeStep(gpu, caches[2], graph=False)
    tok = ids[:, -1]
    for t in range(8, 48):
        tok = np.argmax(host(tok, t), axis=1)
        np.testing.assert_array_equal(tok, g[t - 8])
    # chunks and single steps mixed (19 = 2 x 8 + 3 x 1), ahead of the host, closed early
    c = gpu.new_cache(2, 64)
    gpu.forward_cached(fm.tensor(ids, device="cuda"), c)
    mixed = DecodeStep(gpu, c)
    chain = mixed.greedy(ids[:, -1], 8, 19, chunk=8)
    got = [next(chain) for _ in range(19)]
    np.testing.assert_array_equal(np.stack(got), np.stack(g[:19]))
    assert ("greedy", 1) in mixed._graphs and c.pos == 27
    chain = mixed.greedy(ids[:, -1], 8, 40, chunk=8)
    assert [next(chain) for _ in range(3)][2].tolist() == g[2].tolist()
    chain.close()
    assert c.pos in (8 + 16, 8 + 24)      # the queued chunks wrote their rows


def test_decoder_kept_between_calls_and_dropped_when_weights_change():
    """generate() reuses the cache and captured graphs of the last call of the same shape, and
    never a graph that reads parameter buffers the model no longer has."""
    from forge_ml.inference import generate
    cpu = _varied(GPT2.init(CFG, seed=11), 6)
    gpu = cpu.to("cuda")
    c1, s1 = gpu.decoder(1, 32)
    c2, s2 = gpu.decoder(1, 32)
    assert s1 is s2 and c1 is c2 and c2.pos == 0
    assert gpu.decoder(2, 32)[1] is not s1                     # another shape: a new pair
    prompt = [3, 1, 4, 1, 5]
    a = list(generate(gpu, prompt, max_new_tokens=20, temperature=0))
    assert a == list(generate(gpu, prompt, max_new_tokens=20, temperature=0))
    assert a == list(generate(cpu, prompt, max_new_tokens=20, temperature=0))
    # new weights in new buffers: the kept graphs must not be replayed
    cpu2 = _varied(GPT2.init(CFG, seed=11), 7)
    for k, v in cpu2.params.items():
        gpu.params[k] = v.to("cuda")
    b = list(generate(gpu, prompt, max_new_tokens=20, temperature=0))
    assert b == list(generate(cpu2, prompt, max_new_tokens=20, temperature=0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_step_positions_per_row_graph_equals_op_by_op_and_cpu(dtype):
    """DecodeStep.rows on the GPU: each row at its own position (continuous batching), a row
    past the cache NaN; the graph replays the op-by-op step bit for bit, and both match the
    CPU's float32 step row by row."""
    from forge_ml.inference.decode import DecodeStep
    cpu = _varied(GPT2.init(CFG, seed=12), 8)
    gpu = cpu.to("cuda", dtype=dtype)
    rs = np.random.default_rng(6)
    B, cap = 4, 48
    steps = [DecodeStep(m, m.new_cache(B, cap), graph=g) for m, g in ((cpu, False), (gpu, False), (gpu, True))]
    pos = np.array([0, 5, 11, 2])            # rows start at different positions
    toks = rs.integers(0, CFG.vocab_size, (B, 40))
    for t in range(30):
        p = pos + t
        p[3] = cap + 3 if t % 7 == 6 else p[3]  # an idle row now and then: NaN, nothing written
        outs = [s.rows(toks[:, t], p) for s in steps]
        np.testing.assert_array_equal(outs[2], outs[1])
        live = p < cap
        assert np.isnan(outs[1][~live]).all()
        err = np.linalg.norm(outs[1][live] - outs[0][live]) / np.linalg.norm(outs[0][live])
        # float32 checks the per-row semantics tightly; bf16 weights, activations and caches
        # against the float32 CPU step drift to a few percent over 30 steps (3.9% seen at t=17)
        assert err < (1e-4 if dtype == "float32" else 8e-2), (t, err)
    assert "rows" in steps[2]._graphs


def test_mixed_precision_adamw_owns_the_masters():
    """AdamW(compute_dtype=bfloat16) keeps the float32 masters, puts bf16 copies in the
    model, and after a step the model holds the new masters rounded to bf16."""
    from forge_ml.optim import AdamW
    gpu = GPT2.init(CFG, seed=13).to("cuda")
    masters = dict(gpu.params)
    opt = AdamW(gpu.params, lr=1e-2, compute_dtype="bfloat16")
    assert all(p.dtype == fm.bfloat16 for p in gpu.params.values())
    assert all(opt.params[k] is masters[k] and masters[k].dtype == fm.float32 for k in masters)
    x, y = batch(14)
    _, grads = gpu.loss_and_grads(fm.tensor(x, device="cuda"), fm.tensor(y, device="cuda"))
    opt.step(grads)
    for k in ("wte.weight", "h.0.attn.c_attn.weight", "ln_f.bias"):
        want = round_bf16(masters[k].numpy())
        np.testing.assert_array_equal(gpu.params[k].numpy(), want, err_msg=k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sample_chain_graph_equals_op_by_op_and_the_rule(dtype):
    """DecodeStep.sample on the GPU (a CUDA graph of step + sampling kernel) gives the tokens
    of the op-by-op chain, and those of forge_ml.sampling.sample_row applied on the host to
    the same step's logits (temperature, top-k, top-p, min-p and a repetition penalty)."""
    from forge_ml.inference.decode import DecodeStep
    from forge_ml.sampling import sample_row
    gpu = _varied(GPT2.init(CFG, seed=15), 9).to("cuda", dtype=dtype)
    ids = np.random.default_rng(7).integers(0, CFG.vocab_size, (2, 8))
    caches = [gpu.new_cache(2, 64) for _ in range(3)]
    for c in caches:
        gpu.forward_cached(fm.tensor(ids, device="cuda"), c)
    knobs = [[0.9, 40, 0.95, 0.0, 1.2], [1.0, 0, 1.0, 0.02, 1.0]]
    keys = [[11, 12], [13, 14]]
    seen = np.zeros((2, CFG.vocab_size), bool)
    for r in range(2):
        seen[r, ids[r]] = True
    graph = DecodeStep(gpu, caches[0])
    eager = DecodeStep(gpu, caches[1], graph=False)
    g = list(graph.sample(ids[:, -1], 8, 40, knobs, keys, seen, chunk=8))
    assert ("sample_seen", 8) in graph._graphs
    e = list(eager.sample(ids[:, -1], 8, 40, knobs, keys, seen))
    np.testing.assert_array_equal(np.stack(g), np.stack(e))
    host = DecodeStep(gpu, caches[2], graph=False)
    tok, seen_h = ids[:, -1], seen.copy()
    for t in range(8, 48):
        logits = host(tok, t)
        tok = np.array([sample_row(logits[r], knobs[r], keys[r], t + 1, seen_h[r]) for r in range(2)])
        seen_h[np.arange(2), tok] = True
        np.testing.assert_array_equal(tok, g[t - 8], err_msg=f"position {t + 1}")
    assert len({int(x) for x in np.stack(g)[:, 1]}) > 3          # it samples, it does not argmax
