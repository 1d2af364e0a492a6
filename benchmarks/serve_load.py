"""Load on ``forge-ml serve``: many concurrent streaming clients against one server.

Starts the server itself (``python -m forge_ml.serve.cli`` in a subprocess, on 127.0.0.1 and
a free port), waits for ``/health``, warms it up, then runs ``--clients`` clients at once, each
sending ``--rounds`` streamed completions back to back (distinct random token prompts,
``ignore_eos`` so every request runs its full ``--max-tokens``; every other request greedy,
the rest sampled at temperature 1 with its own seed). Reports generated tokens/s, the p50/p99
time to first token and per-token latency (the gap between a request's consecutive chunks),
and the engine's step rate and slot occupancy; checks that no request was lost (each ends
with ``data: [DONE]`` and a finish reason), truncated (exactly ``--max-tokens`` chunks, one
per token) or mixed with another (one id per request, and ``--verify`` requests sent again
alone, not streamed, must return the same text). Exits 1 if a check fails.

Without ``--ckpt`` it serves a randomly initialised model (GPT-2 124M on cuda, a 2-layer
64-channel one with GPT-2's vocabulary on cpu), written to a temporary checkpoint first.

    python benchmarks/serve_load.py                                  # cuda, bf16, 64 clients
    python benchmarks/serve_load.py --device cpu --clients 8 --max-tokens 32   # a quick try
    python benchmarks/serve_load.py --ckpt ~/gpt2 --dtype float32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_random_checkpoint(path: Path, device: str) -> None:
    from forge_ml.checkpoint import save_checkpoint
    from forge_ml.models.gpt2 import GPT2, GPT2Config

    if device.startswith("cuda"):
        cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768, block_size=1024)       # 124M
    else:
        cfg = GPT2Config(n_layer=2, n_head=2, n_embd=64, block_size=256)
    save_checkpoint(path, GPT2.init(cfg, seed=0).state_dict(),
                    {"config": cfg.to_dict(), "tokenizer": {"kind": "gpt2"}, "step": 0})


def start_server(args, ckpt: Path, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "forge_ml.serve.cli", "--ckpt", str(ckpt), "--device",
           args.device, "--dtype", args.dtype, "--port", str(port), "--model-name", "bench"]
    if args.slots:
        cmd += ["--slots", str(args.slots)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FORGE_API_KEY", None)
    log = open(log_path, "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout: float) -> dict:
    import httpx

    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited with status {proc.returncode}:\n{log_path.read_text()}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            sys.exit(f"the server did not answer /health within {timeout:.0f} s:\n{log_path.read_text()}")
        time.sleep(0.2)


def request_body(i: int, args, vocab: int, eot: int) -> dict:
    rng = np.random.default_rng(1000 + i)
    prompt = [int(t) for t in rng.integers(0, eot, args.prompt_tokens)]   # no end-of-text
    greedy = i % 2 == 0
    return {"model": "bench", "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": 0.0 if greedy else 1.0, "seed": i, "ignore_eos": True}


async def one_stream(client, url: str, body: dict) -> dict:
    """Send one streamed completion; the arrival time of every chunk, its text and ids."""
    t0 = time.perf_counter()
    times, texts, ids, finishes, done, error = [], [], set(), [], False, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    error = f"not an SSE data line: {line[:80]!r}"
                    break
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    break
                times.append(time.perf_counter())
                ids.add(chunk["id"])
                (c,) = chunk["choices"]
                texts.append(c["text"])
                finishes.append(c["finish_reason"])
    except Exception as e:   # noqa: BLE001 - a lost request is a result here
        error = f"{type(e).__name__}: {e}"
    return {"t0": t0, "times": times, "text": "".join(texts), "ids": ids, "finishes": finishes,
            "done": done, "error": error}


async def run_load(args, url: str, bodies: list) -> tuple:
    import httpx

    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    results = [None] * len(bodies)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        async def worker(c: int):
            for k in range(args.rounds):
                i = c * args.rounds + k
                results[i] = await one_stream(client, url, bodies[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in range(args.clients)))
        wall = time.perf_counter() - t0
    return results, wall


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--dtype", default="bf16", help="bf16 (default) or float32")
    ap.add_argument("--ckpt", default=None, help="a checkpoint to serve (default: random weights)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (64)")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client, back to back (2)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (128)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens (32)")
    ap.add_argument("--slots", type=int, default=None, help="engine slots (default: the server's)")
    ap.add_argument("--verify", type=int, default=8, help="requests re-sent alone to compare (8)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    args = ap.parse_args()
    if args.device == "cpu" and args.dtype == "bf16":
        args.dtype = "float32"

    import httpx

    from forge_ml.tokenizer import GPT2_EOT_ID, GPT2_VOCAB_SIZE

    tmp = Path(tempfile.mkdtemp(prefix="forge-serve-load-"))
    ckpt = Path(args.ckpt) if args.ckpt else tmp / "ckpt"
    if not args.ckpt:
        t = time.perf_counter()
        write_random_checkpoint(ckpt, args.device)
        print(f"random checkpoint written in {time.perf_counter() - t:.1f} s: {ckpt}", flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp / "server.log"
    proc = start_server(args, ckpt, port, log_path)
    failures = []
    try:
        t = time.perf_counter()
        health = wait_healthy(url, proc, log_path, args.startup_timeout)
        print(f"server up in {time.perf_counter() - t:.1f} s: {health}", flush=True)
        n = args.clients * args.rounds
        bodies = [request_body(i, args, GPT2_VOCAB_SIZE, GPT2_EOT_ID) for i in range(n)]
        t = time.perf_counter()
        warm = asyncio.run(run_load(argparse.Namespace(clients=min(args.clients, 4), rounds=1),
                                    url, [dict(b, seed=b["seed"] + 10**6) for b in bodies[:4]]))
        print(f"warm-up ({min(args.clients, 4)} requests) {time.perf_counter() - t:.1f} s", flush=True)
        if any(r.get("error") for r in warm[0]):
            failures.append(f"warm-up failed: {[r.get('error') for r in warm[0]]}")
        before = httpx.get(url + "/health").json()
        results, wall = asyncio.run(run_load(args, url, bodies))
        after = httpx.get(url + "/health").json()

        # -- checks ------------------------------------------------------------------------
        lost = [i for i, r in enumerate(results) if r.get("error") or not r.get("done")]
        truncated = [i for i, r in enumerate(results) if i not in lost and (
            len(r["times"]) != args.max_tokens or r["finishes"][-1] != "length"
            or any(f is not None for f in r["finishes"][:-1]))]
        mixed = [i for i, r in enumerate(results) if i not in lost and len(r["ids"]) != 1]
        all_ids = [next(iter(r["ids"])) for r in results if len(r.get("ids", ())) == 1]
        if len(set(all_ids)) != len(all_ids):
            mixed.append("duplicate completion ids")
        step = max(1, n // max(1, args.verify))
        with httpx.Client(timeout=600) as h:
            for i in list(range(0, n, step))[:args.verify]:
                if i in lost:
                    continue
                r = h.post(url + "/v1/completions", json=bodies[i])
                if r.status_code != 200 or r.json()["choices"][0]["text"] != results[i]["text"]:
                    mixed.append(i)
        for name, bad in (("lost", lost), ("truncated", truncated), ("mixed", mixed)):
            if bad:
                failures.append(f"{len(bad)} requests {name}: {bad[:10]}")

        # -- metrics -----------------------------------------------------------------------
        ok = [r for i, r in enumerate(results) if i not in lost]
        tokens = sum(len(r["times"]) for r in ok)
        ttft = [(r["times"][0] - r["t0"]) * 1e3 for r in ok if r["times"]]
        gaps = [g * 1e3 for r in ok for g in np.diff(r["times"])]
        steps = after["steps"] - before["steps"]
        slots = after["slots"]
        fed = len(ok) * (args.prompt_tokens + args.max_tokens - 1)   # tokens the steps fed
        occupancy = f"{fed / (steps * slots):.0%}" if steps else "-"
        rows = [
            ("device / dtype", f"{args.device} / {args.dtype}"),
            ("model", str(args.ckpt or "random GPT-2 (see --help)")),
            ("clients x rounds", f"{args.clients} x {args.rounds} = {n} requests"),
            ("prompt / new tokens", f"{args.prompt_tokens} / {args.max_tokens}"),
            ("slots", f"{slots}"),
            ("wall time", f"{wall:.2f} s"),
            ("generated tokens/s", f"{tokens / wall:,.0f}"),
            ("time to first token p50 / p99", f"{pct(ttft, 50):.1f} / {pct(ttft, 99):.1f} ms"),
            ("per-token latency p50 / p99", f"{pct(gaps, 50):.2f} / {pct(gaps, 99):.2f} ms"),
            ("engine steps/s", f"{steps / wall:,.1f}"),
            ("slot occupancy", occupancy),
            ("lost / truncated / mixed", f"{len(lost)} / {len(truncated)} / {len(mixed)}"),
        ]
        width = max(len(k) for k, _ in rows)
        print()
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
        print(json.dumps({"tokens_per_s": tokens / wall, "ttft_ms_p50": pct(ttft, 50),
                          "ttft_ms_p99": pct(ttft, 99), "token_ms_p50": pct(gaps, 50),
                          "token_ms_p99": pct(gaps, 99), "steps_per_s": steps / wall,
                          "requests": n, "failures": failures}))
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        print(f"server log: {log_path}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
