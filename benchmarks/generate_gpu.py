"""Batch-1 greedy generation of GPT-2 (124M unless --model says another size) on one GPU:
forge-ml against Hugging Face transformers' ``generate`` on the same random weights, in the
same run.

    python benchmarks/generate_gpu.py [--model gpt2|gpt2-medium|gpt2-large|gpt2-xl]
                                      [--new-tokens 1008] [--prompt-len 16] [--dtype float32|bf16]
                                      [--paths forge,perop,fused,layers,nograph,hf]
                                      [--sampling [--batch 64]
                                      [--modes greedy,top-k,top-p,min-p,penalty,openai]]
                                      [--rows 1,2,3,4,6,8 [--rows-modes greedy,top-p]]

tokens/s counts new tokens over the end-to-end time (prefill and the CUDA-graph capture
included), best of a few runs; by default over a whole generation from a 16-token prompt to
position 1,024 (the decoding attention's cost grows with the position). The bandwidth line
reads the parameters once per token (gpt-fast's measure): parameter bytes x tokens/s against
the H200's 4.8 TB/s. forge-ml is also timed with the step as one kernel (FORGE_FUSED_DECODE=on,
decode_model.cu, experimental), as two kernels a layer (FORGE_FUSED_DECODE=layers,
decode_layers.cu, experimental) and with the graph off (the decoding step op by op, the figure
before the graph existed); perop: FORGE_FUSED_DECODE=off, the kernel-per-op step in a graph (the
default before 2026-12-06). ``--paths forge`` times the default path alone, and
``--sampling --modes greedy`` greedy at batch 1 and ``--batch`` alone (an A/B between trees of
the code in seconds a run: scripts/ab_trees.sh).

``--rows B1,B2,...`` times small batches instead (B different prompts of --prompt-len tokens,
one position for all): for each batch and each of --rows-modes, the default path, the layers
step forced (decoder.ROWS raised past its rule; _layers_ok's rounds limit still holds, so
where it says no the forced column is the kernel-per-op step) and the kernel-per-op step, in
turn over
--repeats rounds (each timed run after an untimed one on a fresh cache; best of each),
generated tokens/s over all rows; the rule in backends/cuda/decoder.py (_layers_ok) is set
from this table.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

PEAK_BW = 4.8e12   # H200 HBM3e bytes/s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2",
                    choices=["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"],
                    help="the GPT-2 size (random weights of its shapes)")
    ap.add_argument("--new-tokens", type=int, default=1008)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bf16"])
    ap.add_argument("--sampling", action="store_true",
                    help="also time every sampling mode against greedy at batch 1 and --batch")
    ap.add_argument("--batch", type=int, default=64, help="the larger batch of --sampling")
    ap.add_argument("--modes", default="greedy,top-k,top-p,min-p,penalty,openai",
                    help="the sampling modes --sampling times (greedy always)")
    ap.add_argument("--paths", default="forge,perop,fused,nograph,hf",
                    help="what is timed: forge (the default path: layers where it runs), perop (the "
                         "kernel-per-op step), "
                         "fused (one kernel a step), layers (two kernels a layer), nograph (op by "
                         "op), hf (transformers)")
    ap.add_argument("--rows", default=None,
                    help="comma-separated small batches: time the layers step against the "
                         "kernel-per-op step at each (see the docstring); nothing else is timed")
    ap.add_argument("--rows-modes", default="greedy,top-p",
                    help="the modes --rows times: greedy, top-p (temperature 0.8 + top-p 0.9)")
    a = ap.parse_args(argv)
    paths = set(a.paths.split(","))
    if not paths <= {"forge", "perop", "fused", "layers", "nograph", "hf"} or "forge" not in paths:
        raise SystemExit("--paths takes forge (always) and any of perop, fused, layers, nograph, hf; "
                         f"got {a.paths!r}")

    import cupy as cp
    import torch
    import transformers

    from forge_ml import flags, hf
    from forge_ml.inference import generate
    from forge_ml.models import GPT2, GPT2Config
    from forge_ml.models.gpt2 import PRESETS

    cfg = GPT2Config(**PRESETS[a.model])
    cpu_model = GPT2.init(cfg, seed=0)
    model = cpu_model.to("cuda", dtype="bfloat16" if a.dtype == "bf16" else None)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, cfg.vocab_size, a.prompt_len)]
    if a.rows:
        return time_rows(a, model, cfg)

    def run_forge(graph=True, fused=None):   # fused None: the switch as the user has it
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        over = {} if fused is None else {"FORGE_FUSED_DECODE": fused}
        with flags.override(FORGE_CUDA_GRAPH=graph, **over):
            out = list(generate(model, prompt, max_new_tokens=a.new_tokens, temperature=0))
        cp.cuda.Device().synchronize()
        return time.perf_counter() - t0, out

    if "hf" in paths:
        with tempfile.TemporaryDirectory() as d:
            hf.save_hf_gpt2(d, cfg, cpu_model.state_dict())
            tdtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
            hm = transformers.GPT2LMHeadModel.from_pretrained(d, dtype=tdtype).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")

    def run_hf():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hm.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                              pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    run_forge()      # warm-up: compile, cuBLAS handles
    if "fused" in paths:
        run_forge(fused="on")
    if "layers" in paths:
        run_forge(fused="layers")
    if "hf" in paths:
        run_hf()
    tf = min(run_forge()[0] for _ in range(a.repeats))
    _, fo = run_forge()
    n = a.new_tokens
    print(f"{a.model} batch-1 greedy generation, {a.dtype}, prompt {a.prompt_len}, {n} new tokens")
    print(f"forge-ml:      {n / tf:9.1f} tok/s  (the default path: FORGE_FUSED_DECODE="
          f"{flags.get('FORGE_FUSED_DECODE')}, in a CUDA graph)")
    def other(path, fused, what):   # another forge-ml path against the default's tokens
        if path in paths:
            t = min(run_forge(fused=fused)[0] for _ in range(a.repeats))
            _, got = run_forge(fused=fused)
            same = next((i for i, (x, y) in enumerate(zip(fo, got)) if x != y), len(fo))
            print(f"forge-ml, {what[0]}: {n / t:9.1f} tok/s  ({what[1]}; tokens agree with the "
                  f"default's for the first {same})")

    other("perop", "off", ("kernel per op", "FORGE_FUSED_DECODE=off, ~60 kernels a step in a CUDA graph"))
    other("fused", "on", ("one kernel a step", "FORGE_FUSED_DECODE=on, decode_model.cu"))
    other("layers", "layers", ("two kernels a layer", "FORGE_FUSED_DECODE=layers, decode_layers.cu"))
    if "nograph" in paths:
        te = min(run_forge(graph=False, fused="off")[0] for _ in range(a.repeats))
        print(f"forge-ml, no graph: {n / te:9.1f} tok/s  (decoding step op by op)")
    if "hf" in paths:
        th = min(run_hf()[0] for _ in range(a.repeats))
        _, ho = run_hf()
        same = next((i for i, (x, y) in enumerate(zip(fo, ho)) if x != y), len(fo))
        print(f"transformers:  {n / th:9.1f} tok/s")
        print(f"ratio forge-ml / transformers: {th / tf:.2f}x   (greedy tokens agree for the first "
              f"{same} of {n})")
    nbytes = sum(t.numel * t.dtype.itemsize for t in model.params.values())
    print(f"bandwidth: {nbytes / 1e6:.0f} MB of parameters x {n / tf:.0f} tok/s = "
          f"{nbytes * n / tf / 1e12:.2f} TB/s, {nbytes * n / tf / PEAK_BW:.1%} of {PEAK_BW / 1e12:.1f} TB/s")
    if not a.sampling:
        return
    # every sampling mode against greedy, at batch 1 and batch --batch, over the same length
    every = {"greedy": ("greedy", dict(temperature=0)),
             "top-k": ("temperature 0.8 + top-k 40", dict(temperature=0.8, top_k=40)),
             "top-p": ("temperature 0.8 + top-p 0.9", dict(temperature=0.8, top_p=0.9)),
             "min-p": ("min-p 0.05", dict(temperature=1.0, min_p=0.05)),
             "penalty": ("repetition penalty 1.2", dict(temperature=0.8, repetition_penalty=1.2)),
             # OpenAI's: the server's requests with penalties and a bias (ops.penalize_logits)
             "openai": ("presence 0.5 + frequency 0.5 + bias", dict(
                 temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5,
                 logit_bias={50256 % cfg.vocab_size: -100}))}
    asked = set(a.modes.split(",")) | {"greedy"}
    if not asked <= set(every):
        raise SystemExit(f"--modes takes {', '.join(every)}; got {a.modes!r}")
    modes = dict(every[m] for m in every if m in asked)
    for B in (1, a.batch):
        prompts = [prompt] * B if B > 1 else prompt
        runs = {name: (lambda kw=kw: list(generate(model, prompts, max_new_tokens=n, seed=1, **kw)))
                for name, kw in modes.items()}
        for run in runs.values():   # warm-up: graphs captured, kernels loaded
            run()
        cp.cuda.Device().synchronize()
        # the modes in turn, a.repeats rounds, the best of each, each run from a fresh start of
        # Python's garbage collector: a batch-64 run keeps 64K TokenEvents, enough to set off a
        # full (generation 2) collection, about 0.1 s in a process holding torch and
        # transformers (session 23, on the CPU); the collector's phase repeats each round, so
        # without gc.collect() one mode could pay it in every round and come out 10% slow
        times = dict.fromkeys(runs, float("inf"))
        full = dict.fromkeys(runs, 0)
        for _ in range(a.repeats):
            for name, run in runs.items():
                gc.collect()
                was = gc.get_stats()[2]["collections"]
                t0 = time.perf_counter()
                run()
                cp.cuda.Device().synchronize()
                times[name] = min(times[name], time.perf_counter() - t0)
                full[name] += gc.get_stats()[2]["collections"] - was
        print(f"\nbatch {B}, {a.dtype}: generated tokens/s by sampling mode (ratio to greedy; full "
              f"garbage collections during its {a.repeats} runs)")
        for name, t in times.items():
            print(f"  {name:30s} {B * n / t:10.1f} tok/s   {times['greedy'] / t:5.2f}   ({full[name]})")


def time_rows(a, model, cfg):
    """--rows: small batches, the default path against the layers step forced and the
    kernel-per-op step (see the module's docstring)."""
    import cupy as cp

    from forge_ml import flags
    from forge_ml.backends.cuda import decoder
    from forge_ml.inference import generate

    kinds = {"greedy": dict(temperature=0), "top-p": dict(temperature=0.8, top_p=0.9)}
    modes = a.rows_modes.split(",")
    if not set(modes) <= set(kinds):
        raise SystemExit(f"--rows-modes takes {', '.join(kinds)}; got {a.rows_modes!r}")
    batches = [int(b) for b in a.rows.split(",")]
    rng = np.random.default_rng(1)
    n, rule = a.new_tokens, decoder.ROWS
    print(f"{a.model}, {a.dtype}: small batches, prompt {a.prompt_len}, {n} new tokens a row; "
          f"generated tok/s over all rows, best of {a.repeats} (decoder.ROWS = {rule})")
    print(f"{'batch':>5} {'mode':>7} {'default':>10} {'layers':>10} {'per op':>10} "
          f"{'default/perop':>13}  default path")
    for B in batches:
        prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size, a.prompt_len)] for _ in range(B)]
        for mode in modes:
            def run(path, kw=kinds[mode]):
                over = {"FORGE_FUSED_DECODE": "off"} if path == "perop" else {}
                decoder.ROWS = max(batches) if path == "layers" else rule
                try:
                    with flags.override(**over):
                        cp.cuda.Device().synchronize()
                        t0 = time.perf_counter()
                        out = list(generate(model, prompts, max_new_tokens=n, seed=1, **kw))
                        cp.cuda.Device().synchronize()
                        return time.perf_counter() - t0, out
                finally:
                    decoder.ROWS = rule
            best = {}
            for _ in range(a.repeats):
                for path in ("default", "layers", "perop"):
                    # generate keeps one (cache, step) pair, made for the path that ran last
                    # (whether its step is the layers one is decided when it is made): a fresh
                    # pair and its graphs for each path, made by an untimed run
                    model._decoder_kept = None
                    run(path)
                    gc.collect()
                    best[path] = min(best.get(path, float("inf")), run(path)[0])
            took = decoder._layers_ok(model.params["wte.weight"].data.dtype, cfg.n_embd, B)
            tok = {k: B * n / t for k, t in best.items()}
            print(f"{B:>5} {mode:>7} {tok['default']:>10.1f} {tok['layers']:>10.1f} "
                  f"{tok['perop']:>10.1f} "
                  f"{tok['default'] / tok['perop']:>13.3f}  "
                  f"{'layers' if took else 'per op'}", flush=True)


if __name__ == "__main__":
    main()
