"""A job backend from outside gpunb, in this one file: each task of a job is a plain subprocess on
this machine, started by a small controller in a session of its own.

Importing this module registers it (`cluster="subprocess"`); the job's tasks import it before they
call the entry, so they find it too. Nothing in gpunb names it: a new engine is one file.

    python subprocess_backend.py FOLDER TASKS   the controller: starts the tasks, waits for them,
                                                and starts them again when one asks for a requeue
    each task                                   imports this module and calls the pickled entry

The job's id is the controller's pid (with its start time: a pid may be reused); it has no queue
and no time limit.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path

from gpunb.jobs.backends import register
from gpunb.jobs.backends.base import JobBackend, TaskEnvironment, mark_cancelled

HERE = Path(__file__).resolve().parent
ENTRY = "entry.pkl"  # in the job folder: what every task calls
LOG = "subprocess.log"  # in the job folder: the controller's and the tasks' output
REQUEUE_CODE = 3  # a task that leaves with it asks the controller for another attempt
TASK = "import pickle, sys, subprocess_backend; pickle.load(open(sys.argv[1], 'rb'))()"


class SubprocessBackend(JobBackend):
    name = "subprocess"
    what = "plain subprocesses on this machine (a test backend)"
    title = "Subprocess job"
    requeue_signals = (signal.SIGUSR2,)

    def submit(self, spec, settings: dict, time_limit_min: float, entry) -> None:
        import psutil

        (spec.path / ENTRY).write_bytes(pickle.dumps(entry))
        with open(spec.path / LOG, "ab") as log:
            controller = subprocess.Popen([sys.executable, __file__, str(spec.path), str(spec.tasks_per_node)],
                                          env=_finding_this_module(), start_new_session=True, stdout=log,
                                          stderr=subprocess.STDOUT)
        spec.job_id, spec.job_started = str(controller.pid), psutil.Process(controller.pid).create_time()

    def ask(self, spec) -> tuple[str, str | None]:
        return ("RUNNING" if _alive(spec) else "GONE"), None

    def end(self, spec) -> str | None:
        mark_cancelled(spec)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(spec.job_id), signal.SIGKILL)  # the controller leads its tasks' process group
        return None

    def task(self) -> TaskEnvironment:
        rank, world = int(os.environ["SUBPROCESS_RANK"]), int(os.environ["SUBPROCESS_WORLD"])
        return TaskEnvironment(rank=rank, world_size=world, local_rank=rank, local_world_size=world, node=0,
                               host=socket.gethostname(), job_id=os.environ["SUBPROCESS_JOB"],
                               master_addr="127.0.0.1", master_port=int(os.environ["SUBPROCESS_PORT"]))

    def requeue(self, task: TaskEnvironment) -> None:
        sys.exit(REQUEUE_CODE)


register(SubprocessBackend)


def control(folder: str, tasks: int) -> int:
    """The controller: one process per task, each told its rank; again after a requeue."""
    while True:
        port = _free_port()  # a fresh rendezvous for each attempt
        started = [subprocess.Popen([sys.executable, "-c", TASK, os.path.join(folder, ENTRY)],
                                    env=dict(os.environ, SUBPROCESS_RANK=str(rank), SUBPROCESS_WORLD=str(tasks),
                                             SUBPROCESS_JOB=str(os.getpid()), SUBPROCESS_PORT=str(port)))
                   for rank in range(tasks)]
        codes = [process.wait() for process in started]
        if REQUEUE_CODE not in codes:
            return max(codes, key=abs)


def _finding_this_module() -> dict:
    """The environment of the controller and its tasks: this module's folder on their path."""
    path = os.pathsep.join(part for part in (str(HERE), os.environ.get("PYTHONPATH")) if part)
    return dict(os.environ, PYTHONPATH=path)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _alive(spec) -> bool:
    import psutil

    try:
        process = psutil.Process(int(spec.job_id))
        return process.status() != psutil.STATUS_ZOMBIE and abs(process.create_time() - spec.job_started) < 1.0
    except (psutil.Error, ValueError, TypeError):
        return False


if __name__ == "__main__":
    sys.exit(control(sys.argv[1], int(sys.argv[2])))
