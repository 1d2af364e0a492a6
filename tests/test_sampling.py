"""The sampling rule (forge_ml.sampling.sample_row): draws over many positions follow the
distribution that inference.generate.next_token_probs writes out (a chi-square test), the
same key and position give the same token, and every knob cuts as documented."""
import numpy as np
import pytest

from forge_ml.inference.generate import next_token_probs
from forge_ml.sampling import sample_row

# chi-square critical values at a 1e-4 false-alarm rate, by degrees of freedom (df + 3.72 sqrt(2 df) + ...
# from the Wilson-Hilferty approximation; checked against scipy.stats.chi2.ppf(1 - 1e-4, df))
def _critical(df):
    z = 3.7190
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("knobs,kw", [
    ([1.0, 0, 1.0, 0.0, 1.0], dict(temperature=1.0)),
    ([0.7, 6, 1.0, 0.0, 1.0], dict(temperature=0.7, top_k=6)),
    ([1.2, 0, 0.8, 0.0, 1.0], dict(temperature=1.2, top_p=0.8)),
    ([1.0, 0, 1.0, 0.1, 1.0], dict(temperature=1.0, min_p=0.1)),
    ([0.9, 8, 0.9, 0.02, 1.0], dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.02)),
])
def test_draws_follow_next_token_probs(knobs, kw):
    rs = np.random.default_rng(0)
    z = (rs.standard_normal(30) * 1.5).astype(np.float32)
    probs = next_token_probs(z, **kw)
    n = 6000
    draws = np.array([sample_row(z, knobs, (12345, 678), q) for q in range(n)])
    assert set(np.flatnonzero(np.bincount(draws, minlength=30))) <= set(np.flatnonzero(probs > 0))
    live = probs > 0
    counts = np.bincount(draws, minlength=30)[live]
    expected = probs[live] * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < _critical(int(live.sum()) - 1), stat
    # a wrong distribution (uniform over the support) is rejected by the same test
    wrong = np.full(live.sum(), n / live.sum())
    if live.sum() > 1:
        assert float(((counts - wrong) ** 2 / wrong).sum()) > _critical(int(live.sum()) - 1)


def test_same_key_and_position_same_token_and_the_penalty():
    z = np.linspace(-1, 1, 40).astype(np.float32)
    knobs = [1.0, 0, 1.0, 0.0, 1.0]
    assert sample_row(z, knobs, (1, 2), 5) == sample_row(z, knobs, (1, 2), 5)
    assert len({sample_row(z, knobs, (1, 2), q) for q in range(200)}) > 10
    assert sample_row(z, [0.0, 0, 1, 0, 1], (1, 2), 5) == 39           # temperature 0: argmax
    seen = np.zeros(40, bool)
    seen[39] = True                                                      # 1.0 / 3 < 0.95
    assert sample_row(z, [0.0, 0, 1, 0, 3.0], (1, 2), 5, seen) == 38
    z2 = z.copy()
    z2[3] = np.nan                                                       # a NaN row: argmax (numpy's)
    assert sample_row(z2, knobs, (1, 2), 5) == 3
    assert sample_row(z, [1.0, 1, 1.0, 0, 1.0], (9, 9), 3) == 39         # top_k=1


@pytest.mark.parametrize("knobs,seen_ids,want", [
    ([1e-40, 0, 1.0, 0.0, 1.0], [], 39),          # 1 / T overflows float32: the limit, the argmax
    ([3e-39, 5, 0.9, 0.0, 1.0], [], 39),
    ([1.0, 0, 1.0, 0.0, 1e-40], [30, 35], 30),    # z / penalty = inf for seen positive logits:
    ([0.8, 0, 0.9, 0.1, 1e-40], [35, 30], 30),    # the lowest such id, as argmax has it
])
def test_a_row_past_float32s_range_takes_the_argmax(knobs, seen_ids, want):
    """A temperature so small that 1 / T is infinite (or a penalty that makes a logit
    infinite) made the top weight exp(0 * inf) = NaN, cast to an integer: 0 on the GPU (every
    weight 0, and the draw chose id V, outside the vocabulary), 2^31 on x86 hosts, and after
    a penalty's inf - inf, 0 here too. Now the limit of the draw, on every backend: the argmax."""
    z = np.linspace(-1, 1, 40).astype(np.float32)
    seen = np.zeros(40, bool)
    seen[seen_ids] = True
    for q in range(20):
        assert sample_row(z, knobs, (7, 8), q, seen) == want
    assert sample_row(z, [1e-30, 0, 1.0, 0.0, 1.0], (7, 8), 3) == 39   # 1 / T finite: the draw, argmax too


def test_min_p_above_one_keeps_the_top_token():
    """min_p is not checked where the knobs live on the device (ops.sample_next): above 1 it
    kept nothing, and the kernels then returned an id past the vocabulary and marked it seen
    past the row (a review's finding). The floor is 2^24 at most: the top token (and its ties)
    is kept, on the host rule as on the device."""
    import forge_ml as fm
    from forge_ml import ops
    z = np.array([0.5, 3.0, 1.0, 3.0, -2.0], np.float32)
    for pmin in (1.0, 1.5, 1e9):
        for pos in range(20):
            tok = sample_row(z, [1.0, 0, 1, pmin, 1], (3, 4), pos)
            assert tok in (1, 3), (pmin, pos, tok)
    ids, p = fm.tensor(np.zeros(1, np.int32)), fm.tensor(np.array([4], np.int32))
    seen = fm.tensor(np.zeros((1, 5), np.int32))
    ops.sample_next(fm.tensor(z[None]), 5, ids, p, fm.tensor(np.array([[1.0, 0, 1, 2.0, 1]], np.float32)),
                    fm.tensor(np.array([[3, 4]], np.int32)), seen)
    assert int(ids.numpy()[0]) in (1, 3) and int(seen.numpy().sum()) == 2   # the id counted once


def test_the_draw_in_blocks_is_the_running_sum_over_the_whole_row():
    """``choose_from_weights`` finds the drawn id over block sums, then inside its block, and
    takes its word from ``rng.philox_first_word``: the same id as one running sum over the
    whole row with NumPy's Philox, at every cut, across block edges and vocabulary sizes."""
    import math
    from forge_ml import rng
    from forge_ml.sampling import choose_from_weights

    def reference(w, knobs, key, position):
        _, k, ptop, pmin, _ = (float(np.float32(v)) for v in knobs)
        k, V, floor = int(k), w.shape[0], 0
        if 0 < k < V:
            floor = int(np.sort(w)[::-1][k - 1])
        if 0 < ptop < 1:
            top = np.sort(w[w >= floor].astype(np.uint64))[::-1]
            need = math.ceil(float(np.float32(ptop)) * int(top.sum()))
            floor = max(floor, int(top[int(np.searchsorted(np.cumsum(top), need))]))
        if pmin > 0:
            floor = max(floor, math.ceil(min(pmin, 1.0) * (1 << 24)))
        cum = np.cumsum(np.where(w >= floor, w, 0).astype(np.uint64))
        word = int(rng.philox4x32_10([position, 0, 0, 0], key)[0, 0])
        return int(np.searchsorted(cum, np.uint64((int(cum[-1]) * word) >> 32), side="right"))

    r = np.random.default_rng(5)
    for trial in range(1500):
        V = int(r.choice([1, 3, 1023, 1024, 1025, 2048, 5000, 50257]))
        z = (r.standard_normal(V) * r.choice([0.3, 3.0, 12.0])).astype(np.float32)
        w = (np.exp(z - z.max()) * np.float32(1 << 24)).astype(np.uint32)
        knobs = [1.0, float(r.choice([0, 1, 5, 40])), float(r.choice([1.0, 0.9, 0.3])),
                 float(r.choice([0.0, 0.05])), 1.0]
        key = (int(r.integers(0, 2**32)), int(r.integers(0, 2**32)))
        pos = int(r.integers(0, 2**32))
        assert choose_from_weights(w, knobs, key, pos) == reference(w, knobs, key, pos), (V, knobs)
        assert rng.philox_first_word(pos, key) == int(rng.philox4x32_10([pos, 0, 0, 0], key)[0, 0])
