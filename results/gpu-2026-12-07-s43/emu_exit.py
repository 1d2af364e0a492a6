"""sample.cu's radix descent (radix_select) emulated on the host, with and without the early
stop of the forty-third session (Pick::last: the picked bin holds one candidate, or the bins
from it up hold exactly what the cut needs): the weights each cut keeps must be the same.
Run: python3 results/gpu-2026-12-07-s43/emu_exit.py   (NumPy only; a few seconds)"""
import math

import numpy as np


def radix(w, floor_, need, ptop, by_mass, early):
    """(cut, passes) for int64 weights w (<= 2^24), as radix_select: top-k (by count, need k)
    or top-p (by mass, need ceil(ptop K) weighed in the first pass)."""
    prefix, remaining, passes = 0, need, 0
    kept = w >= floor_
    for p in range(3):
        shift = 16 - 8 * p
        fixed = 0 if p == 0 else (~0 << (shift + 8)) & 0xffffffff
        if by_mass and p == 0 and ptop > 0:
            remaining = math.ceil(ptop * int(w[kept].sum()))
        d = np.minimum(w >> 16, 256) if p == 0 else (w >> shift) & 255
        counted = kept & ((w & fixed) == prefix) & (d != 0)
        n = np.bincount(d[counted], minlength=288)
        v = (np.bincount(d[counted], weights=w[counted], minlength=288).astype(np.int64)
             if by_mass else n)   # exact: every sum here is far below 2^53
        passes += 1
        at, dig, last = 0, 0, False
        for b in range(287, 0, -1):   # pick_digit: the largest digit whose bins reach it
            if at + int(v[b]) >= remaining:
                dig, last = b, int(n[b]) == 1 or at + int(v[b]) == remaining
                break
            at += int(v[b])
        prefix |= dig << shift
        if early and last:
            return prefix, passes
        remaining -= at
    return prefix, passes


def main():
    rs = np.random.default_rng(0)
    V, bad, cases, saved = 3000, 0, 0, 0
    for trial in range(400):
        scale = (3, 0.3, None, 8)[trial % 4]
        z = np.round(rs.standard_normal(V) * 2) if scale is None else rs.standard_normal(V) * scale
        T = (0.7, 1.0, 0.8)[trial % 3]
        w = (np.exp((z - z.max()) / T).astype(np.float32) * np.float32(2 ** 24)).astype(np.int64)
        k, ptop = int(rs.integers(1, 60)), float(rs.choice([0.5, 0.9, 0.95, 0.01, 0.999]))
        for mode in ("k", "p", "kp"):
            f1 = f2 = 0
            if "k" in mode:
                (f1, a), (f2, b) = radix(w, 0, k, 0.0, False, False), radix(w, 0, k, 0.0, False, True)
                saved += a - b
            if "p" in mode:
                (c1, a), (c2, b) = radix(w, f1, 0, ptop, True, False), radix(w, f2, 0, ptop, True, True)
                f1, f2, saved = max(f1, c1), max(f2, c2), saved + a - b
            cases += 1
            bad += not np.array_equal(w >= f1, w >= f2)
    print(f"{cases} cuts, {bad} whose kept weights differ, {saved} passes saved")
    # the benchmark's modes at GPT-2's vocabulary: sampling_cuda.py's flat and peaked logits
    for name, scale in (("flat 0.55", 0.55), ("peaked 3", 3.0)):
        for _ in range(3):
            z = rs.standard_normal(50257) * scale
            w = (np.exp((z - z.max()) / 0.8).astype(np.float32) * np.float32(2 ** 24)).astype(np.int64)
            print(f"{name}, T 0.8: top-k 40 {radix(w, 0, 40, 0.0, False, True)[1]} passes, "
                  f"top-p 0.9 {radix(w, 0, 0, 0.9, True, True)[1]} passes (3 without the stop)")


if __name__ == "__main__":
    main()
