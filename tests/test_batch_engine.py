"""BatchEngine tests: the engine against a no-cache reference loop that draws by
``sampling.sample_row`` (the rule the engine's device choice implements) and against
``generate`` itself; log-probabilities against a straightforward reference; requests joining
and leaving at different steps, queueing for slots, cancelling, stop tokens, prompt scoring,
errors at submit, NaN logits, and a loop that fails."""
import asyncio
import threading
import time

import numpy as np
import pytest

import forge_ml as fm
from forge_ml.errors import ConfigError
from forge_ml import sampling
from forge_ml.inference.batch import BatchEngine, knobs_of, token_logprobs_of
from forge_ml.inference.generate import generate, row_key
from forge_ml.inference.engine import (EngineClosedError, RequestError, SamplingParams,
                                       TokenOut)

from test_generate import make_model  # the same varied-weights model



@pytest.fixture(scope="module")
def model():
    return make_model()


# -- the reference ---------------------------------------------------------------------------


def ref_probs(logits, p: SamplingParams, seen=()):
    """The distribution a sampled row draws from, and its log-probabilities, written plainly:
    one token at a time, a full sort for each cut."""
    z = np.array(logits, dtype=np.float64)
    V = len(z)
    for t in set(seen):
        z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    if p.temperature > 0:
        z = z / p.temperature
    lps = z - z.max() - np.log(np.sum(np.exp(z - z.max())))
    probs = np.exp(lps)
    order = sorted(range(V), key=lambda i: (-probs[i], i))       # most likely, ties by id
    keep = set(range(V))
    if p.top_k:      # the k most likely and every token tied with the k-th (transformers' rule)
        keep = {i for i in range(V) if probs[i] >= probs[order[min(p.top_k, V) - 1]]}
    if p.top_p < 1:  # the shortest head reaching p, and every token tied with its last
        total = sum(probs[i] for i in keep)
        cum, last = 0.0, None
        for i in order:
            if i not in keep:
                continue
            last = i
            cum += probs[i] / total
            if cum >= p.top_p:
                break
        keep = {i for i in keep if probs[i] >= probs[last]}
    if p.min_p:
        best = max(probs[i] for i in keep)
        keep = {i for i in keep if probs[i] >= p.min_p * best}
    w = np.array([probs[i] if i in keep else 0.0 for i in range(V)])
    return w / w.sum(), lps


def ref_choose(logits, p: SamplingParams, seen, position):
    """The request's token at ``position`` (the engine's draw: ``sample_row`` with the
    request's key at that position), and the reference log-probabilities and top ids."""
    _, lps = ref_probs(logits, p, seen)
    marks = np.zeros(len(logits), bool)
    marks[list(seen)] = True
    tok = sampling.sample_row(np.asarray(logits, np.float32), knobs_of(p), row_key(p.seed, 0),
                              position, marks if p.repetition_penalty != 1 else None)
    top = sorted(range(len(lps)), key=lambda i: (-lps[i], i))[:p.logprobs or 0]
    return tok, lps, top


def ref_generate(model, prompt, p: SamplingParams, stop_len=None):
    """A request alone, without a KV cache: the full forward over the sequence each step."""
    seq, out = list(prompt), []
    for _ in range(p.max_tokens):
        logits = model.logits(fm.tensor([seq])).numpy()[0, -1]
        tok, _, _ = ref_choose(logits, p, seq if p.repetition_penalty != 1 else (), len(seq))
        out.append(tok)
        seq.append(tok)
        if tok in p.stop_tokens:
            break
    return out


# -- the log-probabilities -------------------------------------------------------------------


def random_params(rng, i):
    return SamplingParams(
        temperature=[0.0, 0.7, 1.0, 1.6][i % 4],
        top_k=int(rng.choice([0, 1, 3, 10])),
        top_p=float(rng.choice([1.0, 0.9, 0.5, 0.05])),
        min_p=float(rng.choice([0.0, 0.05, 0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
        logprobs=[0, 3, 7][i % 3])


def test_token_logprobs_match_the_reference():
    rng = np.random.default_rng(0)
    V = 40
    for trial in range(100):
        logits = (rng.standard_normal(V) * 3).astype(np.float32)
        logits[5] = logits[9] = logits.max() + 1        # a tie at the top
        p = random_params(rng, trial)
        seen = rng.integers(0, V, rng.integers(0, 12)).tolist()
        tok = int(rng.integers(0, V))
        lp, top = token_logprobs_of(logits, p, set(seen), tok)
        _, lps, want = ref_choose(logits, p, seen, 0)
        assert lp == pytest.approx(lps[tok], abs=1e-6), (trial, p)
        assert [t for t, _ in top] == want
        assert [x for _, x in top] == pytest.approx([lps[t] for t in want], abs=1e-6)


EXTREME = [dict(temperature=1e-40), dict(temperature=1e-46), dict(temperature=5e-324),
           dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300),
           dict(temperature=1e-40, repetition_penalty=1e-40),
           dict(temperature=1e-300, repetition_penalty=1e300), dict(temperature=3e38)]


@pytest.mark.parametrize("kw", EXTREME, ids=range(len(EXTREME)))
def test_temperatures_and_penalties_that_overflow_float32_give_the_limit_not_nan(model, kw):
    """A temperature or repetition penalty so far from 1 that ``z / T`` or ``z / penalty``
    overflows float32: the engine's tokens are the limit's (the penalised argmax as T goes to
    0, ``sample_row``'s rule), and no log-probability is NaN."""
    p = SamplingParams(max_tokens=6, logprobs=4, seed=3, **kw)
    prompt = [3, 1, 4]
    with BatchEngine(model, slots=2) as engine:
        outs = list(engine.submit(prompt, p))
    assert [t.token for t in outs] == ref_generate(model, prompt, p)
    for t in outs:
        assert not np.isnan(t.logprob) and all(not np.isnan(v) for _, v in t.top_logprobs)
        assert [v for _, v in t.top_logprobs] == sorted((v for _, v in t.top_logprobs), reverse=True)
        if p.temperature < 1e-30:
            assert t.logprob == 0.0 and t.token == t.top_logprobs[0][0]


# -- the engine ----------------------------------------------------------------------------


REQUESTS = [
    ([1, 2, 3], SamplingParams(max_tokens=6, temperature=0)),
    ([4], SamplingParams(max_tokens=9, seed=3)),
    ([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=4, temperature=0.8, top_k=5, seed=1)),
    ([11, 12], SamplingParams(max_tokens=7, top_p=0.8, min_p=0.05, seed=7)),
    ([0, 0, 0, 0], SamplingParams(max_tokens=5, repetition_penalty=1.5, temperature=0)),
    ([3, 1], SamplingParams(max_tokens=8, temperature=1.3, repetition_penalty=1.2, seed=2)),
]


@pytest.fixture(scope="module")
def expected(model):
    return [ref_generate(model, pr, p) for pr, p in REQUESTS]


def slow_down(engine, seconds=0.005):
    """Make every step of ``engine`` take ``seconds`` more, so a test can act mid-request."""
    launch = engine._launch

    def slow(*args):
        time.sleep(seconds)
        return launch(*args)

    engine._launch = slow
    return engine


def tokens_of(stream):
    return [t.token for t in stream]


def test_requests_joining_and_leaving_at_different_steps_match_the_reference(model, expected):
    with BatchEngine(model, slots=3) as engine:
        streams = []
        for i, (prompt, p) in enumerate(REQUESTS):
            streams.append(engine.submit(prompt, p))
            if i % 2:
                time.sleep(0.01)                  # join while others are mid-way
        got = [tokens_of(s) for s in streams]
        assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
    assert got == expected
    assert [s.finish for s in streams] == ["length"] * len(REQUESTS)


@pytest.mark.parametrize("slots", [1, 6])
def test_tokens_do_not_depend_on_the_batch(model, expected, slots):
    with BatchEngine(model, slots=slots) as engine:
        streams = [engine.submit(pr, p) for pr, p in reversed(REQUESTS)]
        got = [tokens_of(s) for s in reversed(streams)]
    assert got == expected


@pytest.mark.parametrize("i", range(len(REQUESTS)))
def test_a_request_draws_what_generate_draws_for_its_prompt_and_seed(model, expected, i):
    """The engine's rule and random numbers are generate's: a request gives the tokens
    ``generate`` gives for its prompt, settings and seed (a server's answer is the library's)."""
    prompt, p = REQUESTS[i]
    want = list(generate(model, prompt, max_new_tokens=p.max_tokens, temperature=p.temperature,
                         top_k=p.top_k or None, top_p=p.top_p if p.top_p < 1 else None,
                         min_p=p.min_p or None, repetition_penalty=p.repetition_penalty,
                         seed=p.seed))
    assert want == expected[i]
    with BatchEngine(model, slots=3) as engine:
        assert tokens_of(engine.submit(prompt, p)) == want


def test_requests_of_every_kind_reusing_few_slots_draw_what_generate_draws(model):
    """Penalised and plain, sampled and greedy, with log-probabilities or not, prompts of 1 to
    5 tokens: 24 requests through 2 slots (each slot reused by requests of both kinds, so a
    penalty's marks must be its own request's) give generate's tokens."""
    rng = np.random.default_rng(4)
    reqs = []
    for i in range(24):
        p = SamplingParams(max_tokens=int(rng.integers(1, 7)),
                           temperature=float(rng.choice([0.0, 0.8, 1.5])),
                           top_k=int(rng.choice([0, 3])), top_p=float(rng.choice([1.0, 0.7])),
                           repetition_penalty=float(rng.choice([1.0, 1.6, 0.5])), seed=i,
                           logprobs=None if i % 3 else 1)
        reqs.append((rng.integers(0, 23, int(rng.integers(1, 6))).tolist(), p))
    with BatchEngine(model, slots=2) as engine:
        streams = [engine.submit(pr, p) for pr, p in reqs]
        got = [tokens_of(s) for s in streams]
    for (pr, p), toks in zip(reqs, got):
        want = generate(model, pr, max_new_tokens=p.max_tokens, temperature=p.temperature,
                        top_k=p.top_k or None, top_p=p.top_p if p.top_p < 1 else None,
                        repetition_penalty=p.repetition_penalty, seed=p.seed)
        assert toks == list(want), (pr, p)


def test_a_long_prompt_is_prefilled_in_one_pass(model, expected):
    """A prompt went through the steps one token a step (a 1,000-token prompt: 1,000 steps
    before its first token). Now a prompt of at least prefill_min tokens has all but its last
    token prefilled in one forward pass into its slot's cache rows: its first token comes at
    its first step, and it draws what generate draws (generate prefills its prompt so too);
    shorter prompts, and prompts being scored, still step through, alone or not."""
    for i, (prompt, p) in enumerate(REQUESTS):
        for least, steps in ((2, p.max_tokens), (64, len(prompt) - 1 + p.max_tokens)):
            with BatchEngine(model, slots=2, prefill_min=least) as engine:
                assert tokens_of(engine.submit(prompt, p)) == expected[i], (i, least)
                assert engine.steps == steps, (i, least)
                assert engine.prefills == (len(prompt) >= least), (i, least)
    long_prompt = [int(t) for t in np.random.default_rng(0).integers(0, 23, 15)]
    kinds = [SamplingParams(max_tokens=5, temperature=0),
             SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=4),
             SamplingParams(max_tokens=5, temperature=0.7, repetition_penalty=1.7, seed=5)]
    with slow_down(BatchEngine(model, slots=3, prefill_min=10), 0.002) as engine:
        busy = engine.submit([1, 2, 3], SamplingParams(max_tokens=17, temperature=0))
        while engine.steps < 2:
            time.sleep(0.001)
        streams = [engine.submit(long_prompt, p) for p in kinds[:2]]    # joins busy slots
        got = [tokens_of(s) for s in streams]
        assert tokens_of(busy) == list(generate(model, [1, 2, 3], max_new_tokens=17, temperature=0))
        assert engine.prefills == 2                    # the two long ones
        short = engine.submit([7, 8, 9], kinds[2])     # 3 tokens < 10: steps through
        scored = engine.submit(long_prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))
        got.append(tokens_of(short))
        assert len(scored.prompt_logprobs if list(scored) else ()) == len(long_prompt) - 1
        assert engine.prefills == 2
    for p, toks, pr in zip(kinds, got, (long_prompt, long_prompt, [7, 8, 9])):
        assert toks == list(generate(model, pr, max_new_tokens=5, temperature=p.temperature,
                                     top_p=p.top_p if p.top_p < 1 else None,
                                     repetition_penalty=p.repetition_penalty, seed=p.seed)), p
    with pytest.raises(ConfigError, match="prefill_min must be an int >= 1, got 0"):
        BatchEngine(model, prefill_min=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_padded_prefill_draws_what_generate_draws(device):
    """On a GPU a prefill is replayed from a graph per padded length (the next power of two
    from 64, at most max_len) into a one-row cache and copied into the slot's rows: prompts
    of three lengths (three padded lengths, the last the capacity), one length twice (its
    graph replayed with other ids), greedy, sampled and penalised, each give generate's
    tokens. On the CPU the same padded path runs op by op (forced: the CPU prefills unpadded)."""
    from forge_ml.models.gpt2 import GPT2Config
    from test_generate import _cuda_or_cpu
    _cuda_or_cpu(device)
    m = make_model(GPT2Config(vocab_size=23, padded_vocab_size=32, block_size=160, n_layer=2,
                              n_head=2, n_embd=16)).to(device)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 23, n)] for n in (30, 70, 71, 150)]
    kinds = [SamplingParams(max_tokens=6, temperature=0),
             SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=4),
             SamplingParams(max_tokens=6, temperature=0),
             SamplingParams(max_tokens=6, temperature=0.7, repetition_penalty=1.7, seed=5)]
    with BatchEngine(m, slots=3, prefill_min=16) as engine:
        engine._padded = True
        got = []
        for pr, p in zip(prompts, kinds):
            got.append(tokens_of(engine.submit(pr, p)))
            # the slot's keys and values of the prompt's positions are an unpadded pass's (row
            # 0 aside: idle slots step there)
            n = len(pr) - 1
            ref = m.new_cache(1)
            m.forward_cached(fm.tensor([pr[:n]], device=device), ref)
            for mine, want in ((engine._decode.cache.k, ref.k), (engine._decode.cache.v, ref.v)):
                for a, b in zip(mine, want):
                    a, b = a.numpy()[:, :, 1:n], b.numpy()[0, :, 1:n]
                    assert min(np.abs(a[s] - b).max() for s in range(3)) < 1e-4, len(pr)
        assert engine.prefills == 4
        assert sorted(engine._prefill_at) == [64, 128, 160]   # 29 -> 64, 69 and 70 -> 128, 149 -> 160
        assert all((pre.graph is not None) == (device == "cuda")
                   for pre in engine._prefill_at.values())
    for pr, p, toks in zip(prompts, kinds, got):
        assert toks == list(generate(m, pr, max_new_tokens=6, temperature=p.temperature,
                                     top_p=p.top_p if p.top_p < 1 else None,
                                     repetition_penalty=p.repetition_penalty, seed=p.seed)), len(pr)


def test_a_prefill_whose_capture_fails_goes_on_op_by_op_unpadded(monkeypatch, caplog):
    """(review) A failed capture left the padding on: every later prefill ran op by op at its
    padded length, more work than the unpadded pass. The prefill that failed to capture is
    done (its real run), the engine warns once, and later prefills go straight into the
    slot's rows; every request draws what generate draws."""
    import logging
    from forge_ml import graph
    from forge_ml.errors import CaptureError
    from forge_ml.models.gpt2 import GPT2Config
    m = make_model(GPT2Config(vocab_size=23, padded_vocab_size=32, block_size=160, n_layer=2,
                              n_head=2, n_embd=16))
    tries = []

    def capture(device, fn, run_first=False):   # the real run, then the capture fails
        tries.append(1)
        fn()
        raise CaptureError("the test's capture failure", first=None)
    monkeypatch.setattr(graph, "capture", capture)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, 23, n)] for n in (70, 30, 100)]
    p = SamplingParams(max_tokens=5, temperature=0)
    with caplog.at_level(logging.WARNING, logger="forge_ml.inference"):
        with BatchEngine(m, slots=2, prefill_min=16) as engine:
            engine._graphed = engine._padded = True       # as on a GPU
            got = [tokens_of(engine.submit(pr, p)) for pr in prompts]
            assert engine.prefills == 3 and len(tries) == 1
            assert not engine._padded and engine._prefill_at == {}
    assert sum("graph capture failed" in r.message for r in caplog.records) == 1
    for pr, toks in zip(prompts, got):
        assert toks == list(generate(m, pr, max_new_tokens=5, temperature=0)), len(pr)


def test_a_prefill_that_fails_ends_its_request_not_the_engine():
    """(review) A long prompt's prefill out of memory stopped the engine and every request in
    it; it now ends that request with the error and the engine goes on."""
    m = make_model()
    with slow_down(BatchEngine(m, slots=2, prefill_min=5), 0.002) as engine:
        other = engine.submit([1, 2], SamplingParams(max_tokens=10, temperature=0))
        real = m.forward_cached

        def oom(ids, cache, **kw):
            raise MemoryError("out of memory (the test's)")
        m.forward_cached = oom
        try:
            with pytest.raises(MemoryError, match="the test's"):
                list(engine.submit(list(range(1, 9)), SamplingParams(max_tokens=3)))
        finally:
            m.forward_cached = real
        assert len(list(other)) == 10 and engine.running
        assert len(list(engine.submit(list(range(1, 9)), SamplingParams(max_tokens=3)))) == 3


def test_a_huge_top_k_is_no_cut_and_stops_nothing(model):
    """top_k=10**40 (any HTTP client may send it) was float32's infinity in the knobs: the host
    draw raised OverflowError in the loop thread and every request in flight ended with it.
    A top_k past any vocabulary keeps every token: the request draws as with top_k off."""
    with BatchEngine(model, slots=2) as engine:
        other = engine.submit([1, 2], SamplingParams(max_tokens=6, temperature=0))
        huge = engine.submit([3], SamplingParams(max_tokens=6, top_k=10**40, seed=5))
        got = tokens_of(huge)
        assert got == tokens_of(engine.submit([3], SamplingParams(max_tokens=6, seed=5)))
        assert got == list(generate(model, [3], max_new_tokens=6, top_k=10**40, seed=5))   # (raised too)
        assert len(tokens_of(other)) == 6 and engine.running


@pytest.mark.cuda
def test_on_the_gpu_requests_draw_what_generate_draws_there(expected):
    """On the GPU the engine chooses with the sampling kernel (only tokens come back): every
    request, sampled, cut, penalised or greedy, joining at different steps with logprobs on
    some, gives the tokens generate gives on the GPU for its prompt and seed, and the CPU
    engine's (the float32 logits agree to rounding; these draws are far from any tie)."""
    from test_generate import _cuda_or_cpu
    _cuda_or_cpu("cuda")
    gpu = make_model().to("cuda")
    want = [list(generate(gpu, pr, max_new_tokens=p.max_tokens, temperature=p.temperature,
                          top_k=p.top_k or None, top_p=p.top_p if p.top_p < 1 else None,
                          min_p=p.min_p or None, repetition_penalty=p.repetition_penalty,
                          seed=p.seed)) for pr, p in REQUESTS]
    assert want == expected
    with BatchEngine(gpu, slots=4) as engine:
        streams = []
        for i, (pr, p) in enumerate(REQUESTS):
            if i % 2:
                p = SamplingParams(**{**p.__dict__, "logprobs": 2})
            streams.append(engine.submit(pr, p))
            time.sleep(0.005 * (i % 3))
        outs = [list(s) for s in streams]
        assert any(k[0] == "rows_choose" for k in engine._decode._graphs)   # a graph replays
    assert [[t.token for t in o] for o in outs] == want
    for i, o in enumerate(outs):
        assert all((t.logprob is not None) == bool(i % 2) for t in o)


def test_logprobs_and_a_stop_token(model):
    prompt, p = [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    with BatchEngine(model, slots=2) as engine:
        outs = list(engine.submit(prompt, p))
        seq = prompt + [t.token for t in outs[:2]]
        logits = model.logits(fm.tensor([seq])).numpy()[0, -1]
        _, lps, top = ref_choose(logits, p, (), 0.0)
        assert outs[2].logprob == pytest.approx(lps[outs[2].token], abs=1e-5)
        assert [t for t, _ in outs[2].top_logprobs] == top
        stop = outs[3].token
        outs2 = list(engine.submit(prompt, SamplingParams(max_tokens=6, temperature=0,
                                                          stop_tokens=(stop,))))
    first = next(i for i, t in enumerate(outs) if t.token == stop)
    assert [t.token for t in outs2] == [t.token for t in outs[:first + 1]]
    assert outs2[-1].finish == "stop" and all(t.finish is None for t in outs2[:-1])


def test_prompt_scoring_without_generating(model):
    prompt = [4, 8, 15, 16, 2]
    with BatchEngine(model, slots=2) as engine:
        s = engine.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
        assert list(s) == [] and s.finish == "length"
        s1 = engine.submit([4], SamplingParams(max_tokens=0, prompt_logprobs=1))
        assert list(s1) == [] and s1.prompt_logprobs == []
    logits = model.logits(fm.tensor([prompt])).numpy()[0].astype(np.float64)
    lps = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert len(s.prompt_logprobs) == len(prompt) - 1
    for i, (lp, top) in enumerate(s.prompt_logprobs):
        assert lp == pytest.approx(lps[i, prompt[i + 1]], abs=1e-5)
        assert top[0][0] == int(np.argmax(lps[i]))


def test_cancel_frees_the_slot(model):
    with BatchEngine(model, slots=1) as engine:
        slow_down(engine)
        long = engine.submit([1], SamplingParams(max_tokens=20, temperature=0))
        queued = engine.submit([2], SamplingParams(max_tokens=20, temperature=0))
        it = iter(long)
        next(it), next(it)
        queued.cancel()                          # a queued request never takes the slot
        long.cancel()
        assert list(it) == [] and long.finish is None
        short = engine.submit([3], SamplingParams(max_tokens=3, temperature=0))
        assert len(tokens_of(short)) == 3 and short.finish == "length"
        assert tokens_of(queued) == []
        deadline = time.time() + 5
        while engine.stats()["running"] and time.time() < deadline:
            time.sleep(0.01)
        assert engine.stats() == {"slots": 1, "running": 0, "waiting": 0,
                                  "steps": engine.steps}


def test_async_iteration(model, expected):
    async def main(engine):
        async def one(prompt, p):
            return [t.token async for t in engine.submit(prompt, p)]
        return await asyncio.gather(*(one(pr, p) for pr, p in REQUESTS))

    with BatchEngine(model, slots=2) as engine:
        assert asyncio.run(main(engine)) == expected


@pytest.mark.parametrize("prompt, kw, param", [
    ([1] * 25, {}, "prompt"),                                 # longer than the context
    ([1] * 20, {"max_tokens": 5}, "max_tokens"),              # 20 + 5 > 24
    ([1, 23], {}, "prompt"),                                  # id out of the vocabulary
    ([-1], {}, "prompt"),
    ([], {}, "prompt"),
    ("abc", {}, "prompt"),
    (None, {}, "prompt"),                                     # not a list (was a TypeError)
    (5, {}, "prompt"),
    ([1], {"stop_tokens": (99,)}, "stop_tokens"),
    ([1], {"logit_bias": {23: 1.0}}, "logit_bias"),           # id out of the vocabulary
])
def test_bad_requests_are_refused_at_submit(model, prompt, kw, param):
    with BatchEngine(model, slots=1) as engine:
        with pytest.raises(RequestError) as e:
            engine.submit(prompt, SamplingParams(**kw))
        assert e.value.param == param
        assert len(tokens_of(engine.submit([1], SamplingParams(max_tokens=2)))) == 2


@pytest.mark.parametrize("kw", [{"temperature": -0.5}, {"top_p": 1.5}, {"top_k": -1},
                                {"max_tokens": -1}, {"max_tokens": 2.0}, {"logprobs": 21},
                                {"min_p": 2.0}, {"repetition_penalty": 0}, {"seed": -3},
                                {"temperature": float("nan")}, {"stop_tokens": "7"},
                                {"stop_tokens": [1.5]}, {"stop_tokens": np.zeros((2, 2), int)},
                                {"presence_penalty": 2.5}, {"frequency_penalty": -3},
                                {"frequency_penalty": float("nan")}, {"logit_bias": {1: 200}},
                                {"logit_bias": {"a": 1}}, {"logit_bias": [1, 2]}])
def test_bad_sampling_params(kw):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == next(iter(kw))


def test_close_ends_open_streams_and_refuses_new_ones(model):
    engine = slow_down(BatchEngine(model, slots=1))
    running = engine.submit([1], SamplingParams(max_tokens=20))
    waiting = engine.submit([2], SamplingParams(max_tokens=20))
    next(iter(running))
    engine.close()
    for s in (running, waiting):
        with pytest.raises(EngineClosedError):
            list(s)
    with pytest.raises(EngineClosedError):
        engine.submit([1], SamplingParams())
    with pytest.raises(EngineClosedError):          # was a stream ending 'length'
        engine.submit([1], SamplingParams(max_tokens=0))
    assert not engine.running


def test_a_prompt_given_as_an_iterator_array_or_tensor(model):
    """An iterator was spent by the check and refused as 'the prompt is empty'."""
    with BatchEngine(model, slots=2) as engine:
        want = tokens_of(engine.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0)))
        for prompt in (iter([1, 2, 3]), (t for t in [1, 2, 3]), np.array([1, 2, 3]),
                       fm.tensor([1, 2, 3])):
            got = tokens_of(engine.submit(prompt, SamplingParams(max_tokens=3, temperature=0)))
            assert got == want, prompt


def test_a_failing_step_ends_the_streams_with_its_error(model):
    engine = BatchEngine(model, slots=2)
    def broken(*args):
        raise RuntimeError("device lost")
    engine._launch = broken
    s = engine.submit([1], SamplingParams())
    with pytest.raises(EngineClosedError, match="device lost"):
        list(s)
    engine.close()


def test_stream_from_another_thread_sees_every_token():
    from forge_ml.inference.engine import Stream
    s = Stream([1], SamplingParams())
    def produce():
        for i in range(100):
            s._push(TokenOut(i, finish="length" if i == 99 else None))
    t = threading.Thread(target=produce)
    t.start()
    assert [x.token for x in s] == list(range(100))
    t.join()


def test_engine_sizes_may_be_numpy_integers_but_not_bools(model):
    """slots=np.int64(2) was refused as 'must be an int >= 1, got np.int64(2)'; slots=True
    was taken into a new_cache ShapeError."""
    engine = BatchEngine(model, slots=np.int64(2), max_len=np.int32(16))
    try:
        assert engine.stats()["slots"] == 2 and type(engine.slots) is int and engine.max_len == 16
        assert len(tokens_of(engine.submit([1], SamplingParams(max_tokens=2)))) == 2
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="slots must be an int >= 1, got True"):
        BatchEngine(model, slots=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_an_engine_refuses_a_model_whose_weights_hold_nan(device):
    """A model with NaN weights was served: every request got id 0 at every step. The engine
    now takes one step at its start and refuses the model, naming the weight."""
    from forge_ml.errors import ModelError
    from test_generate import _cuda_or_cpu
    _cuda_or_cpu(device)
    m = make_model()
    m.params["h.0.ln_2.bias"].data[5] = np.nan
    with pytest.raises(ModelError, match=r"BatchEngine: the model's logits for a first step on "
                                         r"token 0 .* its parameter h.0.ln_2.bias holds 1 NaN of 16"):
        BatchEngine(m.to(device), slots=2)
    with BatchEngine(make_model().to(device), slots=2) as engine:     # a healthy one serves
        assert len(list(engine.submit([1, 2], SamplingParams(max_tokens=3)))) == 3


def test_nan_logits_past_the_prompt_end_that_request_in_an_error():
    """A weight row only a later position reads (wpe's row 6): the engine's first step passes,
    and a request reaching position 6 was served a token chosen from NaN logits (a garbage id,
    every step after). The engine now ends that request with a ModelError naming the weight,
    frees its slot, and serves the others."""
    from forge_ml.errors import ModelError
    m = make_model()
    m.params["wpe.weight"].data[6, :] = np.nan
    with BatchEngine(m, slots=2) as engine:
        long = engine.submit([1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
        short = engine.submit([4, 5], SamplingParams(max_tokens=3, temperature=0.7))
        got = []
        with pytest.raises(ModelError, match=r"BatchEngine: the model's logits for this request's "
                                             r"token at position 6 .* wpe.weight holds 16 NaN"):
            for t in long:
                got.append(t.token)
        assert len(got) == 4                         # positions 3-6 fed from 2-5: fine
        assert len(list(short)) == 3 and engine.running
        again = engine.submit([7], SamplingParams(max_tokens=2, temperature=0))
        assert len(list(again)) == 2
        # a prompt scored past position 6 (max_tokens 0): its NaN scores were served as they came
        scored = engine.submit(list(range(1, 10)), SamplingParams(max_tokens=0, prompt_logprobs=1))
        with pytest.raises(ModelError, match="position 6 .* wpe.weight holds 16 NaN"):
            list(scored)
        assert len(list(engine.submit([1, 2], SamplingParams(max_tokens=2)))) == 2


def test_stats_leave_out_requests_whose_clients_left(model):
    """/health's counts: three requests queued behind a long one, then cancelled (their clients
    gone), were still counted as waiting until the loop reached them (a QA report)."""
    with slow_down(BatchEngine(model, slots=1), 0.1) as engine:
        long = engine.submit([1, 2], SamplingParams(max_tokens=20))   # 2 s: 20 steps of 0.1
        deadline = time.time() + 10
        while engine.stats()["running"] == 0 and time.time() < deadline:
            time.sleep(0.001)                       # the long request has its slot
        queued = [engine.submit([3], SamplingParams(max_tokens=20)) for _ in range(3)]
        assert engine.stats()["waiting"] == 3
        for s in queued:
            s.cancel()
        assert engine.stats()["waiting"] == 0 and engine.stats()["running"] == 1
        long.cancel()
        assert engine.stats()["running"] == 0


def test_numpy_scalars_and_range_limits_in_requests(model):
    """SamplingParams(logprobs=np.uint8(3)) overflowed in the top-n cut inside the loop thread
    and stopped the engine for every request; max_tokens=np.uint8(250) passed the context check
    by wrapping; seed=2**64 drew as seed 0 and temperature=1e300 was float32's infinity in the
    knobs (generate refuses both); BatchEngine(None) failed on .config; a tokenizer whose
    vocab_size is a NumPy integer was not taken as the vocabulary."""
    p = SamplingParams(max_tokens=np.uint8(3), logprobs=np.uint8(3), top_k=np.int8(5), seed=np.uint64(4))
    assert type(p.logprobs) is int and type(p.max_tokens) is int and type(p.seed) is int
    with BatchEngine(model, slots=2) as engine:
        outs = list(engine.submit([1, 2], p))
        assert len(outs) == 3 and all(len(t.top_logprobs) == 3 for t in outs) and engine.running
        with pytest.raises(RequestError) as e:
            engine.submit(list(range(10)), SamplingParams(max_tokens=np.uint8(250)))
        assert e.value.param == "max_tokens"
    for kw, name in (({"seed": 2**64}, "seed"), ({"temperature": 1e300}, "temperature")):
        with pytest.raises(RequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == name
    with pytest.raises(TypeError, match="BatchEngine: model must be a forge-ml language model"):
        BatchEngine(None)

    class Tok:
        vocab_size = np.int64(5)
    with BatchEngine(model, Tok(), slots=1) as engine:
        assert engine.vocab_size == 5 and type(engine.vocab_size) is int


def test_a_finished_stream_iterated_again_ends_at_once(model):
    """A QA report: list(stream) a second time (a notebook cell run again) waited forever for
    events that never come. A second iteration of a finished stream ends at once (a failed
    one raises its error again), in a thread and in an event loop."""
    from forge_ml.inference.engine import Stream
    with BatchEngine(model, slots=2) as engine:
        s = engine.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
        zero = engine.submit([1, 2], SamplingParams(max_tokens=0))
        first = [t.token for t in s]
        done = threading.Event()
        again = []

        def twice():
            again.extend([[t.token for t in s], list(zero), list(zero)])
            done.set()
        threading.Thread(target=twice, daemon=True).start()
        assert done.wait(10), "a second iteration of a finished stream blocked"
        assert len(first) == 3 and again == [[], [], []]

        async def consume():
            return [t async for t in s]
        assert asyncio.run(asyncio.wait_for(consume(), 10)) == []
    failed = Stream([1], SamplingParams())
    failed._push(RuntimeError("device lost"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="device lost"):
            list(failed)


def test_stop_tokens_take_generates_forms():
    """(library QA) generate(stop_tokens=1) and an array of ids were taken where
    SamplingParams refused them: every form generate takes is a tuple here."""
    for given, want in ((1, (1,)), (np.int64(3), (3,)), (np.array(5), (5,)), ([1, 2], (1, 2)),
                        (np.array([1, 2]), (1, 2)), ((4,), (4,))):
        assert SamplingParams(stop_tokens=given).stop_tokens == want, given


def _openai_requests(rng, n):
    """Requests with OpenAI's adjustments or without, sampled or greedy, some with logprobs."""
    reqs = []
    for i in range(n):
        bias = None if i % 3 == 1 else {int(rng.integers(0, 23)): float(rng.choice([-100, 4.0])),
                                        int(rng.integers(0, 23)): 1.5}
        p = SamplingParams(max_tokens=int(rng.integers(2, 8)),
                           temperature=float(rng.choice([0.0, 0.9])), seed=i,
                           presence_penalty=float(rng.choice([0.0, 1.2, -0.5])),
                           frequency_penalty=float(rng.choice([0.0, 0.8])),
                           repetition_penalty=float(rng.choice([1.0, 1.3])),
                           logit_bias=bias if i % 2 else None, logprobs=None if i % 4 else 2)
        reqs.append((rng.integers(0, 23, int(rng.integers(1, 6))).tolist(), p))
    return reqs


def _generate_as(model, prompt, p):
    return list(generate(model, prompt, max_new_tokens=p.max_tokens, temperature=p.temperature,
                         repetition_penalty=p.repetition_penalty, seed=p.seed,
                         presence_penalty=p.presence_penalty,
                         frequency_penalty=p.frequency_penalty,
                         logit_bias=dict(p.logit_bias) if p.logit_bias else None))


def test_openai_adjustments_draw_what_generate_draws_through_reused_slots(model):
    """presence_penalty, frequency_penalty and logit_bias in the engine: 20 requests of every
    mix through 2 slots (a slot's bias row and counts must be its own request's, cleared for
    the next) give generate's tokens; a logit_bias of -100 is never drawn and the logprobs
    report the adjusted distribution."""
    reqs = _openai_requests(np.random.default_rng(9), 20)
    with BatchEngine(model, slots=2) as engine:
        outs = [list(engine.submit(pr, p)) for pr, p in reqs[:2]]    # one at a time first
        streams = [engine.submit(pr, p) for pr, p in reqs[2:]]
        outs += [list(st) for st in streams]
    for (pr, p), o in zip(reqs, outs):
        assert [t.token for t in o] == _generate_as(model, pr, p), (pr, p)
        banned = {t for t, b in p.logit_bias or () if b == -100}
        assert not banned & {t.token for t in o}
        if p.logprobs is not None and banned:
            assert all(t.logprob > -50 for t in o)


def test_a_logit_bias_leaves_the_prompt_scores_alone(model):
    """prompt_logprobs are the model's plain distribution: a request's logit bias and penalties
    start with its first chosen token."""
    prompt = [4, 8, 15, 16, 2]
    kw = dict(max_tokens=2, prompt_logprobs=1)
    with BatchEngine(model, slots=1) as engine:
        plain = engine.submit(prompt, SamplingParams(**kw))
        list(plain)
        biased = engine.submit(prompt, SamplingParams(**kw, logit_bias={3: 100.0},
                                                      frequency_penalty=2.0))
        toks = [t.token for t in biased]
    assert biased.prompt_logprobs == plain.prompt_logprobs
    assert toks == [3, 3]


@pytest.mark.cuda
def test_on_the_gpu_openai_adjustments_draw_what_generate_draws(model):
    """The same on the GPU: penalize_logits in the engine's graphs, the CPU's tokens."""
    from test_generate import _cuda_or_cpu
    _cuda_or_cpu("cuda")
    gpu = make_model().to("cuda")
    reqs = _openai_requests(np.random.default_rng(9), 20)
    with BatchEngine(gpu, slots=4) as engine:
        outs = [list(s) for s in [engine.submit(pr, p) for pr, p in reqs]]
        assert any(k[0] == "rows_choose" and k[3] for k in engine._decode._graphs)
    for (pr, p), o in zip(reqs, outs):
        assert [t.token for t in o] == _generate_as(gpu, pr, p) == _generate_as(model, pr, p)
