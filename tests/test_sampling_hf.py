"""Peer tests of the next-token choice against transformers' logits processors (repetition
penalty, temperature, top-k, top-p, min-p, in the order ``_get_logits_processor`` applies
them) on random logits; log-probabilities, through ``generate`` too; greedy decoding with a
repetition penalty against transformers' ``generate``; and a chi-square test of the tokens
``generate`` draws against ``next_token_probs``."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import forge_ml as fm  # noqa: E402
from forge_ml.hf import save_hf_gpt2  # noqa: E402
from forge_ml.inference.generate import (generate, next_token_probs,  # noqa: E402
                                         token_logprobs)
from forge_ml.models.gpt2 import GPT2, GPT2Config, param_shapes  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper)

V = 61
CFG = GPT2Config(vocab_size=V, padded_vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # tiny models: torch's thread pool costs more than it gives (and xdist runs 2 workers)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def hf_probs(logits, context, temperature=1.0, top_k=None, top_p=None, min_p=None,
             repetition_penalty=1.0):
    """transformers' distribution: its processors in ``_get_logits_processor``'s order for
    ``do_sample=True`` (float32, as transformers computes)."""
    ids = torch.tensor([list(context) or [0]])
    scores = torch.tensor(np.asarray(logits, np.float32)[None])            # (1, V)
    chain = []
    if repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(float(repetition_penalty)))
    if temperature != 1.0:
        chain.append(TemperatureLogitsWarper(float(temperature)))
    if top_k is not None:
        chain.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        chain.append(TopPLogitsWarper(float(top_p)))
    if min_p is not None:
        chain.append(MinPLogitsWarper(float(min_p)))
    for proc in chain:
        scores = proc(ids, scores)
    return torch.softmax(scores.double(), -1)[0].numpy()


def hf_logprobs(logits, context, temperature, repetition_penalty):
    ids = torch.tensor([list(context) or [0]])
    scores = torch.tensor(np.asarray(logits, np.float32)[None])
    if repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(float(repetition_penalty))(ids, scores)
    if temperature > 0:
        scores = TemperatureLogitsWarper(float(temperature))(ids, scores)
    return torch.log_softmax(scores.double(), -1)[0].numpy()


SETTINGS = [
    dict(repetition_penalty=1.3),
    dict(repetition_penalty=0.7, temperature=0.8),
    dict(temperature=0.7, top_k=12),
    dict(temperature=1.3, top_p=0.8),
    dict(min_p=0.05),
    dict(temperature=0.6, min_p=0.2, repetition_penalty=1.5),
    dict(temperature=1.5, top_k=20, top_p=0.9, min_p=0.1, repetition_penalty=1.2),
    dict(temperature=0.9, top_p=0.5, min_p=0.3),
]


@pytest.mark.parametrize("kw", SETTINGS)
def test_next_token_probs_match_transformers_processors(kw):
    rng = np.random.default_rng(7)
    for trial in range(20):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)   # positive and negative
        context = rng.integers(0, V, size=rng.integers(1, 30)).tolist()  # repeats included
        got = next_token_probs(logits, context=context, **kw)
        want = hf_probs(logits, context, **kw)
        assert got.sum() == pytest.approx(1.0)
        assert np.array_equal(got > 0, want > 0), (trial, kw)          # the same support
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=str((trial, kw)))


def test_repetition_penalty_counts_each_id_once_and_greedy_applies_it():
    logits = np.array([3.0, -2.0, 2.9, 0.5], np.float32)
    for ctx in ([0], [0, 0, 0], [0, 1, 1]):
        np.testing.assert_allclose(next_token_probs(logits, repetition_penalty=2.0, context=ctx),
                                   hf_probs(logits, ctx, repetition_penalty=2.0), atol=1e-7)
    # greedy: token 0 wins alone, token 2 once 0 is penalised
    assert next_token_probs(logits, 0).tolist() == [1, 0, 0, 0]
    assert next_token_probs(logits, 0, repetition_penalty=1.1, context=[0]).tolist() == [0, 0, 1, 0]


@pytest.mark.parametrize("temperature,penalty", [(1.0, 1.0), (0.7, 1.3), (0, 1.5), (2.0, 0.8)])
def test_token_logprobs_match_transformers(temperature, penalty):
    rng = np.random.default_rng(3)
    for _ in range(10):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        context = rng.integers(0, V, size=8).tolist()
        got = token_logprobs(logits, temperature, repetition_penalty=penalty, context=context)
        np.testing.assert_allclose(got, hf_logprobs(logits, context, temperature, penalty),
                                   atol=2e-6)


# -- through generate, on a model ------------------------------------------------------------


def random_host_params(cfg=CFG, seed=0, scale=0.5):
    """N(0, scale) weights, position embeddings N(0, 1), layer-norm gains near 1, padded
    vocab rows zero: continuations vary with clear top-logit margins."""
    rng = np.random.default_rng(seed)
    host = {}
    for name, shape in param_shapes(cfg).items():
        a = rng.standard_normal(shape) * scale
        if name.endswith(("ln_1.weight", "ln_2.weight")) or name == "ln_f.weight":
            a = 1.0 + 0.2 * rng.standard_normal(shape)
        if name == "wpe.weight":
            a = rng.standard_normal(shape)
        host[name] = a.astype(np.float32)
    host["wte.weight"][cfg.vocab_size:] = 0.0
    return host


@pytest.fixture(scope="module")
def host():
    return random_host_params()


@pytest.fixture(scope="module")
def model(host):
    return GPT2(CFG, {k: fm.tensor(v) for k, v in host.items()})


@pytest.fixture(scope="module")
def theirs(host, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "gpt2"
    save_hf_gpt2(d, CFG, host)
    return transformers.GPT2LMHeadModel.from_pretrained(d).float().eval()


def last_logits(model, seq):
    return model.logits(fm.tensor([seq])).numpy()[0, -1]


@pytest.mark.parametrize("temperature,penalty,n", [(0, 1.0, 5), (0, 1.4, 3), (0.8, 1.3, 4),
                                                   (1.2, 1.0, 0)])
def test_generate_logprobs_match_transformers_over_the_whole_context(model, temperature,
                                                                      penalty, n):
    prompts = [[3, 1, 4, 1, 5], [9, 2], [7, 7, 7, 8]]
    rows = [[] for _ in prompts]
    for events in generate(model, prompts, max_new_tokens=8, temperature=temperature,
                           repetition_penalty=penalty, logprobs=n, seed=5, top_k=20, min_p=0.05):
        for e in events:
            rows[e.row].append(e)
    for p, evs in zip(prompts, rows):
        assert len(evs) == 8
        for i, e in enumerate(evs):
            seq = p + [x.token for x in evs[:i]]
            want = hf_logprobs(last_logits(model, seq), seq, temperature, penalty)
            assert e.logprob == pytest.approx(want[e.token], abs=1e-4)
            assert len(e.top_logprobs) == n
            order = np.argsort(-want, kind="stable")[:n]
            assert [t for t, _ in e.top_logprobs] == order.tolist()
            np.testing.assert_allclose([lp for _, lp in e.top_logprobs], want[order], atol=1e-4)
            if temperature == 0 and n:
                assert e.top_logprobs[0] == (e.token, e.logprob)


def test_greedy_with_repetition_penalty_matches_transformers_generate(model, theirs):
    for prompt, penalty in (([3, 1, 4, 1, 5], 1.3), ([9, 2], 2.0), ([7, 7, 7, 8], 0.8)):
        x = torch.tensor([prompt])
        with torch.no_grad():
            out = theirs.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=16, repetition_penalty=penalty, pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        got = list(generate(model, prompt, max_new_tokens=16, temperature=0,
                            repetition_penalty=penalty))
        assert got == want, penalty
        plain = list(generate(model, prompt, max_new_tokens=16, temperature=0))
        assert got != plain           # the penalty changed the continuation
    # a ragged batch gives each prompt's tokens alone
    prompts = [[3, 1, 4, 1, 5], [9, 2], [7, 7, 7, 8]]
    alone = [list(generate(model, p, max_new_tokens=10, temperature=0, repetition_penalty=1.3))
             for p in prompts]
    rows = [[] for _ in prompts]
    for events in generate(model, prompts, max_new_tokens=10, temperature=0,
                           repetition_penalty=1.3):
        for e in events:
            rows[e.row].append(e.token)
    assert rows == alone


# -- the sampled distribution -----------------------------------------------------------------


def chi_square_critical(df, z=3.719):
    """The chi-square quantile for ``df`` degrees of freedom at the normal quantile ``z``
    (Wilson and Hilferty, 1931; z = 3.719: a 1e-4 false-alarm rate), within 1% for df >= 3."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * np.sqrt(h)) ** 3


def chi_square(counts, probs, min_expected=5.0):
    """Pearson's statistic and degrees of freedom, bins expecting fewer than
    ``min_expected`` draws pooled into one."""
    n = counts.sum()
    expected = n * probs
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=10),
    dict(temperature=1.3, top_p=0.85),
    dict(temperature=1.0, min_p=0.08),
    dict(temperature=1.1, repetition_penalty=1.6),
    dict(temperature=0.9, top_k=30, top_p=0.95, min_p=0.03, repetition_penalty=1.3),
])
def test_sampled_tokens_follow_next_token_probs(model, kw):
    prompt = [5, 11, 5, 2]
    rows, seeds = 1000, (0, 1, 2, 3)
    draws = []
    for seed in seeds:        # every seed: `rows` streams (seed, r), one draw each
        steps = list(generate(model, [prompt] * rows, max_new_tokens=1, seed=seed, **kw))
        draws += [e.token for e in steps[0]]
    counts = np.bincount(draws, minlength=V).astype(np.float64)
    probs = next_token_probs(last_logits(model, prompt), context=prompt, **kw)
    assert counts[probs == 0].sum() == 0                     # nothing outside the support
    stat, df = chi_square(counts, probs)
    assert df >= 3
    assert stat < chi_square_critical(df), (stat, df, kw)
    # and a wrong distribution is told apart: the untempered, uncut, unpenalised one
    plain = next_token_probs(last_logits(model, prompt))
    if not np.allclose(plain, probs, atol=0.02):
        assert chi_square(counts, plain)[0] > chi_square_critical(df)


def test_chi_square_critical_values():
    # against the exact quantile: P(X > c) = Q(df / 2, c / 2), the regularised upper gamma
    for df in (3, 5, 10, 20, 30, 60):
        c = chi_square_critical(df)
        tail = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                       torch.tensor(c / 2, dtype=torch.float64)).item()
        assert 0.5e-4 < tail < 2e-4, (df, c, tail)
