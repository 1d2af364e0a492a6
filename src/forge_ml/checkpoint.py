"""Checkpoints: one directory holding ``model.safetensors`` and ``state.json``.

``model.safetensors`` holds every tensor of the run under one flat namespace:

- model parameters under their forge-ml names (``wte.weight``, ``h.0.attn.c_attn.weight``, ...),
- AdamW's first moments under ``opt.m.<name>`` and second moments under ``opt.v.<name>``
  (``OPT_M_PREFIX`` / ``OPT_V_PREFIX``; ``pack_tensors`` / ``unpack_tensors`` build and split
  such a dict).

``state.json`` is ``{"format": "forge-ml-checkpoint", "format_version": 1, "model_file":
{"name", "bytes", "sha256", "tensors"}, "meta": {...}}``, where ``meta`` is whatever the caller
saved (config, step, optimizer hyper-parameters, data loader state, RNG state, tokenizer dict)
and comes back unchanged from ``load_checkpoint``.

Saving is crash-safe: both files are written and fsynced into ``<dir>.tmp`` next to the
target, then the old checkpoint is renamed to ``<dir>.old``, the new one renamed to ``<dir>``,
and the old one renamed to ``<dir>.tmp`` and deleted (a crash midway through that deletion
leaves scratch that the next save removes). A crash at any point leaves either the previous checkpoint or the
new one complete; if it struck between the two renames, ``load_checkpoint`` (and the next
``save_checkpoint``) picks up ``<dir>.old``. ``<dir>.tmp`` and ``<dir>.old`` are forge-ml's
only while the marker ``.<dir>.swap`` says a write is underway (from before ``<dir>.tmp`` is
made until the old copy is gone): a user's folder of either name is refused, never deleted
or loaded. A save replaces only a checkpoint: a folder
that holds anything else (a run folder, a user's notes) is refused before anything is
written, and a full disk or read-only filesystem is a one-line CheckpointError that keeps
the previous checkpoint.

>>> import tempfile, os, numpy as np
>>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> save_checkpoint(d, {"w": np.ones((2, 3), np.float32)}, {"step": 7})
>>> t, meta = load_checkpoint(d)
>>> t["w"].shape, meta["step"]
((2, 3), 7)
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path

import numpy as np

from .errors import CheckpointError

FORMAT_NAME = "forge-ml-checkpoint"
FORMAT_VERSION = 1
KNOWN_VERSIONS = (1,)
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.json"
OPT_M_PREFIX = "opt.m."
OPT_V_PREFIX = "opt.v."
CHECKPOINT_FILES = frozenset({MODEL_FILE, STATE_FILE})

_ALLOWED_KINDS = "fiub"  # float, signed int, unsigned int, bool: what safetensors stores


# ---------------------------------------------------------------------------------------------
# Safe targets and atomic directory replacement (also used by hf.save_hf_gpt2)


def user_umask() -> int:
    """The process's file-creation mask (read by setting it and putting it back): the mode
    a file written through a temporary name gets is ``0o666 & ~user_umask()``.

    >>> old = os.umask(0o027)
    >>> oct(user_umask()), oct(os.umask(old))     # read, and left as it was
    ('0o27', '0o27')
    """
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def safe_target(path, error=None) -> Path:
    """``path`` as a Path, after checking that writing a new file there and renaming it over
    ``path`` replaces nothing but a regular file: a device, a FIFO, a socket or a directory
    raises ``error`` (a ForgeError subclass, CheckpointError by default). A writer that
    renames a temporary file into place would otherwise swap a device node such as
    ``/dev/full`` for a regular file. A missing path is fine.

    >>> import tempfile, os
    >>> safe_target(os.path.join(tempfile.mkdtemp(), "new.bin")).name
    'new.bin'
    >>> safe_target("/dev/null")
    Traceback (most recent call last):
    ...
    forge_ml.errors.CheckpointError: /dev/null is a character device, not a regular file; refusing to replace it (write to a file path instead)
    """
    error = CheckpointError if error is None else error
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    except OSError as e:
        raise error(f"cannot write {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path} is {_file_kind(st.st_mode)}, not a regular file; refusing to replace it "
                    f"(write to a file path instead)")
    return path


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def write_safetensors(path, arrays: dict, metadata: dict) -> None:
    """``safetensors.numpy.save_file``, with a write failure raised as the OSError it is
    (safetensors wraps ENOSPC and friends in its own SafetensorError).

    >>> import tempfile
    >>> d = tempfile.mkdtemp(); p = os.path.join(d, "w.safetensors")
    >>> write_safetensors(p, {"w": np.arange(3, dtype=np.float32)}, {"step": "1"})
    >>> from safetensors.numpy import load_file; load_file(p)["w"].tolist()
    [0.0, 1.0, 2.0]
    >>> write_safetensors(os.path.join(d, "no", "w.safetensors"), {}, {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: [Errno 2] No such file or directory: '...w.safetensors'
    """
    from safetensors.numpy import save_file

    try:
        save_file(arrays, str(path), metadata=metadata)
        _sort_metadata(path)
        os.chmod(path, 0o666 & ~user_umask())  # save_file makes a 0600 file: the user's umask
    except OSError:
        raise
    except Exception as e:
        m = re.search(r"os error (\d+)", str(e))
        if m:
            code = int(m.group(1))
            raise OSError(code, os.strerror(code), str(path)) from None
        raise CheckpointError(f"{path}: cannot write safetensors: {e}") from None


def _sort_metadata(path) -> None:
    """Put the header's ``__metadata__`` keys in sorted order, in place (the same bytes long).
    safetensors writes them in the order of a Rust hash map, which changes from one save to the
    next, so that equal tensors made files that differ.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "a.safetensors")
    >>> write_safetensors(p, {"w": np.zeros(1, np.float32)}, {"b": "2", "a": "1"})
    >>> b'"__metadata__":{"a":"1","b":"2"}' in open(p, "rb").read()
    True
    """
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        head = f.read(n)
        meta = dict(json.loads(head, object_pairs_hook=list)).get("__metadata__")
        if not meta or len(meta) < 2:
            return
        key = b'"__metadata__":'
        was = key + json.dumps(dict(meta), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        now = key + json.dumps(dict(sorted(meta)), separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        i = head.find(was)
        if was != now and i >= 0 and head.find(was, i + 1) < 0:
            f.seek(8 + i)
            f.write(now)


def _fsync_path(path: Path, directory: bool = False) -> None:
    """Flush a file's (or a directory's entries') data to disk; a no-op where the OS cannot
    open directories (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _side_paths(path: Path) -> tuple[Path, Path]:
    """``(<path>.tmp, <path>.old)``; for a name within 4 bytes of the 255 a name may have,
    hidden names of its hash (a 252-character --out failed with "File name too long" naming
    a ``.old`` path the user never gave)."""
    if len((path.name + ".tmp").encode()) > 255:
        return _hidden_name(path, ".tmp"), _hidden_name(path, ".old")
    return path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")


def _hidden_name(path: Path, suffix: str) -> Path:
    """``.<name><suffix>`` beside ``path`` (hashed where the name would pass 255 bytes)."""
    name = f".{path.name}{suffix}"
    if len(name.encode()) > 255:
        name = f".{hashlib.sha256(path.name.encode()).hexdigest()[:32]}{suffix}"
    return path.with_name(name)


def _swap_marker(path: Path) -> Path:
    """``.<name>.swap`` beside ``path``: there while a write of ``path`` is underway, from
    before its ``<path>.tmp`` is made until its old output is deleted. Only then are
    ``<path>.tmp`` and ``<path>.old`` forge-ml's own scratch: a user's ``cp -r ckpt ckpt.old``
    backup was deleted by the next save as a stale old copy, and loaded when ``ckpt`` was
    missing."""
    return _hidden_name(path, ".swap")


def interrupted_swap(path) -> Path | None:
    """``<path>.old`` where a write of ``path`` died between its two renames (its marker is
    there, ``path`` is not, ``<path>.old`` is a folder): the last complete output, which the
    next write puts back and ``load_checkpoint`` reads; else None.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); os.mkdir(os.path.join(d, "ckpt.old"))
    >>> interrupted_swap(os.path.join(d, "ckpt"))       # a user's folder: no write underway
    >>> _ = open(os.path.join(d, ".ckpt.swap"), "w").close()
    >>> interrupted_swap(os.path.join(d, "ckpt")).name
    'ckpt.old'
    """
    path = Path(path)
    if not path.name:
        return None
    _, old = _side_paths(path)
    if (not os.path.lexists(path) and old.is_dir() and not old.is_symlink()
            and _swap_marker(path).is_file()):
        return old
    return None


def _entries(d: Path) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except OSError:
        return ["?"]


# safetensors writes a file through a temporary one named like this in the same folder (Rust's
# tempfile: ".tmp" and 6 characters); a write killed midway leaves it in ``<dir>.tmp``
_STRAY_TEMP = re.compile(r"\.tmp[A-Za-z0-9_]{6}")


def _only_files(d: Path, files, scratch: bool = False) -> bool:
    """``d`` is a directory holding nothing but regular files named in ``files`` (and, for
    ``scratch``, a write's ``<dir>.tmp``, the temporary files a killed write left there)."""
    if not d.is_dir() or d.is_symlink():
        return False
    for name in _entries(d):
        if not (d / name).is_file() or (d / name).is_symlink():
            return False
        if not (files is not None and name in files or scratch and _STRAY_TEMP.fullmatch(name)):
            return False
    return True


def _listing(names: list, limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def is_own_output(path, files, marker=None) -> bool:
    """Whether ``path`` is an existing folder that a forge-ml writer of ``files`` (a set of
    names) wrote: only those regular files inside, and ``marker(path)`` true when given.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "notes.txt"), "w").write("mine")
    >>> is_own_output(d, {"state.json", "model.safetensors"})
    False
    """
    p = Path(path)
    return _only_files(p, files) and (marker is None or bool(marker(p)))


def _recover(path: Path, files=None, marker=None) -> None:
    """If a save died between its two renames, ``<dir>`` is missing and ``<dir>.old`` is the
    last complete output: put it back (only when it is one of this writer's)."""
    old = interrupted_swap(path)
    if old is not None and is_own_output(old, files, marker):
        os.rename(old, path)


def _discard(old: Path, tmp: Path) -> None:
    """Delete the outdated ``<path>.old`` through the name ``<path>.tmp`` (free by then): a kill
    midway through the deletion leaves a part of it as ``<path>.tmp``, scratch that the next
    write removes, never a ``<path>.old`` that has lost the file that marks it as this
    writer's (every later save refused it as a user's folder)."""
    os.rename(old, tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(tmp: Path, path: Path) -> None:
    """Replace ``path`` by the complete directory ``tmp``: old aside, new in, old deleted.
    ``atomic_directory`` has removed a stale ``<path>.old``."""
    _, old = _side_paths(path)
    had_old = path.exists()
    if had_old:
        st = path.stat()
        # the folder's mode (a setgid bit, a group's write) and group go on to the new one
        with contextlib.suppress(OSError):
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        with contextlib.suppress(OSError):
            os.chown(tmp, -1, st.st_gid)
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if had_old and not path.exists():
            os.rename(old, path)
        raise
    _fsync_path(path.parent, directory=True)
    if had_old:
        _discard(old, tmp)


def _check_deletable(d: Path, path: Path, what: str) -> None:
    """Refuse a folder whose files this process cannot delete (a read-only folder): the swap
    would put the new output in place and then fail to delete the old one, silently leaving
    it as ``<path>.tmp``, where the next write would fail."""
    if d.is_dir() and _entries(d) and not os.access(d, os.W_OK | os.X_OK):
        mode = stat.filemode(d.stat().st_mode)
        raise CheckpointError(
            f"{d} is read-only ({mode}): forge-ml deletes it when it replaces the {what} at "
            f"{path}, which a read-only folder refuses; make it writable (chmod u+w {d}) or "
            f"write to another path; nothing was written")


def _check_replaceable(path: Path, files, marker, what: str) -> None:
    """Refuse, before anything is written, to replace what this writer did not write, or
    what it could not delete once replaced."""
    tmp, old = _side_paths(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise CheckpointError(f"{path} exists and is not a directory; expected a {what} directory "
                                  f"(or a new path)")
        names = _entries(path)
        if names and not is_own_output(path, files, marker):
            raise CheckpointError(
                f"{path} is not empty and is not a {what} that forge-ml wrote (it holds "
                f"{_listing(names)}); refusing to replace it: write into a new or empty folder")
        if not names and not os.access(path, os.W_OK | os.X_OK):
            # (the swap would put a new, writable folder in its place: its mode lost)
            mode = stat.filemode(path.stat().st_mode)
            raise CheckpointError(f"{path} is read-only ({mode}); make it writable (chmod u+w "
                                  f"{path}) or write to another path; nothing was written")
        _check_deletable(path, path, what)
    swapping = _swap_marker(path).is_file()
    for side, complete in ((tmp, False), (old, True)):
        if side.exists() or side.is_symlink():
            names = _entries(side) if side.is_dir() else ["?"]
            ours = _only_files(side, files, scratch=not complete) and (
                not complete or marker is None or marker(side))
            if not swapping and (names or not side.is_dir() or side.is_symlink()):
                raise CheckpointError(
                    f"{side} is in the way: forge-ml keeps the {what} it writes to {path.name} "
                    f"there while swapping it in, and it is not one forge-ml left (no write of "
                    f"{path.name} was underway); move it away or rename it")
            if names and not ours:
                raise CheckpointError(
                    f"{side} is in the way: forge-ml keeps the {what} it writes to {path.name} "
                    f"there while swapping it in, but it holds {_listing(names)}, which forge-ml "
                    f"did not write; move it away")
            _check_deletable(side, path, what)


def check_checkpoint_target(path, kind: str | None = None) -> None:
    """Raise the CheckpointError that ``save_checkpoint(path, ...)`` would raise for the place
    itself (a file or a user's folder at ``path``, or in the way at ``<path>.tmp`` or
    ``<path>.old``; with ``kind``, also a checkpoint of another kind), without writing
    anything: a trainer asks before its first step, not after training to its first
    checkpoint.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); _ = open(os.path.join(d, "ckpt"), "w").write("mine")
    >>> check_checkpoint_target(os.path.join(d, "ckpt"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forge_ml.errors.CheckpointError: ...ckpt exists and is not a directory; expected a checkpoint directory (or a new path)
    """
    path = Path(os.path.abspath(path))
    if path.is_symlink() and path.is_dir():
        path = Path(os.path.realpath(path))
    _check_replaceable(path, CHECKPOINT_FILES, lambda p: is_checkpoint_dir(p, kind), "checkpoint")


def _write_error(path: Path, e: OSError) -> CheckpointError:
    """The one-line error of a write of ``path`` that failed with ``e``."""
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
    kept = f"{path} is unchanged" if path.is_dir() else "nothing was written"
    return CheckpointError(f"cannot write {path}: {e.strerror or e}{where}; {kept}")


def flock_file(path: Path, mode: int = 0o666, follow: bool = True):
    """A descriptor of the file at ``path`` (made with ``mode`` if missing) that holds its
    exclusive flock, or None while another holds it. The file locked is the one at ``path``
    when this returns (a holder that removes its lock file on release leaves the next locker
    an unlinked one: it opens the path again). ``follow=False`` opens no link. Other failures
    (of the open, or of flock itself) raise their OSError; POSIX only (fcntl).

    >>> import tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "a.lock"); fd = flock_file(p)
    >>> flock_file(p) is None          # held: another descriptor does not get it
    True
    >>> os.close(fd); fd = flock_file(p); fd is not None
    True
    >>> os.close(fd)
    """
    import fcntl
    flags = os.O_RDWR | os.O_CREAT | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
    while True:
        fd = os.open(path, flags, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return None
            raise
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


WRITE_LOCK_WAIT = 120.0
"""Seconds a writer waits for another process writing the same folder before it gives up."""


@contextlib.contextmanager
def _write_lock(path: Path, what: str):
    """An exclusive lock on writing ``path``, held through ``.<name>.lock`` beside it (flock,
    dropped by the kernel when its process dies; the file is removed on release): two writers
    of one folder (two ``convert --force`` to one ``--out``) took turns with each other's
    ``<path>.tmp``, and could leave the folder empty. The second waits for the first, up to
    ``WRITE_LOCK_WAIT`` seconds. Where ``fcntl`` is missing (Windows) it locks nothing."""
    try:
        import fcntl  # noqa: F401 (flock_file's)
    except ImportError:
        yield
        return
    lock = _hidden_name(path, ".lock")   # (hashed for a folder name near the limit)
    deadline = time.monotonic() + WRITE_LOCK_WAIT
    # follow=False: a link planted at the lock's name is not followed (it made its target)
    while (fd := flock_file(lock, 0o644, follow=False)) is None:
        if time.monotonic() > deadline:
            raise CheckpointError(f"cannot write {path}: another forge-ml process has been writing "
                                  f"that {what} for {WRITE_LOCK_WAIT:.0f} s (its lock: {lock})")
        time.sleep(0.05)
    try:
        yield
    finally:
        try:
            os.unlink(lock)
        except OSError:
            pass
        os.close(fd)


def _refuse_mount(path: Path, out, what: str) -> None:
    """A mount point (an empty Docker volume, a mounted disk) cannot be renamed aside, as the
    swap needs: say so before any work, not as "Device or resource busy" after it."""
    if path.is_dir() and os.path.ismount(path):
        raise CheckpointError(f"cannot write {out}: it is a mount point, and forge-ml swaps the "
                              f"{what} in as a whole folder (a rename that a mount point refuses); "
                              f"give a folder inside it, e.g. {os.path.join(str(out), 'model')}")


@contextlib.contextmanager
def atomic_directory(path, files=None, marker=None, what: str = "folder", replace: bool = True):
    """Yield an empty temporary directory next to ``path``; when the block ends normally it
    replaces ``path`` as a whole (see the module docstring), and when it raises, ``path`` is
    left as it was and the temporary directory is removed.

    ``path`` may be new, an empty folder, or a folder this writer wrote before: nothing but
    regular files named in ``files``, and ``marker(path)`` true when a marker is given; a
    link to such a folder replaces the folder it links to (the link stays).
    Anything else raises a CheckpointError before anything is written. An OSError (a full
    disk, a read-only filesystem, a permission) becomes a one-line CheckpointError that names
    the file and the cause; ``path`` is then unchanged. ``replace=False``: ``path`` must still
    be new or empty when the swap's lock is taken (a command without ``--force`` that found it
    so: another process may have written it since).

    >>> import tempfile, os
    >>> d = os.path.join(tempfile.mkdtemp(), "out")
    >>> with atomic_directory(d, files={"a.txt"}) as tmp:
    ...     _ = (tmp / "a.txt").write_text("x")
    >>> sorted(os.listdir(d))
    ['a.txt']
    >>> _ = open(os.path.join(d, "notes.txt"), "w").write("mine")
    >>> with atomic_directory(d, files={"a.txt"}) as tmp:
    ...     pass  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forge_ml.errors.CheckpointError: ... is not empty and is not a folder that forge-ml wrote (it holds a.txt, notes.txt); ...
    """
    path = Path(os.path.abspath(path))  # "." and ".." have no name to put a suffix on
    if path.is_symlink() and path.is_dir():
        path = Path(os.path.realpath(path))  # moved elsewhere (another disk) and linked back: replaced there
    if not path.name:
        raise CheckpointError(f"cannot write {path}: expected a path to a folder, not the filesystem root")
    if is_inside(os.getcwd(), path):
        # the swap renames the folder aside: this process's current folder would be gone
        raise CheckpointError(f"refusing to write {path}: it is or holds the current folder; "
                              f"write into a new or empty folder")
    files = None if files is None else frozenset(files)
    _refuse_mount(path, path, what)
    tmp, old = _side_paths(path)
    made = False
    try:
        # (where the parent is new, nothing is at the path or beside it: the check below
        # refuses nothing that this mkdir made)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            # a file where a folder of the path should be: name it ("File exists" said nothing)
            above = next((p for p in path.parents if os.path.lexists(p) and not p.is_dir()), None)
            if above is None:
                raise
            raise CheckpointError(f"cannot write {path}: {above} is a file, not a folder; "
                                  f"give a path through folders") from None
        with _write_lock(path, what):
            # under the lock: no other writer is midway through a swap at this path, and the
            # scratch removed on failure is this writer's own
            try:
                _check_replaceable(path, files, marker, what)
                if not replace and ((path.is_dir() and _entries(path))
                                    or (not path.exists() and old.is_dir())):
                    # checked new or empty before the work (check_output_dir); another writer
                    # finished into it meanwhile: theirs stays, as it would have without the race
                    raise CheckpointError(f"{path} now holds a {what} another process wrote while "
                                          f"this one worked; add --force to replace it")
                _recover(path, files, marker)
                if tmp.exists():
                    shutil.rmtree(tmp)  # left by a save that crashed before its swap (checked: ours)
                if os.path.lexists(old):
                    _discard(old, tmp)  # stale: ``path`` exists (``_recover`` ran), so ``old`` is outdated
                swap = _swap_marker(path)
                swap.touch()            # from here to the end, <path>.tmp and .old are this write's
                _fsync_path(path.parent, directory=True)
                tmp.mkdir()
                made = True
                yield tmp
                for f in tmp.iterdir():
                    _fsync_path(f)
                _fsync_path(tmp, directory=True)
                _swap_in(tmp, path)
                swap.unlink()
            except BaseException:
                if made:
                    shutil.rmtree(tmp, ignore_errors=True)
                if not os.path.lexists(tmp) and not os.path.lexists(old):
                    with contextlib.suppress(OSError):
                        _swap_marker(path).unlink()
                raise
    except OSError as e:
        raise _write_error(path, e) from None


def is_inside(path, folder) -> bool:
    """Whether ``path`` is ``folder`` or inside it, ``~``, links and relative parts resolved.

    >>> is_inside("runs/a/./ckpt", "runs/a/"), is_inside("runs/ab", "runs/a")
    (True, False)
    """
    p, f = (Path(os.path.realpath(os.path.expanduser(str(x)))) for x in (path, folder))
    return p == f or f in p.parents


def check_output_dir(out, reads=(), is_own=None, force: bool = False, what: str = "output",
                     within=()) -> Path:
    """The rule of every command that writes a folder, checked before any work: ``out`` may be
    new or an empty folder; a folder that ``is_own`` recognises as this command's earlier
    ``what`` is replaced only with ``force``; anything else, and the folder the command reads
    from (``reads``), a folder holding it, a folder inside one of ``within`` (the model
    folders it reads: a folder of someone else's inside one makes their next save refuse it),
    or one holding the current folder, is refused with a one-line CheckpointError. Returns
    ``out`` as an absolute Path.

    >>> import tempfile, os
    >>> run = tempfile.mkdtemp(); _ = open(os.path.join(run, "log.jsonl"), "w").write("{}")
    >>> check_output_dir(os.path.join(run, "hf")).name
    'hf'
    >>> check_output_dir(run)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    forge_ml.errors.CheckpointError: ... is not empty (it holds log.jsonl); write into a new or empty folder
    """
    path = Path(os.path.abspath(out))
    real = Path(os.path.realpath(path))
    for src in reads:
        if is_inside(src, real):
            rel = (f"is {src}, the folder this command reads from" if Path(os.path.realpath(src)) == real
                   else f"holds {src}, which this command reads from")
            raise CheckpointError(f"refusing to write {out}: it {rel}; write into a new or empty folder")
    for src in within:
        if is_inside(real, src):
            raise CheckpointError(f"refusing to write {out}: it is inside {src}, the model folder this "
                                  f"command reads from; write into a new or empty folder elsewhere")
    if is_inside(os.getcwd(), real):
        raise CheckpointError(f"refusing to write {out}: it is or holds the current folder; "
                              f"write into a new or empty folder")
    _refuse_mount(real, out, what)   # (a link to a mount point: the swap would meet it resolved)
    old = interrupted_swap(path)
    if old is not None:
        # a save that died between its two renames: <out>.old is what <out> holds, and the
        # next write puts it back first (a run's checkpoint or kept model was replaced so)
        path = old
    if path.exists() or path.is_symlink():
        if path.is_symlink() and not path.exists():
            raise CheckpointError(f"{out} is a link to nothing ({os.readlink(path)}); expected a new "
                                  f"or empty folder (remove the link, or make its target)")
        if not path.is_dir():
            raise CheckpointError(f"{out} exists and is not a folder; expected a new or empty folder")
        names = _entries(path)
        if names:
            if is_own is not None and is_own(path):
                if not force:
                    raise CheckpointError(f"{out} holds an earlier {what}; add --force to replace it")
            else:
                why = ""
                if force and is_own is not None:
                    why = (f"; --force replaces only an earlier {what}: a folder of its files alone (a "
                           f"file of yours beside them keeps it)")
                    if path.is_symlink() and is_own(path.resolve()):   # the link would go, not its folder
                        why = (f"; it is a symbolic link (to {os.readlink(path)}), and --force replaces "
                               f"a folder only where it is: give the folder itself")
                    elif is_checkpoint_dir(path):   # of another kind: a run's, say
                        why = (f"; it is {_kind_said(path)}, not an earlier {what}, and --force "
                               f"replaces only that")
                raise CheckpointError(f"{out} is not empty (it holds {_listing(names)}); write into a "
                                      f"new or empty folder{why}")
    return Path(os.path.abspath(out))


def sha256_file(path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks.

    >>> import tempfile; p = tempfile.mktemp(); _ = open(p, "wb").write(b"abc")
    >>> sha256_file(p)[:16]
    'ba7816bf8f01cfea'
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Tensor naming


def pack_tensors(params: dict, m: dict | None = None, v: dict | None = None) -> dict:
    """One flat dict: params by name, AdamW moments under ``opt.m.<name>`` / ``opt.v.<name>``.

    >>> sorted(pack_tensors({"w": 1}, {"w": 2}, {"w": 3}))
    ['opt.m.w', 'opt.v.w', 'w']
    """
    out = dict(params)
    for prefix, moments in ((OPT_M_PREFIX, m), (OPT_V_PREFIX, v)):
        for name, a in (moments or {}).items():
            out[prefix + name] = a
    return out


def unpack_tensors(tensors: dict) -> tuple[dict, dict, dict]:
    """Inverse of ``pack_tensors``: ``(params, m, v)``.

    >>> unpack_tensors({"w": 1, "opt.m.w": 2, "opt.v.w": 3})
    ({'w': 1}, {'w': 2}, {'w': 3})
    """
    params, m, v = {}, {}, {}
    for name, a in tensors.items():
        if name.startswith(OPT_M_PREFIX):
            m[name[len(OPT_M_PREFIX):]] = a
        elif name.startswith(OPT_V_PREFIX):
            v[name[len(OPT_V_PREFIX):]] = a
        else:
            params[name] = a
    return params, m, v


# ---------------------------------------------------------------------------------------------
# Save / load


def is_path(v) -> bool:
    """Whether ``v`` can name a folder: a str or os.PathLike, not empty or blank (None, a
    number or '' met Python's TypeError or the current folder further in).

    >>> is_path("runs/a"), is_path(Path("ckpt")), is_path(""), is_path(None)
    (True, True, False, False)
    """
    return isinstance(v, (str, os.PathLike)) and bool(str(v).strip())


def _check_path(op: str, dir) -> None:
    """A folder path (``is_path``), else a CheckpointError naming ``op``."""
    if not is_path(dir):
        raise CheckpointError(f"{op}: the checkpoint folder must be a path (str or Path), got "
                              f"{type(dir).__name__} {dir!r:.40}")


def _check_tensors(tensors: dict) -> dict:
    if not isinstance(tensors, dict):
        raise CheckpointError(f"save_checkpoint: tensors must be a dict name -> np.ndarray, got {type(tensors).__name__}")
    out = {}
    for name, a in tensors.items():
        if not isinstance(name, str):
            raise CheckpointError(f"save_checkpoint: tensor names must be str, got {name!r}")
        if name == "__metadata__":   # safetensors' own header key: the file would not load
            raise CheckpointError("save_checkpoint: __metadata__ is safetensors' reserved header "
                                  "name, not a tensor name; rename the tensor")
        if not isinstance(a, np.ndarray):
            raise CheckpointError(
                f"save_checkpoint: {name} is a {type(a).__name__}; expected a NumPy array "
                f"(convert Tensors with .numpy())"
            )
        if a.dtype.kind not in _ALLOWED_KINDS or a.dtype.itemsize > 8:
            # (float128: safetensors' error named the scratch folder <dir>.tmp)
            raise CheckpointError(f"save_checkpoint: {name} has dtype {a.dtype}; expected a float "
                                  f"(16, 32 or 64 bits), int or bool array")
        # np.require keeps a 0-d array 0-d (ascontiguousarray made it (1,), and the model that
        # wrote the checkpoint then refused it)
        out[name] = np.require(a, requirements="C")
    return out


def read_state(dir) -> dict | None:
    """The ``state.json`` of the checkpoint in ``dir`` as a dict (its ``meta`` inside), without
    reading the weights; None where there is none or it does not parse.

    >>> import tempfile, os, numpy as np
    >>> d = os.path.join(tempfile.mkdtemp(), "c")
    >>> save_checkpoint(d, {"w": np.zeros(1, np.float32)}, {"step": 3})
    >>> read_state(d)["meta"]["step"], read_state(os.path.dirname(d))
    (3, None)
    """
    try:
        state = json.loads((Path(dir) / STATE_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def read_meta(dir) -> dict | None:
    """The ``meta`` of the checkpoint in ``dir`` (``read_state``'s), or None where there is no
    checkpoint or its meta is no dict.

    >>> import tempfile, os, numpy as np
    >>> d = os.path.join(tempfile.mkdtemp(), "c")
    >>> save_checkpoint(d, {"w": np.zeros(1, np.float32)}, {"step": 3, "run_id": "r"})
    >>> read_meta(d)["run_id"], read_meta(os.path.dirname(d))
    ('r', None)
    """
    meta = (read_state(dir) or {}).get("meta")
    return meta if isinstance(meta, dict) else None


def _kind_said(path) -> str:
    """A forge-ml checkpoint folder's kind in words (``meta["kind"]``)."""
    kind = (read_meta(path) or {}).get("kind")
    if not isinstance(kind, str):       # a hand-edited state.json: a list is no dict key
        kind = None
    return {"forge-ml-train": "a training run's checkpoint (its optimizer state and data position)",
            "forge-ml-model": "a forge-ml model (from forge-ml convert)"}.get(
                kind, "a forge-ml checkpoint of another kind")


def is_checkpoint_dir(path, kind: str | None = None) -> bool:
    """Whether ``path`` is a folder holding a forge-ml checkpoint's ``state.json`` (and at most
    its ``model.safetensors`` beside it): one that ``save_checkpoint`` may replace. With
    ``kind``, the checkpoint's ``meta["kind"]`` must be that too (``forge-ml convert`` writes
    "forge-ml-model", the trainer "forge-ml-train").

    >>> import tempfile, os, numpy as np
    >>> d = os.path.join(tempfile.mkdtemp(), "c")
    >>> save_checkpoint(d, {"w": np.zeros(1, np.float32)}, {"kind": "forge-ml-train"})
    >>> is_checkpoint_dir(d), is_checkpoint_dir(os.path.dirname(d)), is_checkpoint_dir(d, "forge-ml-model")
    (True, False, False)
    """
    p = Path(path)
    if not _only_files(p, CHECKPOINT_FILES):
        return False
    try:
        with open(p / STATE_FILE, "rb") as f:
            state = json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return False  # an OSError else (a failing disk) is raised: it says nothing of who wrote the folder
    if not isinstance(state, dict) or state.get("format") != FORMAT_NAME:
        return False
    return kind is None or (isinstance(state.get("meta"), dict) and state["meta"].get("kind") == kind)


def save_checkpoint(dir, tensors: dict, meta: dict, replace: bool = True) -> None:
    """Write ``tensors`` (name -> NumPy array) and ``meta`` (JSON-able) as a checkpoint in
    ``dir``, replacing any previous one there atomically.

    ``dir`` must be new, empty, or a checkpoint (``is_checkpoint_dir``): a folder holding
    anything else is never replaced (CheckpointError); with ``replace=False`` not a
    checkpoint either (``forge-ml convert`` without ``--force``). A full disk or a read-only
    filesystem raises a one-line CheckpointError and keeps the previous checkpoint.

    >>> import tempfile, os, numpy as np
    >>> d = os.path.join(tempfile.mkdtemp(), "c")
    >>> save_checkpoint(d, {"w": np.zeros(3, np.float32)}, {"config": {"n_layer": 2}})
    >>> sorted(os.listdir(d))
    ['model.safetensors', 'state.json']
    """
    _check_path("save_checkpoint", dir)
    arrays = _check_tensors(tensors)
    if not isinstance(meta, dict):
        raise CheckpointError(f"save_checkpoint: meta must be a dict, got {type(meta).__name__}")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save_checkpoint: meta is not JSON-able: {e}") from None

    with atomic_directory(dir, CHECKPOINT_FILES, is_checkpoint_dir, "checkpoint", replace) as tmp:
        model_path = tmp / MODEL_FILE
        write_safetensors(model_path, arrays, {"format": "np", "forge_ml_format_version": str(FORMAT_VERSION)})
        state = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "model_file": {
                "name": MODEL_FILE,
                "bytes": model_path.stat().st_size,
                "sha256": sha256_file(model_path),
                "tensors": len(arrays),
            },
            "meta": meta,
        }
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")


def _resolve_dir(dir) -> Path:
    _check_path("load_checkpoint", dir)
    path = Path(os.path.realpath(dir)) if Path(dir).is_symlink() else Path(dir)
    if path.is_dir():
        return path
    old = interrupted_swap(path)
    if old is not None and (old / STATE_FILE).is_file():
        return old  # a save died between its renames; this is the last complete checkpoint
    if path.exists():
        raise CheckpointError(f"checkpoint {path} is not a directory")
    raise CheckpointError(f"checkpoint not found: {path} does not exist")


def _require(d: dict, key: str, where: Path):
    if not isinstance(d, dict) or key not in d:
        raise CheckpointError(f"{where}: missing key {key!r}; the file is damaged or not a forge-ml checkpoint")
    return d[key]


def load_checkpoint(dir) -> tuple[dict, dict]:
    """Read and verify a checkpoint; returns ``(tensors, meta)``.

    Every problem (missing file, bad JSON, unknown format version, truncated or altered
    ``model.safetensors``) raises a CheckpointError naming the file.

    >>> import tempfile, os, numpy as np
    >>> d = os.path.join(tempfile.mkdtemp(), "c")
    >>> save_checkpoint(d, {"opt.m.w": np.ones(2, np.float32)}, {"step": 3})
    >>> t, meta = load_checkpoint(d); list(t), meta
    (['opt.m.w'], {'step': 3})
    """
    for attempt in range(3):
        path = _resolve_dir(dir)
        before = _inode(path)
        try:
            got = _load_once(path)
        except CheckpointError:
            if attempt == 2 or _inode(path) == before:
                raise
            continue   # a trainer swapped a new checkpoint in while this read: read that one
        if _inode(path) == before:
            return got
    return got


def _inode(path: Path):
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _load_once(path: Path) -> tuple[dict, dict]:
    """``load_checkpoint`` of the folder ``path``, read once (a concurrent save can swap the
    folder between the reads of its two files: the caller compares the folder before and
    after)."""
    from safetensors.numpy import load_file

    state_path = path / STATE_FILE
    model_path = path / MODEL_FILE
    if not state_path.is_file():
        raise CheckpointError(f"{state_path} is missing; expected {STATE_FILE} and {MODEL_FILE} in {path}")
    try:
        with open(state_path, "rb") as f:
            state = json.loads(f.read().decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{state_path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{state_path}: not UTF-8 text ({e.reason} at byte {e.start}); the file is corrupted") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{state_path}: bad JSON at line {e.lineno} column {e.colno} ({e.msg}); "
            f"the file is truncated or corrupted"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_path}: expected a JSON object, got {type(state).__name__}")
    fmt = _require(state, "format", state_path)
    if fmt != FORMAT_NAME:
        raise CheckpointError(f"{state_path}: expected format {FORMAT_NAME!r}, got {fmt!r}")
    version = _require(state, "format_version", state_path)
    if version not in KNOWN_VERSIONS:
        raise CheckpointError(
            f"{state_path}: format version {version!r} is unknown; this forge-ml reads versions "
            f"{list(KNOWN_VERSIONS)} (a newer forge-ml wrote it?)"
        )
    info = _require(state, "model_file", state_path)
    want_bytes = _require(info, "bytes", state_path)
    want_sha = _require(info, "sha256", state_path)
    meta = _require(state, "meta", state_path)
    for key, v, ok, want in (("model_file.bytes", want_bytes, type(want_bytes) is int and want_bytes >= 0,
                              "an int >= 0"),
                             ("model_file.sha256", want_sha, isinstance(want_sha, str), "a hex string"),
                             ("meta", meta, isinstance(meta, dict), "an object")):
        if not ok:
            raise CheckpointError(f"{state_path}: {key} is {v!r:.40}; expected {want}: the file "
                                  f"was altered or damaged")

    if not model_path.is_file():
        raise CheckpointError(f"{model_path} is missing; {state_path} expects it ({want_bytes} bytes)")
    try:
        size = model_path.stat().st_size
        got_sha = sha256_file(model_path) if size == want_bytes else None
    except OSError as e:
        raise CheckpointError(f"{model_path}: cannot read it: {e.strerror or e}") from None
    if size != want_bytes:
        raise CheckpointError(
            f"{model_path}: {size} bytes, but {STATE_FILE} recorded {want_bytes}; the file is "
            f"{'truncated' if size < want_bytes else 'longer than written'}"
        )
    if got_sha != want_sha:
        raise CheckpointError(
            f"{model_path}: sha256 mismatch: file hashes to {got_sha}, {STATE_FILE} recorded {want_sha}; "
            f"the file was altered or corrupted"
        )
    try:
        tensors = load_file(str(model_path))
    except Exception as e:  # safetensors raises its own SafetensorError and OSError/ValueError
        raise CheckpointError(f"{model_path}: cannot read safetensors: {e}") from None
    return tensors, meta


# ---------------------------------------------------------------------------------------------
# Architecture check


def _shape_of(x) -> tuple:
    return tuple(int(d) for d in (x.shape if hasattr(x, "shape") else x))


def check_architecture(expected_shapes: dict, tensors: dict, ignore_prefixes=(OPT_M_PREFIX, OPT_V_PREFIX)) -> None:
    """Raise a CheckpointError listing every missing, unexpected and mis-shaped parameter.

    ``expected_shapes`` maps names to shapes (tuples or arrays); ``tensors`` maps names to
    arrays (or shapes). Names starting with ``ignore_prefixes`` (optimizer moments) are skipped.

    >>> import numpy as np
    >>> check_architecture({"w": (2, 3)}, {"w": np.zeros((2, 3))})
    >>> check_architecture({"w": (2, 3)}, {"w": np.zeros((3, 2))})
    Traceback (most recent call last):
    ...
    forge_ml.errors.CheckpointError: checkpoint does not fit the model: 1 mismatched shape(s): w: checkpoint has (3, 2), model expects (2, 3)
    """
    have = {k: _shape_of(v) for k, v in tensors.items() if not k.startswith(tuple(ignore_prefixes))}
    want = {k: _shape_of(v) for k, v in expected_shapes.items()}
    missing = [k for k in want if k not in have]
    unexpected = [k for k in have if k not in want]
    mismatched = [
        f"{k}: checkpoint has {have[k]}, model expects {want[k]}"
        for k in want if k in have and have[k] != want[k]
    ]
    # weights stored as integers (a hand-made file): a model of them trains nothing
    not_float = [f"{k} ({tensors[k].dtype})" for k in want if k in have and isinstance(tensors[k], np.ndarray)
                 and tensors[k].dtype.kind in "iub"]

    def listing(items, limit=12):
        shown = ", ".join(items[:limit])
        return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")

    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {listing(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} mismatched shape(s): {listing(mismatched, 8)}")
    if not_float:
        problems.append(f"{len(not_float)} not floating point: {listing(not_float, 8)}")
    if problems:
        raise CheckpointError("checkpoint does not fit the model: " + "; ".join(problems))
