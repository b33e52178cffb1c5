"""The kernel's side of a running job: its events into the dashboard, stop, cancel, weights back.

`Follower.run()` tails the job's events file (every POLL_S) into a FitState that mirrors
rank 0's, and calls the caller's callbacks (the dashboard, a text line) with it, as the
launcher does for ranks on this machine. Between the run's events it asks the scheduler
how the job stands (every SCHEDULER_POLL_S): while it waits, Slurm's state and reason go
to the run registry (the sidebar) and to callbacks that define `on_job_state(state, job)`.
Each node's GPU samples (gpus.py) go to callbacks that define `on_gpu_samples(state, samples)`,
each sample with its node and host; the result's energy is their nodes' sum, when they wrote any.

The kernel's interrupt button asks the job to stop (the stop file and the registry's stop
request): it stops at its next step, writes a checkpoint and sends its weights. A second
interrupt cancels it (scancel; local: the controller), and the newest checkpoint's weights
are loaded instead. The kernel that follows a job can die: the job goes on, and running
the cell again (or gpunb.attach) follows it from its first event.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field

from gpunb.errors import GpunbError
from gpunb.jobs import scheduler
from gpunb.jobs.events import EventsReader, relayed_fields
from gpunb.jobs.gpus import NodeGpuReader
from gpunb.runtime.events import Callbacks
from gpunb.runtime.interrupt import InterruptFlag
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
        self.callbacks = Callbacks([cb for cb in callbacks])
        self.job_hooks = [getattr(cb, "on_job_state") for cb in callbacks if hasattr(cb, "on_job_state")]
        self.gpu_hooks = [getattr(cb, "on_gpu_samples") for cb in callbacks if hasattr(cb, "on_gpu_samples")]
        self.state = RunState(config=config, model=model, module=model, optimizer=optimizer,
                              device=torch.device("cpu"), run_name=spec.name,
                              world_size=spec.nodes * spec.tasks_per_node)
        self.reader = EventsReader(spec.events_path)
        self.gpus = NodeGpuReader(spec.path)
        self.started = False  # the run's first on_fit_start was dispatched
        self.last_logged = -1  # the newest step whose log row the callbacks heard
        self.attempts: list = []  # (start, end) times of each of the job's starts
        self.scheduler_state = ("SUBMITTED" if not attached else "ATTACHED", None)
        self.stop_asked = False

    # ------------------------------------------------------------------ the loop
    def run(self) -> JobResult:
        """Follow the job to its end; returns its result, the weights loaded into the model."""
        outcome = None
        self._announce()
        next_poll = 0.0
        try:
            with InterruptFlag() as interrupt:
                while outcome is None:
                    outcome = self._read()
                    if outcome is not None:
                        break
                    if interrupt.raised and not self.stop_asked:
                        self.stop()
                    now = time.monotonic()
                    if now >= next_poll:
                        next_poll = now + SCHEDULER_POLL_S
                        outcome = self._poll_scheduler()
                        if outcome is not None:
                            break
                    time.sleep(POLL_S)
        except KeyboardInterrupt:  # the second interrupt: cancel now
            self.cancel()
            outcome = {"event": "cancelled"}
        except BaseException as error:
            self.callbacks.call("on_exception", self.state, error)
            raise
        return self._finish(outcome)

    def now(self) -> JobResult:
        """Without waiting: the result if the job has ended, else what is known (status queued or running)."""
        outcome = self._read()
        if outcome is None and self.spec.result_path.exists():
            outcome = self._read() or {"event": "job_done"}  # the end, even when its event is lost
        if outcome is not None and outcome["event"] in ("job_done", "job_failed"):
            return self._finish(outcome)
        state, reason = scheduler.job_state(self.spec)
        self._job_state(state, reason)  # the registry (the sidebar) hears it too
        return self._result(status="running" if self.attempts else "queued", scheduler_state=state)

    def stop(self) -> None:
        """Ask the job to stop at its next step (checkpoint written, weights sent back)."""
        self.stop_asked = True
        self.state.request_stop("interrupted")
        self.spec.stop_path.touch()
        if self.registry is not None:
            try:
                self.registry.request_stop(self.spec.run_id)
            except Exception:  # the stop file is enough; the registry is the sidebar's path
                pass
        self.callbacks.call("on_step_end", self.state)  # the dashboard shows "stopping" at once

    def cancel(self) -> None:
        scheduler.cancel(self.spec)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline and scheduler.job_state(self.spec)[0] not in scheduler.ENDED:
            time.sleep(0.2)

    # ------------------------------------------------------------------ events
    def _read(self) -> dict | None:
        self._read_gpus()
        for line in self.reader.read():
            kind = line["event"]
            if kind == "job_started":
                self.attempts.append([line["t"], None])
                self._job_state("RUNNING", None)
            elif kind == "requeued":
                self._end_attempt(line["t"])
                self._job_state("REQUEUED", "preempted")
            elif kind in ("job_done", "job_failed"):
                self._end_attempt(line["t"])
                return line
            else:
                self._dispatch(kind, line)
        return None

    def _read_gpus(self, every_node: bool = False) -> None:
        samples = self.gpus.read_all() if every_node else self.gpus.read()
        if samples:
            for hook in self.gpu_hooks:
                hook(self.state, samples)

    def _dispatch(self, event: str, line: dict) -> None:
        state = self.state
        if event == "on_fit_start":
            state.history = list(line["rows"])  # a resumed run sends its whole history again
        else:
            state.history.extend(line["rows"])
        state.load_relayed(relayed_fields(line))
        args = line.get("args", [])
        if event == "on_fit_start":
            if self.started:
                return  # a requeued job going on: the dashboard goes on where it was
            self.started = True
        elif event == "on_log":
            if args[0].get("step", state.step) <= self.last_logged:
                return  # resumed from a checkpoint before rows already shown
            self.last_logged = args[0].get("step", state.step)
        elif event == "on_fit_end":
            return  # the end is the job's (job_done), with the result and the weights
        if self.started:
            self.callbacks.call(event, state, *args)

    # ------------------------------------------------------------------ the scheduler
    def _poll_scheduler(self) -> dict | None:
        finished = self.spec.result_path.exists()  # the end, even when its event is lost or damaged
        state, reason = scheduler.job_state(self.spec)
        self._job_state(state, reason)
        if state not in scheduler.ENDED and not finished:
            return None
        outcome = self._read()  # the last lines may have come just before the end
        if outcome is not None:
            return outcome
        if finished:
            return {"event": "job_done"}
        if state.startswith("CANCELLED") or (self.spec.path / scheduler.CANCELLED_MARK).exists():
            return {"event": "cancelled"}
        return {"event": "gone", "state": state}

    def _job_state(self, state: str, reason: str | None) -> None:
        if (state, reason) == self.scheduler_state:
            return
        self.scheduler_state = (state, reason)
        if self.registry is not None:
            try:  # the job's own recorder writes the run's status once it runs; the scheduler's state is ours
                status = "queued" if state in ("PENDING", "REQUEUED", "CONFIGURING") else None
                self.registry.set_job(self.spec.run_id, {"state": state, "reason": reason}, status=status)
            except Exception:
                pass
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
        job = self._job_info()
        for hook in self.job_hooks:
            hook(self.state, job)

    # ------------------------------------------------------------------ the end
    def _finish(self, outcome: dict) -> JobResult:
        kind = outcome["event"]
        self._read_gpus(every_node=True)  # every node's last line (its energy) is written before the job's end
        if kind == "job_failed":
            error = _remote_error(outcome, self.spec)
            self.callbacks.call("on_exception", self.state, error)
            raise error
        if kind == "job_done":
            self._job_state("COMPLETED", None)  # a replayed job_started said RUNNING: the row follows the end
            result = self._done()
        elif kind == "cancelled":
            result = self._without_result("cancelled", "cancelled")
        else:
            error = GpunbError(f"The job ended ({outcome.get('state')}) without a result or an error from gpunb.",
                               f"its log is in {self.spec.submitit_dir}; a killed process (out of memory, the "
                               "time limit without a requeue) leaves nothing else. Its checkpoints are in "
                               f"{self.spec.checkpoint_dir}.")
            if self.registry is not None:
                try:
                    self.registry.set_job(self.spec.run_id, {"state": outcome.get("state")}, status="failed",
                                          error=error.what[:500])
                except Exception:
                    pass
            self.callbacks.call("on_exception", self.state, error)
            raise error
        self.state.result = result
        if self.started:
            self.callbacks.call("on_fit_end", self.state)
        return result

    def _done(self) -> JobResult:
        import torch

        with open(self.spec.result_path, "rb") as handle:
            trained = pickle.load(handle)
        final = torch.load(self.spec.weights_path, map_location="cpu", weights_only=True)
        result = self._result(status="stopped" if trained.stop_reason else "completed", base=trained)
        result.ema_state_dict = final.get("ema")
        self._load(final["model"], final.get("optimizer"))
        return result

    def _without_result(self, status: str, reason: str) -> JobResult:
        """Cancelled: the newest checkpoint's weights, when there is one."""
        from gpunb.runtime.state.checkpoint_files import (
            list_checkpoints,
            load_checkpoint,
        )

        if self.registry is not None:
            try:
                self.registry.set_job(self.spec.run_id, {"state": "CANCELLED", "reason": None}, status="cancelled")
            except Exception:
                pass
        found = list_checkpoints(self.spec.checkpoint_dir)
        result = self._result(status=status)
        result.interrupted, result.stop_reason = True, reason
        if found:
            payload = load_checkpoint(found[-1])
            self._load(payload["model"], None)
            result.checkpoint_path = str(found[-1])
        return result

    def _result(self, status: str, base: TrainResult | None = None, scheduler_state: str | None = None) -> JobResult:
        state = self.state
        if base is None:
            base = TrainResult(run_name=state.run_name, history=list(state.history), epochs=list(state.epochs),
                               validations=list(state.validations), config=self.config.to_dict(),
                               device=str(state.device), world_size=state.world_size, steps=state.step,
                               samples=state.samples_seen, checkpoint_path=state.checkpoint_path)
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

    def _load(self, model_state: dict, optimizer_state: dict | None) -> None:
        if self.model is None:
            return
        from gpunb.runtime.context import LocalContext

        local = LocalContext()
        local.load_model_state(self.model, model_state)  # a checkpoint may hold only what trains
        if self.optimizer is not None and optimizer_state is not None:
            local.load_optimizer_state(self.model, self.optimizer, optimizer_state)


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

