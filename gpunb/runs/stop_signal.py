"""A stop request's signal beside the registry file, so that a run can look for one at every log
without reading the registry.

`Registry.request_stop` appends a byte to `<registry>.stops` once the request is committed. A
run's recorder looks at that file's (inode, size, mtime) at each log, one os.stat (~2 us), and
reads the registry (~0.1 ms in a fit, where the step has left SQLite's pages and its WAL index
cold) only when the stamp changed since its last read. The size only grows, so a stamp never comes
back to one already seen, whatever the file system's clock resolution.

A signal that cannot be written (a read-only or full disk) or is seen late (another host, over a
file system that caches attributes) costs only promptness: the run's writer thread reads the
request from the registry with each write (once a second) and, between logs, every
`writer.STOP_POLL_S`; each step looks at its answer.
"""

from __future__ import annotations

import os
from pathlib import Path

Stamp = tuple[int, int, int] | None  # (inode, size, mtime in ns), None when there is no file


def signal_path(registry_path: Path) -> Path:
    return registry_path.with_name(registry_path.name + ".stops")


def raise_signal(registry_path: Path) -> None:
    """Tell the runs recorded in `registry_path` that a stop request was committed there."""
    try:
        with open(signal_path(registry_path), "ab") as signal:
            signal.write(b"\n")
    except OSError:
        pass  # the writers' polls still bring the request in


class StopSignal:
    """The signal of `registry_path`, and its stamp at the last read of the registry (`seen`)."""

    def __init__(self, registry_path: Path):
        self.path = signal_path(registry_path)
        self.seen: Stamp | str = "nothing yet"  # the first look reads the registry

    def stamp(self) -> Stamp:
        try:
            found = os.stat(self.path)
        except OSError:
            return None
        return found.st_ino, found.st_size, found.st_mtime_ns
