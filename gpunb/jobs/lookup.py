"""Finding a job again: by the key of the cell that submitted it, or by run name or id.

A re-run of the same cell (the same source and options: the key) finds its job in the
run registry, and follows it instead of submitting again; a job that ended without a result
(killed, cancelled, failed) is submitted again in its folder and goes on from its newest
checkpoint (submit.py). `attach(name_or_run_id)` does it from any cell of any kernel: the model comes
from the job folder's shipped arguments, with the job's weights loaded into it.
"""

from __future__ import annotations

import hashlib
import os

from gpunb.errors import GpunbError
from gpunb.jobs import spec as job_spec

SEARCHED = 1000  # newest registry rows searched for a job


NOT_THE_RUN = ("--no-wait", "--quiet", "--resubmit")  # options that change how a cell waits, not what it trains


def cell_key(cell: str, line: str) -> str:
    """The key of a cell run as a job: its source and its options (blank lines, spaces at the
    ends, and the options that do not change the training do not count)."""
    text = "\n".join(part.rstrip() for part in cell.strip().splitlines() if part.strip())
    options = " ".join(word for word in line.split() if word not in NOT_THE_RUN)
    return hashlib.sha256(f"{options}\n{text}".encode()).hexdigest()[:24]


def find_job(key: str, registry) -> job_spec.JobSpec | None:
    """The newest job submitted with `key`, while its folder is there (running, ended with a result,
    or ended without one: see `ended_without_result`)."""
    if registry is None:
        return None
    for row in registry.list_runs(limit=SEARCHED):
        job = row.get("job")
        if not job or job.get("key") != key:
            continue
        if not os.path.exists(os.path.join(job["folder"], "job.json")):
            return None
        return job_spec.load(job["folder"])
    return None


def ended_without_result(spec) -> bool:
    """The job is over (its scheduler says so) and left no weights: killed, cancelled or failed."""
    from gpunb.jobs.backends.base import ENDED

    if spec.weights_path.exists() or spec.job_id is None:
        return False
    return spec.backend.state(spec)[0] in ENDED


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

    from gpunb.jobs.backends import find
    from gpunb.jobs.backends.base import ended_status

    if time.monotonic() - _refreshed["at"] < REFRESH_EVERY_S:
        return runs
    _refreshed["at"] = time.monotonic()
    changed = False
    for run in runs:
        job = run.get("job")
        backend = find(job.get("cluster")) if job else None
        if backend is None or run["status"] != "queued" or not backend.reports_waiting or not job.get("id"):
            continue
        if not os.path.exists(os.path.join(job["folder"], "job.json")):
            continue  # its folder is gone: nothing to follow or stop
        state, reason = backend.state(job_spec.load(job["folder"]))
        if (state, reason) != (job.get("state"), job.get("reason")) and state != "UNKNOWN":
            ended = ended_status(state)
            registry.set_job(run["id"], {"state": state, "reason": reason}, status=ended or None,
                             stop_reason=backend.cancelled_elsewhere if ended == "cancelled" else None)
            changed = True
    return registry.list_runs(series=True) if changed else runs


def stop_job(registry, run: dict, by: str = "the sidebar") -> bool:
    """The sidebar's Stop (or gpunb.stop) for a job: the first asks it to stop at its next step
    (checkpoint, weights kept); a second, or one for a job still waiting in the queue, cancels it.
    `by` says who, in the job's result and row. False if it has ended."""
    from gpunb.jobs.backends.base import LOST
    from gpunb.jobs.control import request_stop

    if run["status"] not in ("queued", "running"):
        return False
    spec = job_spec.load(run["job"]["folder"])
    if run["status"] == "queued" or run.get("stop_requested") or spec.stop_path.exists():
        lost = spec.backend.cancel(spec)  # sent only while the scheduler's id still names this job
        if lost:
            registry.set_job(run["id"], {"state": LOST, "reason": lost}, status="lost", error=lost)
        else:
            registry.set_job(run["id"], {"state": "CANCELLED", "reason": None}, status="cancelled",
                             stop_reason=f"cancelled from {by}")
        return True
    request_stop(spec, f"stopped from {by}")  # the job reads it even where it cannot reach this registry
    if by == "the sidebar":
        registry.request_stop(run["id"])  # the sidebar shows "stopping…" from the registry
    return True


def stop_sweep(registry, name: str, by: str = "the sidebar") -> bool:
    """The sidebar's Stop of a whole sweep (or gpunb.stop of its name): recorded for the sweep's loop,
    which asks no more trials (sweeps/control.py), and each trial still running asked to stop at its
    next step, its checkpoint kept; a trial's job still waiting in its queue, with no step to stop at,
    is cancelled. Done here too, so that a sweep whose kernel died stops. Between two trials in the
    kernel none runs, and the stop waits for the loop. False: no such sweep, or it has ended (all its
    trials, or stopped before)."""
    from gpunb.runs.sweep_cards import sweep_card

    trials = registry.sweep_runs(name)
    if not trials or sweep_card(name, trials, registry.sweep_stops().get(name))["state"] in ("completed", "stopped"):
        return False
    registry.request_sweep_stop(name, f"the sweep was stopped from {by}")
    for run in trials:
        asked = run.get("stop_requested") or (run.get("job") and os.path.exists(os.path.join(run["job"]["folder"],
                                                                                             "stop")))
        if run["status"] not in ("queued", "running") or (asked and run["status"] == "running"):
            continue  # ended, or asked to stop already (a second request would cancel a job)
        if run.get("job"):
            stop_job(registry, run, by=by)
        registry.request_stop(run["id"])  # the sidebar shows "stopping…"; a run in a kernel stops at its next log
    return True


def stop(name_or_run_id: str) -> str:
    """gpunb.stop: see gpunb/jobs/__init__.py."""
    from gpunb.runs import Registry

    registry = Registry()
    row = registry.get_run(name_or_run_id, with_history=False)
    if row is None:
        rows = [r for r in registry.list_runs(limit=SEARCHED) if r["name"] == name_or_run_id]
        row = next((r for r in rows if r["status"] in ("queued", "running")), rows[0] if rows else None)
    if row is None and registry.sweep_runs(name_or_run_id):
        return "stopping" if stop_sweep(registry, name_or_run_id, by="gpunb.stop") else "ended"
    if row is None:
        raise GpunbError(f"{name_or_run_id!r} names no run nor sweep in the run registry.",
                         "pass a run's name or id, or a sweep's name; `gpunb.runs()` lists them.")
    asked_before = row.get("stop_requested") or (row.get("job") and os.path.exists(
        os.path.join(row["job"]["folder"], "stop")))
    if row.get("job") and stop_job(registry, row, by="gpunb.stop"):
        return "cancelled" if asked_before or row["status"] == "queued" else "stopping"
    if not row.get("job") and registry.request_stop(row["id"]):
        return "stopping"
    return row["status"]
