"""The kernel's side of a submission: the job folder, the checks, the executor, the registry row.

`run_job` is what gpunb.Trainer calls for `cluster="local"|"slurm"`: it finds the job of
this run when there is one (the same cell run again: its key, unless `resubmit`), else
submits a new one, then follows it (follow.py) until it ends.
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import time
import uuid

from gpunb.errors import GpunbError
from gpunb.jobs import checks, clusters, scheduler
from gpunb.jobs.spec import JobSpec, current_versions

DEFAULT_SLURM_TIME_MIN = 24 * 60  # a Slurm job's time limit when neither the run nor the cluster file sets one


def run_job(config, entry, model, train_data, val_data=None, *, callbacks=(), key=None, wait=True, **arguments):
    """Submit (or find) the job of this run and follow it; returns its JobResult (the weights in `model`)."""
    follower = job_follower(config, entry, model, train_data, val_data, callbacks=callbacks, key=key, **arguments)
    return follower.run() if wait else follower.now()


def job_follower(config, entry, model, train_data, val_data=None, *, callbacks=(), key=None, **arguments):
    """Submit (or find) the job of this run; returns its Follower, not yet following (a sweep
    follows several at once through `Follower.poll`)."""
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
        spec, attached = resume_in_folder(spec, config, registry), False  # killed, cancelled, failed
    if spec is None:
        from gpunb.distributed.shipping import FitArgs

        args = FitArgs(config, model, train_data, val_data, **{name: arguments.get(name) for name in
                                                               ("optimizer", "scheduler", "loss_fn", "step", "metrics",
                                                                "state_type")})
        spec = submit(config, entry, args, key=key, registry=registry)
    return Follower(spec, config, callbacks, model=model, optimizer=arguments.get("optimizer"),
                    registry=registry, attached=attached)


def submit(config, entry, args, *, key: str | None, registry) -> JobSpec:
    """Check, write the job folder, submit through submitit, record the queued run; returns the spec."""
    cluster = config.cluster
    settings = job_settings(config)
    root = clusters.job_dir(cluster, settings)
    if cluster == "slurm":
        checks.check_slurm()  # first: an unreachable Slurm explains every later failure
        checks.check_shared(root, settings)
    tasks, gpus = processes_and_gpus(config)
    payload = checks.shipped(args, float(settings.get("max_ship_mb", checks.DEFAULT_MAX_SHIP_MB)))
    run_id = uuid.uuid4().hex
    name = config.name or type(args.model).__name__
    folder = root / f"{_slug(name)}-{run_id[:8]}"
    folder.mkdir(parents=True)
    spec = JobSpec(run_id=run_id, name=name, key=key, cluster=cluster, folder=str(folder), nodes=config.nodes,
                   tasks_per_node=tasks, gpus_per_node=gpus, accelerator=config.accelerator,
                   entry=f"{entry.__module__}:{entry.__qualname__}",
                   registry=str(registry.path) if registry is not None else None, versions=current_versions(),
                   gpu_hour_price=_price(config, settings), job_name=folder.name)
    spec.args_path.write_bytes(payload)
    spec.save()
    if registry is not None:
        registry.start_run(name, config=config.to_dict(), run_id=run_id, status="queued",
                           device=f"{cluster}: {spec.nodes} x {tasks}", job=_job_row(spec, "SUBMITTING"))
    _send(spec, settings, registry)
    return spec


def _send(spec: JobSpec, settings: dict, registry) -> None:
    """Submit the job of `spec` through submitit; its id into job.json and the registry row."""
    from gpunb.jobs.entry import JobEntry

    executor = scheduler.executor(spec, settings, timeout_minutes(spec.cluster, settings))
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):  # submitit prints sbatch's error, then raises it: once is enough
            job = executor.submit(JobEntry(spec.folder))
    except Exception as error:
        if registry is not None:
            registry.set_job(spec.run_id, {"state": "NOT SUBMITTED"}, status="failed", error=str(error)[:500])
        raise _not_submitted(error) from error
    sys.stderr.write(printed.getvalue())  # anything else it said (a warning) is not lost
    spec.job_id, spec.job_started = str(job.job_id), None
    if spec.cluster == "local":
        import psutil

        spec.job_started = psutil.Process(int(job.job_id)).create_time()
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
    for leftover in (spec.stop_path, spec.path / scheduler.CANCELLED_MARK):
        leftover.unlink(missing_ok=True)  # the old job's stop or cancel is not the new one's
    events.append(spec.events_path, "resubmitted")
    step = found[1].get("step")
    print(f"Job {spec.name!r} ended without a result; it goes on from its newest checkpoint (step {step}) "
          "in its folder. `--resubmit` starts afresh.")
    if registry is not None:
        registry.set_job(spec.run_id, {"state": "SUBMITTING", "reason": None}, status="queued")
    _send(spec, job_settings(config), registry)
    return spec


UNREACHABLE = ("configuration source", "Unable to contact", "Zero Bytes were transmitted", "Connection refused")


def processes_and_gpus(config) -> tuple[int, int]:
    """(tasks per node, GPUs asked per node) of a job.

    A local job runs on this machine, so `accelerator="auto"` is decided here as a run in the
    kernel would decide it: with GPUs visible, each task gets one (submitit's local executor hides
    the GPUs it was not asked for). A Slurm job runs on nodes this machine cannot see: there only
    `gpus_per_node` or `accelerator="cuda"` asks for GPUs.
    """
    if config.gpus_per_node:
        return config.gpus_per_node, config.gpus_per_node
    if config.cluster == "local":
        import torch

        from gpunb.distributed.launch import plan_devices

        accelerator, tasks, _ = plan_devices(config)
        # gloo may put more tasks than GPUs on this machine: they share the visible ones
        return tasks, (min(tasks, torch.cuda.device_count()) if accelerator == "cuda" else 0)
    tasks = config.devices if isinstance(config.devices, int) else 1
    return tasks, (tasks if config.accelerator == "cuda" else 0)


def _not_submitted(error: Exception) -> GpunbError:
    """sbatch's refusal, each of its lines once, under the hint that fits it."""
    said = []
    for line in str(error).splitlines():
        line = checks.slurm_error(line)
        if line and line not in said:
            said.append(line)
    text = "; ".join(said) or type(error).__name__
    if any(sign in text for sign in UNREACHABLE):
        return GpunbError(f"The job could not be submitted: Slurm does not answer here (`sbatch`: {text}).",
                          checks.NO_SLURM_HINT)
    return GpunbError(f"The job could not be submitted: {text}",
                      "check the Slurm settings (partition, account, time) in the run's options and in "
                      f"{clusters.path()}; `sbatch --test-only` with them says what Slurm refuses.")


def job_settings(config) -> dict:
    """The cluster file's section with the run's own Slurm settings on top."""
    chosen = dict(clusters.settings(config.cluster))
    clusters.check_settings(config.slurm, "slurm={...} (`--slurm KEY=VALUE`)")
    given = dict(config.slurm)
    sbatch = {**dict(chosen.get("sbatch") or {}), **dict(given.pop("sbatch", None) or {})}
    for key, value in given.items():
        if key.replace("-", "_") in clusters.KEYS:
            chosen[key.replace("-", "_")] = value
        else:
            sbatch[key] = value
    if sbatch:
        chosen["sbatch"] = sbatch
    return chosen


def timeout_minutes(cluster: str, settings: dict) -> float:
    """Slurm's time format ("90", "2:00:00", "1-12:00:00") as minutes."""
    given = settings.get("time")
    if given is None:
        return DEFAULT_SLURM_TIME_MIN if cluster == "slurm" else scheduler.DEFAULT_TIMEOUT_MIN
    text = str(given).strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise GpunbError(f"time={given!r} is not a Slurm time limit.",
                         "write minutes (`90`), `hours:minutes:seconds` (`2:00:00`) or `days-hours:minutes:seconds`.")
    days, first, second, third = match.groups()
    if days is not None:  # d-hh[:mm[:ss]]
        return int(days) * 1440 + int(first) * 60 + int(second or 0) + int(third or 0) / 60
    if third is not None:  # hh:mm:ss
        return int(first) * 60 + int(second) + int(third) / 60
    if second is not None:  # mm:ss
        return int(first) + int(second) / 60
    return float(first)


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
