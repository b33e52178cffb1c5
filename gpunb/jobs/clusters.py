"""The cluster file: where a team writes its clusters' defaults once.

    ~/.config/gpunb/clusters.toml     (the environment variable GPUNB_CLUSTERS names another)

    [slurm]
    partition = "gpu"
    account = "my-team"
    time = "4:00:00"                    # a job's time limit
    job_dir = "/shared/me/gpunb-jobs"   # job folders: on a file system every node mounts
    gpu_hour_price = 2.5                # the result's cost
    signal_delay_s = 90                 # Slurm's warning before the time limit (checkpoint + requeue)
    [slurm.sbatch]                      # any other sbatch setting
    mail-type = "END"

    [local]                             # --detach: jobs on this machine
    job_dir = "~/gpunb-jobs"

Options given to the run (`--partition`, `slurm={...}`) win over the file. A section holds the
settings its backend accepts (gpunb/jobs/backends), each checked before anything is written
(`JobBackend.check_settings`).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from gpunb.errors import GpunbError


def path() -> Path:
    named = os.environ.get("GPUNB_CLUSTERS")
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "gpunb" / "clusters.toml"


def settings(backend) -> dict:
    """The file's section for `backend` (a JobBackend: [local], [slurm] ...); {} without a file or section."""
    file, cluster = path(), backend.name
    if not file.is_file():
        return {}
    try:
        with file.open("rb") as handle:
            data = tomllib.load(handle)
    except (tomllib.TOMLDecodeError, OSError) as error:
        raise GpunbError(f"The cluster file {file} cannot be read: {error}.",
                         "fix its TOML (or move it away); the README shows an example.") from error
    section = data.get(cluster, {})
    if not isinstance(section, dict):
        raise GpunbError(f"In {file}, `{cluster}` is a value, not a table.", f"write it as `[{cluster}]` with keys below.")
    unknown = sorted(set(section) - set(backend.accepts()))
    if unknown:
        table = backend.extra_table
        raise GpunbError(f"In {file}, [{cluster}] has unknown key(s) {', '.join(map(repr, unknown))}.",
                         "known keys: " + ", ".join(backend.accepts())
                         + (f" (other {table} settings go under [{cluster}.{table}])." if table else "."))
    backend.check_settings(section, f"{file}, [{cluster}]")
    return section


def job_dir(chosen: dict) -> Path:
    """Where this cluster's job folders go: the file's `job_dir`, else a folder of gpunb's data
    directory (beside the run registry)."""
    if chosen.get("job_dir"):
        return Path(os.path.expandvars(str(chosen["job_dir"]))).expanduser()
    from gpunb.runs.paths import data_dir

    return data_dir() / "jobs"
