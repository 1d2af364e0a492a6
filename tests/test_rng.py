"""Philox4x32-10 against Random123's published known-answer vectors (kat_vectors), and the
dropout stream's contract."""
import numpy as np
import pytest

from forge_ml import rng

# Random123 kat_vectors, "philox4x32 10": counter (4 words), key (2 words) -> output (4 words)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    got = rng.philox4x32_10(ctr, key)[:, 0]
    assert tuple(int(x) for x in got) == want


def test_philox_vectorized_matches_scalar():
    r = np.random.default_rng(0)
    ctrs = r.integers(0, 2**32, size=(4, 50), dtype=np.uint64)
    key = (123456789, 987654321)
    batch = rng.philox4x32_10(list(ctrs), key)
    for j in range(50):
        one = rng.philox4x32_10([int(c[j]) for c in ctrs], key)[:, 0]
        assert (batch[:, j] == one).all()


def test_uniform_is_a_pure_function_of_seed_and_index():
    full = rng.uniform(42, 103)
    # any window of the stream equals the same slice of the whole stream
    for off, n in [(0, 1), (1, 7), (5, 50), (99, 4)]:
        assert (rng.uniform(42, n, offset=off) == full[off:off + n]).all()
    assert full.dtype == np.float32 and (full >= 0).all() and (full < 1).all()
    assert not (rng.uniform(43, 103) == full).all()


def test_uniform_follows_the_documented_stream():
    seed = (7 << 32) | 11
    i = np.arange(12)
    words = rng.philox4x32_10([i // 4, 0, 0, 0], (11, 7))  # (4, 12)
    want = (words[i % 4, i] >> 8).astype(np.float32) * np.float32(2.0 ** -24)
    assert (rng.uniform(seed, 12) == want).all()


def test_dropout_keep_rate_and_bad_seed():
    keep = rng.dropout_keep(3, 200_000, 0.3)
    assert abs(keep.mean() - 0.7) < 0.005
    with pytest.raises(ValueError):
        rng.seed_key(-1)
