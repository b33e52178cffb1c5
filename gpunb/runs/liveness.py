"""Which process and kernel a run belongs to, and whether that process still lives."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil

STALE_AFTER_S = 300.0  # a run on another host that has not written for this long is dead


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
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def alive(run: dict, this_host: str, now: float) -> bool:
    if run["host"] != this_host:
        return now - (run["updated_at"] or 0.0) < STALE_AFTER_S
    pid = run["pid"]
    if pid is None or not psutil.pid_exists(pid):
        return False
    started = run["_pid_started"]
    if started is None:
        return True
    current = process_start(pid)
    return current is None or abs(current - started) < 1.0  # a different start time: the pid was reused
