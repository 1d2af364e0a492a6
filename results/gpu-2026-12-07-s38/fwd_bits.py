"""Session 38: the wgmma forward's outputs and lse, written for a set of shapes by whichever
forge_ml is on the path (``save DIR``), or compared byte for byte between two such folders
(``cmp A B``): the pipelined forward must give the bits of the one-tile-after-another one."""
import sys
from pathlib import Path

import numpy as np

SHAPES = [(2, 12, 1024, 1024), (1, 4, 4096, 4096), (2, 3, 200, 200), (1, 2, 77, 77),
          (1, 2, 100, 300), (1, 2, 300, 100), (3, 1, 64, 64), (1, 1, 129, 129)]


def save(folder):
    import cupy
    from forge_ml.backends.cuda import attention as A
    from forge_ml.backends.cuda.runtime import BF16
    Path(folder).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(38)
    for B, H, Tq, Tk in SHAPES:
        q, k, v = (cupy.asarray((rng.standard_normal((B, H, T, 64)) * 2).astype(BF16))
                   for T in (Tq, Tk, Tk))
        for rows in (64, 128):
            out, lse = A._attention_flash_hopper(q, k, v, rows=rows)
            tag = f"{B}x{H}x{Tq}x{Tk}r{rows}"
            np.save(Path(folder) / f"{tag}_out.npy", cupy.asnumpy(out.view(np.uint16)))
            np.save(Path(folder) / f"{tag}_lse.npy", cupy.asnumpy(lse))


def cmp(a, b):
    bad = 0
    files = sorted(Path(a).glob("*.npy"))
    for f in files:
        x, y = np.load(f), np.load(Path(b) / f.name)
        same = x.tobytes() == y.tobytes()
        bad += not same
        if not same:
            print("DIFFERENT", f.name, int((x != y).sum()), "of", x.size)
    print(f"{len(files) - bad} of {len(files)} arrays the same bytes")
    return 1 if bad or not files else 0


if __name__ == "__main__":
    sys.exit(save(sys.argv[2]) if sys.argv[1] == "save" else cmp(sys.argv[2], sys.argv[3]))
