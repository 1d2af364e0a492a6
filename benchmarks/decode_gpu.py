"""Where the time of one GPT-2 124M batch-1 decoding step goes on the GPU: the CUDA-graph
replay alone (GPU time per token), a whole ``DecodeStep`` call (host copies in and out
included), the op-by-op step, and each op of the step at decode shapes (GPU time: 20 calls
captured in a CUDA graph and replayed), with torch's matrix-vector products at the same shapes
beside forge-ml's (also in a graph).

With the step as one kernel (``decode_model.cu``, batch 1), ``--stages`` also prints where
that kernel's time goes: each stage's work (the last block's arrival at the grid barrier after
it, from the first departure of the barrier before) and the barrier's own latency (from the
last arrival to the last departure), from each block's ``%globaltimer`` at every barrier,
summed over the layers and averaged over ``--reps`` steps.

``--trace`` (with ``--fused layers``, batch 1) builds decode_layers.cu with its marks
(``-DDL_TRACE``: thread 0 of every block notes ``%globaltimer`` at each phase) and prints, per
kernel of the layers step averaged over the layers and 50 replays, how long each phase
took (the mean over the blocks, and how far the last block to get there moved), and the
release: from the last block of the kernel before leaving to the first block of this one
passing its wait (programmatic dependent launch's hand-over); the per-op table is left out.

``--splits`` times ``decode_attention`` alone with its keys split among 1, 2, 4 and 8 blocks
per head (the choice ``_decode_split`` makes is marked), with the cache bytes it reads.

    python benchmarks/decode_gpu.py [--dtype float32|bf16] [--pos 200] [--batch 1] [--stages]
                                    [--splits] [--fused off|on|layers] [--trace] [--roof]

``--roof`` adds the device's read bandwidth over the LM head's bytes (a plain sum and a copy of
an array of its shape and dtype), the bound for the head's logit rows.

``--fused on`` or ``layers`` times the step's rows (the replay, a call, the greedy chain) with
the step as one kernel or as two kernels a layer (``decode_layers.cu``).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def events_ms(cp, fn, reps):
    """Mean GPU ms per call of ``fn`` launched ``reps`` times back to back."""
    fn()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) / reps


def graph_ms(cp, bk, fn, reps, inner=20):
    """GPU ms per call of ``fn``: ``inner`` calls captured in one CUDA graph, replayed."""
    fn()
    g = bk.capture_graph(lambda: [fn() for _ in range(inner)])
    return events_ms(cp, g.replay, max(1, reps // inner)) / inner


def torch_graph_ms(torch, fn, reps, inner=20):
    """The same for a torch callable (torch.cuda.CUDAGraph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    n = max(1, reps // inner)
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n / inner


def stage_profile(cp, model, cache, tok, pos, reps):
    """Print the fused step's time by stage (see the module's docstring)."""
    from forge_ml.backends.cuda import decoder
    from forge_ml.inference.decode import DecodeStep
    from forge_ml import flags
    decoder.TIMING = True
    try:
        with flags.override(FORGE_FUSED_DECODE=True):   # opt-in (experimental)
            step = DecodeStep(model, cache, graph=False)
        assert step.fused, "the fused step does not take this model"
        L = model.config.n_layer
        names = ["A ln1+qkv", "B attention", "C merge+proj", "D ln2+fc", "E gelu+out"]
        work, wait = np.zeros(5 * L + 1), np.zeros(5 * L + 1)
        for _ in range(reps):
            list(step.greedy(tok, pos, 1))
            cp.cuda.Device().synchronize()
            t = decoder.last_plan().times.get()[:, :5 * L + 1].astype(np.int64)  # (grid, bars, 2)
            arrive, depart = t[:, :, 0], t[:, :, 1]
            work[0] += arrive[:, 0].max() - arrive[:, 0].min()   # the spread of the first stage
            work[1:] += arrive[:, 1:].max(0) - depart[:, :-1].min(0)
            wait += depart.max(0) - arrive.max(0)
        work, wait = work / reps / 1e3, wait / reps / 1e3
    finally:
        decoder.TIMING = False
    plan = decoder.last_plan()
    print(f"\n  the step as one kernel: {plan.grid} blocks, {plan.splits} attention splits a head, "
          f"gemv cuts (lanes a row, K slices, rows a slice) qkv/proj/fc/out = {plan.stages}")
    print("  stage, summed over the layers: work (first block out of the barrier before -> last "
          "block in), barrier (last in -> last out), us")
    for i, name in enumerate(names):
        print(f"  {name:14s} {work[i:5 * L:5].sum():8.1f} {wait[i:5 * L:5].sum():8.1f}")
    print(f"  {'F lm head':14s} {work[5 * L]:8.1f} {wait[5 * L]:8.1f}   (first stage's spread "
          f"{work[0]:.1f})")
    print(f"  {'total':14s} {work.sum():8.1f} {wait.sum():8.1f}   = {work.sum() + wait.sum():.1f} us")


_TRACE_PHASES = {   # decode_layers.cu's dl_mark(i): the phase that ends at mark i
    "layer_attn": ["", "issue weights", "wait (PDL)", "gather x", "ln1", "cp.async wait",
                   "qkv rows", "cluster sync 1", "qkv sum, cache", "attention",
                   "cluster sync 2", "merge", "proj rows"],
    "layer_mlp": ["", "issue weights", "wait (PDL)", "gather x'", "ln2", "cp.async wait",
                  "fc + gelu", "proj partial", "cluster sync", "sum, store"],
    "decode_head": ["", "", "wait (PDL)", "gather x''", "ln_f", "logit rows", "argmax",
                    "last block"],
}


def trace_module():
    """decode_layers.cu compiled with -DDL_TRACE, put in the backend's module cache in place
    of the package's build; called before any of its kernels is asked for (main's first
    step), so no function or shared-memory opt-in of the package's build is cached yet."""
    from forge_ml.backends.cuda import runtime
    mod = runtime.compile_source(runtime.kernel_source("decode_layers"),
                                 "backends/cuda/decode_layers.cu (DL_TRACE)",
                                 runtime._compile_options() + ("-DDL_TRACE",))
    runtime._modules[(runtime._dev(), "decode_layers")] = mod
    return mod


_TRACE_KINDS = tuple(_TRACE_PHASES)   # kernel kinds in dl_trace_out's order


def trace_phases(marks, blocks, L):
    """One replay's phases from its marks: ``marks`` (3, blocks, launches, 16) ns as
    decode_layers.cu's DL_TRACE build writes them (kind 0 layer_attn, 1 layer_mlp, 2
    decode_head; a block's launches of a kind in order; 0 where a mark was not reached),
    ``blocks`` each kind's grid, ``L`` the layers. Returns ``(kinds, step)``: per kind name
    ``{"mean", "last"}`` (16 sums over its launches, ns, of the phase ending at each mark:
    the blocks' mean time from their mark before, and how far the last block to reach it
    moved), ``"whole"`` (first block past its wait -> last block's last mark), ``"release"``
    (the kernel before's last block out -> this kernel's first block past its wait; the first
    layer_attn has none), ``"n"`` launches and ``"n_release"``; ``step``, ns from the first
    layer_attn's wait to the head's last block."""
    raw = np.asarray(marks, np.int64)   # %globaltimer counts from the epoch: ~1.8e18 ns, where
    # float64 steps by 256 ns; the marks are made relative to the first one before any float
    t0 = raw[raw > 0].min() if (raw > 0).any() else 0
    marks = np.where(raw > 0, raw - t0 + 1, 0).astype(np.float64)
    kinds = {n: {"mean": np.zeros(marks.shape[-1]), "last": np.zeros(marks.shape[-1]),
                 "release": 0.0, "whole": 0.0, "n": 0, "n_release": 0} for n in _TRACE_KINDS}
    prev_exit = first = None
    for k, l in [(k, l) for l in range(L) for k in (0, 1)] + [(2, 0)]:
        m = marks[k, :blocks[k], l, :]   # (blocks, marks)
        reached = [i for i in range(m.shape[1]) if (m[:, i] > 0).all()]
        a = kinds[_TRACE_KINDS[k]]
        for j, i in zip(reached, reached[1:]):
            a["mean"][i] += (m[:, i] - m[:, j]).mean()
            a["last"][i] += m[:, i].max() - m[:, j].max()
        end = m[:, reached[-1]].max()
        if prev_exit is not None:
            a["release"] += m[:, 2].min() - prev_exit
            a["n_release"] += 1
        a["whole"] += end - m[:, 2].min()
        a["n"] += 1
        first = m[:, 2].min() if first is None else first
        prev_exit = end
    return kinds, prev_exit - first


def layers_trace(cp, mod, step, L, reps):
    """Print the layers step's phases from its marks (see the module's docstring)."""
    from forge_ml.backends.cuda import decoder
    nb, runs, nmarks = 512, 64, 16   # decode_layers.cu: DL_TRACE_BLOCKS, _RUNS, _MARKS
    count = cp.ndarray((3 * nb,), cp.uint32, mod.get_global("dl_trace_count"))
    buf = cp.ndarray((3, nb, runs, nmarks), cp.uint64, mod.get_global("dl_trace_buf"))
    plan = list(decoder._layer_plans.values())[-1]
    blocks = (decoder._DL_P * plan.partA.shape[1], plan.grid_mlp, plan.grid_head)   # (B, H, C)
    acc, step_ns = None, 0.0
    for _ in range(reps):
        count.fill(0)
        cp.cuda.Device().synchronize()
        step._graphs["logits"].replay()
        cp.cuda.Device().synchronize()
        kinds, ns = trace_phases(buf.get(), blocks, L)
        step_ns += ns
        if acc is None:
            acc = kinds
        else:
            for n, a in kinds.items():
                for key, v in a.items():
                    acc[n][key] = acc[n][key] + v
    print(f"\n  the layers step's phases (DL_TRACE; {reps} replays, mean a kernel over the layers), "
          f"us: the blocks' mean / the last block's advance")
    for n in _TRACE_KINDS:
        a = acc[n]
        k, kr = max(a["n"], 1), max(a["n_release"], 1)
        print(f"  {n} (x{k // reps}): whole {a['whole'] / k / 1e3:.2f} (first wait passed -> last "
              f"block out), release {a['release'] / kr / 1e3:.2f} (the kernel before's last block "
              f"out -> first wait passed)")
        for i, phase in enumerate(_TRACE_PHASES[n]):
            if phase and (a["mean"][i] or a["last"][i]):
                print(f"    {phase:18s} {a['mean'][i] / k / 1e3:7.2f} {a['last'][i] / k / 1e3:7.2f}")
    print(f"  the step, first layer_attn's wait passed -> the head's last block: "
          f"{step_ns / reps / 1e3:.1f} us")


def head_roof(cp, head, reps):
    """Print the read bandwidth of a plain sum (CUB's reduction, reading each byte once) and a
    copy over an array of the LM head's shape and dtype: what the head's logit rows (the same
    bytes, read once a token) could reach on this device."""
    x = cp.asarray(head._data)
    if x.dtype.itemsize == 2:          # bf16 (ml_dtypes, no arithmetic in CuPy): its 2-byte words
        x = x.view(cp.uint16)
    y = cp.empty_like(x)
    nbytes = x.nbytes
    sum_ms = events_ms(cp, lambda: x.sum(dtype=cp.float32), reps)
    copy_ms = events_ms(cp, lambda: cp.copyto(y, x), reps)
    print(f"the LM head's bytes ({nbytes / 1e6:.1f} MB, {x.dtype}): a sum reads them in "
          f"{sum_ms * 1e3:.1f} us ({nbytes / sum_ms / 1e9:.2f} TB/s); a copy in "
          f"{copy_ms * 1e3:.1f} us ({nbytes / copy_ms / 1e9:.2f} TB/s read, as much written)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bf16"])
    ap.add_argument("--pos", type=int, default=200)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--stages", action="store_true", help="the fused step's time by stage")
    ap.add_argument("--batch", type=int, default=1,
                    help="rows decoded at once, each at position --pos (default 1)")
    ap.add_argument("--splits", action="store_true",
                    help="decode_attention alone at 1, 2, 4 and 8 blocks per head")
    ap.add_argument("--fused", default="off", choices=["off", "on", "layers"],
                    help="the step's timings (replay, call, chain) with FORGE_FUSED_DECODE at this "
                         "value: on, one kernel (decode_model.cu); layers, two a layer "
                         "(decode_layers.cu); on takes batch 1, layers 1-4 rows where "
                         "decoder._layers_ok says so")
    ap.add_argument("--trace", action="store_true",
                    help="with --fused layers: each phase of the layers step's kernels, from "
                         "decode_layers.cu built with its marks (DL_TRACE)")
    ap.add_argument("--roof", action="store_true",
                    help="also the device's read bandwidth over the LM head's bytes: a plain "
                         "sum and a copy of an array of the head's size and dtype (the bound "
                         "the head kernel's logit rows are measured against)")
    a = ap.parse_args(argv)
    if a.trace and (a.fused != "layers" or a.batch != 1):
        ap.error("--trace times the layers step: give --fused layers (batch 1)")

    import cupy as cp
    import forge_ml as fm
    from forge_ml import flags, ops
    from forge_ml.models import GPT2, GPT2Config
    from forge_ml.inference.decode import DecodeStep

    traced = trace_module() if a.trace else None
    cfg = GPT2Config()
    dt = "bfloat16" if a.dtype == "bf16" else "float32"
    model = GPT2.init(cfg, seed=0, device="cuda", dtype=dt)
    P = model.params
    Bn = a.batch
    cache = model.new_cache(Bn, cfg.block_size)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (Bn, a.pos))
    model.forward_cached(fm.tensor(prompt, device="cuda"), cache)
    tok = [int(t) for t in prompt[:, -1]]
    if a.stages and Bn == 1:
        stage_profile(cp, model, cache, tok, a.pos, 50)

    def captured_step(pdl: bool):
        """A DecodeStep whose graph was captured with programmatic dependent launch on or off
        (the FORGE_PDL switch is asked as the kernels are launched, i.e. during the capture)."""
        with flags.override(FORGE_PDL=pdl):
            s = DecodeStep(model, cache)
            s(tok, a.pos)
            s(tok, a.pos)                           # captured now
        assert s.captured
        return s

    rows = []
    fused = contextlib.ExitStack()   # FORGE_FUSED_DECODE for the step's rows (not the ops')
    fused.enter_context(flags.override(FORGE_FUSED_DECODE=a.fused))
    nopdl = captured_step(False)
    step = captured_step(True)
    rows.append(("graph replay (GPU time per step)",
                 events_ms(cp, step._graphs["logits"].replay, a.reps)))
    rows.append(("graph replay, no programmatic dependent launch",
                 events_ms(cp, nopdl._graphs["logits"].replay, a.reps)))
    if traced is not None:
        layers_trace(cp, traced, step, cfg.n_layer, 50)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(a.reps):
        step(tok, a.pos)
    rows.append(("DecodeStep call: copy in, replay, copy out", (time.perf_counter() - t0) * 1e3 / a.reps))
    n_chain = min(200, cfg.block_size - 1 - a.pos)
    for chunk in (8, 1):
        list(step.greedy(tok, a.pos, 2 * chunk, chunk=chunk))   # captures the chain's graph
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        list(step.greedy(tok, a.pos, n_chain, chunk=chunk))
        rows.append((f"greedy chain, per token ({n_chain} tokens, argmax on the device, "
                     f"{chunk} steps per graph)", (time.perf_counter() - t0) * 1e3 / n_chain))
    eager = DecodeStep(model, cache, graph=False)
    eager(tok, a.pos)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        eager(tok, a.pos)
    rows.append(("DecodeStep call, op by op (no graph)" if not eager.fused else
                 "DecodeStep call, fused, no graph", (time.perf_counter() - t0) * 1e3 / 20))
    assert eager.fused == (a.fused != "off"), "the fused step does not take this model or batch"
    fused.close()
    print(f"GPT-2 124M decoding step, batch {Bn}, {a.dtype}, position {a.pos}, "
          f"FORGE_FUSED_DECODE={a.fused}")
    for name, ms in rows:
        print(f"  {ms * 1e3:9.1f} us  {name}")
    if a.roof:
        head_roof(cp, P["wte.weight"], a.reps)
    if traced is not None:
        return   # the phases only (the per-op rows would time the marked build)

    # each op at decode shapes; n = how many per token
    rs = np.random.default_rng(1)
    C, H, L = cfg.n_embd, cfg.n_head, cfg.n_layer
    x = fm.tensor(rs.standard_normal((Bn, C)).astype(np.float32), device="cuda").to(dt)
    h4 = fm.tensor(rs.standard_normal((Bn, 4 * C)).astype(np.float32), device="cuda").to(dt)
    qkv = fm.tensor(rs.standard_normal((Bn, 3 * C)).astype(np.float32), device="cuda").to(dt)
    pos_t = fm.tensor(np.array([a.pos], np.int32), device="cuda")
    ids = fm.tensor(np.full((Bn, 1), 5, np.int32), device="cuda")
    p = "h.0."
    ops_ = [
        ("embedding", 1, lambda: ops.embedding(ids, P["wte.weight"], P["wpe.weight"], pos_t)),
        (f"layernorm ({Bn}, 768), ln_f", 1, lambda: ops.layernorm(x, P[p + "ln_1.weight"], P[p + "ln_1.bias"])),
        (f"ln+linear+bias ({Bn},768)x(768,2304)", L, lambda: ops.linear(x, P[p + "attn.c_attn.weight"], P[p + "attn.c_attn.bias"], ln=(P[p + "ln_1.weight"], P[p + "ln_1.bias"]))),
        ("decode_attention", L, lambda: ops.decode_attention(qkv, cache.k[0], cache.v[0], pos_t, H)),
        (f"linear+bias+residual ({Bn},768)x(768,768)", L, lambda: ops.linear(x, P[p + "attn.c_proj.weight"], P[p + "attn.c_proj.bias"], residual=x)),
        (f"ln+linear+bias+gelu ({Bn},768)x(768,3072)", L, lambda: ops.linear(x, P[p + "mlp.c_fc.weight"], P[p + "mlp.c_fc.bias"], act="gelu", ln=(P[p + "ln_2.weight"], P[p + "ln_2.bias"]))),
        (f"linear+bias+residual ({Bn},3072)x(3072,768)", L, lambda: ops.linear(h4, P[p + "mlp.c_proj.weight"], P[p + "mlp.c_proj.bias"], residual=x)),
        (f"lm head ({Bn},768)x(50304,768)^T", 1, lambda: ops.matmul(x, P["wte.weight"], trans_b=True)),
    ]
    from forge_ml.backends import load
    bk = load("cuda")
    print("\n  per op, GPU time (20 calls captured in a CUDA graph); x = calls per token")
    total = 0.0
    for name, n, fn in ops_:
        ms = graph_ms(cp, bk, fn, a.reps)
        total += n * ms
        print(f"  {ms * 1e3:8.1f} us  x{n:<3d} {name}")
    print(f"  {total * 1e3:8.1f} us  sum over one token")
    if a.splits:
        import importlib
        cuda_attention = importlib.import_module("forge_ml.backends.cuda.attention")
        chosen = cuda_attention._decode_split(Bn, H, cfg.block_size)
        kv = 2 * Bn * H * (a.pos + 1) * (C // H) * (2 if a.dtype == "bf16" else 4)
        print(f"\n  decode_attention alone, keys split among P blocks per head "
              f"(cache read: {kv / 1e6:.1f} MB; chosen P = {chosen})")
        default = cuda_attention._decode_split
        try:
            for split in (1, 2, 4, 8):
                cuda_attention._decode_split = lambda B_, H_, T_, s_=split: s_
                ms = graph_ms(cp, bk, lambda: ops.decode_attention(qkv, cache.k[0], cache.v[0],
                                                                   pos_t, H), a.reps)
                print(f"  {ms * 1e3:8.1f} us  P={split}  {kv / (ms * 1e-3) / 1e12:.2f} TB/s"
                      + ("  (chosen)" if split == chosen else ""))
        finally:
            cuda_attention._decode_split = default
    try:
        import torch
        tdt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        print("\n  torch at the same shapes (addmm, weights (in, out) as here)")
        for k_, n_ in ((C, 3 * C), (C, C), (C, 4 * C), (4 * C, C)):
            w = torch.randn(k_, n_, device="cuda", dtype=tdt)
            b = torch.randn(n_, device="cuda", dtype=tdt)
            xx = torch.randn(Bn, k_, device="cuda", dtype=tdt)
            ms = torch_graph_ms(torch, lambda: torch.addmm(b, xx, w), a.reps)
            print(f"  {ms * 1e3:8.1f} us  addmm ({Bn},{k_})x({k_},{n_})")
        wte = torch.randn(cfg.padded_vocab_size, C, device="cuda", dtype=tdt)
        xx = torch.randn(Bn, C, device="cuda", dtype=tdt)
        ms = torch_graph_ms(torch, lambda: xx @ wte.t(), a.reps)
        print(f"  {ms * 1e3:8.1f} us  lm head ({Bn},768)x(50304,768)^T")
    except Exception as e:  # torch is only the peer here
        print(f"  torch not measured: {e}")
    nbytes = sum(v.numel * (2 if a.dtype == "bf16" else 4) for v in P.values())
    print(f"\n  weights read per token: {nbytes / 1e6:.0f} MB = {nbytes / 4.8e12 * 1e6:.0f} us at 4.8 TB/s")


if __name__ == "__main__":
    main()
