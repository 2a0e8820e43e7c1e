"""File I/O with the project's error rules: weights_only loads, atomic writes, one-line errors,
exclusive lock files and renames that never replace."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from kvexport.errors import UserError

_LOCK_ATTEMPTS = 5  # a lock file removed between our open and flock is retried on a fresh one
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1  # <linux/fcntl.h>, <linux/fs.h>

# What a command is writing, to remove when a signal ends it without unwinding its stack
# (kvexport.commands.interrupts: a signal that lands inside torch's tracing cannot be raised there).
_abrupt_cleanups: list[Callable[[], None]] = []


@contextlib.contextmanager
def cleaned_up_on_abrupt_exit(cleanup: Callable[[], None]):
    """Within the block, run_abrupt_cleanups calls `cleanup` (the block's own exit still must)."""
    _abrupt_cleanups.append(cleanup)
    try:
        yield
    finally:
        _abrupt_cleanups.remove(cleanup)


def run_abrupt_cleanups() -> None:
    """Removes what the blocks now open are writing, innermost first."""
    for cleanup in reversed(_abrupt_cleanups):
        with contextlib.suppress(OSError):
            cleanup()


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_tensor_file(path: str | Path, what: str):
    """`torch.load(weights_only=True)`: a file needing pickle code execution is refused, not run."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise UserError(f"{what} {path} does not exist") from exc
    except IsADirectoryError as exc:
        raise UserError(f"{what} {path} is a directory") from exc
    except pickle.UnpicklingError as exc:
        raise UserError(f"{what} {path} is refused: it is not a plain tensor file (weights_only load failed)") from exc
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UserError(f"{what} {path} is unreadable: {first_line(exc)}") from exc


def write_atomically(path: str | Path, write: Callable[[Path], None], what: str) -> None:
    """Calls write(temporary path) next to `path`, then renames it into place; nothing partial remains."""
    path = Path(path)
    if not path.resolve().parent.is_dir():
        raise UserError(f"cannot write {what} {path}: its directory does not exist")
    tmp = path.with_name(path.name + ".partial")
    try:
        write(tmp)
        tmp.replace(path)
    except (OSError, RuntimeError) as exc:  # torch.save reports I/O failures as RuntimeError
        reason = getattr(exc, "strerror", None) or first_line(exc)
        raise UserError(f"cannot write {what} {path}: {reason}") from exc
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive_lock(path: Path, holder: str):
    """Holds an exclusive, non-blocking flock on `path` (created if needed) and removes it on exit.

    A lock held by another process is a UserError naming `holder`. The file is unlinked while still
    locked, so a process that opened it just before sees a stale inode and retries on a fresh file
    instead of sharing the lock with a third one.
    """
    for _ in range(_LOCK_ATTEMPTS):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"{holder} (lock {path} is held by another process)") from None
        if _same_file(path, fd):
            break
        os.close(fd)  # the previous holder removed this lock file after we opened it
    else:
        raise UserError(f"{holder} (lock {path} keeps changing)")
    try:
        with cleaned_up_on_abrupt_exit(lambda: Path(path).unlink(missing_ok=True)):
            yield
    finally:
        Path(path).unlink(missing_ok=True)
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def rename_no_replace(source: Path, target: Path) -> None:
    """Renames source to target, failing with FileExistsError if target exists (even an empty directory).

    os.rename silently replaces an empty directory; renameat2(RENAME_NOREPLACE) makes the check
    and the rename one step. Where the kernel or file system lacks it, the check comes first.
    """
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err), str(target))
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    os.rename(source, target)


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (one we may not signal still counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def remove_stale_staging(parent: Path, prefix: str, suffixes: tuple[str, ...] = ("",)) -> list[Path]:
    """Removes `parent/{prefix}{pid}{suffix}` entries whose process is gone (debris of a killed writer)."""
    removed = []
    for path in sorted(parent.glob(glob.escape(prefix) + "*")):
        pid, dot, rest = path.name[len(prefix) :].partition(".")
        if not pid.isdigit() or dot + rest not in suffixes or process_alive(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path)
    return removed
