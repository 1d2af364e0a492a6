"""The race behind call 1's cudaErrorIllegalAddress, shown on the device: a table dropped
from many._tables with its copy still queued (the stream held by a spinning kernel) gives its
pinned buffer to the next table of its size, and the queued copy reads that table's rows.
Run: PYTHONPATH=src python3 results/gpu-2026-12-07-s42/table_race.py"""
import cupy
import numpy as np

from forge_ml.backends.cuda import many

spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long n) {
    const long long t0 = clock64();
    while (clock64() - t0 < n) {}
}''', "spin")
rows = [(11, 12, 13), (21, 22, 23), (31, 32, 33)]
for name, clear in (("_tables.clear() (the tests before)", many._tables.clear),
                    ("_clear_tables()", many._clear_tables)):
    many._clear_tables()
    spin((1,), (1,), (np.int64(100_000_000),))
    dev = many._table(rows)
    clear()
    many._table([(-1, -2, -3)] * 3)
    got = dev.get().tolist()
    print(f"{name}: the first table holds {got}"
          f" ({'its own rows' if got == [list(r) for r in rows] else 'NOT its rows'})")
