"""The CPU backend's threads: how many its kernels and matrix products take, set at run time,
and ``ThreadTuner``, which picks that count while a run trains, from the run's own step times.
The count is the C kernels' pool's (``backends/cpu/native.py``), which also runs the float32
products where it found NumPy's OpenBLAS (OpenBLAS then keeps one thread); without the C
kernels it is OpenBLAS's own pool.

Why a tuner. Idle threads spin for a while, waiting for the next job. A pool as large as the
machine is the fastest on a quiet machine (a 2-core VM, 2026-12-03, before the kernels' own
pool: 45 ms a nanoGPT CPU step with 2 threads, 62 ms with 1) and collapses beside one busy
process (222 ms with 2 threads, 75 ms with 1). So
``forge-ml train`` starts with half the cores (``limit_default``) and, on the CPU, lets a
``ThreadTuner`` try both counts on the training steps themselves: it keeps the faster and
tries again when the step time jumps or every few hundred steps. No result depends on the
thread count (the threads share out outputs, never a sum; the tests check the training step
bit for bit), so the choice changes the speed only.

The user's own choice wins: with OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS
set, nothing here changes the count and no tuner runs; FORGE_BLAS_TUNE=off keeps the count
``forge-ml train`` starts with.

>>> default_threads(2), default_threads(6), default_threads(64)
(1, 3, 8)
"""
from __future__ import annotations

import ctypes
import os
import statistics
from typing import Callable, Optional

from . import flags
from .errors import ConfigError

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
MAX_THREADS = 8          # the small products of the models trained on a CPU gain little beyond
_chosen_here = False     # limit_default set the count (the user set none)


def cores() -> int:
    """The cores this process may run on.

    >>> cores() >= 1 and default_threads() == default_threads(cores())
    True
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads(n_cores: Optional[int] = None) -> int:
    """The count ``forge-ml`` starts with where the user set none: half the cores, at most
    8, at least 1 (room for a neighbour; ``ThreadTuner`` may take more).

    >>> default_threads(1), default_threads(4), default_threads(32), default_threads() <= 8
    (1, 2, 8, True)
    """
    n_cores = cores() if n_cores is None else n_cores
    return max(1, min(MAX_THREADS, n_cores // 2))


_libs: list = []    # the OpenBLAS libraries found (kept once found: a tuner asks every trial step)


def _openblas_libs() -> list:
    """Every OpenBLAS mapped into this process (Linux: /proc/self/maps), loaded by ctypes."""
    if _libs:
        return _libs
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return []
    libs = []
    for path in sorted(paths):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            continue
    _libs[:] = libs
    return libs


def _symbol(lib, stem: str):
    for name in (f"scipy_{stem}64_", f"scipy_{stem}", f"{stem}64_", stem):
        fn = getattr(lib, name, None)
        if fn is not None:
            return fn
    return None


def set_threads(n: int) -> bool:
    """The CPU backend's thread count: its C kernels' pool (``backends.cpu.native``), which
    also runs the matrix products where it found OpenBLAS's sgemm (OpenBLAS then keeps one
    thread of its own), else OpenBLAS's pool. Whether the pool or an OpenBLAS took it.

    >>> n = get_threads()
    >>> set_threads(n) if n else True
    True
    """
    from .backends.cpu import native          # the CPU kernels' own threads
    native.set_threads(n)                     # (it keeps OpenBLAS at one where it runs the products)
    return native.owns_products() or openblas_set_threads(n)


def openblas_set_threads(n: int) -> bool:
    """``openblas_set_num_threads(n)`` in every OpenBLAS already loaded; whether one took it.
    (The example sets the count it reads, so the test session's count stays as it was.)

    >>> n = openblas_threads()
    >>> openblas_set_threads(n) if n else True
    True
    """
    took = False
    for lib in _openblas_libs():
        fn = _symbol(lib, "openblas_set_num_threads")
        if fn is not None:
            fn(ctypes.c_int(int(n)))
            took = True
    return took


def get_threads() -> Optional[int]:
    """The CPU backend's thread count (``set_threads``): the C kernels' pool where it runs
    the products, else the first OpenBLAS's count; None where there is neither.

    >>> n = get_threads(); n is None or n >= 1
    True
    """
    from .backends.cpu import native
    if native.owns_products():
        return native.threads()
    return openblas_threads()


def openblas_threads() -> Optional[int]:
    """The thread count of the first OpenBLAS loaded, or None where there is none.

    >>> n = openblas_threads(); n is None or n >= 1
    True
    """
    for lib in _openblas_libs():
        fn = _symbol(lib, "openblas_get_num_threads")
        if fn is not None:
            fn.restype = ctypes.c_int
            return int(fn())
    return None


def sgemm() -> Optional[tuple]:
    """``(sgemm address, sgemv address, ilp64)`` of the first loaded OpenBLAS's
    ``cblas_sgemm`` and ``cblas_sgemv`` (ilp64: their integer arguments are 64-bit, as in
    NumPy's wheels), or None where there is no such pair.

    >>> s = sgemm(); s is None or (len(s), isinstance(s[2], bool)) == (3, True)
    True
    """
    for lib in _openblas_libs():
        for prefix, suffix in (("scipy_", "64_"), ("", "64_"), ("scipy_", ""), ("", "")):
            fns = [getattr(lib, f"{prefix}cblas_{name}{suffix}", None) for name in ("sgemm", "sgemv")]
            if all(fn is not None for fn in fns):
                return (*(ctypes.cast(fn, ctypes.c_void_p).value for fn in fns), suffix == "64_")
    return None


def user_threads() -> Optional[tuple]:
    """``(variable, value)`` of the first of ``THREAD_VARS`` the user set, or None; a value that
    is not a thread count (a whole number >= 1; OpenMP's list form ``4,2`` sets the first) is
    a ConfigError, not a count OpenBLAS would quietly replace with its own.

    >>> import os; os.environ.get("OMP_NUM_THREADS") is None or user_threads() is not None
    True
    """
    for var in THREAD_VARS:
        raw = os.environ.get(var, "")
        if raw.strip():
            head = raw.split(",")[0].strip()
            if not (head.isascii() and head.isdigit() and int(head) >= 1):
                raise ConfigError(f"{var}={raw!r} is not a thread count: expected a whole number "
                                  f">= 1 (or unset it, and forge-ml chooses)")
            return var, raw.strip()
    return None


def limit_default() -> Optional[int]:
    """Set this process's BLAS threads to ``default_threads()`` unless the user set one of
    ``THREAD_VARS``; returns the count set, or None. The variables are set for libraries not
    yet loaded (and child processes); NumPy's OpenBLAS, loaded with the package, is told
    through ``set_threads``. Afterwards ``tunable()`` is true where a tuner can change it.
    A count the user set is applied as it is (``MKL_NUM_THREADS`` alone too, which NumPy's
    OpenBLAS does not read), and no tuner runs.
    (Not a doctest: it sets the environment and the thread count for the rest of the process.)

    Example:

        n = limit_default()      # in a CLI command's start, before any work
        assert n is None or n == default_threads()
    """
    global _chosen_here
    asked = user_threads()
    if asked is not None:
        set_threads(int(asked[1].split(",")[0]))
        return None
    n = default_threads()
    for v in THREAD_VARS:
        os.environ[v] = str(n)
    set_threads(n)
    _chosen_here = True
    return n


def tunable() -> bool:
    """Whether a ``ThreadTuner`` may choose the count: ``limit_default`` chose it (the user set
    none), the FORGE_BLAS_TUNE switch is on, and a loaded OpenBLAS takes a new count (whether
    there are two counts to choose from is ``candidates()``'s to say).

    >>> tunable() and get_threads() is None     # a tunable count is one that can be read
    False
    """
    return _chosen_here and flags.on("FORGE_BLAS_TUNE") and get_threads() is not None


def candidates(n_cores: Optional[int] = None) -> list:
    """The counts a tuner tries: the default (half the cores) and every core (at most 8).

    >>> candidates(2), candidates(8), candidates(1)
    ([1, 2], [4, 8], [1])
    """
    n_cores = cores() if n_cores is None else n_cores
    return sorted({default_threads(n_cores), max(1, min(MAX_THREADS, n_cores))})


def tuner(**kw) -> Optional["ThreadTuner"]:
    """A ``ThreadTuner`` over ``candidates()`` (``kw`` goes to it) where ``tunable()`` and there
    are two counts to try; else None. What ``forge-ml train`` and ``forge-ml bench`` run on the
    CPU.

    >>> (tuner() is None) == (not tunable() or len(candidates()) < 2)
    True
    """
    if not tunable():
        return None
    counts = candidates()
    return ThreadTuner(counts, **kw) if len(counts) > 1 else None


class ThreadTuner:
    """Picks the BLAS thread count from the step times of a run (see the module's docstring).

    Call ``before_step()`` before each step and ``after_step(seconds)`` after it. The first
    ``skip`` steps run as they are (a first step allocates); then each count of ``counts`` runs
    ``trials`` steps, in turns (a load change hits every count alike), and the one with the
    lower median stays. It tries again after ``every`` steps, or as soon as two steps in a row
    take ``jump`` times the median of the last ten at the chosen count (a neighbour came; one
    slow step, a hiccup of a shared machine, is not enough).
    ``after_step`` returns a line for the log when it has chosen, else None; ``threads`` is the
    count in use.

    >>> told = []
    >>> t = ThreadTuner([1, 2], set_threads=told.append, skip=0, trials=2)
    >>> for seconds in (0.06, 0.04, 0.06, 0.04):         # 1, 2, 1, 2 threads
    ...     t.before_step(); line = t.after_step(seconds)
    >>> t.threads, told[-1], line
    (2, 2, 'BLAS threads: 2 (median step 40 ms; 1 thread: 60 ms)')
    """

    def __init__(self, counts, set_threads: Callable[[int], object] = set_threads, skip: int = 2,
                 trials: int = 3, every: int = 500, jump: float = 1.5):
        self.counts = sorted(set(int(c) for c in counts))
        self._set, self.trials, self.every, self.jump = set_threads, int(trials), int(every), float(jump)
        self._skip = int(skip)
        self.threads: Optional[int] = None
        self._queue: list = []        # counts still to try, in order
        self._times: dict = {}
        self._recent: list = []       # the chosen count's last step times
        self._since = 0               # steps since the last choice
        self._slow = 0                # slow steps in a row
        if len(self.counts) > 1:
            self._start()

    def _start(self) -> None:
        self._queue = [c for _ in range(self.trials) for c in self.counts]
        self._times = {c: [] for c in self.counts}

    def before_step(self) -> None:
        """Set the count the next step is to try (only while trying counts).

        >>> told = []; t = ThreadTuner([1, 2], set_threads=told.append, skip=0)
        >>> t.before_step(); t.threads, told
        (1, [1])
        """
        if self._skip == 0 and self._queue and self.threads != self._queue[0]:
            self.threads = self._queue[0]
            self._set(self.threads)

    def after_step(self, seconds: float) -> Optional[str]:
        """Note the step's time in ``seconds``; the log's line when this step decided the count.

        >>> t = ThreadTuner([1, 2], set_threads=lambda n: None, skip=0, trials=1)
        >>> t.before_step(); print(t.after_step(0.05))
        None
        >>> t.before_step(); t.after_step(0.03)
        'BLAS threads: 2 (median step 30 ms; 1 thread: 50 ms)'
        """
        if self._skip > 0:
            self._skip -= 1
            return None
        if self._queue:
            self._times[self._queue.pop(0)].append(float(seconds))
            if self._queue:
                return None
            med = {c: statistics.median(ts) for c, ts in self._times.items()}
            best = min(self.counts, key=lambda c: (med[c], c))
            if self.threads != best:
                self.threads = best
                self._set(best)
            self._recent, self._since, self._slow = [], 0, 0
            others = "; ".join(f"{c} thread{'s' if c != 1 else ''}: {med[c] * 1e3:.0f} ms"
                               for c in self.counts if c != best)
            return f"BLAS threads: {best} (median step {med[best] * 1e3:.0f} ms; {others})"
        if len(self.counts) < 2:
            return None
        self._since += 1
        slow = (len(self._recent) >= 5
                and seconds > self.jump * statistics.median(self._recent))
        self._slow = self._slow + 1 if slow else 0
        if not slow:
            self._recent = (self._recent + [float(seconds)])[-10:]
        if self._slow >= 2 or self._since >= self.every:
            self._slow = 0
            self._start()
        return None


def cpu_kernels() -> str:
    """Which kernels the CPU backend runs: "C kernels", or "NumPy kernels (why)" where the C
    kernels are switched off or could not be built (``forge-ml check`` says which it checked).

    >>> cpu_kernels().split(" ")[0] in ("C", "NumPy")
    True
    """
    from .backends.cpu import native
    if native.lib() is not None:
        return "C kernels"
    why = ("FORGE_CPU_KERNELS=numpy" if native.mode() == "numpy"
           else f"the C kernels are unavailable: {native.why_not()}")
    return f"NumPy kernels ({why})"
