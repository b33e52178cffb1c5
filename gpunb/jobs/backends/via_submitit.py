"""What the backends built on submitit share: the submission, the task's place, the requeue.

A subclass gives `executor(spec, settings, time_limit_min)` (submitit's executor for the job's
folder) and `submitted(spec, job)` (what finds the job again); submitit pickles the entry each
task calls, reads the task's place from the scheduler's variables and requeues it.
"""

from __future__ import annotations

import contextlib
import io
import sys

from gpunb.errors import GpunbError
from gpunb.jobs.backends.base import JobBackend, TaskEnvironment


class SubmititBackend(JobBackend):
    def executor(self, spec, settings: dict, time_limit_min: float):
        raise NotImplementedError

    def submitted(self, spec, job) -> None:
        """Note in `spec` what finds the submitted `job` again (its id)."""
        spec.job_id, spec.job_started = str(job.job_id), None

    def refused(self, error: Exception) -> GpunbError:
        """The scheduler's refusal as one message naming the fix."""
        return GpunbError(f"The job could not be submitted ({type(error).__name__} from submitit: {error}).",
                          "fix what it names (the cluster file's `python` is the interpreter the job starts), "
                          "then run the cell again.")

    def submit(self, spec, settings: dict, time_limit_min: float, entry) -> None:
        executor = self.executor(spec, settings, time_limit_min)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stderr(printed):  # submitit prints sbatch's error, then raises it: once is enough
                job = executor.submit(entry)
        except Exception as error:
            raise self.refused(error) from error
        sys.stderr.write(printed.getvalue())  # anything else it said (a warning) is not lost
        self.submitted(spec, job)

    def task(self) -> TaskEnvironment:
        import submitit

        job = submitit.JobEnvironment()
        group = submitit.helpers.TorchDistributedEnvironment()  # rank 0's host; a port drawn from the job id
        return TaskEnvironment(rank=job.global_rank, world_size=job.num_tasks, local_rank=job.local_rank,
                               local_world_size=group.local_world_size, node=job.node, host=job.hostname,
                               job_id=str(job.job_id), master_addr=group.master_addr, master_port=group.master_port)

    def requeue(self, task: TaskEnvironment) -> None:
        """Slurm: `scontrol requeue`; submitit's local executor: exits with its requeue code."""
        import submitit

        submitit.JobEnvironment()._requeue(0)
