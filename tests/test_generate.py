"""Sampling loop tests: greedy against a no-cache reference, determinism, temperature,
top-k, top-p and min-p, the repetition penalty, log-probabilities, stop tokens and strings,
batches of different lengths, the context limit, the errors, and one KV cache per call.
(tests/test_sampling_hf.py checks the choice against transformers' processors.)"""
import re

import numpy as np
import pytest

import forge_ml as fm
from forge_ml.errors import ConfigError, ShapeError
from forge_ml.inference.generate import (TokenEvent, apply_repetition_penalty, generate,
                                         generate_text, next_token_probs, stream_tokens,
                                         token_logprobs)
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


def test_seeds_outside_64_bits_are_refused_not_aliased(model):
    """The seed becomes a 64-bit Philox key: 2**64 drew seed 0's tokens and 2**64 + 5 seed
    5's. Every entry point refuses it, naming the range and the value; 2**64 - 1 is taken,
    and a sliding window's seed + 1 past it wraps rather than fail mid-stream."""
    for bad in (1 << 64, (1 << 64) + 5, -1, 1 << 80):
        msg = re.escape(f"generate: seed must be an int in [0, 2**64), got {bad}")
        with pytest.raises(ConfigError, match=msg):
            generate(model, [2, 7], max_new_tokens=4, seed=bad)
        with pytest.raises(ConfigError, match=msg.replace("generate", "stream_tokens")):
            stream_tokens(model, [2, 7], 4, seed=bad)   # its errors name it
        with pytest.raises(ConfigError, match=msg):
            generate_text(model, CharTokenizer("abcdefghijklmnopqrstuvw"), "ab", 4, seed=bad)
    top = (1 << 64) - 1
    assert len(list(generate(model, [2, 7], max_new_tokens=4, seed=top))) == 4
    assert len(list(stream_tokens(model, [2, 7], CFG.block_size + 4, seed=top))) == CFG.block_size + 4


def test_knobs_past_float32_and_logprobs_in_generate_text_are_refused_clearly(model):
    """An infinite temperature (or one past float32, which the device's knobs are: 1e308
    printed NumPy's cast warning) is refused as the command line refuses it; generate_text's
    logprobs name generate's batch form, and stream_tokens' errors name stream_tokens."""
    for t in (float("inf"), 1e308):
        with pytest.raises(ConfigError, match="temperature must be >= 0 .* finite in float32"):
            generate(model, [2, 7], max_new_tokens=2, temperature=t)
    assert len(list(generate(model, [2, 7], max_new_tokens=2, temperature=3e38))) == 2
    with pytest.raises(ConfigError, match=r"generate_text returns text alone; .*logprobs=n"):
        generate_text(model, CharTokenizer("abcdefghijklmnopqrstuvw"), "ab", 4, logprobs=2)
    with pytest.raises(ConfigError, match="^stream_tokens: temperature must be >= 0"):
        stream_tokens(model, [2, 7], 4, temperature=-1)


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
    p = next_token_probs(z, top_k=2)                     # ties with the k-th stay, as in transformers
    np.testing.assert_allclose(p, [0, 1 / 3, 1 / 3, 1 / 3, 0])
    np.testing.assert_allclose(next_token_probs(z, top_k=1), [0, 1 / 3, 1 / 3, 1 / 3, 0])
    np.testing.assert_allclose(next_token_probs(np.array([1.0, 3.0, 2.0]), top_k=1), [0, 1, 0])
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
    stop_id = tok.encode(text[2])[0]      # no special token: the text keeps it (as vLLM)
    assert generate_text(model, tok, prompt, max_new_tokens=12, temperature=0,
                         stop_tokens=[stop_id]) == text[: text.index(text[2]) + 1]


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
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                dict(max_new_tokens=-1), dict(seed=-3)):
        with pytest.raises(ConfigError):
            generate(model, [1], **bad)


# -- min-p, repetition penalty, log-probabilities ------------------------------------------


def test_token_event_keeps_its_positional_form():
    e = TokenEvent(2, 7, 3, "stop_token")
    assert (e.row, e.token, e.index, e.finish, e.logprob, e.top_logprobs) == \
        (2, 7, 3, "stop_token", None, None)
    assert e == TokenEvent(row=2, token=7, index=3, finish="stop_token")


def test_min_p_one_is_greedy_and_min_p_restricts_the_support(model):
    prompt = [9, 8, 7]
    greedy = list(generate(model, prompt, max_new_tokens=10, temperature=0))
    assert list(generate(model, prompt, max_new_tokens=10, min_p=1.0, seed=3)) == greedy
    tokens, logits = _one_step_samples(model, 400, min_p=0.2, seed=14)
    p = next_token_probs(logits)
    assert set(tokens) <= set(np.flatnonzero(p >= 0.2 * p.max()).tolist())
    assert len(set(tokens)) > 1
    assert np.array_equal(next_token_probs(logits, min_p=0.0), p)


def greedy_penalised_reference(model, prompt, n, penalty):
    """Greedy decoding with the CTRL penalty over the whole sequence, without a cache."""
    seq = list(prompt)
    for _ in range(n):
        z = model.logits(fm.tensor([seq])).numpy()[0, -1]
        seq.append(int(np.argmax(apply_repetition_penalty(z, penalty, seq))))
    return seq[len(prompt):]


def test_greedy_with_repetition_penalty_equals_a_no_cache_reference(model):
    prompt = [3, 1, 4, 1, 5]
    plain = list(generate(model, prompt, max_new_tokens=14, temperature=0))
    for penalty in (1.5, 0.6):
        got = list(generate(model, prompt, max_new_tokens=14, temperature=0,
                            repetition_penalty=penalty))
        assert got == greedy_penalised_reference(model, prompt, 14, penalty)
        assert got != plain
    assert len(set(got)) < len(set(plain))          # a penalty < 1 favours repeats
    assert list(generate(model, prompt, max_new_tokens=14, temperature=0,
                         repetition_penalty=1.0)) == plain
    # the penalty's context is the row's own: a batch row equals the prompt alone
    steps = list(generate(model, [[2], prompt], max_new_tokens=14, temperature=0,
                          repetition_penalty=1.5))
    assert [e.token for s in steps for e in s if e.row == 1] == \
        greedy_penalised_reference(model, prompt, 14, 1.5)


@pytest.mark.parametrize("penalty", [1e-300, 1e-40, 1e40, 1e300])
def test_a_penalty_past_float32_samples_on_the_device_as_on_the_host(model, penalty):
    """generate took repetition_penalty=1e-300 (its check: > 0) and then failed in the device
    chain's knobs ("repetition_penalty 0.0; expected > 0"), float32 rounding it to 0. The
    knobs hold it to [1e-30, 1e30]: the chain (no logprobs) gives the host path's tokens
    (logprobs on), and greedy, the argmax of the logits penalised in float64 with the penalty
    as given (a reference the clamp could break)."""
    prompt = [3, 1, 4, 1, 5]
    for temperature in (0.8, 1e-40, 0.0):
        kw = dict(max_new_tokens=8, temperature=temperature, repetition_penalty=penalty, seed=4)
        chained = list(generate(model, prompt, **kw))
        host = [s[0].token for s in generate(model, [prompt], logprobs=1, **kw)]
        assert chained == host, temperature
        if temperature == 0.0:
            assert chained == greedy_penalised_reference(model, prompt, 8, penalty)


def test_repetition_penalty_counts_prompt_and_generated_tokens():
    z = np.array([2.0, -1.0, 0.5, 3.0])
    np.testing.assert_allclose(apply_repetition_penalty(z, 2.0, [3, 1, 3]), [2.0, -2.0, 0.5, 1.5])
    np.testing.assert_allclose(apply_repetition_penalty(z, 2.0, []), z)
    np.testing.assert_allclose(apply_repetition_penalty(z, 0.5, [0]), [4.0, -1.0, 0.5, 3.0])


def test_logprobs_leave_the_tokens_alone_and_describe_the_distribution(model):
    prompts = [[4, 2], [1, 2, 3, 4]]
    kw = dict(max_new_tokens=6, temperature=0.9, top_k=5, seed=8)
    plain = [[(e.row, e.token) for e in s] for s in generate(model, prompts, **kw)]
    steps = list(generate(model, prompts, logprobs=3, **kw))
    assert [[(e.row, e.token) for e in s] for s in steps] == plain
    for e in (e for s in steps for e in s):
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        lps = [lp for _, lp in e.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert e.token in dict(e.top_logprobs) or e.logprob <= lps[-1]
        if e.token in dict(e.top_logprobs):
            assert dict(e.top_logprobs)[e.token] == e.logprob
    # before the cuts: the logprobs of a top-k run equal those of an uncut one
    uncut = list(generate(model, [[4, 2]], max_new_tokens=1, temperature=0.9,
                          logprobs=CFG.vocab_size))
    first = [s[0] for s in steps if s[0].row == 0][0]
    top3 = uncut[0][0].top_logprobs[:3]
    assert [t for t, _ in top3] == [t for t, _ in first.top_logprobs]
    np.testing.assert_allclose([lp for _, lp in top3], [lp for _, lp in first.top_logprobs],
                               atol=1e-5)             # a batch of 1 vs 2: float32 rounding
    full = dict(uncut[0][0].top_logprobs)
    assert sorted(full) == list(range(CFG.vocab_size))
    assert sum(np.exp(lp) for lp in full.values()) == pytest.approx(1.0)


def test_logprobs_greedy_and_ties():
    z = np.array([1.0, 3.0, 3.0, 0.0])
    logp = token_logprobs(z, 0)
    np.testing.assert_allclose(np.exp(logp), np.exp(z) / np.exp(z).sum())
    from forge_ml.inference.generate import _top_logprobs
    assert [t for t, _ in _top_logprobs(logp, 3)] == [1, 2, 0]      # ties: lower id first
    assert [t for t, _ in _top_logprobs(logp, 4)] == [1, 2, 0, 3]
    assert _top_logprobs(logp, 0) == ()


def test_greedy_logprobs_use_the_host_path_and_match_the_device_chain(model):
    prompts = [[5, 6, 7], [1]]
    greedy = [[e.token for e in s] for s in generate(model, prompts, max_new_tokens=8,
                                                       temperature=0)]
    steps = list(generate(model, prompts, max_new_tokens=8, temperature=0, logprobs=1))
    assert [[e.token for e in s] for s in steps] == greedy
    for e in (e for s in steps for e in s):
        assert e.top_logprobs == ((e.token, e.logprob),)


def test_generate_text_and_stream_tokens_take_the_new_options(model):
    tok = CharTokenizer("abcdefghijklmnopqrstuvw")
    ids = tok.encode("abc")
    want = list(generate(model, ids, max_new_tokens=10, temperature=0, repetition_penalty=1.5))
    assert generate_text(model, tok, "abc", max_new_tokens=10, temperature=0,
                         repetition_penalty=1.5) == tok.decode(want)
    assert list(stream_tokens(model, ids, 10, temperature=0, repetition_penalty=1.5)) == want
    got = list(stream_tokens(model, ids, 10, temperature=0.7, min_p=1.0))
    assert got == list(generate(model, ids, max_new_tokens=10, temperature=0))


def test_stream_tokens_takes_one_stop_token_as_generate_does(model):
    ids = [1, 2, 3]
    want = list(generate(model, ids, max_new_tokens=10, temperature=0))
    stop = want[3]
    cut = want[: want.index(stop) + 1]
    assert list(generate(model, ids, max_new_tokens=10, temperature=0, stop_tokens=stop)) == cut
    assert list(stream_tokens(model, ids, 10, temperature=0, stop_tokens=stop)) == cut
    assert list(stream_tokens(model, ids, 10, temperature=0, stop_tokens=[stop])) == cut


def test_bad_new_arguments(model):
    for bad in (dict(min_p=-0.1), dict(min_p=1.5), dict(min_p="x"),
                dict(repetition_penalty=0), dict(repetition_penalty=-1.0),
                dict(repetition_penalty=float("inf")), dict(repetition_penalty=True),
                dict(logprobs=-1), dict(logprobs=CFG.vocab_size + 1), dict(logprobs=1.5)):
        with pytest.raises(ConfigError):
            generate(model, [[1]], **bad)
    with pytest.raises(ConfigError, match=r"batch form.*\[prompt\]"):
        generate(model, [1, 2], logprobs=2)
    with pytest.raises(TypeError, match="beam_search"):
        generate(model, [1, 2], num_beams=3)
    with pytest.raises(TypeError, match="unexpected"):
        generate(model, [1, 2], top_n=3)


@pytest.mark.parametrize("bad", [dict(stop_tokens="5"), dict(stop_tokens=[1.7]),
                                 dict(stop_tokens=["a"]), dict(stop_tokens=[True]),
                                 dict(stop_strings=[5]), dict(stop_strings=b"x"),
                                 dict(stop_strings=[""])])
def test_bad_stop_arguments_are_config_errors_at_the_call(model, bad):
    # "5" and [1.7] used to become stop token 5 and 1; [5] as a stop string failed mid-stream
    tok = CharTokenizer("abcdefghijklmnopqrstuvw")
    with pytest.raises(ConfigError, match="stop_"):
        generate(model, [1, 2], max_new_tokens=3, tokenizer=tok, **bad)
    with pytest.raises(ConfigError, match="stop_"):
        generate_text(model, tok, "ab", max_new_tokens=3, **bad)


def test_stop_arguments_may_be_none(model):
    want = list(generate(model, [1, 2], max_new_tokens=3, temperature=0))
    assert list(generate(model, [1, 2], max_new_tokens=3, temperature=0, stop_tokens=None,
                         stop_strings=None)) == want


@pytest.mark.cuda
def test_new_options_on_the_gpu_equal_the_cpu(model):
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no GPU")
    except Exception as e:  # no cupy, no driver, no device
        pytest.skip(f"no CUDA GPU: {e}")
    gpu = model.to("cuda")
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    for kw in (dict(temperature=0, repetition_penalty=1.5, logprobs=3),
               dict(temperature=0, logprobs=2),
               dict(temperature=0.8, top_k=8, min_p=0.05, repetition_penalty=1.3, logprobs=1),
               dict(temperature=0.8, presence_penalty=0.9, frequency_penalty=0.6,
                    logit_bias={4: 2.0, 9: -100}, logprobs=2),
               dict(temperature=0, frequency_penalty=1.2, logprobs=1)):
        want = [e for s in generate(model, prompts, max_new_tokens=12, seed=4, **kw) for e in s]
        for _ in range(2):                  # the second call replays the captured step
            got = [e for s in generate(gpu, prompts, max_new_tokens=12, seed=4, **kw) for e in s]
            assert [(e.row, e.token, e.finish) for e in got] == \
                [(e.row, e.token, e.finish) for e in want]
            np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want],
                                       atol=1e-4)
            # and chained on the device (no logprobs: the sampling kernels, penalize_logits)
            chained = [e for s in generate(gpu, prompts, max_new_tokens=12, seed=4,
                                           **{**kw, "logprobs": None}) for e in s]
            assert [(e.row, e.token) for e in chained] == [(e.row, e.token) for e in want]


@pytest.mark.parametrize("kw", [dict(temperature=1e-40), dict(temperature=1.0, repetition_penalty=1e-40),
                                dict(temperature=0.7, repetition_penalty=1e-300, top_k=5),
                                dict(temperature=5e-324), dict(temperature=1e-300)])
def test_knobs_past_float32s_range_choose_the_top_logprob(kw):
    """A temperature or penalty that overflows float32 sampled from weights of exp(0 * inf)
    (or between float32 ties of logits float64 keeps apart): the chosen token was not the one
    the reported log-probabilities put all the mass on. Now it is, with no warning."""
    import warnings
    model = GPT2.init(GPT2Config(vocab_size=50, block_size=16, n_layer=1, n_head=1, n_embd=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        events = [e[0] for e in generate(model, [[1, 2, 3]], max_new_tokens=6, seed=1, logprobs=2, **kw)]
    assert [e.token for e in events] == [e.top_logprobs[0][0] for e in events]
    assert all(e.logprob == 0.0 and len(e.top_logprobs) == 2 for e in events)   # 5e-324: NaN, ()


def test_prompts_as_integer_tensors():
    """An int Tensor prompt (1-d: one prompt, 2-d: a batch) is taken as its ids, as transformers
    takes input_ids; stream_tokens gave a TypeError traceback and generate a ShapeError."""
    model = GPT2.init(GPT2Config(vocab_size=50, block_size=16, n_layer=1, n_head=1, n_embd=8))
    want = list(generate(model, [1, 2, 3], max_new_tokens=3, temperature=0))
    assert list(generate(model, fm.tensor([1, 2, 3]), max_new_tokens=3, temperature=0)) == want
    assert list(stream_tokens(model, fm.tensor([1, 2, 3]), 3, temperature=0)) == want
    batch = [e[0].token for e in generate(model, fm.tensor([[1, 2, 3]]), max_new_tokens=3, temperature=0)]
    assert batch == want
    with pytest.raises(ShapeError, match="one prompt"):
        list(stream_tokens(model, [[1, 2], [3, 4]], 2))
    with pytest.raises(ShapeError, match="token ids .*got a float32 Tensor"):
        list(generate(model, fm.tensor([1.0, 2.0]), max_new_tokens=2))
    # stream_tokens' errors name stream_tokens (its empty prompt said "generate:")
    with pytest.raises(ShapeError, match="^stream_tokens: the prompt is empty"):
        list(stream_tokens(model, [], 2))


def test_numpy_integer_max_new_tokens(model):
    """generate accepts a NumPy integer max_new_tokens, but the KV cache it sized from it
    refused the size ('new_cache: max_len must be in 1..20, got 4')."""
    want = list(generate(model, [1, 2], 3, temperature=0))
    assert list(generate(model, [1, 2], np.int64(3), temperature=0)) == want
    from forge_ml.inference.beam import beam_search
    assert beam_search(model, [1, 2], np.int64(3), num_beams=2) == beam_search(model, [1, 2], 3, num_beams=2)


@pytest.mark.filterwarnings("ignore:DecodeStep")
def test_two_generators_interleaved_never_share_a_kept_decoder(monkeypatch):
    """Where the backend captures graphs (the GPU), generate takes a kept (cache, step) pair and
    the next call of the same shape got that pair back, emptied, while the first generator
    still used it: resumed, the first went on from the second prompt's keys (wrong tokens, or
    a ShapeError). A running generator now holds its pair; the other call gets its own. The
    CPU is made to take the graph path here (its captures fail and it runs op by op)."""
    import forge_ml.inference.decode as D
    monkeypatch.setattr(D.graph, "available", lambda dev: True)
    cfg = GPT2Config(vocab_size=37, block_size=24, n_layer=2, n_head=2, n_embd=32)
    sd = GPT2.init(cfg, seed=6).state_dict()   # weights scaled up: the next token hangs on the prefix
    m = GPT2.from_state_dict(cfg, {k: v * 25 if v.ndim == 2 else v for k, v in sd.items()})
    alone = list(generate(m, [1, 2, 3, 4], 10, temperature=0))
    other = list(generate(m, [9, 8, 7, 6], 10, temperature=0))
    a = generate(m, [1, 2, 3, 4], 10, temperature=0)
    got = [next(a)]
    assert list(generate(m, [9, 8, 7, 6], 10, temperature=0)) == other
    got += list(a)
    assert got == alone
    assert list(generate(m, [1, 2, 3, 4], 10, temperature=0)) == alone   # the kept pair again
    assert not m._decoder_kept[2].held


def test_generation_arguments_are_checked_at_the_call():
    """A library user's findings: stream_tokens checked its arguments at the first next() (and
    looped forever on a 1-token context), a stop id past the vocabulary could never fire and
    ran to max_new_tokens in silence, and an int dtype truncated every weight at init."""
    from forge_ml.errors import ConfigError, DTypeError
    from forge_ml.inference.generate import generate, stream_tokens
    from forge_ml.models.gpt2 import GPT2, GPT2Config
    m = GPT2.init(GPT2Config(vocab_size=50, block_size=8, n_layer=1, n_head=1, n_embd=4))
    for kw in (dict(max_new_tokens=None), dict(max_new_tokens=-5), dict(max_new_tokens=3, temperature=-1)):
        with pytest.raises(ConfigError):
            stream_tokens(m, [1, 2, 3], **kw)          # no next() needed
    one = GPT2.init(GPT2Config(vocab_size=5, block_size=1, n_layer=1, n_head=1, n_embd=4))
    with pytest.raises(ConfigError, match="needs at least 2"):
        stream_tokens(one, [1], 3)
    for stop in ([50256], -1):
        with pytest.raises(ConfigError, match="out of range"):
            list(generate(m, [1, 2, 3], 10, stop_tokens=stop))
        with pytest.raises(ConfigError, match="out of range"):
            stream_tokens(m, [1, 2, 3], 10, stop_tokens=stop)
    assert len(list(stream_tokens(m, [1, 2], 20, temperature=0))) == 20   # the window still slides
    with pytest.raises(DTypeError, match="float32, float64 or bfloat16"):
        GPT2.init(GPT2Config(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4), dtype="int32")


@pytest.mark.parametrize("call,match", [
    (lambda f: f.next_token_probs(np.log([0.5, 0.3, 0.2]), -1), "temperature must be >= 0"),
    (lambda f: f.next_token_probs(np.log([0.5, 0.3, 0.2]), 1, min_p=2), "min_p must be None or in"),
    (lambda f: f.next_token_probs(np.log([0.5, 0.3, 0.2]), 1, top_k=-1), "top_k must be None or an int >= 0"),
    (lambda f: f.next_token_probs(np.log([0.5, 0.3, 0.2]), 1, top_p=0), "top_p must be None or in"),
    (lambda f: f.token_logprobs(np.log([0.5, 0.3, 0.2]), -1), "temperature must be >= 0"),
    (lambda f: f.token_logprobs(np.zeros(3), float("nan")), "temperature must be >= 0"),
    (lambda f: f.apply_repetition_penalty(np.ones(3), 2.0, [-1]), "negative"),
])
def test_the_exported_sampling_helpers_check_their_arguments(call, match):
    """The helpers generate is written with are public (and next_token_probs is the reference
    the tests draw against): a negative temperature inverted the distribution, min_p 2 gave
    NaNs, top_k 0 a raw NumPy error, id -1 penalised the last token (a library user's report)."""
    from forge_ml.errors import ConfigError
    import forge_ml.inference as g   # the package exports them
    with pytest.raises(ConfigError, match=match):
        call(g)


def _cuda_or_cpu(device):
    if device == "cuda":
        from _gpu_checks import cuda_or_skip
        cuda_or_skip()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda),
                                    pytest.param("cuda-bf16", marks=pytest.mark.cuda)])
def test_weights_with_nan_or_inf_are_named_not_generated_from(device):
    """A model whose weights hold NaN gave id 0 at every step, greedy or sampled (the argmax of
    NaN logits), on both backends, where transformers' sampling raises (a library user's
    report): now generate and beam_search refuse it at the prompt, naming the parameter."""
    from forge_ml.errors import ModelError
    from forge_ml.inference import beam_search
    _cuda_or_cpu(device.split("-")[0])
    dtype = "bfloat16" if device.endswith("bf16") else None
    device = device.split("-")[0]
    for name, value, what in (("h.1.attn.c_proj.weight", np.nan, "holds 3 NaN of 256 values"),
                              ("ln_f.bias", np.inf, "holds 3 inf of 16 values")):
        m = make_model()
        m.params[name].data[:3] = value           # (a row of a matrix: 3 x 16 values)
        if m.params[name].data.ndim == 2:
            m.params[name].data[:, :] = 0.0
            m.params[name].data[0, :3] = value
        m = m.to(device, dtype=dtype)
        needle = f"the model's logits for the prompt hold NaN or inf, so no token can be chosen: " \
                 f"its parameter {name} {what}"
        for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9), dict(logprobs=2)):
            prompts = [[1, 2, 3], [4, 5]] if "logprobs" in kw else [1, 2, 3]
            with pytest.raises(ModelError, match=re.escape("generate: " + needle)):
                list(generate(m, prompts, max_new_tokens=4, **kw))
        with pytest.raises(ModelError, match=re.escape("beam_search: " + needle)):
            beam_search(m, [1, 2, 3], max_new_tokens=4, num_beams=2)
        with pytest.raises(ModelError, match=re.escape("beam_search: " + needle)):   # (said generate:)
            beam_search(m, [1, 2, 3], max_new_tokens=4, num_beams=1)
    # finite weights whose logits overflow: said as such, not blamed on a parameter
    m = make_model()
    m.params["ln_f.weight"].data[:] = 3e38
    with pytest.raises(ModelError, match="every parameter is finite, so an activation overflowed"):
        list(generate(m.to(device, dtype=dtype), [1, 2, 3], max_new_tokens=2, temperature=0))
    # and a healthy model still generates on the device the check reads from
    assert len(list(generate(make_model().to(device, dtype=dtype), [1, 2, 3], max_new_tokens=4))) == 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda),
                                    pytest.param("cuda-bf16", marks=pytest.mark.cuda)])
def test_a_nan_that_arises_past_the_prompt_stops_generate_where_it_arises(device):
    """A NaN read first at a later position (here a row of the position embedding) made the
    device's chain (the argmax and the sampler on the GPU, no logits read back) go on from the
    NaN's id in silence; the host path said it. Now both raise at that position, naming the
    parameter, after the tokens before it (the same as a healthy model's)."""
    from forge_ml.errors import ModelError
    _cuda_or_cpu(device.split("-")[0])
    dtype = "bfloat16" if device.endswith("bf16") else None
    device = device.split("-")[0]
    healthy = make_model()
    sick = make_model()
    sick.params["wpe.weight"].data[6, :] = np.nan          # read by the token fed at position 6
    healthy, sick = healthy.to(device, dtype=dtype), sick.to(device, dtype=dtype)
    needle = ("generate: the model's logits for the tokens at position 6 hold NaN or inf, so no "
              "token can be chosen: its parameter wpe.weight holds 16 NaN")
    for kw in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=3),
               dict(temperature=0.8, repetition_penalty=1.3, seed=3)):
        want = list(generate(healthy, [1, 2, 3], max_new_tokens=12, **kw))[:4]   # positions 3-6
        got = []
        with pytest.raises(ModelError, match=re.escape(needle)):
            for t in generate(sick, [1, 2, 3], max_new_tokens=12, **kw):
                got.append(t)
        assert got == want, kw


def test_generate_text_keeps_a_stop_token_that_is_not_special(model):
    # as forge-ml sample and serve (and transformers' pipeline, vLLM): a special stop token
    # (<|endoftext|>) is no text, another one is; a char tokenizer has no special tokens
    tok = CharTokenizer("abcdefghijklmnopqrstuvw")
    full = list(generate(model, tok.encode("abc"), max_new_tokens=10, temperature=0))
    stop = full[3]
    text = generate_text(model, tok, "abc", max_new_tokens=10, temperature=0, stop_tokens=[stop])
    assert text == tok.decode(full[:full.index(stop) + 1])

    class Special(CharTokenizer):
        def is_special(self, token_id):
            return token_id == stop
    special = Special("abcdefghijklmnopqrstuvw")
    assert generate_text(model, special, "abc", max_new_tokens=10, temperature=0,
                         stop_tokens=[stop]) == tok.decode(full[:full.index(stop)])


def test_one_row_helpers_and_the_model_are_checked():
    """next_token_probs and token_logprobs take one row ((V,), or (1, V)): a (B, V) array
    became one distribution over B x V ids; generate, stream_tokens and beam_search name a
    model that is not one (they failed with "'NoneType' object has no attribute 'config'")."""
    import forge_ml.inference as g
    from forge_ml.errors import ShapeError
    from forge_ml.inference.engine import RequestError, SamplingParams
    two = np.log([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    for call in (lambda: g.next_token_probs(two, temperature=0), lambda: g.token_logprobs(two),
                 lambda: g.next_token_probs(np.float64(1.0))):
        with pytest.raises(ShapeError, match="^(next_token_probs|token_logprobs): expected one row"):
            call()
    assert g.next_token_probs(two[1], temperature=0).tolist() == [0.0, 0.0, 1.0]
    assert g.next_token_probs(two[1:], temperature=0).tolist() == [0.0, 0.0, 1.0]   # (1, V)
    np.testing.assert_array_equal(g.token_logprobs(two[:1]), g.token_logprobs(two[0]))
    for call, who in ((lambda: generate(None, [1], 2), "generate"),
                      (lambda: g.stream_tokens("gpt2", [1], 2), "stream_tokens"),
                      (lambda: g.beam_search(None, [1], 2, 2), "beam_search")):
        with pytest.raises(TypeError, match=f"^{who}: model must be a forge-ml language model"):
            call()
    with pytest.raises(RequestError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=float("inf"))       # (it said "a number >= 0")


def test_a_model_that_is_not_one_is_a_forge_error_that_is_still_a_type_error():
    """model_check raised a plain TypeError, the one user error of the package that
    ``except ForgeError`` missed; now a ModelTypeError: a ForgeError, and still a TypeError
    for code that catches that, from generate, stream_tokens, beam_search and BatchEngine."""
    import forge_ml.inference as g
    from forge_ml.errors import ForgeError, ModelTypeError
    from forge_ml.inference.batch import BatchEngine
    for call, who in ((lambda: generate(None, [1], 2), "generate"),
                      (lambda: g.stream_tokens("gpt2", [1], 2), "stream_tokens"),
                      (lambda: g.beam_search(object(), [1], 2, 2), "beam_search"),
                      (lambda: BatchEngine(None), "BatchEngine")):
        with pytest.raises(ForgeError, match=f"^{who}: model must be a forge-ml language model") as e:
            call()
        assert type(e.value) is ModelTypeError and isinstance(e.value, TypeError)
        assert not isinstance(e.value, ValueError)   # not a ModelError: nothing ran
    assert issubclass(ModelTypeError, fm.ForgeError)


def test_a_nan_past_the_prompt_is_refused_where_logits_come_to_the_host(model):
    """A weight row only a later position reads (wpe's) gives NaN logits there: generate with
    logprobs (whose logits come to the host every step) raises a ModelError naming it at that
    step; it yielded id 0 with NaN log-probabilities."""
    bad = GPT2(model.config, {k: fm.tensor(v.numpy().copy()) for k, v in model.params.items()})
    bad.params["wpe.weight"].data[6, :] = np.nan
    steps = generate(bad, [[1, 2, 3], [4, 5, 6]], 8, temperature=0, logprobs=1)
    for _ in range(4):                  # the tokens of positions 3-6 (fed at 2-5)
        assert all(np.isfinite(e.logprob) for e in next(steps))
    with pytest.raises(fm.ModelError, match="position 6 hold NaN or inf.*wpe.weight holds"):
        next(steps)


def test_logprobs_change_no_token_of_a_penalised_row():
    """With logprobs the host applied the repetition penalty in float64 (1.3 exactly), the
    chain in float32 (float32(1.3)): about half the penalised logits came out an ulp apart,
    and a near-tie flipped (a QA report: [6, 5, 5, 5] against [5, 5, 5, 5]). The host now
    draws by sample_row itself."""
    from forge_ml.models.gpt2 import GPT2Config
    cfg = GPT2Config(vocab_size=37, block_size=24, n_layer=1, n_head=1, n_embd=16)
    sd = GPT2.init(cfg, seed=0).state_dict()
    sd["wte.weight"][5] *= 40
    sd["wte.weight"][6] = sd["wte.weight"][5] / np.float32(1.3)
    m = GPT2.from_state_dict(cfg, sd)
    for kw in (dict(temperature=0, repetition_penalty=1.3), dict(temperature=1e-6, repetition_penalty=1.3, seed=2)):
        chained = list(generate(m, [5], 4, **kw))
        host = [e.token for s in generate(m, [[5]], 4, logprobs=1, **kw) for e in s]
        assert host == chained, kw


def test_numpy_scalars_are_taken_as_their_numbers(model):
    """np.uint8(250) new tokens after a 10-token prompt wrapped to 4 in the cache's size (a
    ShapeError about 3 rows); np.uint8 logprobs overflowed in the top-n cut; np.int8 top_k in
    next_token_probs; np.float16('inf') passed the temperature bound (compared in float16)."""
    prompt = list(range(10))
    a = list(generate(model, prompt, np.uint8(250), temperature=0))
    assert a == list(generate(model, prompt, 250, temperature=0))
    steps = list(generate(model, [[1, 2]], np.int8(3), logprobs=np.uint8(3), top_k=np.int16(5), seed=np.uint8(7)))
    assert all(len(e.top_logprobs) == 3 for s in steps for e in s)
    z = np.linspace(0, 1, 300)
    assert np.count_nonzero(next_token_probs(z, top_k=np.int8(3))) == 3
    with pytest.raises(ConfigError, match="temperature"):
        list(generate(model, [1], 2, temperature=np.float16("inf")))
    # a top_p below float32's least value is that value, not 0 ("off"): one token, as 1e-45
    tiny = {tuple(generate(model, [1], 3, top_p=1e-46, seed=s)) for s in range(6)}
    assert tiny == {tuple(generate(model, [1], 3, top_p=1e-45, seed=0))}


def test_the_one_row_helpers_take_a_tensor_one_id_and_refuse_fractional_ids(model):
    """next_token_probs(model output as a Tensor) failed in float(); context=np.int64(1) had no
    len(); context=[1.5] penalised id 1 in silence; generate(stop_tokens=np.array(5)) failed
    iterating a 0-d array."""
    z = np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_allclose(next_token_probs(fm.tensor(z)), next_token_probs(z))
    np.testing.assert_allclose(next_token_probs(z, repetition_penalty=2.0, context=np.int64(1)),
                               next_token_probs(z, repetition_penalty=2.0, context=[1]))
    with pytest.raises(ConfigError, match=r"next_token_probs: context must hold token ids"):
        next_token_probs(z, repetition_penalty=2.0, context=[1.5])
    for bad in ([np.inf, 1.0], [-np.inf, -np.inf], [np.nan, 1.0]):   # gave [nan, nan]
        with pytest.raises(ConfigError, match="give no distribution"):
            next_token_probs(np.array(bad))
    np.testing.assert_allclose(next_token_probs(np.array([-np.inf, 0.0])), [0.0, 1.0])
    for bad in ([np.inf, 1.0], [np.nan, 1.0]):
        with pytest.raises(ConfigError, match="token_logprobs: the logits hold NaN"):
            token_logprobs(np.array(bad))
    # an extreme penalty is held as the knobs hold it: a distribution, not "logits hold +inf"
    p = next_token_probs(np.array([1e10, 1.0]), repetition_penalty=1e-300, context=[0])
    assert p.tolist() == [1.0, 0.0]
    # whole numbers as floats are ids, as before; an id past the logits (even past int64) is
    # ignored, not wrapped to a negative one
    np.testing.assert_allclose(next_token_probs(z, repetition_penalty=2.0, context=np.array([0.0, 1.0])),
                               next_token_probs(z, repetition_penalty=2.0, context=[0, 1]))
    np.testing.assert_allclose(next_token_probs(z, repetition_penalty=2.0,
                                                context=np.array([2**63 + 5, 1], np.uint64)),
                               next_token_probs(z, repetition_penalty=2.0, context=[1]))
    a = list(generate(model, [1, 2], 6, temperature=0, stop_tokens=np.array(5)))
    assert a == list(generate(model, [1, 2], 6, temperature=0, stop_tokens=5))


def test_the_first_argument_of_each_entry_point_is_checked(model, tmp_path):
    """A QA report: Trainer(None), load_model(None) and generate_text(model, None, ...) failed
    deep inside ('NoneType' object has no attribute ...), and the model check pointed at a
    forge_ml.load that does not exist."""
    from forge_ml.errors import ConfigError
    from forge_ml.inference import generate_text, load_model
    from forge_ml.train import Trainer
    for call, says in ((lambda: Trainer(None), "Trainer: config must be a TrainConfig or a dict"),
                       (lambda: Trainer(str(tmp_path / "cfg.json")), "got str"),
                       (lambda: load_model(None), "load_model: path must be a checkpoint"),
                       (lambda: generate_text(model, None, "ab", 3), "generate_text: tokenizer must be"),
                       (lambda: generate_text(CharTokenizer("ab"), model, "ab", 3), "generate_text: tokenizer")):
        with pytest.raises((ConfigError, TypeError), match=says):
            call()
    with pytest.raises(TypeError, match=r"forge_ml\.inference\.load_model\), got NoneType"):
        list(generate(None, [1], 2))


# -- OpenAI's presence and frequency penalties and logit bias --------------------------------

def greedy_adjusted_reference(model, prompt, n, presence=0.0, frequency=0.0, bias=None):
    """Greedy decoding with OpenAI's adjustments in float64 over the whole sequence, without a
    cache: z + bias - frequency * count - presence * [count > 0], the counts over the tokens
    generated (not the prompt's)."""
    seq, out = list(prompt), []
    for _ in range(n):
        z = model.logits(fm.tensor([seq])).numpy()[0, -1].astype(np.float64)
        count = np.bincount(np.array(out, np.int64), minlength=z.shape[0]).astype(np.float64)
        for i, b in (bias or {}).items():
            z[i] += b
        z = z - frequency * count - presence * (count > 0)
        tok = int(np.argmax(z))
        out.append(tok)
        seq.append(tok)
    return out


@pytest.mark.parametrize("kw", [dict(presence=1.5), dict(frequency=0.9),
                                dict(presence=-2.0, frequency=0.3),
                                dict(bias={4: 3.0, 7: -100.0}),
                                dict(presence=0.7, frequency=1.1, bias={2: 1.5})])
def test_greedy_with_openai_adjustments_equals_a_no_cache_reference(model, kw):
    """generate's greedy tokens under presence_penalty, frequency_penalty and logit_bias are
    the argmax of the float64 formula over a full forward each step (the device chain's path:
    ops.penalize_logits, then sample_next, which counts each chosen id), and differ from plain
    greedy: the reference counts generated tokens only."""
    prompt = [3, 1, 4, 1, 5]
    plain = list(generate(model, prompt, max_new_tokens=14, temperature=0))
    got = list(generate(model, prompt, max_new_tokens=14, temperature=0,
                        presence_penalty=kw.get("presence", 0.0),
                        frequency_penalty=kw.get("frequency", 0.0),
                        logit_bias=kw.get("bias")))
    assert got == greedy_adjusted_reference(model, prompt, 14, **kw)
    assert got != plain


def test_openai_adjustments_on_the_chain_equal_the_host_path_and_set_the_logprobs(model):
    """With logprobs the tokens are chosen on the host (sampling.adjusted, then sample_row),
    without them on the device's chain (ops.penalize_logits, then sample_next): the same
    tokens, sampled, in a batch of prompts of two lengths; the logprobs are those of the
    adjusted distribution (a logit bias of -100 leaves an id with about e^-100 of the mass)."""
    prompts = [[4, 2], [1, 2, 3, 4, 5]]
    kw = dict(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=3, presence_penalty=0.6,
              frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={0: -100, 5: 2.5})
    plain = [[(e.row, e.token) for e in s] for s in generate(model, prompts, **kw)]
    steps = list(generate(model, prompts, logprobs=CFG.vocab_size, **kw))
    assert [[(e.row, e.token) for e in s] for s in steps] == plain
    events = [e for s in steps for e in s]
    assert all(e.token != 0 for e in events)
    assert all(dict(e.top_logprobs)[0] < -80 for e in events)
    other = [[(e.row, e.token) for e in s]
             for s in generate(model, prompts, **{**kw, "logit_bias": None})]
    assert other != plain


def test_frequency_penalty_counts_repeats_and_presence_does_not():
    """A model whose greedy output repeats one id: a frequency penalty pushes it down a bit
    more each time it comes (it comes back until its count outweighs the gap), a presence
    penalty of the same size once. Checked on sampling.adjusted itself."""
    from forge_ml.sampling import adjusted, seen_row
    z = np.array([2.0, 0.0, 0.0], np.float32)
    marks = seen_row([1], [0, 0, 0], 3)                      # id 0 generated three times
    np.testing.assert_array_equal(adjusted(z, marks, frequency=0.5), [0.5, 0.0, 0.0])
    np.testing.assert_array_equal(adjusted(z, marks, presence=0.5), [1.5, 0.0, 0.0])
    np.testing.assert_array_equal(adjusted(z, marks), z)      # the prompt's id 1: no count


@pytest.mark.parametrize("bad,match", [
    (dict(presence_penalty=2.5), "presence_penalty must be a number in \\[-2, 2\\]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be"),
    (dict(presence_penalty="1"), "presence_penalty must be"),
    (dict(logit_bias={23: 1.0}), "logit_bias has token id 23; the ids are 0..22"),
    (dict(logit_bias={1: 101}), "logit_bias\\[1\\] must be a number in \\[-100, 100\\]"),
    (dict(logit_bias={1.5: 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a mapping")])
def test_bad_openai_adjustments_are_config_errors_at_the_call(model, bad, match):
    with pytest.raises(ConfigError, match=match):
        generate(model, [1, 2], max_new_tokens=2, **bad)


def test_generate_names_a_float_array_prompt_and_a_tokenizer_without_decode():
    """A float NumPy prompt was read as a batch of one-token rows ("prompt 0 must be a list of
    int token ids, got 1.0"); a tokenizer without decode passed the checks and raised an
    AttributeError at the first stop check (a QA pass)."""
    model = GPT2.init(GPT2Config(vocab_size=50, block_size=16, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(ShapeError, match="prompts must be token ids .*got a float64 array"):
        list(generate(model, np.array([1.0, 2.0]), max_new_tokens=2))
    with pytest.raises(ConfigError, match="tokenizer must be a forge-ml tokenizer .*got object"):
        list(generate(model, [1, 2], 3, stop_strings=["x"], tokenizer=object()))
    assert len(list(generate(model, np.array([1, 2]), 2, temperature=0))) == 2   # ints: ids
