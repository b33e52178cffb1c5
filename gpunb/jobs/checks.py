"""Before a job is submitted: what would break remotely, each in one message that names the fix.

    check_slurm()                Slurm answers here (sbatch on the PATH, sinfo reaches the controller)
    shipped(args, limit_mb)      fit's arguments as bytes; an object that does not pickle is named
                                 (with the path inside it), data too large to ship by value too
                                 (measured from its tensors' and arrays' sizes before pickling)
    check_shared(folder, ...)    a Slurm job folder must be on a file system the nodes share

The version check runs in the job itself (entry.py), the only place that knows the job's
environment; its message reaches the notebook through the events file.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import socket
import subprocess
from dataclasses import fields
from pathlib import Path

from gpunb.errors import GpunbError

DEFAULT_MAX_SHIP_MB = 1024  # fit's arguments above this, pickled, are refused (the cluster file's max_ship_mb)
NETWORK_FILE_SYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "cifs", "smb3",
                        "smbfs", "wekafs", "panfs", "9p", "virtiofs", "afs", "pvfs2", "orangefs", "quobyte")


SLURM_ANSWER_S = 20  # how long sinfo may take to answer before Slurm counts as unreachable
NO_SLURM_HINT = ("set SLURM_CONF or run where Slurm is: point `SLURM_CONF` at the cluster's slurm.conf "
                 "(`export SLURM_CONF=/etc/slurm/slurm.conf` before starting Jupyter), or run the notebook on "
                 "a machine of the cluster (a login node, or Jupyter started inside an allocation); "
                 "`--detach` runs the job on this machine instead.")


def check_slurm() -> None:
    """Slurm must answer here before anything else is checked or written: sbatch on the PATH,
    and sinfo reaching the controller (SLURM_CONF unset on a machine outside the cluster does not)."""
    if shutil.which("sbatch") is None:
        raise GpunbError("cluster='slurm', and `sbatch` is not on this machine's PATH: this kernel cannot "
                         "submit Slurm jobs.",
                         "run the notebook on a machine of the cluster (a login node, or Jupyter started "
                         "inside an allocation), or use `--detach` for a job on this machine.")
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=SLURM_ANSWER_S,
                              check=False)
    except subprocess.TimeoutExpired:
        said = f"no answer in {SLURM_ANSWER_S} s"
    except OSError as error:
        said = str(error)
    else:
        if done.returncode == 0:
            return
        said = slurm_error(done.stderr or done.stdout) or f"exit status {done.returncode}"
    raise GpunbError(f"Slurm does not answer here (`sinfo`: {said}).", NO_SLURM_HINT)


def slurm_error(text: str) -> str:
    """The line of a Slurm command's output that says what went wrong: its `fatal:` line, else
    its first line (without the command's name in front)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    chosen = next((line for line in lines if "fatal:" in line), lines[0] if lines else "")
    command, colon, rest = chosen.partition(": ")
    return rest if colon and " " not in command else chosen


def shipped(args, limit_mb: float) -> bytes:
    """`args` (FitArgs) pickled, or a GpunbError naming what does not pickle or what is too large.
    Tensors and arrays are measured first: data over the limit is refused without pickling it."""
    from gpunb.distributed.shipping import ship, tensor_bytes, unpicklable_part

    sizes = {f.name: tensor_bytes(getattr(args, f.name)) / 2**20 for f in fields(args) if f.name != "config"}
    if sum(sizes.values()) > limit_mb:
        largest = max(sizes, key=sizes.get)
        raise _too_large(f"{sum(sizes.values()):,.0f} MB of tensors and arrays", largest, sizes[largest], limit_mb)
    try:
        payload = ship(args)
    except GpunbError:
        found = unpicklable_part(args)
        if found is None:
            raise
        name, what, where, error = found
        raise GpunbError(f"`{name}` holds {what}{where} that cannot be pickled, so it cannot be sent to the job "
                         f"({type(error).__name__}: {error}).",
                         f"a job starts from nothing and receives the cell's objects pickled: build `{name}` "
                         "from parts that pickle (tensors, a Dataset holding tensors or file paths, a DataLoader "
                         "over such a Dataset; a generator can become a list or a Dataset, a lambda a `def`), "
                         "or train in the kernel (drop `--detach` / `--cluster`).") from None
    size_mb = len(payload) / 2**20
    if size_mb > limit_mb:
        raise _too_large(f"{size_mb:,.0f} MB pickled", *_largest(args), limit_mb)
    return payload


def _too_large(what: str, largest: str, largest_mb: float, limit_mb: float) -> GpunbError:
    return GpunbError(f"fit's arguments are {what} ({largest!r}: {largest_mb:,.0f} MB), more than the "
                      f"{limit_mb:,.0f} MB a job is sent by value.",
                      f"save the data once to a file on a file system the job's nodes see (e.g. "
                      f"`torch.save({largest}, '/shared/data.pt')`) and give the cell a Dataset that opens it "
                      f"in the job (one that keeps the path and loads lazily, or `torch.load(path, mmap=True)`), "
                      f"or raise `max_ship_mb` in the cluster file ({_clusters_path()}).")


def _largest(args) -> tuple[str, float]:
    sizes = {}
    for f in fields(args):
        value = getattr(args, f.name)
        if value is None or f.name == "config":
            continue
        buffer = io.BytesIO()
        try:
            from gpunb.distributed.shipping import _Pickler

            _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        except Exception:
            continue
        sizes[f.name] = buffer.tell() / 2**20
    name = max(sizes, key=sizes.get) if sizes else "train_data"
    return name, sizes.get(name, 0.0)


def _clusters_path() -> str:
    from gpunb.jobs.clusters import path

    return str(path())


def check_shared(folder: Path, settings: dict) -> None:
    """A Slurm job's folder must be readable by every node: on a network file system, or the
    cluster's nodes all this host (a cluster on one machine), or the cluster file says so."""
    if settings.get("shared_fs") is True:
        return
    kind = file_system_type(folder)
    if kind is None or kind.startswith("fuse") or kind in NETWORK_FILE_SYSTEMS:
        return
    if _nodes_are_this_host():
        return
    raise GpunbError(f"The job folder {folder} is on a local file system ({kind}); the job's nodes would not "
                     "find the arguments, checkpoints and events gpunb writes there.",
                     f"set `job_dir` under [slurm] in {_clusters_path()} to a folder on the file system the "
                     "nodes share (e.g. `job_dir = \"/shared/$USER/gpunb-jobs\"`), or `shared_fs = true` "
                     "there if this folder is shared in a way gpunb cannot see.")


def file_system_type(path: Path) -> str | None:
    """The type of the file system holding `path` (its deepest mount point), or None if unknown."""
    import psutil

    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    target = os.path.realpath(path)
    best, kind = "", None
    try:
        partitions = psutil.disk_partitions(all=True)
    except OSError:
        return None
    for partition in partitions:
        mount = partition.mountpoint
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, partition.fstype
    return kind


def _nodes_are_this_host() -> bool:
    """Every node of the Slurm cluster has this machine's host name (a cluster on one machine)."""
    try:
        listed = subprocess.run(["sinfo", "-N", "-h", "-o", "%n"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    hosts = {line.strip() for line in listed.stdout.splitlines() if line.strip()}
    here = {socket.gethostname(), "localhost", "127.0.0.1", socket.getfqdn()}
    return bool(hosts) and hosts <= here
