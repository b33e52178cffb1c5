"""Each task of a job runs `JobEntry` (its backend calls it; one task per GPU or CPU process).

1. Versions: job.json records the kernel's Python, torch, CUDA and gpunb; a job whose
   environment differs stops here, before unpickling anything, and rank 0 writes why into
   the events file, which the notebook shows within a second.
2. The group: the job's backend says where the task stands (backends/: Slurm's variables, or
   submitit's local executor's) and sets torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR ...);
   the runtime joins the group as it does under torchrun: NCCL between GPUs, gloo between CPU processes.
3. The fit: the Trainer's rank entry with the shipped arguments; checkpoints go to the job
   folder; a job that has checkpoints (requeued) resumes from its newest, exactly.
   Each node's first task also writes its GPUs' samples to gpus-<node>.jsonl (gpus.py).
4. The end: every rank leaves its report (distributed/relay.py, as a launched rank does);
   rank 0 writes result.pt (weights, optimizer state) and result.pkl (the TrainResult,
   timings of every rank, energy summed over them). A run stopped for preemption is requeued
   instead, by its backend (Slurm: `scontrol requeue`; local: submitit's requeue exit code),
   and the requeued job goes on from the checkpoint just written.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from dataclasses import replace

from gpunb.jobs import events
from gpunb.jobs import spec as job_spec
from gpunb.jobs.control import PREEMPTED, JobControl
from gpunb.jobs.gpus import NodeGpuWriter, gpus_path

TAG = "job-entry"


class JobEntry:
    """What every task of a job calls: only the folder travels in the backend's own pickle."""

    def __init__(self, folder: str):
        self.folder = str(folder)

    def __call__(self) -> str:
        spec = job_spec.load(self.folder)
        backend = spec.backend
        task = backend.task()
        rank = task.rank
        events_path = spec.events_path
        try:
            mismatch = job_spec.version_mismatch(spec.versions, job_spec.current_versions())
            if mismatch is not None:
                raise mismatch
            if rank == 0:
                events.append(events_path, "job_started", host=task.host, pid=os.getpid(),
                              world_size=task.world_size, job_id=task.job_id)
            outcome = _train(spec, backend, task)
        except BaseException as error:
            if rank == 0:
                from gpunb.distributed.relay import describe

                # the row first: a kernel that reads the event and returns finds the run failed
                _record(spec, {"state": "FAILED"}, "failed", f"{type(error).__name__}: {error}"[:500])
                events.append(events_path, "job_failed", **describe(error))
            raise
        if outcome == PREEMPTED:
            _requeue(spec, backend, task)
        if task.world_size > 1:
            # The result is written. Returning would tear the gloo group down at interpreter exit,
            # which can abort: the task's exit code, and Slurm's verdict on the job, would be FAILED.
            _leave(0)
        return outcome


def _train(spec, backend, task) -> str:
    """Join the group, fit, and on rank 0 write the result; returns the run's stop reason ('' if none)."""
    import torch

    from gpunb.distributed.context import current_context
    from gpunb.distributed.relay import RelayWriter
    from gpunb.distributed.shipping import unship

    if task.world_size > 1:
        backend.join_group(task)
        # The launcher's share of the cores per process: the same arithmetic, the same weights.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // spec.tasks_per_node))
    control = JobControl(spec.stop_path)
    control.install_signal_handlers(backend.requeue_signals)
    args = unship(spec.args_path.read_bytes())
    config = args.config  # as the user gave it: the registry, checkpoints and loggers record it so
    placement = job_placement(config, spec, task)
    context = current_context(config)
    rank = context.rank
    callbacks = [control]
    if rank == 0:
        callbacks += [RelayWriter(events.EventsChannel(spec.events_path)), *_recorder(spec, config), *_loggers(config)]
    if placement.local_rank == 0 and spec.gpus_per_node:
        callbacks.append(NodeGpuWriter(gpus_path(spec.folder, placement.node), node=placement.node,
                                       host=task.host, cuda_indices=range(spec.gpus_per_node)))
    module, _, name = spec.entry.partition(":")
    entry = getattr(importlib.import_module(module), name)
    model, optimizer = args.model, args.optimizer
    result = entry(config, context, model, args.train_data, args.val_data, optimizer=optimizer,
                   scheduler=args.scheduler, loss_fn=args.loss_fn, step=args.step, metrics=args.metrics,
                   callbacks=callbacks, state_type=args.state_type, placement=placement)
    return _leave_report(spec, context, model, optimizer, result, control)


def _leave_report(spec, context, model, optimizer, result, control) -> str:
    """Every rank's report to rank 0 (a collective: preempted or not, every rank takes part), then,
    unless preempted, the weights and, on rank 0, the result; returns the run's stop reason."""
    from gpunb.distributed.relay import gather_reports, rank_report, with_ranks, write_weights

    rank = context.rank
    preempted = result.stop_reason == PREEMPTED or (rank == 0 and control.preempted)
    reports = gather_reports(context, rank_report(rank, result))
    if preempted:
        return PREEMPTED
    write_weights(spec.weights_path, context, model, optimizer, result)  # FSDP: every rank takes part in the gather
    if rank == 0:
        _write_result(spec, with_ranks(result, reports))
        _record(spec, {"state": "COMPLETED", "reason": None})  # the row follows the job to its end
    return result.stop_reason or ""


def job_placement(config, spec, task):
    """How this task is placed: its rank and node; checkpoints in the job's folder unless the config
    names a checkpoint_dir, resumed from when there are some (requeued); the registry is written by
    the recorder with the job's run id, so the task adds none of its own."""
    from gpunb.runtime.placement import Placement
    from gpunb.runtime.state.checkpoint_files import list_checkpoints

    placement = Placement(rank=task.rank, world_size=task.world_size, local_rank=task.local_rank, node=task.node,
                          records=False, checkpoint_dir=str(spec.checkpoint_dir))
    requeued = bool(list_checkpoints(placement.checkpoints(config)))  # go on exactly from the newest
    return replace(placement, resume="last") if requeued else placement


def _recorder(spec, config) -> list:
    if not spec.registry:
        return []
    from gpunb.runs import Registry, RunRecorder

    return [RunRecorder(Registry(spec.registry), run_id=spec.run_id)]


def _loggers(config) -> list:
    if not config.loggers:
        return []
    from gpunb.loggers import make_loggers

    return make_loggers(config)


def _write_result(spec, result) -> None:
    """result.pkl (the TrainResult; result.pt, the weights, is written), whole then renamed, and its event."""
    temporary = spec.result_path.with_suffix(".pkl.partial")
    temporary.write_bytes(pickle.dumps(result))
    os.replace(temporary, spec.result_path)
    events.append(spec.events_path, "job_done", stop_reason=result.stop_reason, step=result.steps)


def _requeue(spec, backend, task) -> None:
    """Preempted: rank 0 puts the job back in the queue; every task leaves without a result
    (submitit would take one for the job's end)."""
    if task.rank == 0:
        events.append(spec.events_path, "requeued")
        _record(spec, {"state": "REQUEUED", "reason": "preempted"}, "queued")
        sys.stdout.flush()
        try:
            backend.requeue(task)  # Slurm: scontrol requeue; local: exits with submitit's requeue code
        except SystemExit as leaving:
            _leave(leaving.code)
    _leave(1)


def _record(spec, job: dict, status: str | None = None, error: str | None = None) -> None:
    """The job's state into its registry row (the sidebar), when the run is tracked; `status`: the
    run's too (a completed or stopped run's is its recorder's)."""
    if not spec.registry:
        return
    from gpunb.runs import Registry

    try:
        Registry(spec.registry).set_job(spec.run_id, job, status=status, error=error)
    except Exception:  # the registry is a view; the job's own end matters more
        pass


def _leave(code) -> None:
    """Exit at once: tearing down a gloo group at interpreter exit can abort (see
    distributed/worker.py), which would hide the requeue exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
