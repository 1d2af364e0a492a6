"""How much the trainer's products would gain from timing cuBLASLt's candidate algorithms
instead of taking its heuristic's first: every product of one training step as ``forge-ml
train`` runs it (recorded from a real step of the model, op by op), each timed with the
heuristic's first algorithm and with each of its next candidates (up to ``--algos``), on
random operands of the recorded shapes. Products that go to plain cuBLAS (``cublasGemmEx``)
are timed that way and as a cuBLASLt product with the same candidates. Each is timed as the
trainer's step runs it, in a CUDA graph (``--calls`` calls a graph, ``--reps`` replays): the
GPU's time, not the Python launch path's.

    python benchmarks/gemm_algos_cuda.py --data shakespeare.txt [--model gpt2] [--batch 32]
                                         [--block 1024] [--algos 16] [--reps 10] [--calls 10]
    python benchmarks/gemm_algos_cuda.py --decode 64 [--pos 512] [--algos 32]

``--decode B`` records the products of one bf16 decoding step of GPT-2 124M at batch B instead
(the kernel-per-op step, ``FORGE_FUSED_DECODE=off``, at position ``--pos``; random weights):
the decoding products' few rows leave most of cuBLASLt's candidates' tiles empty.

Prints, per distinct product: the calls a step, the time of today's path, the best candidate's
time and index, and at the end what a step would save. A measurement for deciding whether an
autotuner is worth building; it changes nothing in the library.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes as C
import importlib
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@contextlib.contextmanager
def spying():
    """Every cuBLASLt and cuBLAS product made while ``on[0]`` is true, counted by its shapes and
    kind: yields (lt calls, cublas calls, on), the library's functions put back after."""
    # the modules themselves (the package exports a function named linear over its module)
    cublas, cublaslt, linear = (importlib.import_module(f"forge_ml.backends.cuda.{m}")
                                for m in ("cublas", "cublaslt", "linear"))
    lt_calls, gemm_calls = collections.Counter(), collections.Counter()
    real_lt, real_gemm = cublaslt.lt_matmul, cublas._gemm
    on = [False]

    def lt_spy(x, w, out, trans_a=False, trans_b=False, *, bias=None, epilogue="default",
               aux=None, c=None, alpha=1.0):
        ok = real_lt(x, w, out, trans_a, trans_b, bias=bias, epilogue=epilogue, aux=aux, c=c,
                     alpha=alpha)
        if on[0] and ok:
            lt_calls[(x.shape, w.shape, out.shape, trans_a, trans_b, epilogue, bias is not None,
                      c is not None, str(x.dtype))] += 1
        return ok

    def gemm_spy(x, w, out, M, N, K, trans_a, trans_b, batch, sa, sb, alpha, beta):
        if on[0] and batch == 1:
            gemm_calls[(x.shape, w.shape, out.shape, trans_a, trans_b, float(beta), str(x.dtype),
                        str(out.dtype))] += 1
        return real_gemm(x, w, out, M, N, K, trans_a, trans_b, batch, sa, sb, alpha, beta)

    linear.lt_matmul = lt_spy   # linear.py makes every cuBLASLt call
    cublas._gemm = gemm_spy
    try:
        yield lt_calls, gemm_calls, on
    finally:
        linear.lt_matmul, cublas._gemm = real_lt, real_gemm
    if not lt_calls:
        print("no cuBLASLt product was recorded (FORGE_CUBLASLT off, or no GPU cuBLASLt here)")


def record_products(a, data):
    """One op-by-op training step; returns (lt calls, cublas calls) as Counters of keys."""
    from train_e2e import forge_config

    from forge_ml import flags
    from forge_ml.train import Trainer
    with spying() as (lt_calls, gemm_calls, on), flags.override(FORGE_TRAIN_GRAPH="off"), \
            tempfile.TemporaryDirectory() as out:
        cfg = forge_config(dict(model=a.model), a.block, a.batch, 0.0, data, out, 10 ** 6)
        tr = Trainer(cfg, log=lambda *_: None)
        tr.train_step()
        on[0] = True
        tr.train_step()
        on[0] = False
    return lt_calls, gemm_calls


def record_decode(a):
    """record_products for one decoding step at batch ``a.decode`` (see the module's docstring)."""
    from forge_ml import flags, tensor
    from forge_ml.inference.decode import DecodeStep
    from forge_ml.models import GPT2, GPT2Config
    cfg = GPT2Config()
    model = GPT2.init(cfg, seed=0).to("cuda", dtype="bfloat16")
    B = a.decode
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, a.pos))
    with spying() as (lt_calls, gemm_calls, on), \
            flags.override(FORGE_CUDA_GRAPH=False, FORGE_FUSED_DECODE="off"):
        cache = model.new_cache(B, a.pos + 2)
        model.forward_cached(tensor(ids, device="cuda"), cache)
        step = DecodeStep(model, cache, graph=False)
        step(ids[:, -1], a.pos)
        on[0] = True
        step(ids[:, -1], a.pos + 1)
        on[0] = False
    return lt_calls, gemm_calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="a text file (training's products; not with --decode)")
    ap.add_argument("--decode", type=int, default=0, metavar="B",
                    help="a decoding step's products at batch B instead of training's")
    ap.add_argument("--pos", type=int, default=512, help="--decode's position")
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--algos", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10, help="graph replays timed")
    ap.add_argument("--calls", type=int, default=10, help="calls of a product in its graph")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "forge_e2e_data"))
    a = ap.parse_args(argv)
    import cupy as cp
    from sampling_cuda import time_graph
    from train_e2e import prepare_data

    from forge_ml.backends.cuda import cublas, cublaslt as L
    from forge_ml.backends.cuda.graph import capture_graph
    if a.decode:
        lt_calls, gemm_calls = record_decode(a)
    elif a.data:
        lt_calls, gemm_calls = record_products(a, prepare_data(a.data, "gpt2", a.cache))
    else:
        raise SystemExit("gemm_algos_cuda.py: give --data (training's products) or --decode B")
    lt = L._lt()
    handle, ws = L._device_state(lt)
    rs = np.random.default_rng(0)

    def arr(shape, dt):
        return cp.asarray(rs.standard_normal(shape, dtype=np.float32) * 0.05).astype(dt)

    def timed(fn):
        """The product's GPU time alone: ``a.calls`` calls captured into one CUDA graph (as the
        trainer's step runs them), the graph replayed ``a.reps`` times between events; ms a
        call, the median. Timed call by call (``time_cupy``), a short product's time was its
        Python launch path's: the GPU waited for the host between the two events (the
        fourteenth session's H100 run gave cuBLAS 0.138 ms where its kernel takes ~0.06)."""
        fn()                                  # plans, algorithms and kernels made outside the capture
        graph = capture_graph(lambda: [fn() for _ in range(a.calls)])
        return time_graph(cp, graph, a.calls, a.reps, 1) / 1000.0

    def candidates(plan):
        """cuBLASLt's heuristic results for the plan's descriptors and preference, up to
        a.algos (the first is the one the library's plan takes): (algorithm, the workspace it
        asks for in bytes). cublasLtMatmulHeuristicResult_t is the 64-byte algorithm, then its
        size_t workspaceSize; a candidate that asks for workspace splits K (its partial
        products are added by a second kernel, after a memset)."""
        res = (C.c_ubyte * (96 * a.algos))()
        n = C.c_int(0)
        lt.matmulalgogetheuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, plan.pref,
                                  a.algos, res, C.byref(n))
        return [((C.c_ubyte * 96).from_buffer(res, 96 * i),
                 C.c_size_t.from_buffer(res, 96 * i + 64).value) for i in range(n.value)]

    def show(times, spaces):
        """The candidates' times, a * after one that uses workspace (split K)."""
        return " ".join(f"{v:.3f}{'*' if w else ' '}" for v, w in zip(times[:8], spaces[:8]))

    def lt_times(x, w, out, ta, tb, epi, bias, aux, c, alpha=1.0):
        M, N = out.shape
        K = x.shape[0] if ta else x.shape[1]
        plan = L._Plan(lt, handle, x.dtype, M, N, K, x.shape, w.shape, ta, tb, epi,
                       None if bias is None else bias.dtype)
        if bias is not None:
            L._set(lt, plan.desc, L._DESC_BIAS_POINTER, bias.data.ptr, C.c_void_p)
        if aux is not None:
            L._set(lt, plan.desc, L._DESC_AUX_POINTER, aux.data.ptr, C.c_void_p)
        al, be = C.c_float(alpha), C.c_float(0.0 if c is None else 1.0)
        cc = out if c is None else c
        times, spaces = [], []
        for algo, space in candidates(plan):
            spaces.append(space)
            def run(algo=algo):
                st = lt.matmul(handle, plan.desc, C.byref(al), w.data.ptr, plan.a, x.data.ptr,
                               plan.b, C.byref(be), cc.data.ptr, plan.d, out.data.ptr, plan.d,
                               algo, ws.data.ptr, L._WORKSPACE,
                               cp.cuda.get_current_stream().ptr)
                if st != 0:
                    raise RuntimeError(st)
            try:
                times.append(timed(run))
            except RuntimeError:
                times.append(float("inf"))
        return times, spaces

    total_now = total_best = 0.0
    print(f"{'calls':>5} {'product':<64} {'today ms':>9} {'best ms':>8} {'index':>5}  candidates"
          " (* asks for workspace: K split)")
    for key, n in sorted(lt_calls.items(), key=lambda kv: -kv[1]):
        xs, wsh, osh, ta, tb, epi, has_b, has_c, dt = key
        x, w, out = arr(xs, dt), arr(wsh, dt), arr(osh, dt)
        # the bias (or BGRADA's bias gradient) has one value per output column
        bias = arr((osh[1],), dt) if has_b else None
        aux = arr(osh, dt) if epi == "gelu_aux_bias" else None
        c = arr(osh, dt) if has_c else None
        t, spaces = lt_times(x, w, out, ta, tb, epi, bias, aux, c)
        best = min(t)
        total_now += n * t[0]
        total_best += n * best
        print(f"{n:5d} lt {str(xs):>13}{'^T' if ta else '  '} @ {str(wsh):>12}{'^T' if tb else '  '} "
              f"{epi:<13}{'+C' if has_c else '  '} {t[0]:9.3f} {best:8.3f} {t.index(best):5d}  "
              + show(t, spaces))
    for key, n in sorted(gemm_calls.items(), key=lambda kv: -kv[1]):
        xs, wsh, osh, ta, tb, beta, dt, odt = key
        x, w, out = arr(xs, dt), arr(wsh, dt), arr(osh, odt)
        M, N = osh
        K = xs[0] if ta else xs[1]
        now = timed(lambda: cublas._gemm(x, w, out, M, N, K, ta, tb, 1, 0, 0, 1.0, beta))
        t, spaces = [], []
        if dt == odt and beta == 0.0:
            t, spaces = lt_times(x, w, out, ta, tb, "default", None, None, None)
        best = min([now] + t)
        total_now += n * now
        total_best += n * best
        print(f"{n:5d} gemm {str(xs):>11}{'^T' if ta else '  '} @ {str(wsh):>12}{'^T' if tb else '  '} "
              f"beta {beta:g} {odt:<9} {now:9.3f} {best:8.3f} {'lt' + str(t.index(best)) if best in t else 'cublas':>5}  "
              + show(t, spaces))
    print(f"a step's products: today {total_now:.2f} ms, each at its best candidate "
          f"{total_best:.2f} ms (-{total_now - total_best:.2f} ms)")


if __name__ == "__main__":
    main()
