"""A run as a job: the same fit, in processes of its own, on this machine or on a Slurm cluster.

    backends/     the engines (local, slurm), one class each, chosen from one table: submit, state,
                  cancel, the task's place and group, requeue, the settings each accepts
    clusters.py   the cluster file (~/.config/gpunb/clusters.toml): a team's defaults per backend
    spec.py       a job's folder: job.json (what, where, which versions) and the shipped arguments
    checks.py     before submitting: what would break remotely, one message each
    events.py     the events file: the relay's channel for a job (rank 0 appends, the kernel reads)
    gpus.py       the GPU samples file of each node: its first task appends, the kernel reads them back
    control.py    in the job: stop requests (a file, the registry) and preemption signals
    entry.py      in the job: each task's body (versions, the group, the fit, result or requeue)
    submit.py     the kernel's side of a submission: folder, checks, backend, registry row
    follow.py     the kernel's side of a running job: its lifetime (events into the relay's mirror,
                  scheduler states, stop, cancel, the end)
    lookup.py     gpunb.attach(name_or_run_id), gpunb.stop(...), and the job of a cell run again
    interrupts.py the kernel's interrupt while a cell follows a job, told apart from a restart

Nothing here is imported by a run in the kernel; submitit is imported only to submit or
to run a job.
"""

from __future__ import annotations


def attach(name_or_run_id: str, *, wait: bool = True, callbacks=()):
    """The result of a job run (by run name, newest first, or run id): its `.status`, history and
    trained `.model`. While the job is queued or running it follows it (the dashboard, through
    `callbacks`) until it ends; `wait=False` returns what is known now."""
    from gpunb.jobs.lookup import attach as attach_job

    return attach_job(name_or_run_id, wait=wait, callbacks=callbacks)


def stop(name_or_run_id: str) -> str:
    """Ask a run (by run name, a running one first, or run id) to stop at its next step, keeping its
    weights and writing a checkpoint; for a job, a second call (or one while it waits in the queue)
    cancels it. Returns "stopping", "cancelled", or the status of a run that has ended. Neither a
    kernel restart nor an interrupt of a cell that follows a job stops the job: this does.

    The name of a sweep stops the whole sweep: its kernel asks no more trials, and its running trials
    stop at their next step, their checkpoints kept ("ended" once all its trials ended or it stopped)."""
    from gpunb.jobs.lookup import stop as stop_run

    return stop_run(name_or_run_id)
