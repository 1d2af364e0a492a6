"""Counter-based random numbers: Philox4x32-10 (Salmon et al., "Parallel random numbers:
as easy as 1, 2, 3", SC'11; the Random123 library).

A counter RNG is a pure function ``(key, counter) -> 4 x uint32``, so a random number is a
pure function of ``(seed, element index)``: dropout's backward regenerates the forward mask
instead of storing it, and the CPU and the GPU draw the same bits.

The dropout stream (every backend implements exactly this):
    key     = (seed & 0xffffffff, (seed >> 32) & 0xffffffff)
    counter = (i // 4 & 0xffffffff, i // 4 >> 32, 0, 0)       for element index i
    word    = philox4x32_10(counter, key)[i % 4]
    u       = (word >> 8) * 2**-24                            float32 in [0, 1), exact
    keep    = u >= p

>>> philox4x32_10([0, 0, 0, 0], [0, 0])[:, 0].tolist()
[1713891541, 3781805453, 3159862348, 2600524760]
>>> dropout_keep(seed=7, n=8, p=0.5).tolist()
[True, True, False, False, False, True, False, True]
"""
from __future__ import annotations

import numpy as np

PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32 with 10 rounds, vectorized over counters.

    ``counter``: 4 words, each a scalar or an array (broadcast together); ``key``: 2 words
    (Python ints). Returns a (4, N) uint32 array (N = 1 for scalar counters).

    >>> philox4x32_10([0, 0, 0, 0], [0, 0]).ravel().tolist()    # Random123's known answer
    [1713891541, 3781805453, 3159862348, 2600524760]
    >>> philox4x32_10([[0, 1, 2], 0, 0, 0], [7, 0]).shape
    (4, 3)
    """
    c = [np.atleast_1d(np.asarray(w, dtype=np.uint64)) & MASK32 for w in counter]
    c = list(np.broadcast_arrays(*c))
    c = [x.astype(np.uint64).ravel() for x in c]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for r in range(10):
        if r:
            k0 = (k0 + PHILOX_W0) & 0xFFFFFFFF
            k1 = (k1 + PHILOX_W1) & 0xFFFFFFFF
        p0 = PHILOX_M0 * c[0]  # 64-bit products of two 32-bit words: exact in uint64
        p1 = PHILOX_M1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & MASK32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
    return np.stack(c).astype(np.uint32)


def philox_first_word(c0: int, key) -> int:
    """``philox4x32_10([c0, 0, 0, 0], key)[0, 0]`` in plain Python integers: one draw without
    NumPy's per-call cost (a sampled token's word, every step of every row on the host).

    >>> philox_first_word(0, [0, 0]) == int(philox4x32_10([0, 0, 0, 0], [0, 0])[0, 0])
    True
    """
    m0, m1, mask = int(PHILOX_M0), int(PHILOX_M1), 0xFFFFFFFF
    x0, x1, x2, x3 = int(c0) & mask, 0, 0, 0
    k0, k1 = int(key[0]) & mask, int(key[1]) & mask
    for r in range(10):
        if r:
            k0 = (k0 + PHILOX_W0) & mask
            k1 = (k1 + PHILOX_W1) & mask
        p0, p1 = m0 * x0, m1 * x2
        x0, x1, x2, x3 = (p1 >> 32) ^ x1 ^ k0, p1 & mask, (p0 >> 32) ^ x3 ^ k1, p0 & mask
    return x0


def seed_key(seed: int) -> tuple[int, int]:
    """The Philox key of a (up to 64-bit, non-negative) seed.

    >>> seed_key(7), seed_key(2**32 + 5)
    ((7, 0), (5, 1))
    """
    seed = int(seed)
    if seed < 0 or seed >= 1 << 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF


def uniform(seed: int, n: int, offset: int = 0) -> np.ndarray:
    """float32 uniforms in [0, 1) for element indices ``offset … offset+n-1`` of stream ``seed``.

    >>> uniform(7, 4).tolist()
    [0.9545971155166626, 0.7501521706581116, 0.11417734622955322, 0.08565783500671387]
    >>> uniform(7, 3, offset=1).tolist() == uniform(7, 4)[1:].tolist()
    True
    """
    if n <= 0:
        return np.zeros(0, np.float32)
    first, last = offset // 4, (offset + n - 1) // 4
    blocks = np.arange(first, last + 1, dtype=np.uint64)
    words = philox4x32_10([blocks & MASK32, blocks >> np.uint64(32), 0, 0], seed_key(seed))
    # word j of block b is element 4*b + j: the stream is the (blocks, 4) transpose, flattened
    w = words.T.ravel()[offset - 4 * first: offset - 4 * first + n]
    out = (w >> np.uint32(8)).astype(np.float32)
    out *= np.float32(2.0 ** -24)
    return out


def dropout_keep(seed: int, n: int, p: float) -> np.ndarray:
    """Boolean keep-mask of ``n`` elements for dropout rate ``p`` (True = kept).

    >>> dropout_keep(7, 4, 0.5).tolist(), bool(dropout_keep(7, 4, 0.0).all())
    ([True, True, False, False], True)
    """
    return uniform(seed, n) >= np.float32(p)


def dropout_scale(p: float) -> np.float32:
    """The inverted-dropout scale 1/(1-p), rounded once to float32 (the same on every backend).

    >>> float(dropout_scale(0.5)), dropout_scale(0.1).dtype, float(dropout_scale(0.1))
    (2.0, dtype('float32'), 1.1111111640930176)
    """
    return np.float32(1.0 / (1.0 - p))


def mix(seed: int, site: int) -> int:
    """A distinct 64-bit stream per (step seed, dropout site): splitmix64's finalizer over
    ``seed * 0x9E3779B97F4A7C15 + site + 1`` (mod 2**64). The GPU computes the same from a
    seed in device memory (``ops.SeedAt``).

    >>> mix(0, 0), mix(0, 1) != mix(0, 0)
    (6238072747940578789, True)
    """
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(site) + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)
