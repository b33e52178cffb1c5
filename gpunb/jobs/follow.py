"""The kernel's side of a running job: its events into the dashboard, stop, cancel, weights back.

`Follower.run()` tails the job's events file (every POLL_S) into the relay's Mirror
(distributed/relay.py), a RunState that mirrors rank 0's and calls the caller's callbacks
(the dashboard, a text line) with it, as the launcher's does for ranks on this machine; this
module keeps the job's lifetime. Between the run's events it asks the scheduler
how the job stands (every SCHEDULER_POLL_S): while it waits, Slurm's state and reason go
to the run registry (the sidebar) and to callbacks that define `on_job_state(state, job)`.
Each node's GPU samples (gpus.py) go to callbacks that define `on_gpu_samples(state, samples)`,
each sample with its node and host; the result's energy is their nodes' sum, when they wrote any.

The kernel's interrupt button asks the job to stop (the stop file, with who asked), once it
is clear that no restart or shutdown of the kernel came with it (interrupts.py): the job stops
at its next step, writes a checkpoint and sends its weights. A second interrupt cancels it
(scancel; local: the controller), and the newest readable checkpoint's weights are loaded
instead. The kernel that follows a job can restart, shut down or die: the job goes on, and
running the cell again (or gpunb.attach) follows it from its first event.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field

from gpunb.distributed.relay import Mirror
from gpunb.errors import GpunbError
from gpunb.jobs import events
from gpunb.jobs.backends.base import CANCELLED_MARK, ENDED
from gpunb.jobs.control import request_stop
from gpunb.jobs.gpus import NodeGpuReader
from gpunb.jobs.interrupts import KernelInterrupts
from gpunb.runtime.result import TrainResult
from gpunb.runtime.run_state import RunState

POLL_S = 0.1  # the events file is read this often (the dashboard's lag behind the job)
SCHEDULER_POLL_S = 2.0  # squeue / the local controller is asked this often
CANCEL_WAIT_S = 15.0  # after a cancel, how long to wait for the job's processes to end


@dataclass(repr=False)
class JobResult(TrainResult):
    """A job's TrainResult: also its `status`, the job (`job`: cluster, id, folder, nodes), its
    GPU-hours and cost; `model` (TrainResult's field) is the model with the job's weights once it ended."""

    status: str = "queued"  # queued, running, completed, stopped, cancelled, failed
    job: dict = field(default_factory=dict)
    gpu_hours: float | None = None
    cost: float | None = None  # gpu_hours x the GPU-hour price, when one is set
    energy_by_node: dict | None = None  # node number -> its GPUs' energy (J), from their samples files
    loaded_step: int | None = None  # cancelled: the step of the checkpoint whose weights were loaded

    def __repr__(self) -> str:
        job = self.job or {}
        where = f"{job.get('cluster')} job {job.get('id')}, {job.get('nodes')} node(s) x {job.get('tasks_per_node')}"
        if not self.steps:
            return f"JobResult({self.run_name!r}: {self.status}; {where})"
        cost = f", {self.gpu_hours:.2f} GPU-hours" if self.gpu_hours is not None else ""
        cost += f", cost {self.cost:.2f}" if self.cost is not None else ""
        return f"{TrainResult.__repr__(self)}\n  {where}: {self.status}{cost}"


class Follower:
    def __init__(self, spec, config, callbacks=(), *, model=None, optimizer=None, registry=None, attached=False):
        import torch

        self.spec, self.config, self.registry = spec, config, registry
        self.model, self.optimizer = model, optimizer
        self.attached = attached  # found an existing job (not submitted now)
        self.job_hooks = [getattr(cb, "on_job_state") for cb in callbacks if hasattr(cb, "on_job_state")]
        self.gpu_hooks = [getattr(cb, "on_gpu_samples") for cb in callbacks if hasattr(cb, "on_gpu_samples")]
        self.state = RunState(config=config, model=model, optimizer=optimizer,
                              device=torch.device("cpu"), run_name=spec.name,
                              world_size=spec.nodes * spec.tasks_per_node)
        self.mirror = Mirror(self.state, callbacks)
        self.callbacks = self.mirror.callbacks
        self.reader = events.EventsReader(spec.events_path)
        self.gpus = NodeGpuReader(spec.path)
        self.attempts: list = []  # (start, end) times of each of the job's starts
        self.scheduler_state = ("SUBMITTED" if not attached else "ATTACHED", None)
        self.stop_asked = False
        self.cancel_reason: str | None = None  # who cancelled the job, in words, when this kernel did
        self.next_poll: float | None = None  # poll(): when the scheduler is asked next (None: not polled yet)

    # ------------------------------------------------------------------ the loop
    def run(self) -> JobResult:
        """Follow the job to its end; returns its result, the weights loaded into the model. A kernel
        that is shutting down (a restart, a shut down) leaves the job running (interrupts.py)."""
        outcome = None
        self._announce()
        next_poll = 0.0
        try:
            with KernelInterrupts() as interrupts:
                while outcome is None:
                    outcome = self._read() or self._interrupted(interrupts)
                    if outcome is not None:
                        break
                    now = time.monotonic()
                    if now >= next_poll:
                        next_poll = now + SCHEDULER_POLL_S
                        outcome = self._poll_scheduler()
                        if outcome is not None:
                            break
                    time.sleep(POLL_S)
        except BaseException as error:
            self.callbacks.call("on_exception", self.state, error)
            raise
        if outcome["event"] == "detached":
            return self._result(status="running" if self.attempts else "queued")
        return self._finish(outcome)

    def poll(self) -> JobResult | None:
        """One look at the job, without waiting (a sweep follows several jobs): its result once it
        has ended (the weights loaded), else None. The kernel's interrupts are the caller's to read."""
        if self.next_poll is None:
            self._announce()
            self.next_poll = 0.0
        outcome = self._read()
        now = time.monotonic()
        if outcome is None and now >= self.next_poll:
            self.next_poll = now + SCHEDULER_POLL_S
            outcome = self._poll_scheduler()
        return None if outcome is None else self._finish(outcome)

    def _interrupted(self, interrupts) -> dict | None:
        """The kernel's interrupts that stand (not a restart's or a shutdown's): the first asks the job
        to stop, a second cancels it; a kernel shutting down detaches (the job goes on)."""
        if interrupts.shutting_down():
            return {"event": "detached"}
        pressed = interrupts.due()
        if pressed >= 2:
            self.cancel("cancelled from the notebook")
            return {"event": "cancelled"}
        if pressed == 1 and not self.stop_asked:
            self.stop()
        return None

    def now(self) -> JobResult:
        """Without waiting: the result if the job has ended, else what is known (status queued or running)."""
        outcome = self._read()
        if outcome is None and self.spec.result_path.exists():
            outcome = self._read() or {"event": "job_done"}  # the end, even when its event is lost
        if outcome is not None and outcome["event"] in ("job_done", "job_failed"):
            return self._finish(outcome)
        state, reason = self.spec.backend.state(self.spec)
        self._job_state(state, reason)  # the registry (the sidebar) hears it too
        return self._result(status="running" if self.attempts else "queued", scheduler_state=state)

    def stop(self, reason: str = "stopped from the notebook") -> None:
        """Ask the job to stop at its next step (checkpoint written, weights sent back)."""
        self.stop_asked = True
        self.state.request_stop("interrupted")
        request_stop(self.spec, reason)
        self.callbacks.call("on_step_end", self.state)  # the dashboard shows "stopping" at once

    def cancel(self, reason: str = "cancelled from the notebook") -> None:
        self.spec.backend.cancel(self.spec)
        self.cancel_reason = reason
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline and self.spec.backend.state(self.spec)[0] not in ENDED:
            time.sleep(0.2)

    # ------------------------------------------------------------------ events
    def _read(self) -> dict | None:
        self._read_gpus()
        lines = self.reader.read()
        # A job submitted again in its folder (submit.resume_in_folder): its earlier end is not this one.
        again = max((i for i, line in enumerate(lines) if line["event"] == "resubmitted"), default=-1)
        for index, line in enumerate(lines):
            kind = line["event"]
            if kind == "resubmitted" or (index < again and kind in ("job_done", "job_failed")):
                self._end_attempt(line["t"])
            elif kind == "job_started":
                if not self.attempts:
                    self.state.started_at = line["t"]  # elapsed time counts from the job's start, re-attached too
                self.attempts.append([line["t"], None])
                self._job_state("RUNNING", None)
            elif kind == "requeued":
                self._end_attempt(line["t"])
                self._job_state("REQUEUED", "preempted")
            elif kind in ("job_done", "job_failed"):
                self._end_attempt(line["t"])
                return line
            else:
                self.mirror.receive(events.message(line))
        return None

    def _read_gpus(self, every_node: bool = False) -> None:
        samples = self.gpus.read_all() if every_node else self.gpus.read()
        if samples:
            for hook in self.gpu_hooks:
                hook(self.state, samples)

    # ------------------------------------------------------------------ the scheduler
    def _poll_scheduler(self) -> dict | None:
        finished = self.spec.result_path.exists()  # the end, even when its event is lost or damaged
        state, reason = self.spec.backend.state(self.spec)
        self._job_state(state, reason)
        if state not in ENDED and not finished:
            return None
        outcome = self._read()  # the last lines may have come just before the end
        if outcome is not None:
            return outcome
        if finished:
            return {"event": "job_done"}
        if state.startswith("CANCELLED") or (self.spec.path / CANCELLED_MARK).exists():
            return {"event": "cancelled", "reason": self._cancel_reason()}
        return {"event": "gone", "state": state}

    def _job_state(self, state: str, reason: str | None) -> None:
        if (state, reason) == self.scheduler_state:
            return
        if self.registry is not None:
            try:  # the job's own recorder writes the run's status once it runs; the scheduler's state is ours
                status = "queued" if state in ("PENDING", "REQUEUED", "CONFIGURING") else None
                self.registry.set_job(self.spec.run_id, {"state": state, "reason": reason}, status=status)
            except Exception:
                pass
        self._tell(state, reason)

    def _tell(self, state: str, reason: str | None) -> None:
        """The job's state to the callbacks that follow it (the line above the dashboard)."""
        self.scheduler_state = (state, reason)
        job = self._job_info()
        for hook in self.job_hooks:
            hook(self.state, job)

    def _job_info(self) -> dict:
        state, reason = self.scheduler_state
        return {"cluster": self.spec.cluster, "id": self.spec.job_id, "name": self.spec.name,
                "run_id": self.spec.run_id, "folder": self.spec.folder, "nodes": self.spec.nodes,
                "tasks_per_node": self.spec.tasks_per_node, "gpus_per_node": self.spec.gpus_per_node,
                "state": state, "reason": reason, "attached": self.attached}

    def _end_attempt(self, t: float) -> None:
        if self.attempts and self.attempts[-1][1] is None:
            self.attempts[-1][1] = t

    def _announce(self) -> None:
        self._tell(*self.scheduler_state)

    # ------------------------------------------------------------------ the end
    def _finish(self, outcome: dict) -> JobResult:
        kind = outcome["event"]
        self._read_gpus(every_node=True)  # every node's last line (its energy) is written before the job's end
        if kind == "job_failed" and self._was_cancelled():
            kind = "cancelled"  # a cancelled job's ranks die of their peers' end (gloo): that is no failure
        if kind == "job_failed":
            error = _remote_error(outcome, self.spec)
            self.callbacks.call("on_exception", self.state, error)
            raise error
        if kind == "job_done":
            self._job_state("COMPLETED", None)  # a replayed job_started said RUNNING: the row follows the end
            result = self._done()
        elif kind == "cancelled":
            result = self._without_result(outcome.get("reason") or self._cancel_reason())
        else:
            error = GpunbError(f"The job ended ({outcome.get('state')}) without a result or an error from gpunb.",
                               f"its log is in {self.spec.submitit_dir}; a killed process (out of memory, the "
                               "time limit without a requeue) leaves nothing else. Its checkpoints are in "
                               f"{self.spec.checkpoint_dir}; running the cell again resumes from the newest.")
            if self.registry is not None:
                try:
                    self.registry.set_job(self.spec.run_id, {"state": outcome.get("state")}, status="failed",
                                          error=error.what[:500])
                except Exception:
                    pass
            self.callbacks.call("on_exception", self.state, error)
            raise error
        self.state.result = result
        self._tell(result.status.upper(), result.stop_reason if result.status != "completed" else None)
        if self.mirror.started:
            self.callbacks.call("on_fit_end", self.state)
        return result

    def _was_cancelled(self) -> bool:
        return self.cancel_reason is not None or (self.spec.path / CANCELLED_MARK).exists()

    def _cancel_reason(self) -> str:
        """Who cancelled the job, in words: this kernel, the sidebar or gpunb.stop (their words are in
        the registry), or the scheduler (scancel, a time limit without a requeue)."""
        if self.cancel_reason is not None:
            return self.cancel_reason
        try:
            row = self.registry.get_run(self.spec.run_id, with_history=False) if self.registry else None
        except Exception:
            row = None
        if row and (row.get("stop_reason") or "").startswith("cancelled"):
            return row["stop_reason"]
        if (self.spec.path / CANCELLED_MARK).exists():
            return "cancelled from gpunb"
        return self.spec.backend.cancelled_elsewhere

    def _done(self) -> JobResult:
        with open(self.spec.result_path, "rb") as handle:
            trained = pickle.load(handle)
        result = self._result(status="stopped" if trained.stop_reason else "completed", base=trained)
        if trained.stop_reason and self._was_cancelled():  # its tasks stopped in time, on the cancel's SIGINT
            result.status, result.stop_reason = "cancelled", self._cancel_reason()
            self._record_cancel(result.stop_reason)  # the tasks' recorder wrote "interrupted"
        result.ema_state_dict = self.mirror.weights_back(self.spec.weights_path)
        return result

    def _record_cancel(self, reason: str) -> None:
        """The row says cancelled, and by whom; a registry that cannot be written costs the record, never the weights."""
        if self.registry is not None:
            try:
                self.registry.set_job(self.spec.run_id, {"state": "CANCELLED", "reason": None}, status="cancelled",
                                      stop_reason=reason)
            except Exception:
                pass

    def _without_result(self, reason: str) -> JobResult:
        """Cancelled: the newest readable checkpoint's weights, when there is one."""
        self._record_cancel(reason)
        result = self._result(status="cancelled")
        result.interrupted, result.stop_reason = True, reason
        newest = newest_checkpoint(self.spec.checkpoint_dir)
        if newest is not None:
            path, payload = newest
            self.mirror.load(payload["model"])
            result.checkpoint_path, result.loaded_step = str(path), payload.get("step")
        return result

    def _result(self, status: str, base: TrainResult | None = None, scheduler_state: str | None = None) -> JobResult:
        state = self.state
        if base is None:  # what the job's events told so far; nothing of a job that never set up
            plan = getattr(state, "plan", None)
            known = {} if plan is None else dict(
                device=str(state.device), precision=plan.precision, precision_reason=plan.precision_reason,
                batch_size=plan.batch_size, micro_batch_size=plan.batch_size, grad_accum=self.config.grad_accum)
            base = TrainResult(run_name=state.run_name, history=list(state.history), epochs=list(state.epochs),
                               validations=list(state.validations), config=self.config.to_dict(),
                               world_size=state.world_size, steps=state.step, samples=state.samples_seen,
                               checkpoint_path=state.checkpoint_path,
                               **{"device": "", "precision": "", **known})
        fields = {name: value for name, value in base.__dict__.items() if not name.startswith("_")}
        job = self._job_info()
        if scheduler_state is not None:
            job["state"] = scheduler_state
        result = JobResult(**fields, status=status, job=job)
        if self.gpus.energy_j is not None:  # every node's GPUs, every attempt (result.pkl: the ranks' own)
            result.energy_j, result.energy_by_node = self.gpus.energy_j, self.gpus.energy_by_node
        hours = sum((end or time.time()) - start for start, end in self.attempts) / 3600
        gpus = self.spec.nodes * self.spec.gpus_per_node
        if gpus and self.attempts:
            result.gpu_hours = gpus * hours
            if self.spec.gpu_hour_price is not None:
                result.cost = result.gpu_hours * self.spec.gpu_hour_price
        if self.model is not None and status in ("completed", "stopped", "cancelled"):
            result.model = self.model
        return result


def newest_checkpoint(directory) -> tuple | None:
    """(path, payload) of the newest checkpoint in `directory` that loads, as a resume picks it
    (an unreadable newer one named in a warning); None when none does."""
    import warnings

    from gpunb.runtime.state.resume_target import open_checkpoint

    try:
        path, payload, fell_back = open_checkpoint(str(directory), None)
    except GpunbError:  # no checkpoint there, or none readable
        return None
    if fell_back:
        warnings.warn(f"gpunb: {fell_back}", stacklevel=2)
    return path, payload


def _remote_error(outcome: dict, spec) -> GpunbError:
    """The job's error, as the notebook shows it: gpunb's own errors as they are, others with the
    job's traceback."""
    if outcome.get("what"):
        return GpunbError(outcome["what"], outcome.get("hint"))
    error = GpunbError(f"The job failed: {outcome['type']}: {outcome['message']}",
                       f"the traceback below is from the job (its log: {spec.submitit_dir}); fix the error, then "
                       "run the cell again with `--resubmit`.")
    error.args = (f"{error.args[0]}\n\nTraceback in the job:\n{outcome['traceback'].rstrip()}",)
    return error

