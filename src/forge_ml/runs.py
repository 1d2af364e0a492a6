"""The run folder: its lock (``RunLock``: one trainer at a time), its append-only log
(``read_log``: a damaged line is left out, never raised about), writes that leave the old
file or the new one (``replace_file``), removals that take all the files or none
(``remove_together``), with one-line messages for writes that fail (``cannot_write``). The
trainer (``forge_ml.train``) uses them; nothing here trains.

>>> cannot_write("runs/a/log.jsonl", OSError(28, "No space left on device"))
'cannot write runs/a/log.jsonl: No space left on device (ENOSPC)'
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

from .checkpoint import flock_file, interrupted_swap, is_checkpoint_dir, user_umask
from .errors import ForgeError

LOCK_NAME = "train.lock"    # <out_dir>/train.lock: held (flock) by the trainer using the folder
# <out_dir>/.overwrite.XXXXXXXX.tmp: the files remove_together takes away, while they go
TRASH_PREFIX, TRASH_SUFFIX = ".overwrite.", ".tmp"
_TRASH = re.compile(re.escape(TRASH_PREFIX) + "[a-z0-9_]{8}" + re.escape(TRASH_SUFFIX))   # (mkdtemp's eight)


class RunError(ForgeError):
    """The run folder cannot be used as asked: another trainer holds it, it holds a run and
    neither resume nor overwrite was asked, or a file in it cannot be written.

    >>> isinstance(RunError("runs/a is in use by another trainer"), ForgeError)
    True
    """


def cannot_write(path, e: OSError, after: str = "") -> str:
    """One line naming the file and the cause of a failed write.

    >>> cannot_write("runs/a/log.jsonl", OSError(errno.ENOSPC, "No space left on device"))
    'cannot write runs/a/log.jsonl: No space left on device (ENOSPC)'
    """
    code = errno.errorcode.get(e.errno, "") if getattr(e, "errno", None) else ""
    return (f"cannot write {path}: {e.strerror or e}" + (f" ({code})" if code else "")
            + (f"; {after}" if after else ""))


def stray_temps(folder, names) -> list:
    """The temporary files that a killed ``replace_file`` (or ``data.write_shard``) of one of
    ``names`` left in ``folder``: ``.<name>.XXXXXXXX.tmp`` (``mkstemp``'s names), nothing else.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> for n in (".log.jsonl.k3_9abzq.tmp", ".log.jsonl.BACKUP01.tmp", "log.jsonl"):
    ...     _ = open(os.path.join(d, n), "w").write("")
    >>> [p.name for p in stray_temps(d, ["log.jsonl"])]
    ['.log.jsonl.k3_9abzq.tmp']
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    # mkstemp's eight characters are lowercase letters, digits and "_" (never a user's
    # ".log.jsonl.BACKUP01.tmp")
    pattern = re.compile(r"\.(%s)\.[a-z0-9_]{8}\.tmp" % "|".join(re.escape(n) for n in names))
    return sorted(folder / n for n in os.listdir(folder)
                  if pattern.fullmatch(n) and (folder / n).is_file() and not (folder / n).is_symlink())


def remove_stray_temps(folder, names) -> None:
    """Remove ``stray_temps(folder, names)`` (what a kill midway through a write left).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> for n in (".log.jsonl.k3_9abzq.tmp", "log.jsonl"):
    ...     _ = open(os.path.join(d, n), "w").write("")
    >>> remove_stray_temps(d, ["log.jsonl"]); os.listdir(d)
    ['log.jsonl']
    """
    for p in stray_temps(folder, names):
        try:
            p.unlink()
        except OSError:
            pass


# the signals that end a process by default (a run stops at a step boundary instead)
ENDING_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


def take_signals(handler, signums, default_only: bool = False) -> dict:
    """``handler`` for each of ``signums`` (on the main thread: only it takes signals; a
    KeyboardInterrupt elsewhere is handled as one); returns the handlers it replaced, for
    ``give_back_signals``. A signal the process inherited as ignored stays ignored (nohup's
    SIGHUP, the SIGINT of a non-interactive shell's background job), as Python leaves an
    ignored SIGINT; ``default_only``: so does one with a handler of its own.

    >>> def note(signum, frame): pass
    >>> old = take_signals(note, (signal.SIGTERM,))
    >>> signal.getsignal(signal.SIGTERM) is note, list(old) == [signal.SIGTERM]
    (True, True)
    >>> give_back_signals(old); signal.getsignal(signal.SIGTERM) is note
    False
    """
    old = {}
    if threading.current_thread() is not threading.main_thread():
        return old
    for s in signums:
        try:
            was = signal.getsignal(s)
            if was is None or was is signal.SIG_IGN or (default_only and was is not signal.SIG_DFL):
                continue     # (None: a handler set outside Python, which could not be put back)
            old[s] = signal.signal(s, handler)
        except (ValueError, OSError):
            pass
    return old


def give_back_signals(old: dict) -> None:
    """The handlers ``take_signals`` replaced, put back.

    >>> was = signal.getsignal(signal.SIGTERM)
    >>> give_back_signals(take_signals(lambda signum, frame: None, (signal.SIGTERM,)))
    >>> signal.getsignal(signal.SIGTERM) is was
    True
    """
    for s, h in old.items():
        signal.signal(s, h)


@contextlib.contextmanager
def signals_held(signums=None):
    """The signals ``signums`` (default SIGINT and ``ENDING_SIGNALS``) held back while the block runs and delivered when it ends (a
    Ctrl-C lands after it): each one's handler is swapped for one that only notes it, and the
    first noted is raised again, to the handler it would have reached, once the block is done.
    Handlers, not the thread's signal mask: the OS may hand a signal sent to the process to
    any of its threads (NumPy's BLAS threads), and Python runs its handler on the main thread
    whichever took it, so a mask held nothing there. A signal ignored stays ignored; off the
    main thread (which cannot set handlers) nothing is held.

    >>> import signal, os
    >>> with signals_held((signal.SIGTERM,)):
    ...     h = signal.getsignal(signal.SIGTERM)
    >>> h is signal.getsignal(signal.SIGTERM)
    False
    """
    noted = []
    old = take_signals(lambda signum, frame: noted.append(signum),
                       (signal.SIGINT,) + ENDING_SIGNALS if signums is None else signums)
    try:
        yield
    finally:
        give_back_signals(old)
        if noted:
            signal.raise_signal(noted[0])


def remove_together(folder, files=(), dirs=()) -> bool:
    """Remove, all or none, the ``files`` (paths in ``folder``) and of each ``(path, names)``
    of ``dirs`` (folders in ``folder``) the files ``names``, and the folder itself when nothing
    else is in it (a user's file there stays, with its folder). Each is first moved into one
    trash folder in ``folder`` (``.overwrite.XXXXXXXX.tmp``); whatever stops the moves (a
    Ctrl-C, an OSError, which is raised) moves them back first, so every file is where it was.
    Then the trash folder is removed with SIGINT held (a Ctrl-C lands after it). SIGTERM and
    SIGHUP are held throughout (they would end the process midway). A SIGKILL or a power loss
    leaves the trash folder, holding nothing but what was to go, for ``remove_trash``.
    Returns whether a file was removed (an empty folder of ``dirs`` goes too, unsaid).

    >>> import tempfile, os
    >>> d = Path(tempfile.mkdtemp()); (d / "ckpt").mkdir()
    >>> for n in ("log.jsonl", "ckpt/model.safetensors", "notes.txt"):
    ...     _ = (d / n).write_text("x")
    >>> remove_together(d, [d / "log.jsonl"], [(d / "ckpt", ("model.safetensors", "state.json"))])
    True
    >>> sorted(os.listdir(d)), remove_together(d, [d / "log.jsonl"])
    (['notes.txt'], False)
    >>> (d / "ckpt").mkdir(); remove_together(d, [], [(d / "ckpt", ("model.safetensors",))])
    False
    >>> sorted(os.listdir(d))
    ['notes.txt']
    """
    folder = Path(folder)
    plan = []   # (a file or folder to go, its place in the trash)
    nfiles = 0
    for d, names in dirs:
        if d.is_dir() and not d.is_symlink():
            ours = [n for n in names if (d / n).is_file()]
            nfiles += len(ours)
            if set(os.listdir(d)) <= set(ours):
                plan.append((d, d.name))                          # the folder with its files
            else:
                plan += [(d / n, os.path.join(d.name, n)) for n in ours]
    present = [f for f in files if f.is_file()]
    plan += [(f, f.name) for f in present]
    nfiles += len(present)
    if not plan:
        return False
    trash, moved = None, []
    with signals_held(ENDING_SIGNALS):
        try:
            trash = Path(tempfile.mkdtemp(prefix=TRASH_PREFIX, suffix=TRASH_SUFFIX, dir=folder))
            for src, rel in plan:
                dst = trash / rel
                if dst.parent != trash:
                    dst.parent.mkdir(exist_ok=True)
                moved.append((src, dst))   # before the rename: one stopped right after it is undone too
                os.rename(src, dst)
        except BaseException:
            with signals_held((signal.SIGINT,)):   # (the others are held already)
                _put_back(moved, trash)
            raise
        # every file is in the trash: from here on the earlier files are gone, so a Ctrl-C waits
        with signals_held((signal.SIGINT,)):
            shutil.rmtree(trash)
    return nfiles > 0


def _put_back(moved: list, trash) -> None:
    """``remove_together``'s moves undone, last first, and its trash folder removed when empty."""
    for src, dst in reversed(moved):
        if (dst.exists() or dst.is_symlink()) and not (src.exists() or src.is_symlink()):
            try:
                os.rename(dst, src)
            except OSError:
                pass   # it stays in the trash folder, which then stays too
    if trash is not None:
        for d, _, _ in sorted(os.walk(trash), key=lambda w: -len(w[0])):   # innermost first
            try:
                os.rmdir(d)
            except OSError:
                pass


def trash_folders(folder) -> list:
    """The trash folders (``remove_together``'s) that a kill left in ``folder``.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); os.mkdir(os.path.join(d, ".overwrite.k3_9abzq.tmp"))
    >>> [p.name for p in trash_folders(d)]
    ['.overwrite.k3_9abzq.tmp']
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(folder / n for n in os.listdir(folder)
                  if _TRASH.fullmatch(n) and (folder / n).is_dir() and not (folder / n).is_symlink())


def remove_trash(folder) -> None:
    """Remove ``trash_folders(folder)``: files that a stopped ``remove_together`` was removing.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); os.makedirs(os.path.join(d, ".overwrite.k3_9abzq.tmp", "ckpt"))
    >>> remove_trash(d); os.listdir(d)
    []
    """
    for t in trash_folders(folder):
        with signals_held():
            shutil.rmtree(t, ignore_errors=True)


def replace_file(path, text) -> None:
    """Write ``text`` (str, or bytes) to a temporary file beside ``path`` (a Path or str) and
    rename it over ``path`` (with the user's umask): a crash or a full disk leaves the old file
    or the new one.

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "state.json"; replace_file(p, '{"step": 1}')
    >>> replace_file(p, b'{"step": 2}'); p.read_text(), os.listdir(p.parent)
    ('{"step": 2}', ['state.json'])
    """
    path = Path(path)   # (a str path gave AttributeError: 'str' object has no attribute 'name')
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o666 & ~user_umask())
        binary = isinstance(text, (bytes, bytearray))
        with os.fdopen(fd, "wb" if binary else "w", encoding=None if binary else "utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_log(path) -> tuple:
    """The records of a ``log.jsonl`` and the numbers of its damaged lines: ``(records,
    bad_lines)``. A line that is not a JSON object with an integer ``step`` (a torn last line
    after a crash, a damaged byte) is left out, never raised about; a missing file is empty.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "log.jsonl")
    >>> _ = open(p, "w").write('{"step": 1, "loss": 2.5}\\n{"step": 2, "lo')
    >>> read_log(p)
    ([{'step': 1, 'loss': 2.5}], [2])
    """
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return [], []
    records, bad = [], []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if isinstance(r, dict) and isinstance(r.get("step"), int) and not isinstance(r["step"], bool):
            records.append(r)
        else:
            bad.append(i)
    return records, bad


_LOCK_LINE = re.compile(r"pid \d+ on .* since ")   # what acquire() writes


def holds_run(folder) -> bool:
    """Whether ``folder`` holds a forge-ml run: its lock file (a trainer's line in it), a
    ``log.jsonl`` that begins with a step's record, or a training checkpoint in ``ckpt/``.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); holds_run(d)
    False
    >>> _ = (d / "log.jsonl").write_text('{"step": 1, "loss": 2.5}\\n'); holds_run(d)
    True
    """
    folder = Path(folder)
    if trainer_locked(folder) or run_log(folder / "log.jsonl", empty=False):
        return True
    try:
        return is_checkpoint_dir(folder / "ckpt", "forge-ml-train")
    except OSError:
        return False


def trainer_locked(folder) -> bool:
    """Whether ``folder`` has a trainer's lock file (a trainer used it; the lock may be free).

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); lock = RunLock(d); lock.acquire(); lock.release()
    >>> trainer_locked(d), trainer_locked(tempfile.mkdtemp())
    (True, False)
    """
    return bool(_LOCK_LINE.match(_holder(Path(folder) / LOCK_NAME)))


def running_trainer(folder) -> str | None:
    """Who holds ``folder``'s trainer lock now (``RunLock``'s): the holder's line from its lock
    file, ``"holder unknown"`` where that file is gone, or None while no trainer holds it.
    Both flocks are probed, the folder's own and the lock file's: a user who deleted the lock
    file under a running trainer leaves the folder's (and a filesystem that cannot lock a
    folder, as NFS, leaves the file's). Creates and writes nothing. None where ``fcntl`` is
    missing (Windows: RunLock locks nothing there either).

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); a = RunLock(d); a.acquire(); os.unlink(os.path.join(d, LOCK_NAME))
    >>> running_trainer(d)
    'holder unknown'
    >>> a.release(); print(running_trainer(d))
    None
    """
    try:
        import fcntl
    except ImportError:
        return None
    folder = Path(folder)

    def held(path) -> bool:
        try:   # O_NONBLOCK: a FIFO of that name does not hang the probe
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:        # gone, or not ours to open: no trainer's lock to see there
            return False
        try:
            # shared: it conflicts with a trainer's exclusive flock (and wants only a
            # descriptor open for reading, also where NFS turns flock into a byte-range lock)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:   # EBADF etc.: a filesystem that cannot tell (the other probe may)
            return e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
        finally:
            os.close(fd)       # closing drops the probe's own flock, if it got one
        return False

    if not (held(folder) or held(folder / LOCK_NAME)):
        return None
    return _holder(folder / LOCK_NAME) or "holder unknown"


def _holder(path) -> str:
    """The holder's line from the lock file ``path`` ("pid N on HOST since TIME"), or ""."""
    try:
        with open(path, "rb") as f:
            line = f.read(400).decode("utf-8", "replace")
    except OSError:
        return ""
    return (line.strip().splitlines() or [""])[0]


def run_log(path, empty: bool = True) -> bool:
    """Whether the file ``path`` is a run's log: its first line a record with an integer step,
    or a step's record a kill or a full disk cut short (an empty file too, with ``empty``: a
    run stopped before its first record). Another file of that name is a user's, which no
    trainer may count as a run's (nor remove).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "a").write_text('{"event": "deploy"}\\n'); _ = (d / "b").write_text('{"step": 0}\\n')
    >>> run_log(d / "a"), run_log(d / "b"), run_log(d / "c")
    (False, True, False)
    """
    try:
        with open(path, "rb") as f:
            line = f.readline(4096)
        if not line.strip():
            return empty and not line
        if line.startswith(b'{"step": ') and not line.endswith(b"\n"):
            return True                       # torn: a record's beginning, no end
        first = json.loads(line.decode("utf-8", "replace"))
        return isinstance(first, dict) and isinstance(first.get("step"), int) \
            and not isinstance(first.get("step"), bool)
    except (OSError, ValueError):
        return False


class RunLock:
    """An exclusive lock on a run folder: ``<folder>/train.lock``, held with ``flock`` while a
    trainer uses the folder, and holding the holder's pid, host and start time. The kernel
    drops a flock when its process dies, so a crashed trainer's lock is never stale; the file
    itself stays. The folder itself is flocked too: a user who deletes the lock file (it looks
    stale once a run has ended) does not let a second trainer into a running folder (where the
    filesystem cannot lock a folder, as NFS, the lock file alone). So ``flock RUN cmd`` around
    a trainer of RUN refuses it: wrap it with a lock on another path. Where ``fcntl`` is
    missing (Windows) it locks nothing.

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); a = RunLock(d); a.acquire()
    >>> RunLock(d).acquire()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forge_ml.runs.RunError: ... is in use by another trainer (pid ...); ...
    >>> a.release(); RunLock(d).acquire()
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._f = None
        self._dir_fd = None   # the folder's own descriptor, flocked while the lock is held
        self._made = []  # what acquire() created: the folder (and its parents), the lock file

    @property
    def held(self) -> bool:
        """Whether this lock holds its folder now.

        >>> import tempfile
        >>> lock = RunLock(tempfile.mkdtemp()); lock.acquire(); lock.held
        True
        >>> lock.release(); lock.held
        False
        """
        return self._f is not None

    def acquire(self) -> None:
        """Take the lock: make the folder (and its parents) if missing, flock it and the lock
        file, and write the holder's line there; a RunError where another trainer holds it or
        the folder cannot be used. Taking a lock already held does nothing.

        >>> import tempfile
        >>> d = tempfile.mkdtemp(); lock = RunLock(d); lock.acquire(); lock.acquire()
        >>> open(lock.path).read().startswith(f"pid {os.getpid()} on ")
        True
        >>> lock.release()
        """
        if self._f is not None:
            return
        try:
            missing = [p for p in (self.folder, *self.folder.parents) if not p.exists()]
            self.folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            what = (f"is a link to {os.readlink(self.folder)}, which does not exist" if self.folder.is_symlink()
                    and not self.folder.exists() else "exists and is not a folder")
            raise RunError(f"{self.folder} {what}; expected a run folder (or a new path) for --out") from None
        except OSError as e:
            raise RunError(cannot_write(self.folder, e)) from None
        self._made = missing
        try:
            import fcntl
        except ImportError:  # no flock on this platform
            return
        try:
            dir_fd = os.open(self.folder, os.O_RDONLY)
        except OSError:      # a folder this user may write but not list: the lock file alone
            self._lock_file()
            return
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(dir_fd)
            dir_fd = None
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                # a filesystem that cannot lock a folder opened for reading (NFS turns flock
                # into a byte-range lock, which wants a descriptor open for writing: EBADF):
                # the lock file alone guards the folder there, as it did before
                self._lock_file()
                return
            raise self._in_use() from None
        self._dir_fd = dir_fd
        try:
            self._lock_file()
        except BaseException:
            self._drop_dir_lock()
            raise

    def _drop_dir_lock(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)     # closing the descriptor drops the flock
            self._dir_fd = None

    def _in_use(self) -> RunError:
        """The error for a folder another trainer holds, naming the holder its lock file names."""
        holder = _holder(self.path)
        mine = holder.startswith(f"pid {os.getpid()} ")
        return RunError(f"{self.folder} is in use by another trainer ({holder or 'holder unknown'}); "
                        + ("it is a Trainer of this process: close() it, or make Trainers with "
                           "`with Trainer(...) as t:`" if mine else
                           "wait for it to finish, stop it, or choose another --out"))

    def _lock_file(self) -> None:
        """The lock file's flock, and the holder's line written into it."""
        if not self.path.exists():
            self._made.insert(0, self.path)
        try:
            fd = flock_file(self.path)
        except OSError as e:     # the open names the file; flock itself does not
            raise RunError(cannot_write(self.path, e) if e.filename else
                           f"cannot lock {self.path}: {e.strerror or e}") from None
        if fd is None:
            raise self._in_use()
        f = os.fdopen(fd, "r+", encoding="utf-8")
        try:
            was = f.read(400)
        except (OSError, ValueError):   # not text: not a lock line either
            was = "?"
        # a user's file of that name, in a folder that holds no run (a run's own lock file,
        # zero-filled by a power loss, is the run's: it is rewritten)
        # (a run's log, torn or not, or its checkpoint: looser than holds_run; a user's
        # log.jsonl beside a user's train.lock is no run, and the lock file is not rewritten)
        run_here = (run_log(self.folder / "log.jsonl")
                    or (self.folder / "ckpt").exists()
                    or interrupted_swap(self.folder / "ckpt") is not None)
        if was.strip("\x00 \n\t") and not _LOCK_LINE.match(was) and not run_here:
            f.close()
            self.release(undo=True)
            raise RunError(f"{self.path} is not a lock file that forge-ml wrote (it begins {was[:40]!r}), and a "
                           f"trainer keeps its lock there; move it away or choose another --out")
        try:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            f.flush()
        except OSError as e:
            try:
                f.close()  # flushes again, and fails again: the cause is ``e``
            except OSError:
                pass
            self.release(undo=True)  # the lock file and the folders made for it
            raise RunError(cannot_write(self.path, e)) from None
        self._f = f

    def __del__(self):
        # a Trainer dropped without close() (a notebook cell run again) lets the folder go
        # when it is collected: the folder's descriptor is a raw one, not a file object
        try:
            self.release()
        except Exception:
            pass

    def release(self, undo: bool = False) -> None:
        """Drop the lock. ``undo``: also remove the lock file and the folders that
        ``acquire`` created, when nothing else was written there (a run that failed its
        checks leaves no trace).

        >>> import tempfile
        >>> d = os.path.join(tempfile.mkdtemp(), "run"); lock = RunLock(d); lock.acquire()
        >>> lock.release(undo=True); lock.held, os.path.exists(d)
        (False, False)
        """
        if undo and self._made:
            for p in self._made:  # the lock file first (still held), then the folders, innermost first
                try:
                    p.unlink() if p == self.path else p.rmdir()
                except OSError:
                    break
            self._made = []
        if self._f is not None:
            self._f.close()  # closing the descriptor drops the flock
            self._f = None
        self._drop_dir_lock()
