"""QA (second pass) of the next-token choice as a Hugging Face user calls it: the written-out
distribution (``next_token_probs``) at the edges of the temperature, and the checks of
``apply_repetition_penalty``'s arguments."""
import warnings

import numpy as np
import pytest

from forge_ml.errors import ConfigError
from forge_ml.inference.generate import (apply_repetition_penalty, next_token_probs,
                                         token_logprobs)


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-310])
def test_next_token_probs_at_a_vanishing_temperature_is_the_argmax(temperature):
    """A subnormal temperature (a limit generate's sampling takes as greedy, and that
    token_logprobs reports as all the mass on the argmax) gave a distribution of NaNs:
    ``z / T`` overflowed to inf and ``exp(inf - inf)`` is NaN. The logits' max is now taken
    away first, as token_logprobs does."""
    rng = np.random.default_rng(0)
    for _ in range(5):
        z = rng.standard_normal(17) * 3
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # no overflow or invalid-value warning either
            got = next_token_probs(z, temperature=temperature)
        assert np.isfinite(got).all()
        assert got.tolist() == next_token_probs(z, temperature=0).tolist()
        np.testing.assert_array_equal(got, np.exp(token_logprobs(z, temperature)))


def test_next_token_probs_of_float32s_largest_logits_at_a_small_temperature():
    """Logits near float32's range over a small temperature overflowed float64 too."""
    z = np.array([3e38, -3e38, 0.0, 1e38], np.float32)
    got = next_token_probs(z, temperature=1e-300, top_k=2)
    assert got.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("penalty", [0.0, -2.0, float("nan"), float("inf"), "2", None, True])
def test_apply_repetition_penalty_refuses_a_penalty_that_is_no_positive_number(penalty):
    """apply_repetition_penalty (public: forge_ml.inference) took any penalty: 0 gave +inf
    logits, a negative one swapped the seen logits' signs, NaN gave NaN logits, all in
    silence, and a string a NumPy UFuncTypeError traceback. It says what it expects now, as
    generate and next_token_probs do for their repetition_penalty."""
    logits = np.array([2.0, -1.0, 3.0])
    with pytest.raises(ConfigError, match=r"apply_repetition_penalty: the repetition penalty "
                                          r"must be a finite number > 0.*got"):
        apply_repetition_penalty(logits, penalty, [0, 1])
    # the valid edge values still work (and 1 is off)
    assert apply_repetition_penalty(logits, 1.0, [0, 1]).tolist() == logits.tolist()
    assert apply_repetition_penalty(logits, 1e-30, [0]).tolist()[0] == pytest.approx(2e30)


def test_a_negative_context_id_is_refused_in_the_callers_name():
    """A negative id in the context (NumPy would penalise the last id) was refused in
    apply_repetition_penalty's name whoever called: next_token_probs' and token_logprobs'
    users read of a function they never called."""
    z = np.array([2.0, -1.0, 0.5])
    with pytest.raises(ConfigError, match=r"^next_token_probs: token id -1 in the context"):
        next_token_probs(z, repetition_penalty=2.0, context=[0, -1])
    with pytest.raises(ConfigError, match=r"^token_logprobs: token id -3 in the context"):
        token_logprobs(z, 1.0, repetition_penalty=2.0, context=[-3])


def test_beam_search_takes_an_eos_id_as_a_0d_array():
    """``eos_token_id=np.array(3)`` (one id, as an argmax or ``tok.eos_token_id`` read from
    an array gives it) was refused: "must be None, an int or a list of ints", though
    generate takes the same value as its stop_tokens. It is one id now."""
    from forge_ml.inference.beam import beam_search
    from forge_ml.models.gpt2 import GPT2, GPT2Config

    model = GPT2.init(GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8))
    seqs, _ = beam_search(model, [1, 2], 6, 2, num_return_sequences=2)
    eos = seqs[0][1]                  # a token the best beam produces: the search ends there
    want = beam_search(model, [1, 2], 6, 2, eos_token_id=eos, num_return_sequences=2)
    assert beam_search(model, [1, 2], 6, 2, eos_token_id=np.array(eos),
                       num_return_sequences=2) == want
    assert want[0][0][-1] == eos or eos not in want[0][0]
    with pytest.raises(ConfigError, match="eos_token_id must be None, an int"):
        beam_search(model, [1, 2], 6, 2, eos_token_id=np.array(3.0))
