"""Which of this server's kernels owns a GPU process: PID -> kernel id -> notebook path."""

from __future__ import annotations

import psutil


def kernel_root_pids(kernel_manager) -> dict[int, str]:
    """The PID of each local kernel process, mapped to its kernel id.

    Remote kernels (a provisioner without a `pid`) have no local process to match.
    """
    roots = {}
    for kernel_id in kernel_manager.list_kernel_ids():
        provisioner = getattr(kernel_manager.get_kernel(kernel_id), "provisioner", None)
        pid = getattr(provisioner, "pid", None)
        if pid:
            roots[pid] = kernel_id
    return roots


async def kernel_notebooks(session_manager) -> dict[str, str]:
    """Kernel id -> the path of the notebook (or console) its session is attached to."""
    sessions = await session_manager.list_sessions()
    return {s["kernel"]["id"]: s["path"] for s in sessions if s.get("kernel")}


def with_children(roots: dict[int, str]) -> dict[int, str]:
    """Add every descendant of each kernel (DataLoader workers, DDP ranks). Reads /proc: not on the event loop."""
    owners = dict(roots)
    for pid, kernel_id in roots.items():
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.Error:  # the kernel exited since it was listed
            continue
        for child in children:
            owners.setdefault(child.pid, kernel_id)
    return owners


def annotate_processes(snapshot: dict, owners: dict[int, str], notebooks: dict[str, str]) -> dict:
    """Add `kernel_id` and `notebook` to each GPU process that belongs to one of our kernels."""
    for gpu in snapshot.get("gpus", []):
        for process in gpu.get("processes", []):
            kernel_id = owners.get(process.get("pid"))
            if kernel_id is not None:
                process["kernel_id"] = kernel_id
                process["notebook"] = notebooks.get(kernel_id)
    return snapshot
