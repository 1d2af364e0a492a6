"""Sampling loop tests: greedy against a no-cache reference, determinism, temperature,
top-k and top-p, stop tokens and strings, batches of different lengths, the context limit,
the errors, and one KV cache per call."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml.errors import ConfigError, ShapeError
from forge_ml.inference.generate import TokenEvent, generate, generate_text, next_token_probs
from forge_ml.models.gpt2 import GPT2, GPT2Config, param_shapes
from forge_ml.tokenizer import CharTokenizer

CFG = GPT2Config(vocab_size=23, padded_vocab_size=32, block_size=24, n_layer=2, n_head=2, n_embd=16)


def make_model(cfg=CFG, seed=2, scale=0.5):
    """Random weights whose greedy continuations vary (GPT-2's own init repeats one token),
    with clear margins between the top logits: N(0, scale) weights, position embeddings
    N(0, 1), layer-norm gains near 1; padded vocab rows zero."""
    rng = np.random.default_rng(seed)
    host = {}
    for name, shape in param_shapes(cfg).items():
        a = rng.standard_normal(shape) * scale
        if name.endswith(("ln_1.weight", "ln_2.weight")) or name == "ln_f.weight":
            a = 1.0 + 0.2 * a
        if name == "wpe.weight":
            a = rng.standard_normal(shape)
        host[name] = a.astype(np.float32)
    host["wte.weight"][cfg.vocab_size:] = 0.0
    return GPT2(cfg, {k: fm.tensor(v) for k, v in host.items()})


@pytest.fixture(scope="module")
def model():
    return make_model()


def greedy_reference(model, prompt, n):
    """Greedy decoding without a cache: the full forward over the whole sequence each step."""
    seq = list(prompt)
    for _ in range(n):
        if len(seq) >= model.config.block_size:
            break
        seq.append(int(np.argmax(model.logits(fm.tensor([seq])).numpy()[0, -1])))
    return seq[len(prompt):]


# -- greedy and sampling -------------------------------------------------------------------


def test_greedy_equals_full_forward_reference(model):
    prompt = [3, 1, 4, 1, 5]
    got = list(generate(model, prompt, max_new_tokens=12, temperature=0))
    assert got == greedy_reference(model, prompt, 12)
    assert len(set(got)) > 1  # not a degenerate model


def test_same_seed_same_tokens_other_seed_other_tokens(model):
    run = lambda seed: list(generate(model, [2, 7], max_new_tokens=16, seed=seed))  # noqa: E731
    assert run(5) == run(5)
    assert run(5) != run(6)
    assert all(0 <= t < CFG.vocab_size for t in run(5))


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    prompt = [9, 8, 7]
    greedy = list(generate(model, prompt, max_new_tokens=10, temperature=0))
    assert list(generate(model, prompt, max_new_tokens=10, top_k=1, seed=3)) == greedy
    assert list(generate(model, prompt, max_new_tokens=10, top_p=1e-9, seed=4)) == greedy
    assert list(generate(model, prompt, max_new_tokens=10, temperature=1e-6, seed=5)) == greedy


def _one_step_samples(model, n_rows, **kw):
    """One sampled token from each of ``n_rows`` copies of one prompt (each row has its own
    random stream), and the logits they were drawn from."""
    prompt = [4, 2]
    steps = list(generate(model, [prompt] * n_rows, max_new_tokens=1, **kw))
    tokens = np.array([ev.token for ev in steps[0]])
    logits = model.logits(fm.tensor([prompt])).numpy()[0, -1]
    return tokens, logits


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampling_frequencies_follow_the_temperature(model, temperature):
    tokens, logits = _one_step_samples(model, 3000, temperature=temperature, seed=11)
    want = next_token_probs(logits, temperature)
    freq = np.bincount(tokens, minlength=CFG.vocab_size) / tokens.size
    # 3000 draws: each frequency is within ~4 standard deviations of its probability
    assert np.all(np.abs(freq - want) <= 4 * np.sqrt(want * (1 - want) / tokens.size) + 1e-3)


def test_temperature_sharpens_and_flattens():
    logits = np.array([2.0, 1.0, 0.5, -1.0])
    entropy = lambda p: -np.sum(p[p > 0] * np.log(p[p > 0]))  # noqa: E731
    h = [entropy(next_token_probs(logits, t)) for t in (0, 0.3, 1.0, 3.0, 100.0)]
    assert h[0] == 0.0 and h == sorted(h)
    assert h[-1] == pytest.approx(np.log(4), abs=1e-3)
    np.testing.assert_allclose(next_token_probs(logits, 1.0), np.exp(logits) / np.exp(logits).sum())


def test_top_k_and_top_p_restrict_the_support(model):
    tokens, logits = _one_step_samples(model, 400, top_k=3, seed=12)
    assert set(tokens) <= set(np.argsort(-logits)[:3].tolist())
    assert len(set(tokens)) > 1
    p = next_token_probs(logits)
    order = np.argsort(-p)
    n_nucleus = int(np.searchsorted(np.cumsum(p[order]), 0.6)) + 1
    tokens, _ = _one_step_samples(model, 400, top_p=0.6, seed=13)
    assert set(tokens) <= set(order[:n_nucleus].tolist())


def test_next_token_probs_top_k_ties_and_top_p():
    z = np.array([1.0, 3.0, 3.0, 3.0, 0.0])
    p = next_token_probs(z, top_k=2)                     # exactly two kept, lowest ids first
    np.testing.assert_allclose(p, [0, 0.5, 0.5, 0, 0])
    assert next_token_probs(z, top_k=1).tolist() == [0, 1, 0, 0, 0]
    p = next_token_probs(np.log([0.1, 0.6, 0.3]), top_p=0.6)   # 0.6 reached by the top token
    np.testing.assert_allclose(p, [0, 1, 0])
    p = next_token_probs(np.log([0.1, 0.6, 0.3]), top_p=0.61)
    np.testing.assert_allclose(p, [0, 2 / 3, 1 / 3])


def test_padded_vocab_is_never_sampled():
    model = make_model(seed=1)
    wte = model.params["wte.weight"].numpy()
    wte[CFG.vocab_size:] = 100.0 * np.abs(wte[: CFG.padded_vocab_size - CFG.vocab_size])
    model = GPT2(CFG, dict(model.params, **{"wte.weight": fm.tensor(wte)}))
    cache = model.new_cache(1)
    padded = model.forward_cached(fm.tensor([[1, 2]]), cache).numpy()[0, -1]
    assert padded[CFG.vocab_size:].max() > padded[: CFG.vocab_size].max()  # padding would win
    for kw in (dict(temperature=0), dict(temperature=5.0), dict(top_p=0.5)):
        assert all(t < CFG.vocab_size for t in generate(model, [1, 2], max_new_tokens=20, **kw))


# -- stopping ------------------------------------------------------------------------------


def test_stop_token_ends_the_row_and_is_yielded(model):
    greedy = list(generate(model, [1, 2, 3], max_new_tokens=12, temperature=0))
    stop = greedy[4]
    first = greedy.index(stop)
    got = list(generate(model, [1, 2, 3], max_new_tokens=12, temperature=0, stop_tokens=[stop]))
    assert got == greedy[: first + 1]
    steps = list(generate(model, [[1, 2, 3]], max_new_tokens=12, temperature=0, stop_tokens=stop))
    assert steps[-1] == [TokenEvent(0, stop, first, "stop_token")]


def test_stop_string_ends_the_row_and_generate_text_cuts_it(model):
    tok = CharTokenizer("abcdefghijklmnopqrstuvw")                       # 23 characters
    prompt = "abc"
    text = generate_text(model, tok, prompt, max_new_tokens=12, temperature=0)
    assert len(text) == 12
    assert text == tok.decode(generate(model, tok.encode(prompt), max_new_tokens=12, temperature=0))
    stop = text[3:5]
    cut = text.find(stop)
    got = list(generate(model, tok.encode(prompt), max_new_tokens=12, temperature=0,
                        stop_strings=[stop], tokenizer=tok))
    assert tok.decode(got) == text[: cut + 2]
    steps = list(generate(model, [tok.encode(prompt)], max_new_tokens=12, temperature=0,
                          stop_strings=stop, tokenizer=tok))
    assert steps[-1][0].finish == "stop_string"
    assert generate_text(model, tok, prompt, max_new_tokens=12, temperature=0,
                         stop_strings=[stop]) == text[:cut]
    stop_id = tok.encode(text[2])[0]
    assert generate_text(model, tok, prompt, max_new_tokens=12, temperature=0,
                         stop_tokens=[stop_id]) == text[: text.index(text[2])]


def test_max_new_tokens_and_context_full(model):
    steps = list(generate(model, [[1] * 5], max_new_tokens=3, temperature=0))
    assert [s[0].finish for s in steps] == [None, None, "max_new_tokens"]
    n = CFG.block_size - 3
    steps = list(generate(model, [[1] * n], max_new_tokens=10, temperature=0))
    assert [s[0].finish for s in steps] == [None, None, "context_full"]
    assert [e.token for s in steps for e in s] == greedy_reference(model, [1] * n, 10)
    assert list(generate(model, [1] * CFG.block_size, max_new_tokens=10)) == []
    assert list(generate(model, [1, 2], max_new_tokens=0)) == []


# -- batches -------------------------------------------------------------------------------


def test_batch_of_different_lengths_equals_each_prompt_alone(model):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1], [2, 3, 4], [20, 19, 18, 17]]
    alone = [list(generate(model, p, max_new_tokens=9, temperature=0)) for p in prompts]
    rows = [[] for _ in prompts]
    for events in generate(model, prompts, max_new_tokens=9, temperature=0):
        assert events and all(isinstance(e, TokenEvent) for e in events)
        assert len({e.row for e in events}) == len(events)       # one token per row per step
        for e in events:
            assert e.index == len(rows[e.row])
            rows[e.row].append(e.token)
    assert rows == alone
    # sampling too: row 0 of a batch draws from the stream a single prompt uses
    sampled = list(generate(model, prompts[0], max_new_tokens=9, seed=21))
    batch = [e.token for s in generate(model, prompts, max_new_tokens=9, seed=21) for e in s if e.row == 0]
    assert batch == sampled


def test_finished_rows_stop_yielding(model):
    prompts = [[1, 2], [3, 4, 5]]
    alone = [list(generate(model, p, max_new_tokens=10, temperature=0)) for p in prompts]
    stop = alone[0][0]
    want = [a[: a.index(stop) + 1] if stop in a else a for a in alone]
    assert len(want[0]) < len(want[1])          # row 0 stops early, row 1 goes on
    rows = {0: [], 1: []}
    for events in generate(model, prompts, max_new_tokens=10, temperature=0, stop_tokens=[stop]):
        for e in events:
            assert not rows[e.row] or rows[e.row][-1].finish is None   # nothing after finish
            rows[e.row].append(e)
    assert [[e.token for e in rows[r]] for r in (0, 1)] == want
    assert rows[0][-1].finish == "stop_token"


def test_cache_is_allocated_once(model, monkeypatch):
    from forge_ml.inference import decode
    made, used = [], set()
    empty, forward_cached = decode.KVCache.empty.__func__, model.forward_cached

    def counting_empty(cls, *a, **kw):
        made.append(empty(cls, *a, **kw))
        return made[-1]

    def recording_forward_cached(ids, cache, *a, **kw):
        used.add(id(cache))
        return forward_cached(ids, cache, *a, **kw)

    monkeypatch.setattr(decode.KVCache, "empty", classmethod(counting_empty))
    monkeypatch.setattr(model, "forward_cached", recording_forward_cached)
    out = list(generate(model, [[1, 2, 3], [4]], max_new_tokens=8, temperature=0.8))
    assert len(out) == 8 + 2
    assert len(made) == 1 and used == {id(made[0])}
    assert made[0].k[0].shape[0] == 2 and made[0].capacity == 3 + 8 - 1
    assert made[0].pos == made[0].capacity


# -- errors --------------------------------------------------------------------------------


def test_prompt_longer_than_context_is_a_shape_error(model):
    with pytest.raises(ShapeError, match=r"25 tokens.*context of 24"):
        generate(model, [1] * 25)
    with pytest.raises(ShapeError, match=r"prompt 1 has 30 tokens.*24"):
        generate(model, [[1], [2] * 30])


def test_bad_prompts_and_arguments(model):
    with pytest.raises(ShapeError, match="empty"):
        generate(model, [])
    with pytest.raises(ShapeError, match="prompt 1 is empty"):
        generate(model, [[1], []])
    with pytest.raises(ShapeError, match="out of range"):
        generate(model, [1, CFG.vocab_size])
    with pytest.raises(ConfigError, match="tokenizer"):
        generate(model, [1], stop_strings=["x"])
    for bad in (dict(temperature=-1), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5),
                dict(max_new_tokens=-1), dict(seed=-3)):
        with pytest.raises(ConfigError):
            generate(model, [1], **bad)
