"""The kernel's side of a submission: the job folder, the checks, the executor, the registry row.

`run_job` is what gpunb.Trainer calls for a run with a `cluster`: it finds the job of this run
when there is one (the same cell run again: its key, unless `resubmit`), else submits a new one
through the cluster's backend (backends/), then follows it (follow.py) until it ends.
"""

from __future__ import annotations

import re
import time
import uuid

from gpunb.errors import GpunbError
from gpunb.jobs import backends, checks, clusters
from gpunb.jobs.backends.base import CANCELLED_MARK
from gpunb.jobs.spec import JobSpec, current_versions


def run_job(config, entry, model, train_data, val_data=None, *, callbacks=(), key=None, wait=True, **arguments):
    """Submit (or find) the job of this run and follow it; returns its JobResult (the weights in `model`)."""
    follower = job_follower(config, entry, model, train_data, val_data, callbacks=callbacks, key=key, **arguments)
    return follower.run() if wait else follower.now()


def job_follower(config, entry, model, train_data, val_data=None, *, callbacks=(), key=None, visible=None,
                 **arguments):
    """Submit (or find) the job of this run; returns its Follower, not yet following (a sweep
    follows several at once through `Follower.poll`). `visible`: the GPUs of this machine the job
    may use, as CUDA_VISIBLE_DEVICES names them (a sweep's packing; None: the backend's choice)."""
    from gpunb.jobs.follow import Follower
    from gpunb.jobs.lookup import ended_without_result, find_job

    if arguments.get("continue_from") is not None:
        raise GpunbError("--continue goes on with objects in this kernel's memory, which a job cannot reach.",
                         "drop `--continue`, or train in the kernel (drop `--detach` / `--cluster`); a job goes "
                         "on from its own checkpoints when it is requeued.")
    registry = _registry(config)
    spec = None if config.resubmit or key is None else find_job(key, registry)
    attached = spec is not None
    if spec is not None and ended_without_result(spec):
        spec.visible_devices = visible  # where it goes on now
        spec, attached = resume_in_folder(spec, config, registry), False  # killed, cancelled, failed
    if spec is None:
        from gpunb.distributed.shipping import FitArgs

        args = FitArgs(config, model, train_data, val_data, **{name: arguments.get(name) for name in
                                                               ("optimizer", "scheduler", "loss_fn", "step", "metrics",
                                                                "state_type")})
        spec = submit(config, entry, args, key=key, registry=registry, visible=visible)
    return Follower(spec, config, callbacks, model=model, optimizer=arguments.get("optimizer"),
                    registry=registry, attached=attached)


def submit(config, entry, args, *, key: str | None, registry, visible: str | None = None) -> JobSpec:
    """Check, write the job folder, submit through the backend, record the queued run; returns the spec."""
    backend = backends.chosen(config)
    settings = job_settings(config)
    root = clusters.job_dir(settings)
    backend.check(root, settings)
    tasks, gpus = backend.tasks_and_gpus(config)
    payload = checks.shipped(args, float(settings.get("max_ship_mb", checks.DEFAULT_MAX_SHIP_MB)))
    run_id = uuid.uuid4().hex
    name = config.name or type(args.model).__name__
    folder = root / f"{_slug(name)}-{run_id[:8]}"
    folder.mkdir(parents=True)
    spec = JobSpec(run_id=run_id, name=name, key=key, cluster=backend.name, folder=str(folder), nodes=config.nodes,
                   tasks_per_node=tasks, gpus_per_node=gpus, accelerator=config.accelerator,
                   entry=f"{entry.__module__}:{entry.__qualname__}",
                   registry=str(registry.path) if registry is not None else None, versions=current_versions(),
                   gpu_hour_price=_price(config, settings), job_name=folder.name, visible_devices=visible)
    spec.args_path.write_bytes(payload)
    spec.save()
    if registry is not None:
        registry.start_run(name, config=config.to_dict(), run_id=run_id, status="queued",
                           device=f"{backend.name}: {spec.nodes} x {tasks}", job=_job_row(spec, "SUBMITTING"))
    _send(spec, settings, registry)
    return spec


def _send(spec: JobSpec, settings: dict, registry) -> None:
    """Submit the job of `spec` through its backend; its id into job.json and the registry row."""
    from gpunb.jobs.entry import JobEntry

    backend = spec.backend
    try:
        backend.submit(spec, settings, backend.time_limit_min(settings), JobEntry(spec.folder))
    except GpunbError as error:
        if registry is not None:
            registry.set_job(spec.run_id, {"state": "NOT SUBMITTED"}, status="failed", error=error.what[:500])
        raise
    spec.save()
    if registry is not None:
        registry.set_job(spec.run_id, {"id": spec.job_id, "state": "PENDING"})


def resume_in_folder(spec: JobSpec, config, registry) -> JobSpec | None:
    """Submit a job that ended without a result again, in its own folder: like a requeued job it
    goes on exactly from the folder's newest checkpoint (entry.py), and says so in one line. None
    when it left no checkpoint (then it is submitted anew)."""
    from gpunb.jobs import events
    from gpunb.jobs.follow import newest_checkpoint

    found = newest_checkpoint(config.checkpoint_dir or spec.checkpoint_dir)
    if found is None:
        return None
    for leftover in (spec.stop_path, spec.path / CANCELLED_MARK):
        leftover.unlink(missing_ok=True)  # the old job's stop or cancel is not the new one's
    events.append(spec.events_path, "resubmitted")
    step = found[1].get("step")
    print(f"Job {spec.name!r} ended without a result; it goes on from its newest checkpoint (step {step}) "
          "in its folder. `--resubmit` starts afresh.")
    if registry is not None:
        registry.set_job(spec.run_id, {"state": "SUBMITTING", "reason": None}, status="queued")
    _send(spec, job_settings(config), registry)
    return spec


def job_settings(config) -> dict:
    """The cluster file's section with the run's own settings (`slurm={...}`) on top: a setting the
    backend knows by name at the top, any other in its table of other settings (Slurm's sbatch)."""
    backend = backends.chosen(config)
    chosen = dict(clusters.settings(backend))
    backend.check_settings(config.slurm, "slurm={...} (`--slurm KEY=VALUE`)")
    given, table = dict(config.slurm), backend.extra_table
    extra = {**dict(chosen.get(table) or {}), **dict(given.pop(table, None) or {})} if table else {}
    known = {s.name for s in backend.settings}
    for key, value in given.items():
        if key.replace("-", "_") in known:
            chosen[key.replace("-", "_")] = value
        elif table:
            extra[key] = value
        else:
            raise GpunbError(f"The setting {key!r} means nothing to cluster={config.cluster!r} ({backend.what}).",
                             f"drop it; the settings of {backend.name!r} are {', '.join(sorted(known))}.")
    if extra:
        chosen[table] = extra
    return chosen


def _price(config, settings: dict) -> float | None:
    price = config.gpu_hour_price if config.gpu_hour_price is not None else settings.get("gpu_hour_price")
    return float(price) if price is not None else None


def _job_row(spec: JobSpec, state: str) -> dict:
    """What the registry (the sidebar, gpunb.runs()) keeps of a job."""
    return {"cluster": spec.cluster, "id": spec.job_id, "folder": spec.folder, "key": spec.key,
            "nodes": spec.nodes, "tasks_per_node": spec.tasks_per_node, "gpus_per_node": spec.gpus_per_node,
            "state": state, "reason": None, "submitted_at": time.time()}


def _registry(config):
    if not config.track:
        return None
    from gpunb.runs import Registry

    return Registry()


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:40] or "run"
