"""RunRecorder: the callback that keeps a run's row in the registry up to date.

A plain callback (see gpunb/runtime/events.py). It hands data to a `RunWriter`
(a daemon thread) at most once a second (always on the first log). A stop request from
the sidebar is looked for at every log interval, so a stop lands at the log it meets: one
os.stat of the registry's stop signal (see stop_signal.py) and, only when that changed, one
read of the registry that never waits (WAL readers do not wait for writers, and busy_timeout
is 0 for it); between logs the writer's thread reads it (writer.STOP_POLL_S) and each step
looks at its answer, an attribute. A locked, full or damaged registry can neither slow nor
break the training loop.
The first problem is logged once; a locked registry is written once it is free.
Fit start does not wait for the run's row: the thread creates it while the first steps
run (what the run logs meanwhile waits for it). Fit end waits FINISH_WAIT_S at most for
the final status, so that a finished fit's record is on disk when `fit` returns; what a
locked registry keeps out by then is left to the thread, and waited for at exit.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from pathlib import Path

from gpunb.render import eta_left
from gpunb.runs.paths import default_path
from gpunb.runs.registry import Registry, RegistryLocked, json_safe
from gpunb.runs.stop_signal import StopSignal
from gpunb.runs.writer import RunWriter

log = logging.getLogger(__name__)

WRITE_EVERY_S = 1.0  # the registry's promise: at most one write per second per run
POINTS_PER_WRITE = 25  # log rows kept per write (evenly thinned): curves survive short runs
HEARTBEAT_S = 30.0  # without logs, still send step and progress this often (liveness: the writer's own stamp)
FINISH_WAIT_S = 2.0  # at fit end, wait this long at most for the final status to be written
RESULT_FIGURES = ("achieved_tflops", "mfu", "tokens_per_s")  # TrainResult properties kept in `latest`
_now = time.monotonic  # the clock for throttling (tests replace it)


@functools.lru_cache(maxsize=8)
def kept_registry(path: Path, timeout: float = 5.0) -> Registry:
    """This process's Registry for `path` and `timeout`, kept between fits: each thread's connection
    to the file stays open, so a fit opens none (an open and its first read of the schema: ~0.3 ms,
    on the training thread for its stop reads and its end, on the writer's thread for the row)."""
    return Registry(path, timeout=timeout)


class RunRecorder:
    """Records the run (rank 0 only) in `registry` (default: `Registry()`)."""

    def __init__(self, registry: Registry | None = None, run_id: str | None = None):
        self.registry = registry
        self.fixed_id = run_id  # a job's run, recorded by the kernel at submission: the job goes on in its row
        self.writer: RunWriter | None = None
        self._reset()

    def _reset(self) -> None:
        self.run_id: str | None = None
        self._warned = False
        self._rows: list = []  # (step, metrics) logged since the last write
        self._latest: dict = {}  # every metric's newest value
        self._reader: Registry | None = None  # the training thread's own, never waiting
        self._last_write = 0.0  # monotonic time of the last write
        self._logged = False  # the first log is always written
        self._stop_read_step: int | None = None  # the step of the training thread's last stop read
        self._signal: StopSignal | None = None  # the registry's stop signal, as of that read

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what was handed to the writer is in the registry; False on timeout."""
        return self.writer is None or self.writer.flush(timeout)

    # ------------------------------------------------------------------ events
    def on_fit_start(self, state) -> None:
        self._reset()
        if state.rank != 0 or not (self.fixed_id or getattr(state.config, "track", True)):
            return  # a recorder given its run's id records it whatever `track` says (a job's: see gpunb.jobs)
        config = state.settings() if hasattr(state, "settings") else state.config
        if self.registry is None:
            self.registry = kept_registry(default_path())  # only a path the first time: no disk access here
        # A continued fit goes on in the row of the run it continues: one run, its curve unbroken.
        continues = getattr(state, "continues_run", None) or self.fixed_id
        self.run_id = continues or uuid.uuid4().hex
        start = {"name": state.run_name, "config": json_safe(config), "device": str(state.device),
                 "total_steps": state.total_steps, "started_at": time.time(), "reopen": continues is not None}
        self.writer = RunWriter(self.registry, self.run_id, start, self._warn_once, owner=self)
        self._reader = kept_registry(self.registry.path, timeout=0.0)
        self._signal = StopSignal(self.registry.path)
        state.registry_run = self.run_id
        self._last_write = _now()

    def on_step_end(self, state) -> None:
        # Only attribute and clock reads per step: the writer's thread reads stop requests from
        # the registry; a long log interval still gets its row touched every HEARTBEAT_S.
        if self.run_id is None:
            return
        if _now() - self._last_write >= HEARTBEAT_S:
            self._write(state, force=True)  # looks at the stop answer too
        elif self.writer.stop_requested:
            state.request_stop("stopped from the sidebar")

    def on_log(self, state, metrics: dict) -> None:
        if self.run_id is None:
            return
        first, self._logged = not self._logged, True
        self._collect(state.step, metrics)
        self._write(state, force=first)

    def on_validation_end(self, state, metrics: dict) -> None:
        if self.run_id is not None:
            self._collect(state.step, metrics)
            self._write(state)

    on_epoch_end = on_validation_end

    def on_fit_end(self, state) -> None:
        if self.run_id is None:
            return
        result = state.result
        if getattr(result, "interrupted", False) and state.stop_reason == "interrupted":
            status = "interrupted"
        elif state.stop_reason:
            status = "stopped"
        else:
            status = "completed"
        for name in RESULT_FIGURES:  # the run's compute figures join its last metrics for the sidebar
            value = getattr(result, name, None)
            if value is not None:
                self._latest[name] = value
        self._finish(state, status, energy_j=getattr(result, "energy_j", None), stop_reason=state.stop_reason)

    def on_exception(self, state, error: BaseException) -> None:
        if self.run_id is None:
            return
        if isinstance(error, KeyboardInterrupt):
            self._finish(state, "interrupted")
            return
        lines = str(error).strip().splitlines()
        summary = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
        self._finish(state, "failed", error=summary[:500])

    # ------------------------------------------------------------------ internals
    def _collect(self, step: int, metrics: dict) -> None:
        metrics = json_safe(metrics)
        self._latest.update(metrics)
        if self._rows and self._rows[-1][0] == step:  # validation at the step just logged
            self._rows[-1][1].update(metrics)
        else:
            self._rows.append((step, dict(metrics)))

    def _take_rows(self, limit: int) -> list:
        rows, self._rows = self._rows, []
        if len(rows) > limit:  # evenly spread, always keeping the newest
            stride = len(rows) / limit
            rows = [rows[int(i * stride)] for i in range(limit - 1)] + [rows[-1]]
        return rows

    def _write(self, state, force: bool = False) -> None:
        # The stop check first, while the writer's thread sleeps: a read after `submit` has woken
        # it hands it the GIL, and the step then waits for its whole write (on a loaded machine,
        # for as long as the scheduler leaves that thread off a core).
        if self.writer.stop_requested or self._stop_requested_now(state.step):
            state.request_stop("stopped from the sidebar")
        now = _now()
        if force or now - self._last_write >= WRITE_EVERY_S:
            self._last_write = now
            fields = {"step": state.step, "epoch": state.epoch, "progress": state.progress,
                      "eta_s": eta_left(state), "latest": dict(self._latest)}
            self.writer.submit(fields, self._take_rows(POINTS_PER_WRITE))

    def _stop_requested_now(self, step: int) -> bool:
        if not self.writer.recorded.is_set():
            return False  # no row yet, so no request either
        if step == self._stop_read_step:
            return False  # read at this step already (an epoch's end at a log step): ~0.1 ms a read in a fit
        # Looked at here, the writer's thread skips its next poll. Where the signal cannot be written,
        # a run that logs this often still learns of a request from its writes (once a second).
        self.writer.stop_read_at = time.monotonic()
        stamp = self._signal.stamp()
        if stamp == self._signal.seen:
            return False  # no request made since the last read
        self._stop_read_step = step
        try:
            requested = self._reader.stop_requested(self.run_id)
        except Exception:  # locked out or damaged: the writer thread reports it, and a later log reads again
            return False
        self._signal.seen = stamp
        return requested

    def _finish(self, state, status: str, **fields) -> None:
        fields.update(step=state.step, epoch=state.epoch, progress=state.progress, latest=dict(self._latest))
        # Written here, on the training thread, while the writer's thread is idle (as it is at the
        # end of most fits): the record is on disk when `fit` returns, without a wait for that thread.
        rows = self._take_rows(10 * POINTS_PER_WRITE)
        written = self.writer.end(self._reader, {"status": status, **fields}, rows)
        if not (written or self.writer.flush(FINISH_WAIT_S)) and not self._warned:
            self._warned = True
            log.warning("gpunb: the end of this run is not in the run registry %s yet; it is written "
                        "in the background as soon as the registry is free.", self.registry.path)
        self.run_id = None

    def _warn_once(self, error: Exception) -> None:  # called from the writer thread
        if self._warned:
            return
        self._warned = True
        if isinstance(error, RegistryLocked):
            log.warning("gpunb: the run registry %s is locked by another process. Training goes on; "
                        "this run is recorded as soon as the registry is free.", self.registry.path)
        else:
            log.warning("gpunb: could not write to the run registry (%s): %s. Training goes on; "
                        "this run may be missing from gpunb.runs() and the sidebar.",
                        self.registry.path, error)
