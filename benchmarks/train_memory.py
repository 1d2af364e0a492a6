"""Where the trainer's device memory goes: forge-ml's ``Trainer`` (as ``forge-ml train`` and
``train_e2e.py`` drive it), op by op and as one captured graph, each in its own process.

    python benchmarks/train_memory.py --data shakespeare.txt [--model gpt2] [--batch 32]

After each of the first steps, an evaluation, a garbage collection and one more step it prints,
for the process:
- ``nvml``: the device memory NVML counts (what nvidia-smi shows), and its peak so far (polled
  every 20 ms);
- ``pool``: CuPy's default pool, bytes in live arrays / bytes it holds;
- ``graph pool``: the captured step's own pool (``graph.capture``), live / held;
- ``graph mem``: the CUDA driver's graph-owned memory (allocations made inside captured work,
  e.g. by a library during capture), in use / reserved high-water marks.
NVML minus the pools and the graph-owned memory is the CUDA context, loaded modules and
library workspaces. ``--workspace-mib N`` adds a third run, the graph with cuBLAS given a fixed
workspace of N MiB first (``cublasSetWorkspace``; without one, cuBLAS 12.2+ allocates its
workspace stream-ordered, which inside a capture is graph-owned memory).

What it found (GPT-2 124M, B=32, bf16, 2026-12-03): ``train_e2e.py``'s 21.5 GiB with the graph
was the captured step's pool (9.7 GiB) still held after the trainer dropped the graph for an
evaluation, beside the step captured again after it; the graph-owned memory was 0.06 GiB and
a fixed cuBLAS workspace changed nothing. ``CapturedGraph.release`` now gives the pool back:
12.2 GiB at every step, evaluation included (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GB = 2 ** 30


def _graph_mem():
    """(used high, reserved high) of the driver's graph memory in GiB, or None."""
    try:
        from cuda.bindings import runtime as rt
        out = []
        for attr in (rt.cudaGraphMemAttributeType.cudaGraphMemAttrUsedMemHigh,
                     rt.cudaGraphMemAttributeType.cudaGraphMemAttrReservedMemHigh):
            err, value = rt.cudaDeviceGetGraphMemAttribute(0, attr)
            if err != rt.cudaError_t.cudaSuccess:
                return None
            out.append(int(value) / GB)
        return tuple(out)
    except Exception:
        return None


def _set_cublas_workspace(mib: int):
    """Give forge-ml's cuBLAS handle a fixed workspace of ``mib`` MiB (kept for the process)."""
    import ctypes
    import cupy
    from forge_ml.backends.cuda import cublas
    h = cublas._cublas_handle()
    direct = cublas._cublas_direct()
    if direct is None:
        raise SystemExit("libcublas was not found in this process: the backend uses CuPy's wrappers")
    lib = direct.lib                       # the libcublas the backend loaded
    lib.cublasSetWorkspace_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    mem = cupy.cuda.Memory(mib << 20)
    st = lib.cublasSetWorkspace_v2(h, mem.ptr, mib << 20)
    if st != 0:
        raise SystemExit(f"cublasSetWorkspace_v2 failed: status {st}")
    _set_cublas_workspace.keep = mem


def worker(a):
    import cupy
    from forge_ml.train import TrainConfig, Trainer
    from train_e2e import PeakMemory, prepare_data
    data = prepare_data(a.data, "gpt2", a.cache)
    dp = cupy.get_default_memory_pool()
    mem = PeakMemory()
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(data=str(data), block_size=a.block, batch_size=a.batch, device="cuda",
                          dtype="bf16", max_steps=a.steps + 1, warmup=10, eval_interval=0,
                          sample_interval=0, checkpoint_interval=0, log_interval=1,
                          progress=False, out_dir=out, model=a.model)
        trainer = Trainer(cfg, log=lambda *_: None)
        mode = os.environ.get("FORGE_TRAIN_GRAPH", "on")
        if a.workspace_mib:
            _set_cublas_workspace(a.workspace_mib)
            mode += f", cuBLAS workspace {a.workspace_mib} MiB"

        def line(what):
            cupy.cuda.runtime.deviceSynchronize()
            text = (f"[graph {mode}] {what:8s} nvml {mem.current() / GB:6.2f} (peak {mem.peak / GB:6.2f})"
                    f" | pool {dp.used_bytes() / GB:6.2f} / {dp.total_bytes() / GB:6.2f}")
            g = getattr(getattr(trainer._fast, "_graph", None), "_captured", None)
            if g is not None:
                text += f" | graph pool {g._pool.used_bytes() / GB:6.2f} / {g._pool.total_bytes() / GB:6.2f}"
            gm = _graph_mem()
            if gm is not None:
                text += f" | graph mem {gm[0]:6.2f} / {gm[1]:6.2f}"
            print(text, flush=True)

        line("set up")
        for i in range(a.steps):
            trainer.train_step()
            line(f"step {i + 1}")
        # what an evaluation between steps holds: the trainer gives the captured step's memory
        # back first (_off_graph); a reference cycle would keep it until the collector runs
        trainer._off_graph(lambda: trainer.evaluate(4))
        line("eval")
        import gc
        gc.collect()
        line("gc")
        trainer.train_step()
        line("step again")
    mem.stop()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a text file (tinyshakespeare)")
    ap.add_argument("--model", default="gpt2", help="a preset (gpt2, gpt2-medium, ...)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--workspace-mib", type=int, default=0,
                    help="also run the graph with a fixed cuBLAS workspace of this size")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "forge_e2e_data"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    runs = [("off", 0), ("on", 0)] + ([("on", a.workspace_mib)] if a.workspace_mib else [])
    for mode, mib in runs:
        env = dict(os.environ, FORGE_TRAIN_GRAPH=mode)
        cmd = [sys.executable, __file__, "--worker", "--data", a.data, "--model", a.model,
               "--batch", str(a.batch), "--block", str(a.block), "--steps", str(a.steps),
               "--cache", a.cache, "--workspace-mib", str(mib)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            print(f"graph {mode}: failed ({proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)


if __name__ == "__main__":
    main()
