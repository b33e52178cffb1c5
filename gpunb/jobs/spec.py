"""A job's folder, and job.json in it: what the job runs, where, and with which versions.

    <job_dir>/<name>-<run id>/
        job.json          this spec (written by the kernel; the scheduler's job id added once known)
        args.pkl          fit's arguments, cloudpickled (distributed/shipping.py)
        events.jsonl      the run's events, appended by rank 0 (events.py)
        gpus-<node>.jsonl each node's GPU samples, appended by its first task (gpus.py)
        checkpoints/      the run's checkpoints (unless checkpoint_dir is set)
        stop              present: the kernel asked the job to stop (control.py)
        result.pt         at the end: the trained weights (and optimizer state)
        result.pkl        at the end: the TrainResult
        submitit/         submitit's own files (the job's logs among them)

The folder is the job: a kernel that has it (through the run registry or a path) can
follow the job, stop it and take its weights, whichever kernel submitted it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpunb.errors import GpunbError
from gpunb.jobs.events import EVENTS_FILE


@dataclass
class JobSpec:
    run_id: str  # the run registry's id of the run (the job's row)
    name: str  # the run's name
    key: str | None  # what re-running the same cell finds the job by (None: never attached to by key)
    cluster: str  # its backend's name (backends/: "local", "slurm" ...)
    folder: str  # this job's folder
    nodes: int
    tasks_per_node: int  # processes per node, one per GPU (or CPU process)
    gpus_per_node: int  # GPUs asked of the scheduler per node (0: a CPU job)
    accelerator: str  # the config's (the job's devices)
    entry: str  # "module:function" each rank runs (the Trainer's rank entry)
    registry: str | None  # the run registry file the job records its run in (None: not tracked)
    versions: dict = field(default_factory=dict)  # the kernel's Python, torch, CUDA, gpunb
    gpu_hour_price: float | None = None
    submitted_at: float = field(default_factory=time.time)
    job_id: str | None = None  # the scheduler's (Slurm job id; local: the controller's pid)
    job_started: float | None = None  # local: the controller's start time (its pid alone may be reused)
    job_name: str | None = None  # the scheduler's name of the job: the folder's (Slurm ids are reused)
    visible_devices: str | None = None  # local: its CUDA_VISIBLE_DEVICES (a sweep's packing); None: the first GPUs

    @property
    def backend(self):
        """The JobBackend that runs this job: it submits, asks, cancels and requeues it."""
        from gpunb.jobs.backends import get

        return get(self.cluster)

    @property
    def path(self) -> Path:
        return Path(self.folder)

    @property
    def events_path(self) -> Path:
        return self.path / EVENTS_FILE

    @property
    def args_path(self) -> Path:
        return self.path / "args.pkl"

    @property
    def stop_path(self) -> Path:
        return self.path / "stop"

    @property
    def checkpoint_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def weights_path(self) -> Path:
        return self.path / "result.pt"

    @property
    def result_path(self) -> Path:
        return self.path / "result.pkl"

    @property
    def submitit_dir(self) -> Path:
        return self.path / "submitit"

    def save(self) -> None:
        """Write job.json atomically (the job may be reading it)."""
        temporary = self.path / f".job.json.{os.getpid()}"
        temporary.write_text(json.dumps(asdict(self), indent=1))
        os.replace(temporary, self.path / "job.json")


def load(folder: str | os.PathLike) -> JobSpec:
    file = Path(folder) / "job.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise GpunbError(f"{file} cannot be read ({error}): this folder is not a gpunb job, or it was moved.",
                         "pass the run's name or id to `gpunb.attach(...)`; `gpunb.runs()` lists them.") from error
    return JobSpec(**data)


def current_versions() -> dict:
    """What a pickled model needs to load the same way: Python, torch, its CUDA, gpunb."""
    import torch

    package = sys.modules["gpunb"]  # imported before any of its modules (not imported here: it is the top layer)
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpunb": package.__version__}


def version_mismatch(kernel: dict, job: dict) -> GpunbError | None:
    """The kernel's and the job's versions compared: Python's minor version, torch's release
    (its build, +cpu or +cu130, may differ: a kernel on a laptop, a job on GPUs), CUDA's minor
    version where both have one, gpunb's version."""
    def minor(version):
        return ".".join(str(version).split(".")[:2]) if version else None

    differ = []
    if minor(kernel.get("python")) != minor(job["python"]):
        differ.append(("Python", kernel.get("python"), job["python"]))
    if str(kernel.get("torch")).split("+")[0] != job["torch"].split("+")[0]:
        differ.append(("torch", kernel.get("torch"), job["torch"]))
    if kernel.get("cuda") and job["cuda"] and minor(kernel["cuda"]) != minor(job["cuda"]):
        differ.append(("CUDA (torch's build)", kernel["cuda"], job["cuda"]))
    if kernel.get("gpunb") != job["gpunb"]:
        differ.append(("gpunb", kernel.get("gpunb"), job["gpunb"]))
    if not differ:
        return None
    listed = "; ".join(f"{what} {here} in the notebook's kernel, {there} in the job" for what, here, there in differ)
    return GpunbError(f"The job's Python environment differs from the notebook's: {listed}. The model and data "
                      "pickled in the kernel may not load, or may train differently, there, so the job stopped "
                      "before loading them.",
                      "run the job in the kernel's environment: activate the same virtual environment in the "
                      "cluster file's `python` (e.g. `python = \"/shared/venvs/train/bin/python\"` under "
                      "[slurm]), or install the same versions there (`pip install torch==<version>`), then "
                      "run the cell again.")
