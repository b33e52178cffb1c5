"""The cluster file: where a team writes its Slurm defaults once.

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

Options given to the run (`--partition`, `slurm={...}`) win over the file.

Every setting becomes a line of the job's sbatch script, so each is checked before anything
is written (`check_settings`): a key is an option's name (letters, digits, `-`, `_`) and a
value one line of text, a number or a switch. submitit quotes values, not keys, and a line
break in either would end the directives there and run the rest as a command.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

from gpunb.errors import GpunbError

KEYS = ("partition", "account", "qos", "constraint", "time", "job_dir", "gpu_hour_price", "signal_delay_s",
        "shared_fs", "max_ship_mb", "sbatch", "python")
OPTION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")  # sbatch's long options: `mail-type`, `cpus_per_task`
LINE_BREAKS = ("\n", "\r", "\0")  # would end the script's line (a NUL ends the text sbatch reads)


def path() -> Path:
    named = os.environ.get("GPUNB_CLUSTERS")
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "gpunb" / "clusters.toml"


def settings(cluster: str) -> dict:
    """The file's section for `cluster` ("local" or "slurm"); {} without a file or section."""
    file = path()
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
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        raise GpunbError(f"In {file}, [{cluster}] has unknown key(s) {', '.join(map(repr, unknown))}.",
                         "known keys: " + ", ".join(KEYS) + " (other sbatch settings go under "
                         f"[{cluster}.sbatch]).")
    check_settings(section, f"{file}, [{cluster}]")
    return section


def check_settings(given: dict, where: str) -> None:
    """Refuse, in one message naming them, settings that would not stay one line of the sbatch
    script: keys that are not option names, values with a line break, values of another kind."""
    bad = []
    for key, value in given.items():
        name = f"{where}.sbatch" if key == "sbatch" else where
        if key == "sbatch" and isinstance(value, dict):
            bad += [(f"{name}: {k!r} = {v!r}", why) for k, v in value.items() if (why := _problem(k, v))]
        elif why := _problem(key, value):
            bad.append((f"{where}: {key!r} = {value!r}", why))
    if bad:
        listed = "; ".join(f"{setting} ({why})" for setting, why in bad)
        raise GpunbError(f"Slurm setting(s) refused before anything was written: {listed}. Each setting is a line "
                         "of the job's sbatch script, and a line break there would run the rest as a command.",
                         "write each key as sbatch's option name (letters, digits, `-`, `_`: `mail-type`, "
                         "`cpus_per_task`) and each value on one line (`time = \"2:00:00\"`, `exclusive = true`); "
                         "`setup` takes a list of commands, one line each.")


def _problem(key, value) -> str | None:
    """Why `key = value` cannot be a line of the sbatch script, or None."""
    if not isinstance(key, str) or not OPTION_NAME.fullmatch(key):
        return "the key is not an option name"
    if key == "setup":
        lines = value if isinstance(value, (list, tuple)) else [None]
        if not all(isinstance(line, str) for line in lines):
            return "`setup` is a list of commands (strings)"
        return "a command holds a line break" if any(any(c in line for c in LINE_BREAKS) for line in lines) else None
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return None
    if not isinstance(value, str):
        return f"the value is {type(value).__name__}, not text, a number or true/false"
    return "the value holds a line break" if any(c in value for c in LINE_BREAKS) else None


def job_dir(cluster: str, chosen: dict) -> Path:
    """Where this cluster's job folders go: the file's `job_dir`, else a folder of gpunb's data
    directory (beside the run registry)."""
    if chosen.get("job_dir"):
        return Path(os.path.expandvars(str(chosen["job_dir"]))).expanduser()
    from gpunb.runs.paths import data_dir

    return data_dir() / "jobs"
