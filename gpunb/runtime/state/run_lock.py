"""The lock that says a run directory is in use by a live run.

The run that writes checkpoints into a directory holds an exclusive lock on its `.lock`
file for as long as it trains; the operating system drops the lock when the process
ends, however it ends (a SIGKILL or a dead kernel included), so a held lock always
means a live writer. The file also says who holds it, so a refusal can name the run.
POSIX systems use flock (which Linux maps to fcntl locks on NFS); Windows locks the
file's first byte. A forked child (a DataLoader worker) closes its copy of the file at once,
so that the lock goes when the run releases it, not when the last worker exits.
"""

from __future__ import annotations

import json
import os
import socket
import time
import weakref
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt

LOCK_FILE = ".lock"
_HELD: weakref.WeakSet = weakref.WeakSet()  # this process's locks, closed in forked children
_FORK_HOOK = False  # registered at the first lock, not at import


class RunLock:
    """A held lock on one run directory; `release()` (or the process ending) frees it."""

    def __init__(self, directory: Path, handle):
        self.directory, self._handle = directory, handle

    @classmethod
    def acquire(cls, directory: str | os.PathLike, owner: dict) -> RunLock | None:
        """Lock `directory` for this process and record `owner` in it; None when a live run
        holds it already."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        handle = open(directory / LOCK_FILE, "a+")  # noqa: SIM115 - held open while the run lives
        if not _try_lock(handle):
            handle.close()
            return None
        lock = cls(directory, handle)
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps({**owner, "pid": os.getpid(), "host": socket.gethostname(),
                                     "locked_at": time.strftime("%Y-%m-%d %H:%M:%S")}))
            handle.flush()
        except OSError:  # a full disk: no lock held by an unreachable handle
            lock.release()
            raise
        _close_in_forked_children(lock)
        return lock

    def release(self) -> None:
        if self._handle is None:
            return
        if fcntl is None:  # Windows asks for the region to be unlocked before the file closes
            self._handle.seek(0)
            msvcrt.locking(self._handle.fileno(), msvcrt.LK_UNLCK, 1)
        self._handle.close()  # closing the file drops a flock
        self._handle = None


def owner_of(directory: str | os.PathLike) -> dict:
    """What the run that locked `directory` recorded about itself ({} when unknown)."""
    try:
        return json.loads((Path(directory) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):  # Windows cannot read a locked byte; an owner mid-write
        return {}


def describe(owner: dict) -> str:
    """A live run in words: its name, process, host and when it took the directory."""
    parts = [f"run {owner['run_name']!r}" if owner.get("run_name") else "a run"]
    if owner.get("pid"):
        parts.append(f"process {owner['pid']} on {owner.get('host', 'this machine')}")
    if owner.get("locked_at"):
        parts.append(f"writing there since {owner['locked_at']}")
    return ", ".join(parts)


def _close_in_forked_children(lock: RunLock) -> None:
    global _FORK_HOOK
    if not _FORK_HOOK and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_drop_inherited)
        _FORK_HOOK = True
    _HELD.add(lock)


def _drop_inherited() -> None:
    """In a forked child: close the inherited files without unlocking (the parent still holds them)."""
    for lock in list(_HELD):
        if lock._handle is not None:
            lock._handle.close()
            lock._handle = None
    _HELD.clear()


def _try_lock(handle) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
    except OSError:
        return False
    return True
