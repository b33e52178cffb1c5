"""Finding a job again: by the key of the cell that submitted it, or by run name or id.

A re-run of the same cell (the same source and options: the key) finds its job in the
run registry, and follows it instead of submitting again, unless that job failed or was
cancelled. `attach(name_or_run_id)` does it from any cell of any kernel: the model comes
from the job folder's shipped arguments, with the job's weights loaded into it.
"""

from __future__ import annotations

import hashlib
import os

from gpunb.errors import GpunbError
from gpunb.jobs import spec as job_spec

RESUBMIT_AFTER = ("failed", "cancelled", "interrupted", "lost")  # a job that ended so is submitted again
SEARCHED = 1000  # newest registry rows searched for a job


NOT_THE_RUN = ("--no-wait", "--quiet", "--resubmit")  # options that change how a cell waits, not what it trains


def cell_key(cell: str, line: str) -> str:
    """The key of a cell run as a job: its source and its options (blank lines, spaces at the
    ends, and the options that do not change the training do not count)."""
    text = "\n".join(part.rstrip() for part in cell.strip().splitlines() if part.strip())
    options = " ".join(word for word in line.split() if word not in NOT_THE_RUN)
    return hashlib.sha256(f"{options}\n{text}".encode()).hexdigest()[:24]


def find_job(key: str, registry) -> job_spec.JobSpec | None:
    """The newest job submitted with `key` that is queued, running or ended with a result."""
    if registry is None:
        return None
    for row in registry.list_runs(limit=SEARCHED):
        job = row.get("job")
        if not job or job.get("key") != key:
            continue
        if row["status"] in RESUBMIT_AFTER or not os.path.exists(os.path.join(job["folder"], "job.json")):
            return None
        return job_spec.load(job["folder"])
    return None


def attach(name_or_run_id: str, *, wait: bool = True, callbacks=()):
    """gpunb.attach: see gpunb/jobs/__init__.py."""
    from gpunb.distributed.shipping import unship
    from gpunb.jobs.follow import Follower
    from gpunb.runs import Registry

    registry = Registry()
    row = _row(registry, name_or_run_id)
    spec = job_spec.load(row["job"]["folder"])
    args = unship(spec.args_path.read_bytes())  # the model as submitted: the job's weights go into it
    follower = Follower(spec, args.config, callbacks, model=args.model, optimizer=args.optimizer,
                        registry=registry, attached=True)
    return follower.run() if wait else follower.now()


def _row(registry, name_or_run_id: str) -> dict:
    row = registry.get_run(name_or_run_id, with_history=False)
    if row is None:
        rows = [r for r in registry.list_runs(limit=SEARCHED) if r["name"] == name_or_run_id and r.get("job")]
        row = rows[0] if rows else None
    if row is None or not row.get("job"):
        what = "is a run in the kernel, not a job" if row is not None else "names no job in the run registry"
        raise GpunbError(f"{name_or_run_id!r} {what}.",
                         "pass the name or id of a run submitted with `--detach` or `--cluster slurm`; "
                         "`gpunb.runs()` lists the runs (jobs show their cluster).")
    if not os.path.exists(os.path.join(row["job"]["folder"], "job.json")):
        raise GpunbError(f"The folder of job {name_or_run_id!r}, {row['job']['folder']}, is gone.",
                         "its weights went with it; run the cell again with `--resubmit` to train anew.")
    return row


REFRESH_EVERY_S = 5.0  # the sidebar polls often; the scheduler is asked about waiting jobs this often at most
_refreshed = {"at": 0.0}


def refresh_waiting(registry, runs: list[dict]) -> list[dict]:
    """Queued jobs' scheduler state and reason into the registry (a job waiting with no kernel
    following it still shows why it waits), at most every REFRESH_EVERY_S; `runs` as read again."""
    import time

    from gpunb.jobs import scheduler

    if time.monotonic() - _refreshed["at"] < REFRESH_EVERY_S:
        return runs
    _refreshed["at"] = time.monotonic()
    changed = False
    for run in runs:
        job = run.get("job")
        if not job or run["status"] != "queued" or job.get("cluster") != "slurm" or not job.get("id"):
            continue
        if not os.path.exists(os.path.join(job["folder"], "job.json")):
            continue  # its folder is gone: nothing to follow or stop
        state, reason = scheduler.job_state(job_spec.load(job["folder"]))
        if (state, reason) != (job.get("state"), job.get("reason")) and state != "UNKNOWN":
            ended = scheduler.ended_status(state)
            registry.set_job(run["id"], {"state": state, "reason": reason}, status=ended or None)
            changed = True
    return registry.list_runs(series=True) if changed else runs


def stop_job(registry, run: dict) -> bool:
    """The sidebar's Stop for a job: the first asks it to stop at its next step (checkpoint, weights
    kept); a second, or one for a job still waiting in the queue, cancels it. False if it has ended."""
    from gpunb.jobs import scheduler

    if run["status"] not in ("queued", "running"):
        return False
    spec = job_spec.load(run["job"]["folder"])
    if run["status"] == "queued" or run.get("stop_requested"):
        lost = scheduler.cancel(spec)  # sent only while the Slurm id still names this job
        if lost:
            registry.set_job(run["id"], {"state": scheduler.LOST, "reason": lost}, status="lost", error=lost)
        else:
            registry.set_job(run["id"], {"state": "CANCELLED", "reason": None}, status="cancelled")
        return True
    spec.stop_path.touch()  # the job reads it even where it cannot reach this registry
    registry.request_stop(run["id"])
    return True
