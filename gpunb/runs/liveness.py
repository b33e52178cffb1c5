"""Which process and kernel a run belongs to, and whether that process still lives.

On the run's own host its process answers (pid and start time). From another host
(a registry on a shared file system) only the row can: a running run's recorder
stamps `heartbeat_at` every few seconds from a thread of its own, even while one
step runs for minutes, so a run is dead there only after STALE_AFTER_S of silence.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import psutil

STALE_AFTER_S = 300.0  # a run on another host that has not written for this long is dead
PROCESS_DIED = "process died"  # the error of a running run that a reader found dead


def kernel_id() -> str | None:
    """This kernel's id (from its connection file kernel-<id>.json), or None outside a kernel."""
    if "ipykernel" not in sys.modules:
        return None  # not a kernel; importing ipykernel just to find out costs ~0.3 s
    try:
        from ipykernel.connect import get_connection_file

        name = Path(get_connection_file()).name
    except Exception:  # any failure just means "not a kernel we can identify"
        return None
    if name.startswith("kernel-") and name.endswith(".json"):
        return name[len("kernel-"):-len(".json")]
    return None


def process_start(pid: int) -> float | None:
    """When process `pid` started; with the pid it names a process even after pid reuse."""
    if pid == os.getpid():
        return _own_start(pid)  # each run's row asks it for this process: psutil's reads once
    return _start_of(pid)


def _start_of(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


@functools.lru_cache(maxsize=1)
def _own_start(pid: int) -> float | None:  # by pid: a forked child asks again
    return _start_of(pid)


def last_sign(run: dict) -> float:
    """When the run last wrote anything: its newest heartbeat or update."""
    return max(run["updated_at"] or 0.0, run.get("heartbeat_at") or 0.0)


def judged_dead(run: dict) -> bool:
    """A running run that a reader marked failed for want of a sign of life (it may have been wrong)."""
    return run["status"] == "failed" and run["error"] == PROCESS_DIED


def whereabouts(run: dict, this_host: str, now: float) -> str:
    """Where a live run lives, for messages: its process here, or its host and last heartbeat."""
    if run["host"] == this_host:
        return f"process {run['pid']} on this host"
    return f"on host {run['host']}, last heartbeat {max(0.0, now - last_sign(run)):.0f} s ago"


def alive(run: dict, this_host: str, now: float) -> bool:
    if run["host"] != this_host:
        return now - last_sign(run) < STALE_AFTER_S
    pid = run["pid"]
    if pid is None or not psutil.pid_exists(pid):
        return False
    started = run["_pid_started"]
    if started is None:
        return True
    current = process_start(pid)
    return current is None or abs(current - started) < 1.0  # a different start time: the pid was reused
