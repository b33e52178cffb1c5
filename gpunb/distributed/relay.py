"""The relay from rank 0 to the kernel, for every run whose ranks train away from the kernel.

Ranks the launcher started (launch.py) and the tasks of a job (gpunb/jobs/) differ only in the
channel between rank 0 and the kernel, and in the lifetimes of their processes; what travels
and what the kernel does with it is written here, once:

- Rank 0: `RelayWriter`, a callback, sends each of the run's events as a message: the event's
  name and arguments, the log rows not sent yet, and the RunState's relayed fields
  (`RunState.relayed`); on_step_end as a progress update at most every PROGRESS_EVERY_S. A
  channel has `send(message) -> bool` (False: lost; its rows go out with the next message),
  `stop_requested() -> reason or None` and `close()`: `QueueChannel` (the launcher's queue, with
  the kernel's stop requests in through a shared flag) or `gpunb.jobs.events.EventsChannel` (a
  line of the job's events file; a job's stops come in through jobs/control.py).
- The kernel: `Mirror`, a RunState kept equal to rank 0's from the messages, whose callbacks
  (the dashboard, the run registry, loggers) hear each event once: a requeued job's second
  on_fit_start and rows already shown are not told again. At the end it brings the weights back
  into the caller's model and optimizer.
- Every rank at its end: `write_weights` (every rank takes part, FSDP gathers; rank 0 writes
  the file), `rank_report` (the one report a rank leaves: its timings, and rank 0's result),
  and `with_ranks` (rank 0's result with every rank's timings and the energy summed over them),
  wherever the reports meet: the kernel for launched ranks (over the queue), rank 0 for a job's
  tasks (`gather_reports`, over the process group); a failed rank leaves `describe(error)`.

A new way to run ranks elsewhere (a sweep's trials, another cluster engine) brings a channel
and the lifetimes of its processes, and uses the rest as it is.
"""

from __future__ import annotations

import copy
import os
import time
import traceback

from gpunb.errors import GpunbError
from gpunb.runtime.events import Callbacks

PROGRESS_EVERY_S = 0.25  # rank 0 sends its progress (on_step_end) at most this often
RUN, STOP, INTERRUPT = 0, 1, 2  # values of the launcher's shared stop flag


class RelayWriter:
    """Rank 0's callback: each event of the run over `channel` to the kernel; the kernel's stop
    requests in. Nothing is sent before on_fit_start or after the fit's end."""

    def __init__(self, channel):
        self.channel = channel
        self.rows_sent = 0
        self.progress_sent = 0.0
        self.open = False  # from on_fit_start to the fit's end

    def on_fit_start(self, state) -> None:
        self.rows_sent = 0  # a resumed run sends its history again: the mirror takes it whole
        self.open = True
        self._send("on_fit_start", state)

    def on_step_end(self, state) -> None:
        reason = self.channel.stop_requested()
        if reason is not None:
            state.request_stop(reason)  # with several ranks: voted on at the next log
        now = time.monotonic()  # per step only a clock read: the progress goes out at most 4 times a second
        if now - self.progress_sent >= PROGRESS_EVERY_S:
            self.progress_sent = now
            self._send("on_step_end", state)

    def on_log(self, state, metrics) -> None:
        self._send("on_log", state, dict(metrics))

    def on_validation_end(self, state, metrics) -> None:
        self._send("on_validation_end", state, dict(metrics))

    def on_epoch_end(self, state, metrics) -> None:
        self._send("on_epoch_end", state, dict(metrics))

    def on_checkpoint(self, state, path) -> None:
        self._send("on_checkpoint", state, str(path))

    def on_fit_end(self, state) -> None:
        self._send("on_fit_end", state, stop_reason=state.stop_reason)
        self._close()

    def on_exception(self, state, error) -> None:
        self._close()

    def _send(self, event: str, state, *args, **extra) -> None:
        if not self.open:
            return
        message = {"event": event, "rows": state.history[self.rows_sent:], "fields": state.relayed(),
                   "args": list(args), **extra}
        if self.channel.send(message):
            self.rows_sent = len(state.history)  # the rows of a lost message go out with the next one

    def _close(self) -> None:
        self.open = False
        self.channel.close()


class QueueChannel:
    """The launcher's channel: messages over its multiprocessing queue; its stop requests in
    through a shared integer (RUN, STOP or INTERRUPT)."""

    def __init__(self, queue, stop):
        self.queue, self.stop = queue, stop

    def send(self, message: dict) -> bool:
        # A deep copy: the queue pickles on its own thread, later, while training goes on.
        self.queue.put(("event", 0, copy.deepcopy(message)))
        return True

    def stop_requested(self) -> str | None:
        code = self.stop.value  # a read of shared memory: no lock, no sync
        if code == RUN:
            return None
        return "interrupted" if code == INTERRUPT else "stopped"

    def close(self) -> None:
        pass  # the queue is the rank's: it is flushed when the rank leaves


class Mirror:
    """The kernel's copy of rank 0's RunState (`state`: built by the caller, holding the caller's
    model and optimizer), and the callbacks here that hear the relayed events."""

    def __init__(self, state, callbacks=()):
        self.state = state
        self.callbacks = Callbacks(list(callbacks))
        self.started = False  # the run's first on_fit_start was heard: rank 0 trains
        self.last_logged = -1  # the newest step whose log row the callbacks heard

    def receive(self, message: dict) -> None:
        """Bring the state up to date with rank 0's, then call the callbacks here, if they are due."""
        state, event, args = self.state, message["event"], message.get("args", [])
        if event == "on_fit_start":
            state.history = list(message["rows"])  # a resumed run sends its whole history again
        else:
            state.history.extend(message["rows"])
        state.load_relayed(message["fields"])
        if self._due(event, args):
            self.callbacks.call(event, state, *args)

    def _due(self, event: str, args: list) -> bool:
        if event == "on_fit_start":
            first = not self.started  # a requeued job going on: the dashboard goes on where it was
            self.started = True
            return first
        if event == "on_log":
            step = args[0].get("step", self.state.step)
            if step <= self.last_logged:
                return False  # resumed from a checkpoint before rows already shown
            self.last_logged = step
        elif event == "on_fit_end":
            return False  # the end is the launcher's or the job's, with the result and the weights
        return self.started

    def weights_back(self, path) -> dict | None:
        """The weights file rank 0 wrote (`write_weights`) into the caller's model and optimizer;
        returns the weight average it holds, for the result."""
        import torch

        final = torch.load(path, map_location="cpu", weights_only=True)
        self.load(final["model"], final.get("optimizer"))
        return final.get("ema")

    def load(self, model_state: dict, optimizer_state: dict | None = None) -> None:
        """Weights into the caller's model (wherever its parameters live), and its optimizer's state."""
        from gpunb.runtime.context import LocalContext

        model, optimizer = self.state.model, self.state.optimizer
        if model is None:
            return
        local = LocalContext()
        local.load_model_state(model, model_state)  # what trained (a checkpoint's): the frozen weights never left
        if optimizer is not None and optimizer_state is not None:
            local.load_optimizer_state(model, optimizer, optimizer_state)


def write_weights(path, context, model, optimizer, result) -> None:
    """At a fit's end on every rank (FSDP gathers the shards to rank 0), rank 0 writes the weights
    file whole, then renames it: what trained, the optimizer's state (when `optimizer` is given)
    and the weight average, which then leaves the result."""
    import torch

    from gpunb.runtime.trainable import trainable_part

    model_state, optimizer_state = context.state_dicts(model, optimizer)
    if context.rank != 0:
        return
    # The weight average travels in the file: tensors sent over a queue would be shared through file
    # descriptors that die with the rank. Frozen weights stay behind: the caller's model has them
    # already (a LoRA model's base is not written out and read back).
    temporary = f"{os.fspath(path)}.partial"
    torch.save({"model": trainable_part(model, model_state), "optimizer": optimizer_state,
                "ema": result.ema_state_dict}, temporary)
    os.replace(temporary, path)
    result.ema_state_dict = None


def rank_report(rank: int, result) -> dict:
    """The report a rank leaves at its end: its timings, and on rank 0 its TrainResult."""
    timings = {"rank": rank, "device": result.device, "steps": result.steps, "wall_time_s": result.wall_time_s,
               "data_wait_s": result.data_wait_s, "compute_s": result.compute_s,
               "validation_s": result.validation_s, "peak_memory_mb": result.peak_memory_mb,
               "energy_j": result.energy_j}
    return {"result": result if rank == 0 else None, "timings": timings}


def gather_reports(context, report: dict) -> list | None:
    """Every rank's report on rank 0, through the process group (every rank calls it); None elsewhere."""
    if context.world_size == 1:
        return [report]
    import torch.distributed as dist

    gathered = [None] * context.world_size if context.rank == 0 else None
    dist.gather_object({**report, "result": None}, gathered, dst=0)  # rank 0's result stays where it is
    if gathered is not None:
        gathered[0] = report
    return gathered


def with_ranks(result, reports: list):
    """Rank 0's result with every rank's timings (`per_rank`, in rank order) and the energy summed over
    them (every node's GPUs; the result's own when no rank measured any)."""
    result.per_rank = [report["timings"] for report in sorted(reports, key=lambda r: r["timings"]["rank"])]
    energies = [t["energy_j"] for t in result.per_rank if t.get("energy_j") is not None]
    result.energy_j = sum(energies) if energies else result.energy_j
    return result


def describe(error: BaseException) -> dict:
    """What a rank that failed leaves: its error, in plain data (gpunb's own with what and hint)."""
    info = {"type": type(error).__name__, "message": str(error), "traceback": traceback.format_exc()}
    if isinstance(error, GpunbError):
        info.update(what=error.what, hint=error.hint)
    return info
