"""BatchEngine tests: the sampler against a straightforward per-row reference (tokens,
log-probabilities, the distribution it draws from), and the engine against a no-cache
reference loop: requests joining and leaving at different steps, queueing for slots,
cancelling, stop tokens, prompt scoring, errors at submit, the per-row step's fallback, and a
loop that fails."""
import asyncio
import threading
import time

import numpy as np
import pytest

import forge_ml as fm
from forge_ml.errors import ConfigError
from forge_ml.inference import batch as batch_mod
from forge_ml import sampling
from forge_ml.inference.batch import BatchEngine, choose_tokens
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


def ref_choose(logits, p: SamplingParams, seen, u):
    w, lps = ref_probs(logits, p, seen)
    if p.greedy:
        z = np.array(logits, dtype=np.float64)
        for t in set(seen):
            z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
        tok = int(np.argmax(z))
    else:
        cdf = np.cumsum(w)
        tok = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    top = sorted(range(len(lps)), key=lambda i: (-lps[i], i))[:p.logprobs or 0]
    return tok, lps, top


def ref_generate(model, prompt, p: SamplingParams, stop_len=None):
    """A request alone, without a KV cache: the full forward over the sequence each step."""
    gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([p.seed, 0])))
    seq, out = list(prompt), []
    for _ in range(p.max_tokens):
        logits = model.logits(fm.tensor([seq])).numpy()[0, -1]
        u = 0.0 if p.greedy else gen.random()
        tok, _, _ = ref_choose(logits, p, seq if p.repetition_penalty != 1 else (), u)
        out.append(tok)
        seq.append(tok)
        if tok in p.stop_tokens:
            break
    return out


# -- the sampler ---------------------------------------------------------------------------


def random_params(rng, i):
    return SamplingParams(
        temperature=[0.0, 0.7, 1.0, 1.6][i % 4],
        top_k=int(rng.choice([0, 1, 3, 10])),
        top_p=float(rng.choice([1.0, 0.9, 0.5, 0.05])),
        min_p=float(rng.choice([0.0, 0.05, 0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
        logprobs=[None, 0, 3][i % 3])


def test_choose_tokens_matches_the_reference():
    rng = np.random.default_rng(0)
    V = 40
    for trial in range(30):
        B = 7
        logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
        logits[0, 5] = logits[0, 9] = logits[0].max() + 1        # a tie for the argmax
        params = [random_params(rng, trial * B + r) for r in range(B)]
        seen = [rng.integers(0, V, rng.integers(0, 12)).tolist() for _ in range(B)]
        u = rng.random(B)
        got = choose_tokens(logits, params, seen, u)
        for r in range(B):
            tok, lps, top = ref_choose(logits[r], params[r], seen[r], u[r])
            assert got[r][0] == tok, (trial, r, params[r])
            if params[r].logprobs is None:
                assert got[r][1] is None and got[r][2] == ()
            else:
                assert got[r][1] == pytest.approx(lps[tok], abs=1e-5)
                assert [t for t, _ in got[r][2]] == top
                assert [lp for _, lp in got[r][2]] == pytest.approx([lps[t] for t in top], abs=1e-5)


EXTREME = [dict(temperature=1e-40), dict(temperature=1e-46), dict(temperature=5e-324),
           dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300),
           dict(temperature=1e-40, repetition_penalty=1e-40),
           dict(temperature=1e-300, repetition_penalty=1e300), dict(temperature=1e300)]


@pytest.mark.parametrize("kw", EXTREME, ids=range(len(EXTREME)))
def test_temperatures_and_penalties_that_overflow_float32_give_the_limit_not_nan(kw):
    """A temperature or repetition penalty so far from 1 that ``z / T`` or ``z / penalty``
    overflows float32 still draws from the limit distribution (the argmax of the penalised
    logits as T goes to 0, uniform as T grows), with no NaN log-probability."""
    rng = np.random.default_rng(2)
    V = 30
    logits = (rng.standard_normal((5, V)) * 3).astype(np.float32)
    seen = [rng.integers(0, V, 8).tolist() for _ in range(5)]
    u = rng.random(5)
    params = [SamplingParams(logprobs=4, **kw)] * 5
    got = choose_tokens(logits, params, seen, u)
    for r, (tok, lp, top) in enumerate(got):
        z = logits[r].astype(np.float64)
        pen = params[r].repetition_penalty
        for t in set(seen[r]):
            z[t] = z[t] / pen if z[t] > 0 else z[t] * pen
        if params[r].temperature > 1e100:
            assert tok == int(u[r] * V) and lp == pytest.approx(-np.log(V))
        elif params[r].temperature < 1e-30:
            assert tok == int(np.argmax(z)) and lp == 0.0
        else:       # temperature 1: the penalised softmax, seen tokens at its extremes
            w = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            assert tok == int(np.searchsorted(np.cumsum(w), u[r], side="right"))
            assert lp == pytest.approx(np.log(w[tok]), abs=1e-5)
        assert not np.isnan(lp) and all(not np.isnan(v) for _, v in top)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_greedy_takes_the_lowest_id_on_ties_and_top_k_one_is_greedy():
    logits = np.array([[0.0, 2.0, 2.0, 1.0]] * 2)
    ps = [SamplingParams(temperature=0), SamplingParams(top_k=1)]
    assert [t for t, _, _ in choose_tokens(logits, ps, [(), ()], [0.0, 0.999])] == [1, 2]
    logits = np.array([[0.0, 2.0, 3.0, 1.0]])        # no tie: top-k 1 is the argmax
    assert choose_tokens(logits, [SamplingParams(top_k=1)], [()], [0.999])[0][0] == 2


@pytest.mark.parametrize("cut", [dict(top_k=3), dict(top_p=0.5), dict(top_k=2, top_p=0.05)])
def test_the_cuts_keep_every_token_tied_at_the_cut_as_generate_does(cut):
    """99 tokens tied just under the top: top-k 3 keeps all 100 (transformers' TopKLogitsWarper
    and ``sampling.sample_row`` do), and a nucleus ending inside the tie keeps the whole tie;
    uniforms over [0, 1) reach every kept token, the server drew only ids 0, 2 and 3 before."""
    V = 120
    logits = np.full(V, -30.0, np.float32)
    logits[0], logits[2:101] = 1.0, 0.0
    p = SamplingParams(**cut)
    toks = {choose_tokens(logits[None], [p], [()], [x])[0][0] for x in (np.arange(4000) + 0.5) / 4000}
    knobs = [1.0, p.top_k, p.top_p, p.min_p, 1.0]
    want = {sampling.sample_row(logits, knobs, (5, s), 0) for s in range(3000)}
    assert toks == want == {0, *range(2, 101)}


def test_the_draw_follows_the_cut_distribution():
    """Uniforms on a fine grid draw each token in proportion to its probability (to 1/N)."""
    logits = np.log(np.array([0.3, 0.05, 0.2, 0.01, 0.15, 0.12, 0.1, 0.07]))
    for p in [SamplingParams(), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(top_p=0.8, min_p=0.2), SamplingParams(temperature=2.0, top_p=0.9)]:
        N = 4000
        u = (np.arange(N) + 0.5) / N
        toks = [choose_tokens(logits[None], [p], [()], [x])[0][0] for x in u]
        freq = np.bincount(toks, minlength=8) / N
        want, _ = ref_probs(logits, p)
        assert np.abs(freq - want).max() <= 1.0 / N + 1e-12, (p, freq, want)


def test_cuts_that_reach_past_the_first_candidates_and_a_large_vocabulary():
    """A few likely tokens over a long tail 10 below them: top-k, top-p and the top
    log-probabilities must widen their search past the first threshold; and a vocabulary
    large enough for the draw to go through block sums."""
    rng = np.random.default_rng(1)
    V = 9000
    tail = np.full(V, -10.0) + rng.standard_normal(V) * 0.5
    tail[[7, 100, 2000, 4000, 8999]] = 0.0                   # five tied at the top
    flat = rng.standard_normal(V) * 2
    for logits in (tail, flat):
        for p in [SamplingParams(top_k=50, logprobs=20), SamplingParams(top_p=0.999),
                  SamplingParams(temperature=0.5, top_p=0.7, min_p=0.001),
                  SamplingParams(top_k=3, top_p=0.5), SamplingParams(logprobs=7)]:
            for x in rng.random(4):
                tok, lps, top = ref_choose(logits, p, (), x)
                got = choose_tokens(logits[None], [p], [()], [x])[0]
                assert got[0] == tok, p
                assert [t for t, _ in got[2]] == top


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
    step = engine._step

    def slow(tokens, positions):
        time.sleep(seconds)
        return step(tokens, positions)

    engine._step = slow
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


def test_the_fallback_step_gives_the_same_tokens(model, expected, monkeypatch):
    monkeypatch.setattr(batch_mod, "row_step", None)
    with BatchEngine(model, slots=4) as engine:
        assert engine._step.__qualname__.startswith("_row_step_fallback")
        got = [tokens_of(engine.submit(pr, p)) for pr, p in REQUESTS[:3]]
    assert got == expected[:3]


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
                                {"temperature": float("nan")}])
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
    def broken(tokens, positions):
        raise RuntimeError("device lost")
    engine._step = broken
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
    every step after). choose_tokens now gives None for such a row; the engine ends that
    request with a ModelError naming the weight, frees its slot, and serves the others."""
    from forge_ml.errors import ModelError
    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.1, np.nan, 0.8], [0.2, np.inf, 0.1]]))
    for p, want in ((SamplingParams(temperature=0), 0), (SamplingParams(top_p=0.9, logprobs=1), 0),
                    (SamplingParams(top_p=0.9), 2)):
        u = 0.3 if want == 0 else 0.95          # the draw: the first id whose running sum passes u
        got = choose_tokens(logits, [p] * 3, [[], [], []], [u] * 3)
        assert got[1] == got[2] == (None, None, ())
        assert got[0][0] == want
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
