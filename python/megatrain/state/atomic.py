"""Write a directory atomically: the one way megatrain replaces a checkpoint, an export or a model.

:func:`atomic_directory` is a context manager: the caller writes into a fresh temporary directory
beside the destination; on success it is fsynced and swapped into place with one atomic rename
(``renameat2(RENAME_EXCHANGE)`` on Linux when the destination exists), so a process killed at
any moment leaves the destination holding either the complete old directory or the complete new
one. What it would replace is checked first (:func:`check_replaceable`: new, empty, or what the
caller's ``looks_right`` accepts) and checked again just before the swap.

Concurrent writers to one destination never destroy each other's work: each holds an exclusive
``flock`` on its own temporary directory while it writes, and the clean-up of temporaries left by
killed processes deletes only those whose lock it can take. Short critical sections (clean-up,
creating the temporary, the swap) are serialised by a lock on the parent directory. Two live
writers both finish; the one that swaps last wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import os
import secrets
import shutil
import tempfile
from typing import Callable, Iterator, Optional, Type

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def existing_ancestor(path: str) -> str:
    """The nearest existing path above ``path`` (absolute): where creating ``path`` would start."""
    p = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def write_probe_error(directory: str) -> Optional[OSError]:
    """Why this process cannot create a file in ``directory`` (the ``OSError`` of creating a probe
    file there, removed at once), or None when it can: permission bits say nothing for root,
    read-only mounts or pseudo filesystems (/proc)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return exc
    return None


def check_replaceable(path: str, what: str, looks_right: Optional[Callable[[str], bool]], expected: str,
                      error: Type[ValueError] = ValueError) -> str:
    """Refuse (before anything is written) a destination that a save would destroy by mistake.

    ``path`` may be new, an empty directory, or a directory ``looks_right(path)`` accepts (the
    previous output of the same kind, replaced atomically; None accepts nothing). A file, a
    symlink, a directory holding something else, or a parent that is not a directory raises
    ``error`` (``ValueError`` or a subclass of it, e.g. ``megatrain.CheckpointError``) naming what
    was found and what to do. Returns the absolute path.
    """
    path = os.path.abspath(path)
    p = existing_ancestor(path)
    if not os.path.isdir(p):
        raise error(f"{what}: cannot create {path!r}: {p!r} is a file, not a directory; choose another path")
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise error(f"{what}: {path!r} exists and is not a directory; it would be replaced: "
                             "choose another path or remove it first")
        if os.listdir(path) and not (looks_right is not None and looks_right(path)):
            raise error(f"{what}: {path!r} is not empty and is not {expected}; saving would delete what is "
                             "there: choose a new or empty directory, or remove it first")
    return path


def umask_file_mode(path: str) -> None:
    """Give ``path`` the mode ``open`` gives a new file under the process's umask (0644 under umask 022):
    for files written by libraries that create them 0600 (safetensors' ``save_file``)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def make_temp_dir(parent: str, prefix: str) -> str:
    """Create a new directory ``parent/prefix<random>`` and return its path.

    Unlike ``tempfile.mkdtemp`` (always mode 0700), the directory is made with a plain
    ``os.mkdir(path, 0o777)``: it gets the mode (and default ACLs) the process's umask gives any
    directory (0755 under umask 022), so what is swapped into place is readable by whoever may
    read a directory this process creates.

    Raises:
        OSError: the file system refused (permissions, ENOSPC, ...).
    """
    for _ in range(100):
        path = os.path.join(parent, prefix + secrets.token_hex(6))
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name {prefix}* in {parent}")


def _lock_fd(path: str, blocking: bool) -> Optional[int]:
    """An fd holding an exclusive flock on directory ``path``; None if it is held elsewhere (non-blocking)
    or locks are not supported there (``path`` is then left alone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        return fd
    except OSError:
        os.close(fd)
        return None


@contextlib.contextmanager
def _parent_lock(parent: str, base: str) -> Iterator[None]:
    fd = _lock_fd(parent, blocking=True)
    if fd is None:  # no flock on directories here (some network file systems): a lock file instead
        try:
            fd = os.open(os.path.join(parent, f".{base}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                _fsync(p)
        _fsync(dirpath)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap directories ``a`` and ``b`` (Linux renameat2); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


def _clean_stale(parent: str, base: str, path: str) -> None:
    """Under the parent lock: remove temporaries of killed writers (unlocked), and bring back an old
    directory a killed non-atomic swap left aside (``path`` missing)."""
    for stale in sorted(glob.glob(os.path.join(parent, glob.escape(f".{base}.") + "*-*"))):
        kind = os.path.basename(stale)[len(base) + 2:].split("-", 1)[0]
        if kind not in ("tmp", "old") or not os.path.isdir(stale) or os.path.islink(stale):
            continue
        fd = _lock_fd(stale, blocking=False)
        if fd is None:  # a live writer's, or unlockable: leave it
            continue
        try:
            if kind == "old" and not os.path.lexists(path):
                os.rename(stale, path)
            else:
                shutil.rmtree(stale, ignore_errors=True)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_directory(path: str, what: str, looks_right: Optional[Callable[[str], bool]] = None,
                     expected: str = "an earlier output of the same kind",
                     error: Type[ValueError] = ValueError) -> Iterator[str]:
    """Write directory ``path`` atomically: yields a temporary directory to fill, then swaps it in.

    ``with atomic_directory(out, "megatrain.save_checkpoint", is_ckpt, "a megatrain checkpoint") as tmp:``
    write every file into ``tmp``; on a normal exit the files are fsynced and ``tmp`` replaces
    ``out`` atomically (a kill at any moment leaves the old or the new complete directory at
    ``out``). The directory gets the mode a plain ``mkdir`` gives under the process's umask
    (0755 under umask 022), as do the files written into it with ``open``. On an exception ``tmp`` is removed and ``out`` is untouched.

    Args:
        path: destination: new, an empty directory, or one ``looks_right(path)`` accepts.
        what: the caller's name for error messages (e.g. ``"megatrain.export_pretrained"``).
        looks_right: predicate on an existing non-empty directory: True if it may be replaced.
        expected: what ``looks_right`` accepts, in words (for the error message).
        error: the class raised for a refused destination (``ValueError`` or a subclass).

    Raises:
        ValueError: (``error``) ``path`` is a file, a symlink, or a non-empty directory ``looks_right``
            refuses (checked before anything is written, and again before the swap).
        OSError: the file system refused (permissions, ENOSPC, ...); ``path`` is untouched.
    """
    path = check_replaceable(path, what, looks_right, expected, error)
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    with _parent_lock(parent, base):
        _clean_stale(parent, base, path)
        tmp = make_temp_dir(parent, f".{base}.tmp-")  # the umask's mode, not mkdtemp's 0700
        tmp_fd = _lock_fd(tmp, blocking=False)  # held until the swap: marks tmp as a live writer's
    try:
        yield tmp
        _fsync_tree(tmp)
        with _parent_lock(parent, base):
            check_replaceable(path, what, looks_right, expected, error)  # it may have changed while we wrote
            if os.path.lexists(path) and _exchange(tmp, path):
                _fsync(parent)  # tmp now holds the old directory
            elif os.path.lexists(path):
                old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
                os.rmdir(old)
                os.rename(path, old)
                os.rename(tmp, path)
                _fsync(parent)
                tmp = old
            else:
                os.rename(tmp, path)
                _fsync(parent)
                tmp = None
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if tmp_fd is not None:
            os.close(tmp_fd)
