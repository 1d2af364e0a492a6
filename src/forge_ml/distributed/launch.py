"""Starting ranks: threads on one process (tests), processes on one machine (``spawn``, what
``forge-ml train --gpus N`` runs), and the bootstrap of one process's NCCL communicator from
its environment (``init_process_group``).

Environment (torchrun's names, set by ``spawn`` as torchrun sets them): ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` (the GPU: ``cuda:LOCAL_RANK``), ``MASTER_ADDR``,
``MASTER_PORT``. Rank 0 serves a small key-value store (``TCPStore``, standard library only)
at ``MASTER_ADDR:MASTER_PORT``; it posts NCCL's unique id there, every rank checks in and
reads it. Under ``mpirun`` (Open MPI's ``OMPI_COMM_WORLD_*`` or MPICH/Intel's ``PMI_*``
variables, no ``RANK``) mpi4py broadcasts the id instead. Several machines need nothing
else: NCCL finds its way over the network once every rank has the id.

>>> env = process_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
...                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
>>> env.rank, env.world_size, env.device, env.launcher
(1, 2, 'cuda:1', 'torchrun')
"""
from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..device import Device
from ..errors import ConfigError, DeviceError
from ..tensor import backend_of
from .comm import CommError, CommTimeout, Communicator, NcclCommunicator, ThreadGroup, _cupy_nccl

# ---------------------------------------------------------------------------------------------
# Ranks as threads


def threads(n: int, fn: Callable, *, timeout: float = 60.0) -> list:
    """Run ``fn(comm)`` on ``n`` threads, each with the ``ThreadCommunicator`` of its rank in
    one ``ThreadGroup``: the in-process stand-in for ``n`` GPUs. Returns the results in rank
    order. A rank that raises ends the group: the others' collectives raise a CommError that
    names it (at once, not at the timeout), and its own exception is raised here once every
    thread has ended (a thread still running ``timeout`` seconds after the group failed is
    left behind, hung, and the failure raised all the same).

    >>> threads(3, lambda comm: comm.rank * 10)
    [0, 10, 20]
    >>> def fn(comm):
    ...     if comm.rank == 1:
    ...         raise ValueError("rank 1 broke")
    ...     comm.barrier()
    >>> threads(2, fn)
    Traceback (most recent call last):
    ...
    ValueError: rank 1 broke
    """
    group = ThreadGroup(n, timeout=timeout)
    backend_of(Device.parse("cpu"))            # load the backend once, before the threads race to
    results: list = [None] * n
    errors: list = [None] * n

    def run(rank: int) -> None:
        try:
            results[rank] = fn(group.communicator(rank))
        except BaseException as e:  # noqa: B902 - every failure must end the group
            errors[rank] = e
            group.abort(rank, f"{type(e).__name__}: {e}")

    ts = [threading.Thread(target=run, args=(r,), name=f"forge-rank-{r}", daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    # Once the group has failed, the ranks still running get one more timeout to end (each
    # ends at its next collective); a rank hung outside any collective (a deadlock, a loop)
    # never would, and joining it would hang the caller the timeouts are there to spare.
    # It is left behind (a daemon thread) and the group's failure raised.
    failed_at = None
    live = ts
    while live:
        live[0].join(0.02)
        live = [t for t in live if t.is_alive()]
        if live and group._failed is not None:
            failed_at = time.monotonic() if failed_at is None else failed_at
            if time.monotonic() - failed_at > group.timeout:
                break
    failed = [e for e in errors if e is not None]
    if live and not failed:    # (the rank that recorded the failure has not raised it yet)
        who, reason, timed_out = group._failed
        failed = [(CommTimeout if timed_out else CommError)(reason)]
    if failed:
        # the first failure that is not just another rank reporting it
        first = next((e for e in failed if not isinstance(e, CommError)), None)
        if first is None:
            first = next((e for e in failed if isinstance(e, CommTimeout)), failed[0])
        raise first
    return results


# ---------------------------------------------------------------------------------------------
# The rendezvous store


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        store = self.server.store        # type: ignore[attr-defined]
        lock = self.server.lock          # type: ignore[attr-defined]
        try:
            req = json.loads(self.rfile.readline().decode())
            with lock:
                if req["op"] == "set":
                    store[req["key"]] = req["value"]
                    reply = {"ok": True}
                elif req["op"] == "get":
                    reply = {"value": store.get(req["key"])}
                elif req["op"] == "add":
                    store[req["key"]] = int(store.get(req["key"], 0)) + int(req["value"])
                    reply = {"value": store[req["key"]]}
                else:
                    reply = {"error": f"unknown op {req['op']!r}"}
        except (ValueError, KeyError) as e:
            reply = {"error": f"bad request: {e}"}
        self.wfile.write((json.dumps(reply) + "\n").encode())


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class TCPStore:
    """A small key-value store over TCP for the rendezvous: rank 0 serves it (``server=True``,
    a daemon thread), every rank (rank 0 too) is a client. One JSON line per request, one
    connection per request; ``get`` and ``wait_count`` poll until the value is there or
    ``timeout`` passes (CommTimeout naming the address). Values are strings.

    >>> s = TCPStore("127.0.0.1", 0, server=True, timeout=5)   # port 0: any free port
    >>> s.set("id", "abc"); s.get("id"), s.add("joined", 1), s.add("joined", 1)
    ('abc', 1, 2)
    >>> s.close()
    """

    def __init__(self, host: str, port: int, *, server: bool, timeout: float = 300.0):
        self.host, self.port, self.timeout = host, int(port), float(timeout)
        self._server = None
        if server:
            try:
                srv = _Server(("" if host not in ("127.0.0.1", "localhost") else host, self.port), _Handler)
            except OSError as e:
                raise CommError(f"rendezvous: rank 0 cannot serve the store on port {self.port}: "
                                f"{e.strerror or e}; choose another MASTER_PORT") from None
            srv.store, srv.lock = {}, threading.Lock()
            self.port = srv.server_address[1]
            threading.Thread(target=srv.serve_forever, name="forge-store", daemon=True).start()
            self._server = srv

    def _request(self, req: dict) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                with socket.create_connection((self.host, self.port), timeout=min(10.0, self.timeout)) as s:
                    s.sendall((json.dumps(req) + "\n").encode())
                    line = s.makefile("rb").readline()
                reply = json.loads(line.decode())
                if "error" in reply:
                    raise CommError(f"rendezvous store at {self.host}:{self.port}: {reply['error']}")
                return reply
            except (OSError, ValueError) as e:      # not up yet, reset, timed out, a torn reply
                if time.monotonic() > deadline:
                    raise CommTimeout(f"rendezvous: no store answered at {self.host}:{self.port} within "
                                      f"{self.timeout:g} s ({e}); is rank 0 running, and MASTER_ADDR / "
                                      f"MASTER_PORT the same on every rank?") from None
                time.sleep(0.05)

    def set(self, key: str, value: str) -> None:
        """Post ``value`` under ``key``."""
        self._request({"op": "set", "key": key, "value": str(value)})

    def add(self, key: str, n: int = 1) -> int:
        """Add ``n`` to the counter ``key`` (0 when new); returns the new count."""
        return int(self._request({"op": "add", "key": key, "value": int(n)})["value"])

    def get(self, key: str) -> str:
        """The value of ``key``, waiting until some rank posted it."""
        deadline = time.monotonic() + self.timeout
        while True:
            v = self._request({"op": "get", "key": key})["value"]
            if v is not None:
                return v
            if time.monotonic() > deadline:
                raise CommTimeout(f"rendezvous: {key!r} was not posted at {self.host}:{self.port} within "
                                  f"{self.timeout:g} s (rank 0 failed before it?)")
            time.sleep(0.05)

    def wait_count(self, key: str, n: int) -> None:
        """Wait until the counter ``key`` reaches ``n`` (every rank checked in)."""
        deadline = time.monotonic() + self.timeout
        while (have := self.add(key, 0)) < n:
            if time.monotonic() > deadline:
                raise CommTimeout(f"rendezvous: only {have} of {n} ranks checked in at {self.host}:{self.port} "
                                  f"within {self.timeout:g} s; start every rank (WORLD_SIZE={n})")
            time.sleep(0.05)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _encode_id(uid) -> str:
    # CuPy 14's get_unique_id gives 128 bytes (a tuple of 128 ints before)
    if isinstance(uid, (bytes, bytearray)):
        return json.dumps({"b64": base64.b64encode(bytes(uid)).decode()})
    return json.dumps({"ints": [int(v) for v in uid]})


def _decode_id(text: str):
    d = json.loads(text)
    return base64.b64decode(d["b64"]) if "b64" in d else tuple(d["ints"])


def exchange_unique_id(store: TCPStore, rank: int, world_size: int, make_id: Callable):
    """Rank 0 posts ``make_id()``; every rank checks in, waits for all ``world_size`` of them
    (so nobody enters NCCL's blocking init while a rank is missing) and returns the id.

    >>> s = TCPStore("127.0.0.1", 0, server=True, timeout=5)
    >>> exchange_unique_id(s, 0, 1, lambda: (1, -2, 3))
    (1, -2, 3)
    >>> s.close()
    """
    if rank == 0:
        store.set("nccl_unique_id", _encode_id(make_id()))
    store.add("joined", 1)
    store.wait_count("joined", world_size)
    return _decode_id(store.get("nccl_unique_id"))


# ---------------------------------------------------------------------------------------------
# One process's communicator from its environment


@dataclass
class ProcessEnv:
    """Where this process stands in the job: its rank, the job's size, its GPU, the
    rendezvous address, and who launched it (``torchrun``, ``mpirun`` or ``single``)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str

    @property
    def device(self) -> str:
        return f"cuda:{self.local_rank}"


def process_env(environ=None) -> ProcessEnv:
    """Read the launcher's variables: torchrun's (and ``spawn``'s) ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; else Open MPI's or PMI's under mpirun;
    else a single process. A partial or inconsistent set is a ConfigError naming what is
    wrong.

    >>> process_env({}).launcher
    'single'
    >>> process_env({"RANK": "0", "WORLD_SIZE": "2"})
    Traceback (most recent call last):
    ...
    forge_ml.errors.ConfigError: RANK is set, so torchrun's variables are expected, but MASTER_ADDR, MASTER_PORT are missing (torchrun and forge-ml train --gpus set them all)
    """
    env = os.environ if environ is None else environ

    def num(name: str, value) -> int:
        # decimal digits only: int() also took "1_0" (10) and non-ASCII digits, a typo trained
        # as another rank
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if not isinstance(value, str) or not re.fullmatch(r"\s*[-+]?[0-9]+\s*", value):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        return int(value)

    if "RANK" in env:
        need = ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [k for k in need if k not in env]
        if missing:
            raise ConfigError(f"RANK is set, so torchrun's variables are expected, but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing (torchrun and forge-ml train "
                              f"--gpus set them all)")
        rank, world = num("RANK", env["RANK"]), num("WORLD_SIZE", env["WORLD_SIZE"])
        local = num("LOCAL_RANK", env.get("LOCAL_RANK", rank))
        port = num("MASTER_PORT", env["MASTER_PORT"])
        launcher = "torchrun"
        addr = env["MASTER_ADDR"]
    elif "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        ompi = "OMPI_COMM_WORLD_RANK" in env
        rank = num("rank", env["OMPI_COMM_WORLD_RANK" if ompi else "PMI_RANK"])
        world = num("size", env.get("OMPI_COMM_WORLD_SIZE" if ompi else "PMI_SIZE", 1))
        local = num("local rank", env.get("OMPI_COMM_WORLD_LOCAL_RANK" if ompi else "MPI_LOCALRANKID", rank))
        addr, port, launcher = "", 0, "mpirun"
    else:
        return ProcessEnv(0, 1, 0, "127.0.0.1", 0, "single")
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ConfigError(f"rank {rank} of world size {world} (local rank {local}) is not a valid position; "
                          f"expected 0 <= rank < world size")
    if launcher == "torchrun" and world > 1:
        # the rendezvous: rank 0 serves at MASTER_PORT, the others connect to MASTER_ADDR. A port
        # out of range failed rank 0 with a traceback and left the others retrying until their
        # timeout (30 minutes); port 0 is a different free port on rank 0, unknown to the others
        if not 0 < port < 65536:
            raise ConfigError(f"MASTER_PORT must be a TCP port in 1..65535 (the same on every "
                              f"rank), got {env['MASTER_PORT']!r}")
        if not addr.strip():
            raise ConfigError("MASTER_ADDR is empty; expected rank 0's host name or address "
                              "(the same on every rank)")
    return ProcessEnv(rank, world, local, addr, port, launcher)


def init_process_group(timeout: float = 1800.0, environ=None) -> Communicator:
    """This process's ``NcclCommunicator``, on ``cuda:LOCAL_RANK``, from the launcher's
    environment (``process_env``). Rank 0 makes NCCL's unique id and shares it through the
    ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (port + 1 under torchrun when its own agent
    store already holds the port), or through mpi4py's broadcast under mpirun. A single
    process gets a communicator of one.

    Needs CuPy with NCCL; without it a DeviceError says so (nothing here runs on the CPU, so
    no doctest). On a GPU machine, in each process that ``spawn``, torchrun or mpirun started:

    Example:
        import numpy as np, forge_ml as fm
        comm = init_process_group()               # rank 1 of 8: NcclCommunicator on cuda:1
        x = fm.tensor(np.ones(4, np.float32), device=comm.device)
        comm.all_reduce(x); comm.synchronize()    # x is 8.0 everywhere, on every rank
    """
    env = process_env(environ)
    _, nccl = _cupy_nccl()
    device = env.device
    backend_of(Device.parse(device))           # make this process's GPU current before NCCL init
    if env.world_size == 1:
        uid = nccl.get_unique_id()
    elif env.launcher == "mpirun":
        try:
            from mpi4py import MPI
        except ImportError:
            raise ConfigError("launched by mpirun, so mpi4py is needed to share NCCL's id: pip install mpi4py "
                              "(or launch with forge-ml train --gpus N / torchrun)") from None
        world = MPI.COMM_WORLD
        local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        if local != env.local_rank:
            device = f"cuda:{local}"
            backend_of(Device.parse(device))
        uid = world.bcast(nccl.get_unique_id() if env.rank == 0 else None, root=0)
    else:
        environ = os.environ if environ is None else environ
        # torchrun's agent serves its own store on MASTER_PORT when it says so
        port = env.master_port + (1 if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0)
        store = TCPStore(env.master_addr, port, server=env.rank == 0, timeout=timeout)
        try:
            uid = exchange_unique_id(store, env.rank, env.world_size, nccl.get_unique_id)
        except BaseException:
            store.close()       # rank 0 stops serving: the others fail at once instead of at their timeout
            raise
        # rank 0 keeps serving (a daemon thread) until the process ends: a late reader still finds the id
    return NcclCommunicator(env.rank, env.world_size, uid, device=device, timeout=timeout)


# ---------------------------------------------------------------------------------------------
# N processes on this machine


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's choice).

    >>> 0 < free_port() < 65536
    True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _describe_exit(code: int) -> str:
    """``Popen.returncode`` in words: "exited with status 3", "was killed by SIGKILL"."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def preflight(n: int) -> None:
    """Check, before ``forge-ml train --gpus N`` starts its ``n`` processes, that this
    machine can run them: CuPy with NCCL imports and at least ``n`` GPUs are visible. A
    DeviceError says what is missing, once, instead of one failure a rank.

    >>> try:
    ...     preflight(10**6)           # no machine has that many: CuPy or the count says so
    ... except DeviceError as e:
    ...     print(type(e).__name__)
    DeviceError
    """
    cupy, _ = _cupy_nccl()
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:          # no driver or no device: CUDA's own error names it
        raise DeviceError(f"--gpus {n} needs {n} NVIDIA GPUs, but CUDA finds none here ({e})") from None
    if count < n:
        raise DeviceError(f"--gpus {n} needs {n} GPUs, but this machine has {count} "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def spawn(n: int, argv: list, *, env: Optional[dict] = None, master_port: Optional[int] = None,
          grace: float = 30.0) -> int:
    """Run ``n`` processes of the command ``argv`` on this machine, one per GPU, with
    torchrun's variables set (``RANK`` = ``LOCAL_RANK`` = 0..n-1, ``WORLD_SIZE`` =
    ``LOCAL_WORLD_SIZE`` = n, ``MASTER_ADDR`` = 127.0.0.1, ``MASTER_PORT`` a free port), and
    wait for them. When one exits with an error or is killed, a line on stderr says which
    and how, and the others get SIGTERM (SIGKILL ``grace`` seconds later): no rank is left
    waiting for a dead peer. Returns 0, or the exit status of the first process that failed
    (128 + signal for a signal). Ctrl-C reaches the children through the terminal; this
    process keeps waiting for them. A SIGTERM sent to this process alone is passed on to
    them (rank 0 then saves and stops the run, as it would on its own SIGTERM).

    ``forge-ml train --gpus N`` calls ``spawn(N, [sys.executable, "-m", "forge_ml", *argv])``
    and each child, seeing ``RANK``, trains its rank.

    >>> import sys
    >>> spawn(2, [sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['RANK']) * 3)"])
    3
    """
    if int(n) < 1:
        raise ConfigError(f"spawn: expected at least one process, got {n}")
    port = master_port or free_port()
    procs: list = []
    forwarded: list = []

    def on_term(signum, frame) -> None:
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    main = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        for rank in range(n):
            e = dict(os.environ if env is None else env)
            e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen(list(argv), env=e))
        return _wait_ranks(procs, grace, forwarded)
    except BaseException:
        for p in procs:           # this process failed (not a rank): leave no rank behind
            if p.poll() is None:
                p.kill()
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if old_term is None else old_term)


def _wait_ranks(procs: list, grace: float, forwarded: list) -> int:
    """``spawn``'s wait: poll the ranks, stop the others when one fails, return the status."""
    n = len(procs)
    failed: Optional[int] = None
    stop_at: Optional[float] = None
    while True:
        try:
            codes = [p.poll() for p in procs]
            for rank, c in enumerate(codes):
                if c not in (None, 0) and failed is None:
                    failed = c if c > 0 else 128 - c
                    stop_at = time.monotonic() + grace
                    live = [p for p in procs if p.poll() is None]
                    if not forwarded:
                        msg = f"forge-ml: rank {rank} of {n} (pid {procs[rank].pid}) {_describe_exit(c)}"
                        if live:
                            msg += (f"; stopping the other {len(live)} rank(s) (SIGTERM, SIGKILL after "
                                    f"{grace:g} s)")
                        print(msg, file=sys.stderr, flush=True)
                        for p in live:
                            p.send_signal(signal.SIGTERM)
                    # (after Ctrl-C or a forwarded SIGTERM every rank has had its signal: a second
                    # would make the workers give up while rank 0 saves; SIGKILL after the grace only)
            if all(c is not None for c in codes):
                break
            if stop_at is not None and time.monotonic() > stop_at:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.05)
        except KeyboardInterrupt:
            # Ctrl-C: the children got the signal too; rank 0 saves and ends the workers
            forwarded.append(signal.SIGINT)
            continue
    return 0 if failed is None else failed   # a non-zero code sets failed before the loop ends
