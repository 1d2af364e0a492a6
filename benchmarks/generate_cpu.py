"""Batch-1 greedy generation on the CPU: forge-ml against Hugging Face transformers.

GPT-2 124M (``GPT2Config()`` defaults, random weights from ``GPT2.init``, float32). The same
weights go to transformers through ``forge_ml.hf.save_hf_gpt2``. Both generate
``--new-tokens`` tokens greedily after a ``--prompt-len``-token prompt, with a KV cache,
timed end to end (prefill included); runs alternate between the two and each side's best
run is reported (other work on the machine only ever slows a run down). Then one more
forge-ml run is timed op by op, to show where its time goes.

    .venv/bin/python benchmarks/generate_cpu.py [--new-tokens 64] [--repeats 5] [--threads N]

Prints, and writes to ``results/cpu-generate_cpu.txt``, both tokens/s and their ratio.
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="threads for both NumPy's BLAS and torch (default: all cores)")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "cpu-generate_cpu.txt"))
    return ap.parse_args()


# BLAS libraries read their thread count when they load, so it is set before NumPy comes in.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import numpy as np  # noqa: E402

from forge_ml import hf  # noqa: E402
from forge_ml.generate import generate  # noqa: E402
from forge_ml.models import gpt2 as gpt2_module  # noqa: E402
from forge_ml.models.gpt2 import GPT2, GPT2Config  # noqa: E402


def time_forge(model, prompt, n):
    t = time.perf_counter()
    out = list(generate(model, prompt, max_new_tokens=n, temperature=0))
    return time.perf_counter() - t, out


def time_hf(model, prompt, n):
    import torch
    x = torch.tensor([prompt])
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return time.perf_counter() - t, out[0, len(prompt):].tolist()


def op_breakdown(model, prompt, n):
    """Seconds per op over one forge-ml generation, timing each ``ops`` call that the prefill
    (``forward_cached``) and the decoding step (``decode_step``) make; matmuls are split by
    what they multiply."""
    ops = gpt2_module.ops
    spent = collections.Counter()
    calls = collections.Counter()
    originals = {}

    def timed(name, f):
        def wrapper(*a, **kw):
            key = {"linear": "linear layers (decoding step)",
                   "decode_attention": "decode_attention"}.get(name, name)
            if name == "matmul":
                b = a[1]
                key = ("matmul lm_head" if b.shape[0] == model.config.padded_vocab_size
                       else "matmul attention (q k^T, p v)" if b.ndim == 4 else "matmul linear layers")
            t = time.perf_counter()
            r = f(*a, **kw)
            spent[key] += time.perf_counter() - t
            calls[key] += 1
            return r
        return wrapper

    for name in ("matmul", "linear", "decode_attention", "add", "layernorm", "gelu", "softmax",
                 "split_heads", "merge_heads", "kv_append", "embedding"):
        originals[name] = getattr(ops, name)
        setattr(ops, name, timed(name, originals[name]))
    try:
        total, _ = time_forge(model, prompt, n)
    finally:
        for name, f in originals.items():
            setattr(ops, name, f)
    spent["other (Python, sampling, tensor wrapping)"] = total - sum(spent.values())
    return total, spent, calls


def main(args):
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    lines = []

    def say(s=""):
        print(s, flush=True)
        lines.append(s)

    cfg = GPT2Config()
    model = GPT2.init(cfg, seed=0)
    with tempfile.TemporaryDirectory() as d:
        hf.save_hf_gpt2(Path(d) / "gpt2", cfg, model.state_dict())
        peer = transformers.GPT2LMHeadModel.from_pretrained(Path(d) / "gpt2").float().eval()
    peer.generation_config.eos_token_id = None  # always generate exactly --new-tokens
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len).tolist()
    n = args.new_tokens

    say("forge-ml generate benchmark: GPT-2 124M, random weights, float32, CPU, batch 1, greedy")
    say(f"prompt {args.prompt_len} tokens, {n} new tokens, {args.repeats} alternating runs each, "
        "best run reported (prefill included)")
    say(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"BLAS and torch threads {args.threads}, load average before {os.getloadavg()[0]:.2f}")
    say(f"versions: python {platform.python_version()}, numpy {np.__version__}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}")

    time_forge(model, prompt, 8)   # warm up both (allocator, BLAS threads, caches)
    time_hf(peer, prompt, 8)
    t_forge, t_hf = [], []
    for _ in range(args.repeats):
        dt, ours = time_forge(model, prompt, n)
        t_forge.append(dt)
        dt, theirs = time_hf(peer, prompt, n)
        t_hf.append(dt)
    assert len(ours) == len(theirs) == n
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), n)

    f_tps, h_tps = n / min(t_forge), n / min(t_hf)
    say()
    say(f"forge-ml:     {f_tps:7.2f} tokens/s   (runs: {', '.join(f'{t:.2f}' for t in t_forge)} s)")
    say(f"transformers: {h_tps:7.2f} tokens/s   (runs: {', '.join(f'{t:.2f}' for t in t_hf)} s)")
    say(f"ratio forge-ml / transformers: {f_tps / h_tps:.2f}x")
    say(f"greedy tokens identical for the first {agree} of {n} "
        "(random GPT-2 init has near-tied logits, so float rounding may part them later)")

    total, spent, calls = op_breakdown(model, prompt, n)
    say()
    say(f"forge-ml time by op over one run ({total:.2f} s with timers, {n} tokens):")
    for key, s in spent.most_common():
        c = f"{calls[key]:6d} calls" if calls[key] else " " * 12
        say(f"  {key:44s} {s * 1e3 / n:7.2f} ms/token  {100 * s / total:5.1f}%  {c}")
    say(f"load average after: {os.getloadavg()[0]:.2f}")
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(ARGS)
