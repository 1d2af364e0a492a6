"""The sampling kernel (sample.cu) against the greedy one (greedy.cu), on the device alone:
microseconds per call at GPT-2's vocabulary (V = 50,257 float32 logits in rows of 50,304),
batch 1 and 64, for each sampling mode of benchmarks/generate_gpu.py --sampling.

    PYTHONPATH=src python3 benchmarks/sampling_cuda.py [--reps 30] [--calls 20] [--compare]

A decoding chain replays its steps from a CUDA graph, so each case is timed so too: `--calls`
calls captured in one graph, CUDA events around one replay, `--warmup` replays first, the
median of `--reps` replays divided by `--calls` (no host launch cost in the figure). Each call
writes the row's token, its seen flag and the position, as in a chain.

Two kinds of logits (standard normal times a scale): "flat" (0.55, about the logits of the
random-init GPT-2 that generate_gpu.py decodes: nearly every weight of the row large) and
"peaked" (3: most weights near 0, more like a trained model's). `--compare` adds the
global-memory fallback kernel (backends.cuda.sampling._STAGE = False) next to the staged one.

Prints one table: us per call by logits, mode and batch, and "+us", the time over greedy's
call, which a decoding step adds to greedy's (a GPT-2 124M bf16 step on an H200 takes about
455 us at batch 1 and 882 us at batch 64, so 10% of greedy is about 45 and 88 us).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

V, VP = 50257, 50304
BATCHES = (1, 64)
SCALES = {"flat": 0.55, "peaked": 3.0}
# (temperature, top_k, top_p, min_p, repetition_penalty), as generate_gpu.py --sampling
MODES = {
    "greedy": None,
    "temperature 0.8 + top-k 40": [0.8, 40, 1.0, 0.0, 1.0],
    "temperature 0.8 + top-p 0.9": [0.8, 0, 0.9, 0.0, 1.0],
    "min-p 0.05": [1.0, 0, 1.0, 0.05, 1.0],
    "repetition penalty 1.2": [0.8, 0, 1.0, 0.0, 1.2],
}


def time_graph(cupy, graph, calls, reps, warmup):
    """Median microseconds per call over `reps` replays of a graph of `calls` calls."""
    for _ in range(warmup):
        graph.replay()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1000.0 / calls)
    return statistics.median(times)


def case(be, cupy, B, scale, knob_row, rs):
    """The function of one call (greedy_next, or sample_next with the knobs on every row)."""
    logits = cupy.asarray((rs.standard_normal((B, VP)) * scale).astype(np.float32))
    logits[:, V:] = -1e30                                  # padding
    ids = cupy.zeros(B, np.int32)
    pos = cupy.zeros(1, np.int32)
    if knob_row is None:
        return lambda: be.greedy_next(logits, V, ids, pos, ids)
    knobs = cupy.asarray(np.array([knob_row] * B, np.float32))
    keys = cupy.asarray(rs.integers(0, 1 << 32, (B, 2)).astype(np.uint32).view(np.int32))
    seen = None
    if knob_row[4] != 1.0:   # the penalty's context: 64 tokens per row (a prompt and a reply)
        s = np.zeros((B, VP), np.int32)
        s[np.arange(B)[:, None], rs.integers(0, V, (B, 64))] = 1
        seen = cupy.asarray(s)
    return lambda: be.sample_next(logits, V, ids, pos, knobs, keys, seen, ids)


def measure(cupy, capture_graph, fn, args):
    fn()                                                   # compiled and loaded before capture
    graph = capture_graph(lambda: [fn() for _ in range(args.calls)])
    return time_graph(cupy, graph, args.calls, args.reps, args.warmup)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    ap.add_argument("--compare", action="store_true",
                    help="also the global-memory fallback kernel (sampling._STAGE = False)")
    args = ap.parse_args(argv)

    import cupy
    from forge_ml.backends import get
    from forge_ml.backends.cuda import capture_graph, sampling
    from forge_ml.device import Device

    be = get(Device("cuda", 0))
    print(f"device: {be.device_name()}; cupy {cupy.__version__}; V={V} (rows of {VP}); "
          f"median of {args.reps} graph replays of {args.calls} calls, after {args.warmup}")
    kernels = [("staged", True)] + ([("fallback", False)] if args.compare else [])
    rs = np.random.default_rng(0)
    # results[(logits, mode, B, kernel)] = us per call
    results = {}
    for lname, scale in SCALES.items():
        for mode, knob_row in MODES.items():
            for B in BATCHES:
                for kname, stage in kernels:
                    if knob_row is None and kname != "staged":
                        continue                            # greedy has one kernel
                    old = sampling._STAGE
                    sampling._STAGE = stage
                    try:
                        fn = case(be, cupy, B, scale, knob_row, rs)
                        us = measure(cupy, capture_graph, fn, args)
                    finally:
                        sampling._STAGE = old
                    results[(lname, mode, B, kname)] = us
                    print(f"  {lname:6s} {mode:28s} B={B:<3d} {kname:8s} {us:9.1f} us", flush=True)
                    cupy.get_default_memory_pool().free_all_blocks()

    print()
    head = f"{'logits':7s} {'mode':28s}"
    for kname, _ in kernels:
        for B in BATCHES:
            head += f" {kname + ' B=' + str(B):>15s} {'+us':>7s}"
    print(head)
    for lname in SCALES:
        for mode, knob_row in MODES.items():
            line = f"{lname:7s} {mode:28s}"
            for kname, _ in kernels:
                for B in BATCHES:
                    us = results.get((lname, mode, B, kname if knob_row is not None else "staged"))
                    base = results[(lname, "greedy", B, "staged")]
                    line += f" {us:15.1f} {us - base:+7.1f}"
            print(line)
    print("us: per call (greedy_next for greedy, sample_next for the others); +us: over "
          "greedy_next's call at the same batch (greedy has one kernel: its fallback columns "
          "repeat it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
