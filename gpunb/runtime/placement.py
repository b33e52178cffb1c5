"""Placement: how this process of a run is placed, beside the TrainConfig the user gave.

The config says what the user asked for (devices=2, cluster="local", track=True) and reaches
every process of the run unchanged: it is what checkpoints, loggers and the run registry record.
Whoever starts a process says where that process stands: the launcher for the ranks it starts
(distributed/launch.py), the job's entry for each task of a job (jobs/entry.py). A process
started by the user (the kernel, or a torchrun rank) is placed by default: it records its run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    rank: int = 0  # this process's rank in the run's group
    world_size: int = 1  # processes training together
    local_rank: int = 0  # rank on this node (its GPU)
    node: int = 0  # the node this process runs on
    # False: the run's row in the registry is written elsewhere (the launcher's kernel, the job's
    # own recorder), so this process adds no recorder of its own.
    records: bool = True
    # Where checkpoints go when the config names no checkpoint_dir (a job's folder; None: nowhere).
    checkpoint_dir: str | None = None
    # What to resume from, ahead of the config's `resume` (a requeued job: "last", its newest).
    resume: bool | str | None = None

    def checkpoints(self, config) -> str | None:
        """The directory this process's checkpoints go to: the user's, else the placement's."""
        return config.checkpoint_dir or self.checkpoint_dir

    def resumes(self, config) -> bool | str | None:
        """What this process resumes from: the placement's (a requeue), else the user's."""
        return self.resume or config.resume


ALONE = Placement()  # a process started by the user: rank 0 of 1, recording its run
