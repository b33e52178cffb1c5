"""What the Slurm tests and benchmarks/slurm_cluster.py run as jobs. The jobs import nothing from
tests/ (it is not on their path), so this module travels by value."""

import os
import sys
import time
from pathlib import Path

import cloudpickle

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def where_am_i():
    return int(os.environ["SLURM_PROCID"]), os.environ["SLURMD_NODENAME"], os.getcwd()


def sleep_then_say_how_often_started(marker: str, seconds: float) -> int:
    """Sleeps on its first start (to be requeued meanwhile); returns how often it was started."""
    starts = Path(marker)
    count = len(starts.read_text()) + 1 if starts.exists() else 1
    starts.write_text("x" * count)
    if count == 1:
        time.sleep(seconds)
    return count


class Preemptible:
    """A submitit Checkpointable: sleeps until preempted, then finishes when started again."""

    def __init__(self, marker: str):
        self.marker = marker

    def __call__(self) -> str:
        if Path(self.marker).exists():
            return "resumed"
        Path(self.marker).write_text("started")
        time.sleep(300)
        return "never preempted"

    def checkpoint(self):
        import submitit

        return submitit.helpers.DelayedSubmission(self)
