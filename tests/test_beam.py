"""Beam search against transformers' ``generate(num_beams=...)`` on the same random GPT-2
weights: sequences (new tokens, best first) and their scores, for 2 and 4 beams, length
penalties 0.5, 1 and 2, early stopping on and off, with and without an end-of-sequence token
that ends beams early; then the rules' coverage, greedy as one beam, the errors, and the GPU."""
import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import forge_ml as fm  # noqa: E402
from forge_ml.errors import ConfigError, ShapeError  # noqa: E402
from forge_ml.hf import save_hf_gpt2  # noqa: E402
from forge_ml.inference import beam  # noqa: E402
from forge_ml.inference.beam import beam_search  # noqa: E402
from forge_ml.inference.generate import generate  # noqa: E402
from forge_ml.models.gpt2 import GPT2, GPT2Config  # noqa: E402
from test_sampling_hf import one_torch_thread, random_host_params  # noqa: E402,F401 (a fixture; the weights recipe)

CFG = GPT2Config(vocab_size=53, padded_vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
PROMPT = [3, 1, 4, 1, 5]
NEW = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(forge-ml model, transformers GPT2LMHeadModel) on the same weights, through
    ``save_hf_gpt2`` and ``from_pretrained``."""
    host = random_host_params(CFG)
    d = tmp_path_factory.mktemp("hf") / "gpt2"
    save_hf_gpt2(d, CFG, host)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(d).float().eval()
    return GPT2(CFG, {k: fm.tensor(v) for k, v in host.items()}), theirs


def hf_beams(theirs, prompt, num_beams, length_penalty, early_stopping, eos, n_return=None):
    """transformers' beam search: the returned sequences' new tokens (cut at their generated
    length, which ``beam_indices`` tells) and ``sequences_scores``."""
    n_return = num_beams if n_return is None else n_return
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = theirs.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                              num_beams=num_beams, length_penalty=length_penalty,
                              early_stopping=early_stopping, max_new_tokens=NEW,
                              eos_token_id=eos, pad_token_id=0,
                              num_return_sequences=n_return, return_dict_in_generate=True,
                              output_scores=True)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    seqs = [out.sequences[i, len(prompt):len(prompt) + n].tolist() for i, n in enumerate(lengths)]
    return seqs, out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def eos(pair):
    """An end-of-sequence id that beams actually produce: the third token of the best
    4-beam sequence without one."""
    ours, _ = pair
    seqs, _ = beam_search(ours, PROMPT, NEW, 4, num_return_sequences=4)
    assert len({tuple(s) for s in seqs}) == 4 and len(set(seqs[0])) > 4   # varied beams
    return seqs[0][2]


GRID = list(itertools.product([2, 4], [0.5, 1.0, 2.0], [False, True], [False, True]))


@pytest.mark.parametrize("num_beams,length_penalty,early_stopping,with_eos", GRID)
def test_beam_search_matches_transformers(pair, eos, num_beams, length_penalty, early_stopping,
                                          with_eos):
    ours, theirs = pair
    e = eos if with_eos else None
    want, want_scores = hf_beams(theirs, PROMPT, num_beams, length_penalty, early_stopping, e)
    got, scores = beam_search(ours, PROMPT, NEW, num_beams, length_penalty=length_penalty,
                              early_stopping=early_stopping, eos_token_id=e,
                              num_return_sequences=num_beams)
    assert got == want
    np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-5)
    assert scores == sorted(scores, reverse=True)
    for s in got:       # a hypothesis ends at max_new_tokens or at its first eos
        assert len(s) == NEW or s[-1] == e
        assert e is None or e not in s[:-1]


@pytest.mark.parametrize("length_penalty", [0.5, 2.0])
def test_early_stopping_never_matches_transformers(pair, eos, length_penalty):
    ours, theirs = pair
    want, want_scores = hf_beams(theirs, PROMPT, 4, length_penalty, "never", eos)
    got, scores = beam_search(ours, PROMPT, NEW, 4, length_penalty, "never", eos, 4)
    assert got == want
    np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-5)


def test_num_return_sequences_and_other_prompts(pair, eos):
    ours, theirs = pair
    for prompt in ([7], [40, 2, 2, 9, 30, 11]):
        want, want_scores = hf_beams(theirs, prompt, 3, 1.0, False, eos, n_return=2)
        got, scores = beam_search(ours, prompt, NEW, 3, eos_token_id=eos, num_return_sequences=2)
        assert got == want
        np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-5)
        best, best_score = beam_search(ours, prompt, NEW, 3, eos_token_id=eos)
        assert best == got[:1] and best_score == scores[:1]
        if eos is not None:     # the ids as a NumPy array, as transformers takes a tensor
            arr = np.atleast_1d(np.asarray(eos, np.int64))
            assert beam_search(ours, prompt, NEW, 3, eos_token_id=arr, num_return_sequences=2) == (got, scores)


def test_the_cases_cover_every_stopping_rule(pair, eos, monkeypatch):
    """The parity grid means something only if its cases reach each rule: beams ended by the
    eos before max_new_tokens, a search ended early by the heuristic (early_stopping=False)
    and one by early_stopping=True, with different results."""
    ours, _ = pair
    steps = []

    class CountingStep(beam.DecodeStep):
        def __call__(self, tokens, pos):
            steps[-1] += 1
            return super().__call__(tokens, pos)

    monkeypatch.setattr(beam, "DecodeStep", CountingStep)
    ran = {}
    for nb, lp, es in itertools.product([2, 4], [0.5, 1.0, 2.0], [False, True]):
        steps.append(1)                          # the prefill's logits choose the first token
        seqs, _ = beam_search(ours, PROMPT, NEW, nb, lp, es, eos, nb)
        ran[nb, lp, es] = (seqs, steps[-1])
    short = [k for k, (seqs, _) in ran.items() if any(len(s) < NEW for s in seqs)]
    assert short                                                  # eos ended some beams
    heuristic = [k for k, (seqs, n) in ran.items() if not k[2] and n < NEW]
    assert heuristic                                              # stopped before NEW steps
    differ = [k[:2] for k in ran if k[2] and ran[k][0] != ran[k[:2] + (False,)][0]]
    assert differ                                                 # early_stopping changed it


def test_one_beam_without_eos_is_greedy(pair):
    ours, _ = pair
    for prompt in (PROMPT, [8, 8]):
        (seq,), (score,) = beam_search(ours, prompt, NEW, 1)
        assert seq == list(generate(ours, prompt, max_new_tokens=NEW, temperature=0))
        events = [e for s in generate(ours, [prompt], max_new_tokens=NEW, temperature=0,
                                      logprobs=0) for e in s]
        assert score == pytest.approx(sum(e.logprob for e in events) / NEW, rel=1e-6)


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (2.0, "never"), (0.5, True)])
def test_one_beam_is_transformers_greedy_search(pair, length_penalty, early_stopping):
    """transformers' generate(num_beams=1) is greedy search: it stops at the first eos, whatever
    length_penalty and early_stopping say. One beam of beam search went on past an eos that
    early_stopping="never" with a positive length penalty let it outscore (a known difference
    until now); num_beams=1 is greedy search here too."""
    ours, theirs = pair
    for prompt in (PROMPT, [7], [40, 2, 2, 9, 30, 11]):
        greedy = list(generate(ours, prompt, max_new_tokens=NEW, temperature=0))
        e = greedy[2]                          # an eos the greedy sequence meets early
        x = torch.tensor([prompt])
        with torch.no_grad():
            out = theirs.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1,
                                  length_penalty=length_penalty, early_stopping=early_stopping,
                                  max_new_tokens=NEW, eos_token_id=e, pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        want = want[:want.index(e) + 1] if e in want else want
        (got,), (score,) = beam_search(ours, prompt, NEW, 1, length_penalty, early_stopping, e)
        assert got == want == greedy[:greedy.index(e) + 1], (prompt, got, want)
        events = [ev for s in generate(ours, [prompt], max_new_tokens=NEW, temperature=0,
                                       logprobs=0, stop_tokens=[e]) for ev in s]
        assert score == pytest.approx(sum(ev.logprob for ev in events) / len(got) ** length_penalty,
                                      rel=1e-6)


def test_beam_search_arguments_are_checked(pair):
    ours, _ = pair
    with pytest.raises(ShapeError, match="empty"):
        beam_search(ours, [], 4, 2)
    with pytest.raises(ShapeError, match="out of range"):
        beam_search(ours, [1, 53], 4, 2)
    with pytest.raises(ShapeError, match="context of 32"):
        beam_search(ours, [1] * 30, 3, 2)
    bad = [dict(max_new_tokens=-1), dict(max_new_tokens=1.5), dict(num_beams=0), dict(num_beams=27),
           dict(length_penalty=float("nan")), dict(early_stopping="sometimes"),
           dict(eos_token_id=99), dict(eos_token_id="x"), dict(num_return_sequences=3)]
    for kw in bad:
        args = dict(max_new_tokens=4, num_beams=2)
        args.update(kw)
        with pytest.raises(ConfigError):
            beam_search(ours, [1, 2], **args)
    with pytest.raises(TypeError, match="beam_search"):
        generate(ours, [1, 2], num_beams=2)
    for kw in (dict(early_stopping=1), dict(early_stopping=0), dict(length_penalty=True)):
        with pytest.raises(ConfigError):   # (1 ran as False: the search asks `is True`)
            beam_search(ours, [1, 2], 4, 2, **kw)
    with pytest.raises(TypeError, match="beam_search: model must be a forge-ml language model"):
        beam_search(None, [1, 2], 4, 2)


def test_no_new_tokens_is_the_empty_continuation(pair, eos):
    """max_new_tokens=0 was a ConfigError, while generate(..., max_new_tokens=0) yields no token.
    Now the search ends before it starts: ``num_return_sequences`` empty continuations, each
    scored 0.0 (an empty continuation's log-probability is log 1 = 0, and 0 stays 0 over any
    length normalisation), for greedy and beams alike; the other arguments are still checked,
    and a negative count is refused saying what it takes."""
    ours, _ = pair
    assert list(generate(ours, PROMPT, max_new_tokens=0)) == []
    for num_beams, n_return, penalty, stop in ((1, 1, 1.0, None), (2, 1, 1.0, eos), (4, 3, 2.0, None),
                                               (4, 4, -1.0, eos), (2, 2, 0.0, None)):
        seqs, scores = beam_search(ours, PROMPT, 0, num_beams, penalty, eos_token_id=stop,
                                   num_return_sequences=n_return)
        assert (seqs, scores) == ([[]] * n_return, [0.0] * n_return)
        assert all(type(s) is float for s in scores)
    seqs, _ = beam_search(ours, PROMPT, np.int64(0), 2, num_return_sequences=2)
    assert seqs == [[], []] and seqs[0] is not seqs[1]          # a list each, not one shared
    assert beam_search(ours, [1] * 32, 0, 2) == ([[]], [0.0])   # a prompt that fills the context
    with pytest.raises(ConfigError, match=r"^beam_search: max_new_tokens must be an int >= 0, got -1$"):
        beam_search(ours, PROMPT, -1, 2)
    with pytest.raises(ShapeError, match="context of 32"):
        beam_search(ours, [1] * 33, 0, 2)
    with pytest.raises(ConfigError, match="num_beams"):
        beam_search(ours, PROMPT, 0, 0)
    with pytest.raises(ConfigError, match="num_return_sequences"):
        beam_search(ours, PROMPT, 0, 2, num_return_sequences=3)


def test_numpy_knobs_are_python_values(pair, eos):
    """NumPy's bool and float32 are taken as Python's: np.True_ stops early as True does (it
    ran as False), and a float32 length penalty leaves the scores Python floats (they came
    back float32, the ranking in float32)."""
    ours, _ = pair
    want = beam_search(ours, PROMPT, NEW, 4, 2.0, True, eos, 4)
    assert beam_search(ours, PROMPT, NEW, 4, 2.0, np.True_, eos, 4) == want
    assert want != beam_search(ours, PROMPT, NEW, 4, 2.0, False, eos, 4)   # the case bites
    seqs, scores = beam_search(ours, PROMPT, NEW, 4, np.float32(0.5), False, eos, 4)
    assert all(type(x) is float for x in scores)
    assert (seqs, scores) == beam_search(ours, PROMPT, NEW, 4, 0.5, False, eos, 4)


def test_a_nan_past_the_prompt_is_refused_at_its_step(pair):
    """A weight that only a later position reads (a row of wpe) gives NaN logits there: beam
    search says so with a ModelError at that step (its scores came back NaN)."""
    ours, _ = pair
    bad = GPT2(ours.config, {k: fm.tensor(v.numpy().copy()) for k, v in ours.params.items()})
    bad.params["wpe.weight"].data[7, :] = np.inf
    assert beam_search(bad, PROMPT, 2, 2)[0]        # positions 0-6: fine
    with pytest.raises(fm.ModelError, match="position 7 hold NaN or inf.*wpe.weight holds 32 inf"):
        beam_search(bad, PROMPT, NEW, 2)


@pytest.mark.cuda
def test_beam_search_on_the_gpu_equals_the_cpu(pair, eos):
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no GPU")
    except Exception as e:  # no cupy, no driver, no device
        pytest.skip(f"no CUDA GPU: {e}")
    ours, _ = pair
    gpu = ours.to("cuda")
    for nb, lp, es in itertools.product([2, 4], [0.5, 2.0], [False, True]):
        want, want_scores = beam_search(ours, PROMPT, NEW, nb, lp, es, eos, nb)
        for _ in range(2):              # the second call replays the captured steps
            got, scores = beam_search(gpu, PROMPT, NEW, nb, lp, es, eos, nb)
            assert got == want
            np.testing.assert_allclose(scores, want_scores, rtol=1e-4, atol=1e-5)


def test_one_beam_on_nan_logits_names_beam_search():
    """num_beams=1 runs greedy search through generate, whose NaN error named "generate:"."""
    from forge_ml.errors import ModelError
    from forge_ml.inference.beam import beam_search
    from test_generate import make_model
    m = make_model()
    m.params["wpe.weight"].data[3, :] = np.nan
    with pytest.raises(ModelError, match=r"^beam_search: the model's logits"):
        beam_search(m, [1, 2], max_new_tokens=4, num_beams=1)


def test_length_penalties_past_floats_range_score_instead_of_crashing(pair, eos):
    """``generated_length ** length_penalty`` overflowed (OverflowError at 400) or underflowed
    to 0 (ZeroDivisionError at -400 with early stopping): `forge-ml sample --num-beams 2
    --length-penalty 400` ended in a traceback. The quotient is now taken at its limit: -0.0
    past the top, -inf under the bottom; the search runs to an answer of the asked size."""
    assert beam._normalised(-3.0, 5, 1.0) == -3.0 / 5
    assert beam._normalised(-3.0, 5, 2.5) == -3.0 / 5 ** 2.5       # transformers' formula
    assert str(beam._normalised(-3.0, 5, 1e308)) == "-0.0"
    assert beam._normalised(-3.0, 5, -1e308) == -np.inf
    assert beam._normalised(0.0, 5, -1e308) == 0.0
    ours, _ = pair
    for lp, early in ((400.0, False), (-400.0, True), (1e308, "never"), (-1e308, False)):
        seqs, scores = beam_search(ours, PROMPT, 6, 2, length_penalty=lp,
                                   early_stopping=early, eos_token_id=eos, num_return_sequences=2)
        assert len(seqs) == 2 and all(s for s in seqs), (lp, early)
        assert all(s <= 0 for s in scores) and scores == sorted(scores, reverse=True)


def test_one_beam_is_greedy_even_where_the_vocabulary_is_smaller_than_two_candidates():
    """num_beams=1 runs greedy search, which keeps no candidates, but the check that each step
    keeps at most a vocabulary of candidates refused it at vocabularies of 1 (and 2 with two
    end ids), advising fewer beams than one."""
    m1 = GPT2.init(GPT2Config(vocab_size=1, block_size=8, n_layer=1, n_head=1, n_embd=4))
    seqs, scores = beam_search(m1, [0], 3, num_beams=1)
    assert seqs == [[0, 0, 0]] and scores[0] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ConfigError, match="use fewer beams"):
        beam_search(m1, [0], 3, num_beams=2)
